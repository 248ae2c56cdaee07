"""Token selection as a chain of kernel graphs (build/kernels.py): process -> top-k -> top-p ->
min-p -> sample, or argmax. Plain greedy with no processor runs one argmax kernel.

Randomness comes from `random.Random(seed)` here and enters the `sample` kernel as an input, so a
seeded run gives the same tokens on every target.

Fused decode steps (execute/work.py `Decode`) select their tokens in the target, without a round
trip to the core per token: `pick` describes the same chain for a burst of steps, with the
uniform numbers the generator would have drawn for them (`drew` winds it to what the burst used).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from ..config.settings import SearchSettings
from ..errors import GenerationError, OrtpipeError
from ..execute.work import Backend, Handle, Run, Select, Work, kernel, non_finite
from .processors import banned_ids, lowered_by, penalty_counts


@dataclass(frozen=True)
class Pick:
    """How a fused decode step selects its token from the last row of logits, as `Sampler.select`
    would: scores in float32 (each id of `bias` raised by its bias, penalty over `seen`, each id of
    `counts` lowered by its count times `frequency` plus `presence`, `banned` ids out, divided by
    `temperature`),
    then the argmax, or top-k, top-p and min-p and a draw with the step's number of `uniforms`.
    The target adds each token it selects to `seen`. Targets: web/sampling.js, and
    targets/cpython/sampling.py, whose module docstring gives the arithmetic."""

    sample: bool  # draw (else the argmax of the scores)
    temperature: float
    top_k: int  # 0: off
    top_p: float  # 1: off
    min_p: float  # 0: off
    penalty: float  # the repetition penalty; 1: off (then `seen` is empty)
    seen: tuple[int, ...]  # distinct ids so far
    banned: tuple[int, ...]
    uniforms: tuple[float, ...]  # one per step, in (0, 1], when sampling
    frequency: float = 0.0  # the frequency penalty; 0 and presence 0: off (then `counts` is empty)
    presence: float = 0.0  # the presence penalty
    counts: tuple[tuple[int, int], ...] = ()  # (id, times generated so far)
    bias: tuple[tuple[int, float], ...] = ()  # (id, bias): the logit bias


def named_ids(s: SearchSettings) -> tuple[tuple[str, list[int]], ...]:
    """The token ids the settings name, by setting: each must be below the vocabulary size (a request's are
    checked by Sampler.check_ids, a config's at load)."""
    forced = [i for i in (s.forced_bos_token_id, s.forced_eos_token_id) if i is not None]
    return (("suppress_tokens", list(s.suppress_tokens)),
            ("begin_suppress_tokens", list(s.begin_suppress_tokens)),
            ("logit_bias", [i for i, _ in s.logit_bias or ()]),
            ("forced_bos_token_id and forced_eos_token_id", forced))


def forced_id(s: SearchSettings, length: int, max_length: int | None) -> int | None:
    """The id forced after a sequence of `length` ids (Sampler.forced), or None."""
    if s.forced_eos_token_id is not None and max_length is not None and length == max_length - 1:
        return s.forced_eos_token_id
    return s.forced_bos_token_id if length == 1 else None


def generator(seed: int | None) -> random.Random:
    """The generator of one request. Unseeded: a seed from the module's generator, which each target
    seeds from the system's entropy (the browser's worker from crypto.getRandomValues after restoring
    its snapshot, whose own state is the build's)."""
    return random.Random(random.getrandbits(64) if seed is None else seed)


class Sampler:
    def __init__(self, backend: Backend, logits_dtype: str, settings: SearchSettings, eos: frozenset[int],
                 vocab: int | None = None):
        """`vocab`: the logits' width when the graph fixes it (the ids the settings name are checked
        against it here, else at the first selection)."""
        self.backend, self.settings, self.eos = backend, settings, eos
        self.dtype = logits_dtype
        self.rng = generator(settings.seed)
        self._vocab = 0
        if vocab:
            self.check_ids(vocab)
        self._peeked = False  # a burst's pick carries uniforms the generator has not drawn yet
        self.max_length: int | None = None  # the request's length limit (forced_eos_token_id's last position)
        self.label = ""  # the step the logits come from, for messages and traces
        self.last_logprobs: tuple[float, tuple[tuple[int, float], ...]] | None = None


    def check_ids(self, vocab: int) -> None:
        """The token ids the settings name are below the vocabulary size (a kernel would fail on them)."""
        for name, ids in named_ids(self.settings):
            wrong = [i for i in ids if i >= vocab]
            if wrong:
                raise GenerationError(f"{name}: token id {wrong[0]} is not below the vocabulary size {vocab} "
                                      f"of this model's logits; drop it", setting=name)

    def kernels(self) -> list[str]:
        """The kernel sessions `select` runs when nothing is banned: a target may open them early."""
        s = self.settings
        if s.argmax_only:
            return [kernel("argmax_last", self.dtype)]
        if self.selects_in_target:
            return []
        if not s.sampling:
            return [kernel("process", self.dtype), kernel("argmax", "float32")]
        stages = [("top_k", bool(s.top_k)), ("top_p", s.top_p < 1.0), ("min_p", s.min_p > 0.0),
                  ("sample", True)]
        return [kernel("process", self.dtype), *(kernel(name, "float32") for name, used in stages if used)]

    @property
    def selects_in_target(self) -> bool:
        """Whether the target selects every token as its fused steps do (a `Select` for the first one):
        sampling, penalties and bans that a Pick carries, on a target with fused sampling."""
        return bool(getattr(self.backend, "fused_sampling", False)) and self.fusable

    @property
    def fusable(self) -> bool:
        """Whether a target can select as `select` does, from `pick`: every ban but the n-gram
        one is known before a burst."""
        return not self.settings.no_repeat_ngram_size and self.settings.logprobs is None


    def pick(self, tokens: list[int], generated: int, limit: int) -> tuple[Pick | None, int]:
        """How a burst of at most `limit` fused steps after `tokens` selects (None: the argmax of the
        logits), and the limit that keeps its bans the same throughout: eos stays banned until
        min_length and min_new_tokens are reached, and a burst stops there."""
        s = self.settings
        if s.plain_greedy:
            return None, limit
        held = max(s.min_length - len(tokens), s.min_new_tokens - generated) if self.eos else 0
        if held > 0:
            limit = min(limit, held)
        if s.begin_suppress_tokens and generated == 0:
            limit = 1  # the first token's bans are not the next one's
        uniforms: tuple[float, ...] = ()
        if s.sampling:
            uniforms = tuple(self.uniforms(limit))
            self._peeked = True
        penalty = s.repetition_penalty
        pick = Pick(
            s.sampling,
            s.temperature if s.sampling else 1.0,
            s.top_k,
            s.top_p,
            s.min_p,
            penalty,
            tuple(sorted(set(tokens))) if penalty != 1.0 else (),
            tuple(banned_ids(s, tokens, generated, self.eos)),
            uniforms,
            s.frequency_penalty,
            s.presence_penalty,
            tuple(sorted(penalty_counts(s, tokens, generated).items())),
            s.logit_bias or (),
        )
        return pick, limit

    def drew(self, taken: int) -> None:
        """A burst took `taken` of its pick's uniforms (one a token): the generator as if they had been
        drawn one at a time."""
        if self._peeked:
            self._peeked = False
            self.skip(taken)

    def uniforms(self, n: int) -> list[float]:
        """The next n uniform numbers in (0, 1], left undrawn: `skip` draws those used."""
        state = self.rng.getstate()
        values = [1.0 - self.rng.random() for _ in range(n)]
        self.rng.setstate(state)
        return values

    def skip(self, n: int) -> None:
        for _ in range(n):
            self.rng.random()

    def select(self, logits: Handle, tokens: list[int], generated: int) -> Work:
        """The next token; with `logprobs` set, its log-probability and the most likely alternatives
        are left in `last_logprobs` (from the model's own distribution, before any penalty or warper)."""
        token = yield from self._pick(logits, tokens, generated)
        k = self.settings.logprobs
        if k is not None:
            b = self.backend
            out = yield Run(kernel("logprobs", self.dtype), {
                "logits": logits, "token": b.tensor([token], (1,), "int64"),
                "k": b.tensor([max(k, 1)], (1,), "int64")}, ("chosen", "values", "indices"), None, self.label)
            top = list(zip(b.to_list(out["indices"])[:k], b.to_list(out["values"])[:k], strict=True))
            self.last_logprobs = (b.to_list(out["chosen"])[0], tuple(top))
        return token

    def forced(self, tokens: list[int]) -> int | None:
        """The id the next token is forced to be, as transformers' logits processors force it (every other
        score -inf): forced_bos_token_id after a one-token sequence (an encoder-decoder's start token),
        forced_eos_token_id at the last position max_length allows (the later wins where both apply); None:
        a selection."""
        return forced_id(self.settings, len(tokens), self.max_length)

    def _pick(self, logits: Handle, tokens: list[int], generated: int) -> Work:
        s, b = self.settings, self.backend
        forced = self.forced(tokens)
        if forced is not None:
            if s.sampling:
                self.rng.random()  # one uniform a token, as a selection draws it
            return forced
        banned = banned_ids(s, tokens, generated, self.eos)
        if s.argmax_only and not banned:
            out = yield Run(
                kernel("argmax_last", self.dtype), {"logits": logits}, ("token",), None, self.label
            )
            return b.to_list(out["token"])[0]
        if self.selects_in_target:
            pick, _ = self.pick(tokens, generated, 1)
            token = yield Select(logits, pick, self.label or "the prefill", max(len(tokens) - 1, 0))
            self.drew(1)
            return int(token)
        scores = yield from self.scores(logits, [tokens], [banned], [generated])
        if not s.sampling:
            out = yield Run(kernel("argmax", "float32"), {"scores": scores}, ("token",))
            return self.checked(b.to_list(out["token"]), max(len(tokens) - 1, 0))[0]
        out = yield Run(
            kernel("sample", "float32"),
            {"scores": scores, "u": b.tensor([1.0 - self.rng.random()], (1,), "float32")},
            ("token",),
        )
        return self.checked(b.to_list(out["token"]), max(len(tokens) - 1, 0))[0]

    def checked(self, tokens: list[int], position: int) -> list[int]:
        """The kernels' selections, which are -1 where the scores held a NaN or +inf: an error then."""
        if any(t < 0 for t in tokens):
            raise OrtpipeError(non_finite(self.label or "the prefill", position))
        return tokens

    def scores(self, logits: Handle, seen: list[list[int]], banned: list[list[int]],
               generated: list[int] | None = None) -> Work:
        """Processed float32 scores [rows, vocab]: penalties, bans, and (when sampling) the warpers.
        Row r's text is seen[r], the last generated[r] of it generated (none when not given)."""
        s, b = self.settings, self.backend
        if not self._vocab:
            self._vocab = b.shape(logits)[-1]
            self.check_ids(self._vocab)
        vocab = self._vocab
        penalize = s.repetition_penalty != 1.0
        temperature = s.temperature if s.sampling else 1.0
        generated = generated or [0] * len(seen)
        bias = s.logit_bias or ()
        counts = [penalty_counts(s, text, n) for text, n in zip(seen, generated, strict=True)]
        width = max(1, max(len(c) for c in counts))
        amounts = [a for c in counts
                   for a in [lowered_by(s, c[i]) for i in sorted(c)] + [0.0] * (width - len(c))]
        out = yield Run(
            kernel("process", self.dtype),
            {
                "logits": logits,
                "banned": _padded(banned, vocab, b),
                "seen": _padded(seen if penalize else [[] for _ in seen], vocab, b),
                "counted": _padded([sorted(c) for c in counts], vocab, b),
                "amounts": b.tensor(amounts, (len(counts), width), "float32"),
                "biased": _padded([[i for i, _ in bias]] * len(seen), vocab, b),
                "biases": b.tensor([v for _, v in bias] * len(seen) if bias else [0.0] * len(seen),
                                   (len(seen), max(1, len(bias))), "float32"),
                "penalty": b.tensor([s.repetition_penalty], (1,), "float32"),
                "temperature": b.tensor([temperature], (1,), "float32"),
            },
            ("scores",),
        )
        scores = out["scores"]
        if not s.sampling:
            return scores
        k = min(s.top_k, vocab) if s.top_k else vocab
        if s.top_k and k < vocab:
            scores = (
                yield Run(
                    kernel("top_k", "float32"),
                    {"scores": scores, "k": b.tensor([k], (1,), "int64")},
                    ("kept",),
                )
            )["kept"]
        if s.top_p < 1.0:
            scores = (
                yield Run(
                    kernel("top_p", "float32"),
                    {
                        "scores": scores,
                        "p": b.tensor([s.top_p], (1,), "float32"),
                        "k": b.tensor([k], (1,), "int64"),
                    },
                    ("kept",),
                )
            )["kept"]
        if s.min_p > 0.0:
            scores = (
                yield Run(
                    kernel("min_p", "float32"),
                    {"scores": scores, "min_p": b.tensor([s.min_p], (1,), "float32")},
                    ("kept",),
                )
            )["kept"]
        return scores


def _padded(rows: list[list[int]], vocab: int, b: Backend) -> Handle:
    """Id lists as one [rows, n] tensor padded with `vocab`, the kernel's discard column."""
    width = max(1, max(len(r) for r in rows))
    flat = [i for r in rows for i in r + [vocab] * (width - len(r))]
    return b.tensor(flat, (len(rows), width), "int64")
