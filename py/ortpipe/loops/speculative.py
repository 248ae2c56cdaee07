"""Speculative decoding: draft several tokens cheaply, check them all with one run of the model.

Drafts come from the text itself (prompt lookup: what followed the latest earlier occurrence of
the last n tokens) or from a smaller draft model with the same tokenizer, run greedily (sampled, for
a sampled request). One
decoder run over the pending token and k drafts gives the model's logits at all k+1 positions:

- greedy: the model's choice at each position; the longest prefix of drafts it agrees with is
  accepted, plus its choice after them: exactly the tokens of plain greedy decoding;
- sampling: each checked position's token is drawn from its processed distribution p_i with the
  uniform number plain sampling would use there (one a token, from the request's seeded generator),
  and the drafts equal to them are accepted, plus the token after them: the tokens are exactly those
  of plain sampling with the same seed, whatever was drafted. A draft model samples its drafts from
  its own processed distributions q_i with the same uniform numbers (draft i with the uniform of its
  position), so a draft is accepted when the two draws agree: always where q = p, and the closer q
  is to p the more often (a looked-up draft is accepted with probability p_i(draft), as speculative
  sampling with a one-token draft would).

The KV cache then keeps only the accepted positions: a shared buffer moves its length (the next
run's mask and writes start there), a concat cache is narrowed by a kernel.

The draft length adapts (DraftLength): each round drafts the length that gives the most tokens per
unit of time, from how often drafts were accepted (counted per source: the length of the n-gram a
lookup matched) and what a run of several tokens costs beside a run of one; when none pays, steps
are plain ones, during which prompt lookup's proposals are checked against the tokens chosen (at no
cost) and a draft model probes now and then, so open-ended text runs at about the speed of plain
decoding. Targets that run rounds in their bursts measure the costs (and keep them for the next
request); the core's own rounds use fixed guesses. No draft length changes the tokens.

Requests on a plan whose step fuses yield `Decode`s that carry a `Speculation`: a target runs whole
rounds inside its burst (the CPython driver calls this module's Speculator, the browser's JS decoder
mirrors it in web/speculate.js), or ignores it and runs plain steps. A request that selects by a
`Pick` (sampling, penalties, bans) does so on targets with `fused_speculation` (its Picker, in numpy
or JS, selects at each position as the kernels below would); elsewhere, and for requests that cannot
fuse (an n-gram ban), the rounds run here, with `Run`s and kernels, the same way on every target.
"""

from __future__ import annotations

import statistics
from bisect import bisect_left
from collections import deque
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

from ..config.settings import SearchSettings
from ..errors import GenerationError
from ..execute.flow import FlowRun
from ..execute.work import Backend, Decoded, FusedStep, Handle, Run, Work, kernel
from ..plan import Plan
from ..sampling.processors import banned_ids
from ..sampling.sampler import Sampler

if TYPE_CHECKING:
    from .autoregressive import TokenGenerator

LOOKUP_NGRAM = 2  # the longest n-gram prompt lookup matches when only prompt_lookup_num_tokens is given
MAX_PAUSE = 16  # steps without drafts after rounds that accepted nothing, at most
# ... and where a draft model's step costs so much that drafts always taken would not pay (a tiny model
# in the browser, where every run costs about the same): its probes only watch for costs that change
HOPELESS_PAUSE = 128
SHADOW_STEPS = 8  # plain steps before prompt lookup looks again, when no draft length pays
# where the core runs the rounds (a request that cannot fuse), each look that drafts nothing ends a burst
# of fused steps:
# looks that keep drafting nothing wait twice as long each time, up to this
SHADOW_STEPS_MOST = 32
ROUND = 0.5  # the guess of what a round run by the core costs beyond a plain step, relative to a step
SAMPLES = 15  # the measurements of run costs kept


def cannot_verify(plan: Plan) -> str | None:
    """Why the plan's decoder cannot check drafts in one run and roll its cache back, or None."""
    step = plan.fused
    if step is None:
        return "its step phase is not a single decoder run over a KV cache (a multi-session pipeline)"
    if step.fixed:
        return ("its decoder takes inputs fixed for each request (an encoder's states, a cache-branch flag), "
                "which speculative rounds do not feed yet")
    if any(e.window is not None for e in plan.step_phase[0].kv.entries):
        return "its KV cache slides (a sliding-window cache cannot be rolled back)"
    info = plan.signatures[step.session].output(step.logits)
    if info.rank != 3 or info.shape[1] == 1:
        return "its decoder gives the logits of the last position only, not of every new token"
    return None


