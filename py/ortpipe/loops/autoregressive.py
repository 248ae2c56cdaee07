"""The autoregressive loop as a step-wise, sans-IO generator of tokens.

`append_tokens` queues ids; `next_token` runs the flow on what is queued (the init phase first,
on the first call) and selects one token from the logits. The selected token is queued, not run:
N new tokens cost one prefill and N-1 decode runs. Appending after generation continues from the
cache (continuous decoding).
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
        self.fused_steps = 0  # decode steps the target ran as one `Decode`
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
        if decode and len(self._pending) == 1:
            decode.token, decode.past = self._pending[0], self.flow.length
            decode.label = f"step {self.flow.steps_run}"
            token = yield decode
            self.flow.advance(1)
            self.fused_steps += 1
        else:
            logits = yield from self.flow.run_step(self._pending)
            token = yield from self.sampler.select(logits, self.tokens, self.generated)
        self.tokens.append(token)
        self._pending = [token]
        self.generated += 1
        return token
