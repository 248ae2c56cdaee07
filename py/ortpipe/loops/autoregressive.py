"""The autoregressive loop as a step-wise, sans-IO generator of tokens.

`append_tokens` queues ids; `next_token` runs the flow on what is queued (the init phase first,
on the first call) and selects one token from the logits. The selected token is queued, not run:
N new tokens cost one prefill and N-1 decode runs. Appending after generation continues from the
cache (continuous decoding).

`next_tokens` may return several: a target that fuses greedy decode steps may answer one `Decode`
with a burst of tokens, up to the `limit` the generator sets from the length limit and the
caller's budget.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from ..errors import GenerationError
from ..execute.flow import FlowRun
from ..execute.work import Backend, Decode, Handle, Work
from ..plan import Plan
from ..sampling.sampler import Sampler
from ..sampling.settings import SearchSettings


@dataclass(frozen=True)
class Limits:
    max_length: int  # prompt + generated, never more
    eos: frozenset[int] = field(default_factory=frozenset)
    grows: bool = False  # set by max_new_tokens: expanding the prompt's placeholders raises max_length


class TokenGenerator:
    def __init__(self, plan: Plan, backend: Backend, limits: Limits, settings: SearchSettings | None = None,
                 inputs: dict[str, Handle] | None = None):
        self.plan, self.backend, self.limits = plan, backend, limits
        self.flow = FlowRun(plan, backend, 1, limits.max_length, inputs)
        gen = plan.generator
        dtype = plan.signatures[gen.session].output(gen.logits).dtype
        self.sampler = Sampler(backend, dtype, settings or SearchSettings(), limits.eos)
        self.tokens: list[int] = []  # every id so far: prompts and generated
        self.generated = 0  # since the last append
        self._pending: list[int] = []
        self._started = False
        self.interrupted = False
        self.fused_steps = 0  # decode steps the target ran as `Decode`s
        self._burst = max(1, int(getattr(backend, "decode_burst", 1)))
        # Plain greedy decoding on a target that fuses decode steps: once the first step ran, each
        # later one is a single `Decode` (None: not yet decided; False: this request cannot).
        self._fuse = bool(getattr(backend, "fused_decode", False)) and self.sampler.settings.plain_greedy
        self._decode: Decode | bool | None = None if self._fuse else False

    def append_tokens(self, ids: list[int]) -> None:
        if not ids or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
            raise GenerationError(f"token ids must be a non-empty list of non-negative integers, found {ids!r}")
        if len(self.tokens) + len(ids) > self.limits.max_length:
            raise GenerationError(f"{len(self.tokens) + len(ids)} tokens do not fit in max_length "
                                  f"{self.limits.max_length}; raise max_length or shorten the prompt")
        self.tokens.extend(ids)
        self._pending.extend(ids)
        self.generated = 0

    @property
    def done(self) -> bool:
        if self.interrupted or len(self.tokens) >= self.limits.max_length:
            return True
        return self.generated > 0 and self.tokens[-1] in self.limits.eos

    @property
    def prefill_length(self) -> int:
        """How many ids the next run will feed (the last prefill's length, once it ran)."""
        return len(self._pending)

    def rewind(self, length: int) -> Work:
        """Keep only the first `length` ids, and the cache positions among them (a chat rewind)."""
        if not 0 <= length <= len(self.tokens):
            raise GenerationError(f"cannot rewind {len(self.tokens)} tokens to {length}")
        seen = min(self.flow.length, length)
        for cache in self.flow.caches.values():
            yield from cache.truncate(seen, self.backend)
        self.flow.length = seen
        self._pending = self.tokens[seen:length]
        del self.tokens[length:]
        self.generated = 0
        self.interrupted = False

    def next_token(self) -> Work:
        """The next token."""
        return (yield from self.next_tokens(1))[0]

    def next_tokens(self, budget: int | None = None) -> Work:
        """The next token, or several when the target runs a burst of fused decode steps. `budget`:
        how many the caller takes at most (a request's max_new_tokens left, 1 while stop strings are
        watched); never more than max_length leaves room for, and none after an eos."""
        if not self._pending:
            raise GenerationError("append tokens (a prompt) before asking for the next token")
        if self.done:
            raise GenerationError("generation is done (eos, max_length or interrupt); append tokens to go on")
        if not self._started:
            expanded = yield from self.flow.run_init(self._pending)
            self._started = True
            if expanded != self._pending:  # placeholders became one id per feature row
                del self.tokens[len(self.tokens) - len(self._pending):]
                self.tokens.extend(expanded)
                if self.limits.grows:
                    extra = len(expanded) - len(self._pending)
                    self.limits = dataclasses.replace(self.limits, max_length=self.limits.max_length + extra)
                    self.flow.resize(self.limits.max_length)
                self._pending = expanded
                if len(self.tokens) > self.limits.max_length:
                    raise GenerationError(f"with its images or audio expanded the prompt is {len(self.tokens)} "
                                          f"tokens, more than max_length {self.limits.max_length}")
        decode = self._decode
        if decode is None and self.flow.steps_run:
            decode = self._decode = self.flow.decode_step() or False
            if decode:
                decode.eos = self.limits.eos
        if decode and len(self._pending) == 1:
            room = self.limits.max_length - len(self.tokens)
            decode.token, decode.past = self._pending[0], self.flow.length
            decode.limit = max(1, min(self._burst, room, room if budget is None else budget))
            decode.label = f"step {self.flow.steps_run}"
            tokens = yield decode
            self._check_burst(tokens, decode.limit)
            self.flow.advance(len(tokens))
            self.fused_steps += len(tokens)
        else:
            logits = yield from self.flow.run_step(self._pending)
            tokens = [(yield from self.sampler.select(logits, self.tokens, self.generated))]
        self.tokens.extend(tokens)
        self._pending = [tokens[-1]]
        self.generated += len(tokens)
        return tokens

    def _check_burst(self, tokens: list[int], limit: int) -> None:
        """A target's answer to a Decode: 1 to `limit` ids, none but the last an eos."""
        if type(tokens) is not list or not 1 <= len(tokens) <= limit \
                or (len(tokens) > 1 and not self.limits.eos.isdisjoint(tokens[:-1])):
            raise GenerationError(f"the target answered a decode of at most {limit} steps with {tokens!r}: "
                                  "it must answer 1 to that many token ids, stopping after an eos")
