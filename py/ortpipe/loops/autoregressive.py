"""The autoregressive loop as a step-wise, sans-IO generator of tokens.

`append_tokens` queues ids; `next_tokens` runs the flow on what is queued (the init phase first,
on the first call) and selects a token from the logits. The selected token is queued, not run: N
new tokens cost one prefill and N-1 decode runs. Appending after generation continues from the
cache (continuous decoding). The generator's lifecycle (lifecycle.py) says what may happen when.

Decoding on a plan whose step phase can be fused (plan.fused), on a target that fuses its cache
layout, runs every iteration after the first as a `Decode`: the target may answer one with a burst
of tokens, up to the `limit` set from the length limit and the caller's budget. Plain greedy
requests select the argmax; others (sampling, penalties, bans) are fused on targets that select as
the sampler does (`Backend.fused_sampling`), with the sampler's `Pick` and its random numbers.
With speculative decoding (loops/speculative.py) the Decode carries the request's speculator: a
plain greedy request's on every fusing target, a request with a `Pick` on targets that run those
rounds too (`Backend.fused_speculation`); elsewhere such a request runs its rounds here, with kernels.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from ..config.settings import SearchSettings
from ..errors import GenerationError
from ..execute.flow import FlowRun
from ..execute.work import Backend, Decode, Decoded, FusedStep, Handle, Run, Work, kernel
from ..lifecycle import APPEND, BEGIN, EMPTY, END, FINISH, READY, RESAMPLE, REWIND, STOP, Lifecycle
from ..plan import Plan
from ..sampling.sampler import Sampler
from .speculative import ROUND, Speculator


@dataclass(frozen=True)
class Limits:
    max_length: int  # prompt + generated, never more
    eos: frozenset[int] = field(default_factory=frozenset)
    grows: bool = False  # set by max_new_tokens: expanding the prompt's placeholders raises max_length
    vocab: int | None = None  # prompt ids must be below it, when the graph says


def check_ids(ids: list[int], vocab: int | None) -> None:
    """Token ids a graph can take: integers from 0, below the vocabulary size when the graph fixes it."""
    if (
        not ids
        or not isinstance(ids, list)
        or not all(type(i) is int and 0 <= i and (vocab is None or i < vocab) for i in ids)
    ):
        bound = f" below the vocabulary size {vocab}" if vocab else ""
        shown = repr(ids) if len(repr(ids)) < 200 else f"{repr(ids)[:200]}..."
        raise GenerationError(f"token ids must be a non-empty list of integers from 0{bound}, found {shown}",
                              setting="prompt_ids")


class TokenGenerator:
    def __init__(
        self,
        plan: Plan,
        backend: Backend,
        limits: Limits,
        settings: SearchSettings | None = None,
        inputs: dict[str, Handle] | None = None,
        draft: Plan | None = None,
    ):
        """`draft`: the plan of the draft model that settings.draft_model names, loaded (Model.prepare)."""
        self.plan, self.backend, self.limits = plan, backend, limits
        self.flow = FlowRun(plan, backend, 1, limits.max_length, inputs)
        gen = plan.generator
        dtype = plan.signatures[gen.session].output(gen.logits).dtype
        self.sampler = Sampler(backend, dtype, settings or SearchSettings(), limits.eos, limits.vocab)
        self.sampler.max_length = limits.max_length
        self.life = Lifecycle()
        self.tokens: list[int] = []  # every id so far: prompts and generated
        self.generated = 0  # since the last append
        self._pending: list[int] = []  # ids the graph has not seen yet
        self.interrupted = False
        self.fused_steps = 0  # decode steps the target ran as `Decode`s
        self.logprobs: list[tuple[float, tuple[tuple[int, float], ...]] | None] = []  # per token, when asked

        self._burst = max(1, int(getattr(backend, "decode_burst", 1)))
        self._draft = draft
        self._choose_path()

    def _choose_path(self) -> None:
        """How the next tokens are made, from the sampler's settings: fused steps, speculative rounds, or
        one generic step at a time."""
        plan, backend, settings = self.plan, self.backend, self.sampler.settings
        fused = plan.fused
        fusable = fused is not None and fused.layout in getattr(backend, "fused_layouts", ())
        # logprobs are given one token a step: a request that asks for them does not speculate
        self.speculator = (
            Speculator(plan, backend, settings, self.limits.max_length, self.limits.eos, self._draft)
            if settings.speculative and settings.logprobs is None else None
        )
        # a request that selects by a pick and speculates runs its rounds in the target's bursts where
        # the target runs such rounds, else here (speculative sampling with kernels), not fused
        picks = getattr(backend, "fused_sampling", False) and self.sampler.fusable
        speculates = self.speculator is not None and not getattr(backend, "fused_speculation", False)
        selects = settings.plain_greedy or (picks and not speculates)
        self._fused: FusedStep | None = fused if fusable and selects else None
        # the plain steps between a speculating sampled request's rounds still run fused
        plain = self.speculator is not None and getattr(backend, "fused_sampling", False)
        plain = plain and self.sampler.fusable and self._fused is None
        self._plain: FusedStep | None = fused if fusable and plain else None
        if self.speculator is not None and self._fused is None:  # its rounds run here, with kernels
            self.speculator.length.overhead = ROUND

    def resample(self, settings: SearchSettings, draft: Plan | None = None) -> None:
        """Select the tokens from here on by `settings`: a fresh sampler (a seed starts over) and the path
        chosen again, so that a kept KV cache serves a request with other settings (the server's prompt
        cache). Speculation starts over too: prompt lookup's index is rebuilt from the tokens, and a draft
        model (`draft`: the plan of the one settings.draft_model names, loaded) runs the text it has not
        seen when it next drafts. Not while a step is running."""
        if bool(settings.draft_model) != (draft is not None):
            raise GenerationError("resample takes the plan of the draft model the settings name, and only "
                                  "then")
        self.life.fire(RESAMPLE)
        self._draft = draft
        self.sampler = Sampler(self.backend, self.sampler.dtype, settings, self.limits.eos, self.limits.vocab)
        self.sampler.max_length = self.limits.max_length
        self._choose_path()

    @property
    def state(self) -> str:
        return self.life.state

    def append_tokens(self, ids: list[int]) -> None:
        check_ids(ids, self.limits.vocab)
        if len(self.tokens) + len(ids) > self.limits.max_length:
            raise GenerationError(
                f"{len(self.tokens) + len(ids)} tokens do not fit in max_length "
                f"{self.limits.max_length}; raise max_length or shorten the prompt"
            )
        self.life.fire(APPEND)
        self.tokens.extend(ids)
        self._pending.extend(ids)
        self.generated = 0

    @property
    def done(self) -> bool:
        if self.interrupted or len(self.tokens) >= self.limits.max_length:
            return True
        return self.generated > 0 and self.tokens[-1] in self.limits.eos

    def named_outputs(self) -> tuple[dict[str, Handle], dict[str, dict[str, object]]]:
        """pipeline.output as the sessions gave them: an accumulated output's rows of the whole loop, any
        other's last value; and {name: {"kind", "sampling_rate"}}."""
        outputs: dict[str, Handle] = {}
        kinds: dict[str, dict[str, object]] = {}
        for o in self.plan.config.pipeline.outputs:
            value = self.flow.accumulated.get(o.source, self.flow.values.get(o.source))
            if value is not None:
                outputs[o.name] = value
                rate = {"sampling_rate": o.sampling_rate} if o.sampling_rate else {}
                kinds[o.name] = {"kind": o.kind, **rate}
        return outputs, kinds

    @property
    def prefill_length(self) -> int:
        """How many ids the next run will feed (the last prefill's length, once it ran)."""
        return len(self._pending)

    def rewind(self, length: int) -> Work:
        """Keep only the first `length` ids, and the cache positions among them (a chat rewind; from
        ERROR, the way back to a sequence that can run)."""
        if not 0 <= length <= len(self.tokens):
            raise GenerationError(f"cannot rewind {len(self.tokens)} tokens to {length}")
        self.life.fire(REWIND)
        seen = min(self.flow.position, length)
        for cache in self.flow.caches.values():
            yield from cache.truncate(min(seen, cache.length), self.backend)
        self.flow.position = seen
        if self.speculator is not None:
            yield from self.speculator.rewound(length)
        self._pending = self.tokens[seen:length]
        del self.tokens[length:]
        self.generated = 0
        self.interrupted = False
        if not self._pending:
            self.life.fire(EMPTY)

    def take_back(self, n: int) -> Work:
        """Forget the last n generated tokens (a request ended at a stop string before them): the
        sequence is as if generation had stopped after the token before them."""
        keep = len(self.tokens) - n
        if n <= 0 or n > self.generated:
            raise GenerationError(f"cannot take back {n} of {self.generated} generated tokens")
        self.life.fire(REWIND)
        for cache in self.flow.caches.values():
            if cache.length > keep - 1:
                yield from cache.truncate(keep - 1, self.backend)
        self.flow.position = keep - 1
        del self.tokens[keep:]
        self._pending = self.tokens[-1:]
        self.generated -= n
        if self.speculator is not None:
            yield from self.speculator.rewound(keep)

    def choose(self, among: list[int]) -> Work:
        """Run the queued ids and give the id of `among` the model makes most likely after them, queued
        as a prompt id (not a generated one): the decoder prompt's language, when a request names none.
        Append the ids that follow it before asking for tokens."""
        if self.life.state == READY and self.done:
            self.life.fire(STOP)
        self.life.fire(BEGIN)
        try:
            if self.flow.iterations == 0:
                yield from self._init_phase()
            logits = yield from self.flow.run_iteration(self._pending)
            ids = self.backend.tensor(sorted(among), (len(among),), "int64")
            out = yield Run(kernel("argmax_among", self.sampler.dtype), {"logits": logits, "ids": ids},
                            ("token",), None, self.flow.label)
            chosen = int(self.backend.to_list(out["token"])[0])
        except BaseException as e:  # as next_tokens: the cache cannot be trusted
            self.life.fail(e)
            raise
        self.life.fire(END)
        self._pending = []
        return chosen

    def next_token(self) -> Work:
        """The next token."""
        return (yield from self.next_tokens(1))[0]

    def next_tokens(self, budget: int | None = None) -> Work:
        """The next token, or several when the target runs a burst of fused decode steps. `budget`:
        how many the caller takes at most (a request's max_new_tokens left, 1 while stop strings are
        watched); never more than max_length leaves room for, and none after an eos."""
        if self.life.state == READY and self.done:  # interrupted since the last step, or no room left
            self.life.fire(STOP)
        self.life.fire(BEGIN)
        try:
            tokens = yield from self._iterate(budget)
        except BaseException as e:  # the target failed (or Ctrl-C) mid-step: the cache cannot be trusted
            self.life.fail(e)
            raise
        self._took(tokens)
        return tokens

    @property
    def pending(self) -> list[int]:
        """The ids the graph has not seen yet (after a step: the last token)."""
        return self._pending

    # Steps another loop runs for this sequence: a batch (loops/batched.py) whose row it is.

    def begin_external(self) -> None:
        if self.life.state == READY and self.done:
            self.life.fire(STOP)
        self.life.fire(BEGIN)

    def end_external(self, tokens: list[int], fed: int = 1) -> None:
        """The step fed the `fed` pending ids (one a decode step; the prompt a prefill) and selected
        `tokens`."""
        for cache in self.flow.caches.values():
            cache.length += fed
        self.flow.position += fed
        self.flow.iterations += 1
        self._took(tokens)

    def fail_external(self, error: BaseException) -> None:
        self.life.fail(error)

    def _took(self, tokens: list[int]) -> None:
        if self.sampler.settings.logprobs is not None:  # one token per step: logprobs keep the generic path
            self.logprobs.append(self.sampler.last_logprobs)
        self.tokens.extend(tokens)
        self._pending = [tokens[-1]]
        self.generated += len(tokens)
        self.life.fire(FINISH if self.done else END)


    def _iterate(self, budget: int | None) -> Work:
        if self.flow.iterations == 0:
            yield from self._init_phase()
        if self.sampler.forced(self.tokens) is not None:
            return [(yield from self._step())]  # a forced token is no burst's: the sampler's own step
        if self.sampler.settings.forced_eos_token_id is not None:  # no burst or round reaches the forced last
            room = self.limits.max_length - len(self.tokens) - 1
            budget = room if budget is None else min(budget, room)
        fused, spec = self._fused, self.speculator
        if self.flow.iterations and len(self._pending) == 1:
            if fused is not None:
                return (yield from self._decode(fused, budget))
            if spec is not None:
                tokens = yield from spec.round(self, budget)
                if tokens:
                    return tokens
                if self._plain is not None:  # no draft this step: plain fused steps, through the pause
                    steps = spec.plain_steps() if budget is None else min(spec.plain_steps(), budget)
                    tokens = yield from self._decode(self._plain, steps, speculate=False)
                else:
                    tokens = [(yield from self._step())]
                spec.stepped(self.tokens, tokens)
                spec.ran_plain(len(tokens))
                return tokens
        return [(yield from self._step())]

    def _step(self) -> Work:
        """One generic step: the graphs over the pending ids, the sampler's kernels over the logits."""
        logits = yield from self.flow.run_iteration(self._pending)
        self.sampler.label = self.flow.label
        return (yield from self.sampler.select(logits, self.tokens, self.generated))

    def _decode(self, fused: FusedStep, budget: int | None, speculate: bool = True) -> Work:
        """A burst of fused steps (speculative rounds, when the request speculates and `speculate`)."""
        room = self.limits.max_length - len(self.tokens)
        limit = max(1, min(self._burst, room, room if budget is None else budget))
        # one uniform a token, speculating or not: a round draws its positions with the uniforms plain
        # steps would use there, and drafts no further than the limit
        pick, limit = self.sampler.pick(self.tokens, self.generated, limit)
        cache = self.flow.caches[fused.session]
        spec = self.speculator if speculate else None
        answer = yield Decode(
            fused,
            cache.feeds,
            self.flow.max_length,
            self.limits.eos,
            self._pending[0],
            self.flow.position,
            limit,
            f"step {self.flow.iterations}",
            speculation=spec.speculation(self.tokens) if spec is not None else None,
            pick=pick,
            fixed=self.flow.fixed(fused) if fused.fixed else None,
        )
        tokens = self._check_burst(answer, limit)
        self.sampler.drew(len(tokens))

        self.flow.advance(fused.session, answer.cache, len(tokens))
        if self.speculator is not None:
            self.speculator.took(answer)
        self.fused_steps += len(tokens)
        return tokens

    def _init_phase(self) -> Work:
        expanded = yield from self.flow.run_init(self._pending)
        if expanded == self._pending:
            return
        # placeholders became one id per feature row
        del self.tokens[len(self.tokens) - len(self._pending) :]
        self.tokens.extend(expanded)
        if self.limits.grows:
            extra = len(expanded) - len(self._pending)
            self.limits = dataclasses.replace(self.limits, max_length=self.limits.max_length + extra)
            self.flow.resize(self.limits.max_length)
            self.sampler.max_length = self.limits.max_length
        self._pending = expanded
        if len(self.tokens) > self.limits.max_length:
            raise GenerationError(
                f"with its images or audio expanded the prompt is {len(self.tokens)} "
                f"tokens, more than max_length {self.limits.max_length}"
            )

    def _check_burst(self, answer: object, limit: int) -> list[int]:
        """A target's answer to a Decode: 1 to `limit` ids, none but the last an eos."""
        tokens = answer.tokens if type(answer) is Decoded else None
        if (
            type(tokens) is not list
            or not 1 <= len(tokens) <= limit
            or (len(tokens) > 1 and not self.limits.eos.isdisjoint(tokens[:-1]))
        ):
            raise GenerationError(
                f"the target answered a decode of at most {limit} steps with {tokens or answer!r:.200}: "
                "it must answer 1 to that many token ids, stopping after an eos"
            )
        return tokens