class NgramIndex:
    """Prompt lookup: where each n-gram of the text (n = 1 .. size) last ended, kept as it grows; and,
    when the caller predicts the text (`predict`), where each n-gram of the prediction ends."""

    def __init__(self, size: int):
        self.size = size
        self.last: list[dict[tuple[int, ...], int]] = [{} for _ in range(size)]
        self.indexed = 0  # the n-grams ending before this position are in the index
        self.matched = 0  # the length of the n-gram the last proposal matched (0: none)
        self.reference: list[int] = []  # the predicted text
        self.from_reference = False  # whether the last proposal came from it
        self.ends: list[dict[tuple[int, ...], list[int]]] = []  # n-gram -> where it ends in the prediction
        self.followed = 0  # where in the prediction the last proposal from it began
        self.at_text = 0  # the text's length then: the prediction's token `followed` was to come there

    def reset(self) -> None:
        self.last = [{} for _ in range(self.size)]
        self.indexed = 0
        self.followed = self.at_text = 0

    def predict(self, reference: list[int]) -> None:
        """Propose from `reference` first, the text the generation is expected to write (a server's
        Predicted Outputs): where the text went on as the last proposal from it said, what comes next
        there; else what follows the longest n-gram ending the text, at its first occurrence from where
        the last proposal began on (else its first)."""
        self.reference = list(reference)
        self.ends = [{} for _ in range(self.size)]
        for i in range(len(reference)):
            for n in range(1, min(self.size, i + 1) + 1):
                self.ends[n - 1].setdefault(tuple(reference[i - n + 1 : i + 1]), []).append(i)
        self.followed = self.at_text = 0

    def _predicted(self, tokens: list[int], k: int) -> list[int]:
        went = len(tokens) - self.at_text  # tokens the text took since the last proposal from the prediction
        if self.at_text and 0 < went and self.followed + went < len(self.reference) and (
                tokens[self.at_text :] == self.reference[self.followed : self.followed + went]):
            self.followed += went
            self.at_text = len(tokens)
            self.matched = self.size
            return self.reference[self.followed : self.followed + k]
        for n in range(min(self.size, len(tokens)), 0, -1):
            ends = self.ends[n - 1].get(tuple(tokens[-n:]))
            if not ends:
                continue
            at = bisect_left(ends, self.followed - 1)
            end = ends[at] if at < len(ends) else ends[0]
            if end + 1 < len(self.reference):
                self.followed, self.at_text = end + 1, len(tokens)
                self.matched = n
                return self.reference[end + 1 : end + 1 + k]
        return []

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the longest n-gram ending
        the text (the prediction's first, when there is one); a copy that reaches the end goes on over
        what it copied (a repeating loop)."""
        self.from_reference = False
        if self.reference:
            predicted = self._predicted(tokens, k)
            if predicted:
                self.from_reference = True
                return predicted
        end = len(tokens) - 1  # n-grams ending here have no continuation yet
        if end < self.indexed:
            self.reset()
        for i in range(self.indexed, end):
            for n in range(1, min(self.size, i + 1) + 1):
                self.last[n - 1][tuple(tokens[i - n + 1 : i + 1])] = i
        self.indexed = max(self.indexed, end)
        for n in range(min(self.size, len(tokens)), 0, -1):
            at = self.last[n - 1].get(tuple(tokens[-n:]))
            if at is not None:
                draft: list[int] = []
                for i in range(at + 1, at + 1 + k):
                    draft.append(tokens[i] if i < len(tokens) else draft[i - len(tokens)])
                self.matched = n
                return draft
        self.matched = 0
        return []


class DraftLength:
    """How many tokens the next round drafts: the length that gives the most tokens per unit of time.

    A round of k drafts gives 1 + a + ... + a^k tokens on average, a being the chance that a draft
    is accepted (accepted drafts over accepted drafts plus rejections, a decaying count from a
    prior), and costs
    1 + overhead + (extra + draft) * k times a plain step: `extra`, what each more token adds to one
    run, and `draft`, what drafting one costs (a draft model's step), both measured by the target
    that runs the rounds (`timed`; kept across requests where the target keeps `speculation_costs`),
    else guessed; `overhead`, what a round run by the core (its kernels) costs beyond a plain step, a
    guess (ROUND, see TokenGenerator).

    Acceptance is counted per source: prompt lookup's drafts by the length of the n-gram they
    matched (a draft after a 1-gram match is taken far less often than one after a 3-gram match),
    a draft model's as one source. `next` gives the most a round may draft; `fit` its length once
    the source is known. When no length pays:
    - prompt lookup (`shadows`): plain steps, SHADOW_STEPS of them before the next look (where the
      core runs the rounds, 8, 16, 32, 32 ... while looks keep drafting nothing); at each,
      the proposal lookup would have drafted is checked against the token the step chose
      (`shadow`), which is what a one-token draft's check gives, without the cost of a check;
    - a draft model: a probe after a pause of 1, 2, 4 ... MAX_PAUSE plain steps (its proposal costs
      a run), of one token, and twice as many after a probe whose drafts were all taken (up to the
      most a round may draft), so that a draft model that agrees is found out in a few probes; while
      drafts always taken would not pay either (at costs the target measured, perhaps in earlier
      requests), a probe comes after each HOPELESS_PAUSE plain steps.
    """

    DECAY = 0.9  # the weight of earlier rounds in the acceptance count
    EXTRA = 0.4  # the guess of what one more token costs a run, relative to a run of one
    DRAFT = 0.3  # the guess of what a draft model's step costs, relative to the model's

    __slots__ = ("most", "hits", "misses", "ones", "extras", "drafts", "wait", "pause", "shadows",
                 "overhead", "source", "probing", "probe")

    def __init__(self, most: int, model: bool = False, sources: int = 1, sampled: bool = False):
        self.most = most
        # the prior acceptance: 2/3; 1/3 for prompt lookup in a sampled request (a sampled token equals
        # a proposal less often than the argmax does), whose proposals are checked in the shadow of
        # plain steps at no cost until drafts pay
        hit = 1.0 if sampled and not model else 2.0
        self.hits, self.misses = [hit] * sources, [3.0 - hit] * sources
        # the last measurements (a median of them resists a busy machine's outliers): seconds of a run of
        # one token, and the extra and drafting costs of a token relative to it
        self.ones: deque[float] = deque(maxlen=SAMPLES)
        self.extras: deque[float] = deque([self.EXTRA], maxlen=SAMPLES)
        self.drafts: deque[float] = deque([self.DRAFT if model else 0.0], maxlen=SAMPLES)
        self.wait = self.pause = 0
        self.shadows = not model
        self.overhead = 0.0
        self.source, self.probing = 0, False
        self.probe = 1  # the next probe's length

    def next(self, room: int) -> int:
        """The most the next round may draft (0: a plain step), at most `room`."""
        self.probing = False
        if room <= 0:
            return 0
        if self.wait:
            self.wait -= 1
            return 0
        most = min(self.most, room)
        if any(self.best(most, source) for source in range(len(self.hits))):
            self.pause = 0
            return most
        if self.shadows:
            self.wait = self._quiet()
            return 0
        pays = self.could_pay(most)
        if not pays and self.pause != HOPELESS_PAUSE:  # a first pause, before any probe
            self.pause = self.wait = HOPELESS_PAUSE
            return 0
        self.pause = min(MAX_PAUSE, 2 * self.pause or 1) if pays else HOPELESS_PAUSE
        self.wait = self.pause
        self.probing = True
        return min(self.probe, most)

    def fit(self, source: int, k: int) -> int:
        """How many of the k drafts proposed from `source` (k = 0: none was) the round checks: a probe
        its one, else the best length. Where the core runs the rounds (`overhead`), a step that drafts
        nothing starts the plain steps `_quiet` says, which run as one burst of fused steps."""
        self.source = source
        if self.probing:
            return k
        best = self.best(k, source) if k else 0
        if not best and self.overhead:
            self.wait = self._quiet()
        elif best and self.shadows:
            self.pause = 0
        return best

    def _quiet(self) -> int:
        """Plain steps before prompt lookup looks again, after a look that drafts nothing: SHADOW_STEPS;
        where the core runs the rounds, twice the last wait after another such look, up to
        SHADOW_STEPS_MOST (its plain steps run as one burst, which a look ends)."""
        if not self.overhead:
            return SHADOW_STEPS - 1
        self.pause = min(SHADOW_STEPS_MOST, 2 * self.pause or SHADOW_STEPS)
        return self.pause - 1

    def best(self, most: int, source: int = 0) -> int:
        """The draft length (0 to most) with the most tokens per unit of time, drafting from `source`."""
        rate = self.hits[source] / (self.hits[source] + self.misses[source])
        cost = statistics.median(self.extras) + statistics.median(self.drafts)
        best, best_k, tokens, term = 1.0, 0, 1.0, 1.0
        for k in range(1, most + 1):
            term *= rate
            tokens += term
            spent = 1 + self.overhead + cost * k
            if tokens / spent > best:
                best, best_k = tokens / spent, k
        return best_k

    def could_pay(self, most: int) -> bool:
        """Whether rounds of up to `most` drafts would pay if every draft were taken, at the costs known."""
        cost = statistics.median(self.extras) + statistics.median(self.drafts)
        return any(k + 1 > 1 + self.overhead + cost * k for k in range(1, most + 1))

    def update(self, drafted: int, accepted: int) -> None:
        """The round's drafts (from the source `fit` was last given): `accepted` of `drafted` taken."""
        s = self.source
        self.hits[s] = self.DECAY * self.hits[s] + accepted
        self.misses[s] = self.DECAY * self.misses[s] + (accepted < drafted)
        if self.probing:
            self.probe = min(self.most, 2 * self.probe) if accepted == drafted else 1

    def shadow(self, source: int, taken: bool) -> None:
        """A plain step chose the token a one-token draft from `source` proposed (`taken`), or not."""
        self.source = source
        self.update(1, int(taken))

    def one(self) -> float:
        """The median time of a run of one token; 0 before any (or when the clock is too coarse to see one:
        a browser's timer can read 0 for a fast run, and the ratios then wait for a measurable one)."""
        return statistics.median(self.ones) if self.ones else 0.0

    def timed(self, tokens: int, seconds: float) -> None:
        """A target's run of `tokens` tokens took `seconds`: what one more token costs, measured."""
        if tokens == 1:
            self.ones.append(seconds)
        elif self.one() > 0:
            self.extras.append(max(0.0, (seconds / self.one() - 1) / (tokens - 1)))

    def drafted(self, steps: int, seconds: float) -> None:
        """A draft model took `seconds` for `steps` drafted tokens."""
        if self.one() > 0 and steps:
            self.drafts.append(seconds / steps / self.one())

    def state(self) -> dict[str, Any]:
        measured = {name: list(getattr(self, name)) for name in ("ones", "extras", "drafts")}
        return {"hits": list(self.hits), "misses": list(self.misses), **measured, "wait": self.wait,
                "pause": self.pause, "shadows": self.shadows, "overhead": self.overhead, "probe": self.probe}

    def restore(self, state: Mapping[str, Any]) -> None:
        self.hits = [float(x) for x in state["hits"]]
        self.misses = [float(x) for x in state["misses"]]
        for name in ("ones", "extras", "drafts"):
            getattr(self, name).clear()
            getattr(self, name).extend(float(x) for x in state[name])
        self.wait, self.pause = int(state["wait"]), int(state["pause"])
        self.shadows, self.overhead = bool(state["shadows"]), float(state["overhead"])
        self.probe = int(state["probe"])


class DraftDecode(NamedTuple):
    """The draft model's side of a speculative `Decode`: its fused step, its cache (past input ->
    tensor) covering the first `length` tokens of the text, and its capacity."""

    step: FusedStep
    cache: Mapping[str, Handle]
    length: int
    capacity: int
    seq_axes: Mapping[str, int]


class Speculation(NamedTuple):
    """What a target needs to run speculative rounds inside a `Decode` burst."""

    speculator: Speculator  # the request's: its draft length, prompt lookup and statistics
    tokens: list[int]  # the text so far, ending with the Decode's token (the target must not change it)
    seq_axes: Mapping[str, int]  # each past input's sequence axis: where a concat cache is narrowed
    draft: DraftDecode | None  # drafting with a draft model; None: prompt lookup


class Speculator:
    """One request's speculative decoding: its drafter, its draft length and what was accepted.

    Targets that run rounds themselves call `draft_length`, `lookup` and `update`."""

    def __init__(self, plan: Plan, backend: Backend, settings: SearchSettings, max_length: int,
                 eos: frozenset[int], draft: Plan | None = None):
        why = cannot_verify(plan)
        if why:
            raise GenerationError(f"speculative decoding needs a model whose decoder checks several drafted "
                                  f"tokens in one run; this one cannot: {why}")
        lookup = bool(settings.prompt_lookup_num_tokens or settings.ngram_size)
        if lookup and draft is not None:
            raise GenerationError("prompt lookup and a draft model cannot draft together: give draft_model, "
                                  "or prompt_lookup_num_tokens / ngram_size, not both")
        positions = draft.max_positions if draft is not None else None
        if positions is not None and max_length > positions:
            raise GenerationError(f"max_length {max_length} is more than the {positions} positions the draft "
                                  "model's graph can run; lower max_length or max_new_tokens")
        self.backend, self.eos = backend, eos
        most = settings.prompt_lookup_num_tokens or settings.max_draft_tokens
        self.ngram = NgramIndex(settings.ngram_size or LOOKUP_NGRAM) if lookup else None
        self.length = DraftLength(most, draft is not None, self.ngram.size if self.ngram is not None else 1,
                                  settings.sampling)
        # what runs cost belongs to the target and the models, not to one request: a target that keeps
        # `speculation_costs` lets each request start from what the ones before it measured
        costs = getattr(backend, "speculation_costs", None)
        if costs is not None:
            key = (id(plan), id(draft))  # the plans of the model and the draft model, as loaded
            length = self.length
            length.ones, length.extras, length.drafts = costs.setdefault(
                key, (length.ones, length.extras, length.drafts))
        self.draft = DraftModel(draft, backend, max_length) if draft is not None else None
        entries = plan.step_phase[0].kv.entries
        self.seq_axes = {e.past_input: e.seq_axis for e in entries}
        self.drafted = self.accepted = self.rounds = 0
        # of them, the drafts a prediction gave (`predict`), and those accepted
        self.predicted_drafted = self.predicted_accepted = 0
        self._predicted = False  # the round being checked drafted from the prediction
        self.resets = 0  # rewinds of the text, for a target that keeps its own index of it

    # what targets call

    def draft_length(self, room: int) -> int:
        return self.length.next(room)

    def lookup(self, tokens: list[int], k: int) -> list[int]:
        """Prompt lookup's drafts for a round that may draft k: as many as pay, for the n-gram matched."""
        drafts = self.ngram.propose(tokens, k) if self.ngram is not None else []
        self._predicted = bool(drafts) and self.ngram.from_reference
        return drafts[: self.length.fit(max(0, self.ngram.matched - 1), len(drafts))]

    def drafting(self, k: int) -> int:
        """How many tokens the draft model drafts in a round that may draft k."""
        return self.length.fit(0, k)

    def shadow(self, tokens: list[int], token: int) -> None:
        """A plain step after `tokens` chose `token`: prompt lookup's proposal there, checked against it
        as a one-token draft would have been (DraftLength)."""
        if self.ngram is not None and self.length.shadows:
            proposal = self.ngram.propose(tokens, 1)
            if proposal:
                self.length.shadow(self.ngram.matched - 1, proposal[0] == token)

    def stepped(self, tokens: list[int], new: list[int]) -> None:
        """Plain steps after `tokens` chose `new`: each checked as `shadow` does."""
        if self.ngram is not None and self.length.shadows:
            seen = list(tokens)
            for token in new:
                self.shadow(seen, token)
                seen.append(token)

    def timed(self, tokens: int, seconds: float) -> None:
        """A target's run over `tokens` new tokens took `seconds` (see DraftLength)."""
        self.length.timed(tokens, seconds)

    def update(self, drafted: int, accepted: int) -> None:
        """A round checked `drafted` tokens and accepted the first `accepted` of them."""
        self.rounds += 1
        self.drafted += drafted
        self.accepted += accepted
        if self._predicted:
            self.predicted_drafted += drafted
            self.predicted_accepted += accepted
            self._predicted = False
        self.length.update(drafted, accepted)

    def plain_steps(self) -> int:
        """How many plain steps may run as one burst after a step that drafted nothing: it and the
        rest of the draft length's pause."""
        return 1 + self.length.wait

    def ran_plain(self, steps: int) -> None:
        """`steps` plain steps ran: the first was the step that drafted nothing; the others count off
        the pause, as steps one at a time would."""
        self.length.wait = max(0, self.length.wait - (steps - 1))

    def absorb(self, state: Mapping[str, Any]) -> None:
        """What a target that mirrors this speculator (web/speculate.js) did in a burst: its draft
        length's state, and the drafts it checked and accepted."""
        self.length.restore(state["length"])
        self.drafted += int(state["drafted"])
        self.accepted += int(state["accepted"])
        self.rounds += int(state["rounds"])

    def predict(self, reference: list[int]) -> None:
        """Draft `reference` (the text the request is expected to write) where the text follows it."""
        if self.ngram is None:
            raise GenerationError("a prediction is drafted by prompt lookup: this request drafts with a "
                                  "draft model")
        self.ngram.predict(reference)

    def rewound(self, length: int) -> Work:
        """The text was cut to its first `length` tokens: forget what the drafter knew past them."""
        self.resets += 1
        if self.ngram is not None:
            self.ngram.reset()
        if self.draft is not None:
            yield from self.draft.roll_back(length)

    # the fused path

    def speculation(self, tokens: list[int]) -> Speculation:
        draft = self.draft.fused() if self.draft is not None else None
        return Speculation(self, tokens, self.seq_axes, draft)

    def took(self, answer: Decoded) -> None:
        """After a fused Decode: the draft model's cache as the target answered it (none: it ran
        plain steps, and the draft model catches up when it drafts next)."""
        if self.draft is not None and answer.draft is not None:
            self.draft.take(*answer.draft)

    # rounds run here (targets without `fused_speculation`, requests that cannot fuse)

    def round(self, gen: TokenGenerator, budget: int | None) -> Work:
        """One round: draft, check with one run, keep what was accepted. Returns the new tokens, or
        None when this step drafts nothing (the caller runs a plain step)."""
        drafts = yield from self.drafts(gen, budget)
        if not drafts:
            return None
        flow, sampler = gen.flow, gen.sampler
        start = flow.position
        logits = yield from flow.run_iteration([gen.pending[0], *drafts])
        sampler.label = flow.label
        picks = yield from verify_picks(sampler, logits, drafts, gen.tokens, gen.generated)
        tokens = yield from self.settle(gen, drafts, picks, start)
        yield from roll_back(flow, start + len(tokens))
        return tokens

    def drafts(self, gen: TokenGenerator, budget: int | None) -> Work:
        """The drafts of a round after `gen`'s pending token ([]: this step drafts none), no more than the
        request's `budget` of new tokens and its max_length leave room for with the token after them."""
        room = gen.limits.max_length - len(gen.tokens)
        k = self.length.next(min(room, room if budget is None else budget) - 1)
        if self.draft is not None and k:
            k = self.drafting(k)
        if k == 0:
            return []
        if self.draft is not None:
            return (yield from self.draft.propose(gen.tokens, k, self.eos, gen.sampler, gen.generated))
        return self.lookup(gen.tokens, k)

    def settle(self, gen: TokenGenerator, drafts: list[int], picks: list[int], start: int) -> Work:
        """The tokens a round keeps, from the model's picks at its len(drafts) + 1 positions: the drafts it
        agrees with and its pick after them, cut after an eos. Counts them, draws their uniforms (sampling)
        and rolls the draft model back; the caller keeps the model's cache up to the pending token and the
        drafts kept: len(tokens) positions from `start`, the pending token's."""
        accepted = agreeing(drafts, picks)
        tokens = cut_at_eos([*drafts[:accepted], picks[accepted]], self.eos)
        if gen.sampler.settings.sampling:
            gen.sampler.skip(len(tokens))  # a uniform a token, as plain sampling draws them
        self.update(len(drafts), min(accepted, len(tokens)))
        if self.draft is not None:
            yield from self.draft.roll_back(start + 1 + min(accepted, len(tokens)))
        return tokens


def agreeing(drafts: list[int], picks: list[int]) -> int:
    """How many drafts, from the first, equal the model's picks at their positions."""
    n = 0
    while n < len(drafts) and drafts[n] == picks[n]:
        n += 1
    return n


def cut_at_eos(tokens: list[int], eos: frozenset[int]) -> list[int]:
    for i, token in enumerate(tokens):
        if token in eos:
            return tokens[: i + 1]
    return tokens


def roll_back(flow: FlowRun, length: int) -> Work:
    """Keep the first `length` positions of every cache of the flow (the accepted ones)."""
    for cache in flow.caches.values():
        if cache.length > length:
            yield from cache.truncate(length, flow.backend)
    flow.position = length


def _rows(sampler: Any, logits: Handle, drafts: list[int], tokens: list[int], generated: int) -> Work:
    """Processed scores [k+1, vocab], one row per checked position, each with the text before it."""
    out = yield Run(kernel("unfold", sampler.dtype), {"logits": logits}, ("rows",), None, sampler.label)
    rows = out["rows"]
    seen = [tokens + drafts[:i] for i in range(len(drafts) + 1)]
    banned = [banned_ids(sampler.settings, s, generated + i, sampler.eos) for i, s in enumerate(seen)]
    return (yield from sampler.scores(rows, seen, banned, [generated + i for i in range(len(seen))]))


def verify_picks(sampler: Any, logits: Handle, drafts: list[int], tokens: list[int], generated: int) -> Work:
    """The model's choice at each of the k+1 positions (its processors applied): the argmax, or when it
    samples a draw with the uniform plain sampling would use there (left undrawn: the caller draws
    one per token it keeps)."""
    scores = yield from _rows(sampler, logits, drafts, tokens, generated)
    b = sampler.backend
    if not sampler.settings.sampling:
        out = yield Run(kernel("argmax", "float32"), {"scores": scores}, ("token",), None, sampler.label)
    else:
        u = sampler.uniforms(len(drafts) + 1)
        feeds = {"scores": scores, "u": b.tensor(u, (len(u),), "float32")}
        out = yield Run(kernel("sample", "float32"), feeds, ("token",), None, sampler.label)
    return sampler.checked(b.to_list(out["token"]), len(tokens) - 1)


class DraftModel:
    """A draft model's run for one request: its own flow and KV cache over a prefix of the text,
    caught up with the text when it drafts, rolled back to what the model accepted."""

    def __init__(self, plan: Plan, backend: Backend, max_length: int):
        self.plan, self.backend = plan, backend
        self.flow = FlowRun(plan, backend, 1, max_length)
        self.step = plan.fused
        self.seq_axes = {e.past_input: e.seq_axis for e in plan.step_phase[0].kv.entries}
        self.dtype = plan.signatures[self.step.session].output(self.step.logits).dtype
        self.sampler: Sampler | None = None  # a sampled request's processors over the draft's logits

    def fused(self) -> DraftDecode:
        cache = self.flow.caches[self.step.session]
        return DraftDecode(self.step, cache.feeds, self.flow.position, self.flow.max_length, self.seq_axes)

    def take(self, cache: Mapping[str, Handle], length: int) -> None:
        kv = self.flow.caches[self.step.session]
        kv.take(cache, 0)
        kv.length = self.flow.position = length

    def propose(self, tokens: list[int], k: int, eos: frozenset[int], sampler: Any, generated: int) -> Work:
        """Up to k tokens after `tokens` (the text it has not seen yet is run first): its greedy ones; or,
        when the request samples, each drawn from its distribution, processed with the request's
        settings as the model's are, with the uniform number of its position (left undrawn: the
        model's check draws them)."""
        b = self.backend
        own = None
        if sampler.settings.sampling:
            own = self.sampler
            if own is None or own.settings is not sampler.settings:
                own = self.sampler = Sampler(b, self.dtype, sampler.settings, sampler.eos)
            own.label = "draft"
        uniforms = sampler.uniforms(k) if own is not None else []
        fed = tokens[self.flow.position :]
        drafts: list[int] = []
        while len(drafts) < k:
            logits = yield from self.flow.run_iteration(fed)
            if own is None:
                feeds, name = {"logits": logits}, kernel("argmax_last", self.dtype)
            else:
                seen = tokens + drafts
                banned = banned_ids(own.settings, seen, generated + len(drafts), own.eos)
                scores = yield from own.scores(logits, [seen], [banned], [generated + len(drafts)])
                feeds = {"scores": scores, "u": b.tensor([uniforms[len(drafts)]], (1,), "float32")}
                name = kernel("sample", "float32")
            out = yield Run(name, feeds, ("token",), None, "draft")
            drafts.append((own or sampler).checked(b.to_list(out["token"]), len(tokens) + len(drafts) - 1)[0])
            if drafts[-1] in eos:
                break
            fed = drafts[-1:]
        return drafts

    def roll_back(self, length: int) -> Work:
        yield from roll_back(self.flow, min(length, self.flow.position))
