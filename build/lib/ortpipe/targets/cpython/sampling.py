"""Token selection of fused decode steps (a `Decode`'s `Pick`), with numpy: the sampler's chain of
kernel graphs (build/kernels.py, sampling/sampler.py) over one row of logits, as web/sampling.js
computes it in the browser. Both follow the same arithmetic, so that a seeded run gives the same
tokens on every target:

- scores in float32, as the `process` kernel computes them: a biased id's bias added (logit
  bias), a seen id's score divided by the penalty (multiplied when negative), a generated id's
  lowered by its count times the frequency penalty plus the presence penalty (that amount rounded
  to float32 once), banned ids -inf, everything divided by the temperature;
- greedy: the first index of the largest score;
- top-k (0 < k < vocab): scores below the k-th largest dropped (ties kept);
- top-p (p < 1) and min-p (> 0), and the draw: probabilities in float64, exp(score - max) over the
  scores left, summed in index order; top-p keeps the highest scores (ties by lower index) while
  the probability above them is below p, min-p drops those below min_p times the largest;
- the draw: the first index whose running sum of exp(score - max), in index order, reaches
  u * the sum, with u the step's uniform number rounded to float32.

Speculative rounds select at each checked position as a plain step there would (`check`: sampling
with the uniform number of that position), and a sampled draft model draws its drafts with the
uniforms of their positions (`sample`): the drafts equal to the model's selections are kept, and a
seeded run's tokens are plain decoding's.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from itertools import accumulate

import numpy as np

from ...errors import OrtpipeError
from ...sampling.sampler import Pick

FEW = 256  # the most ids a Python draw takes


class Picker:
    """Selects the tokens of one burst of fused steps: each `select` is the burst's next step; a burst
    of speculative rounds draws (`sample`) and checks (`check`) drafts. The uniform numbers are taken
    in the core's order from `uniforms` (a draft model's Picker shares the model's)."""

    def __init__(self, pick: Pick, vocab: int, uniforms: Uniforms | None = None):
        self.pick, self.vocab = pick, vocab
        self.seen = set(pick.seen)
        self.counts = dict(pick.counts)  # id -> times generated, for the frequency and presence penalties
        self.counting = bool(pick.frequency or pick.presence)
        self.uniforms = uniforms or Uniforms(pick.uniforms)
        self.top_k = pick.top_k if 0 < pick.top_k < vocab else 0
        self.temperature = np.float32(pick.temperature)
        # the logit bias, made once: every step adds it
        self.biased = np.fromiter((i for i, _ in pick.bias), np.int64, len(pick.bias))
        self.biases = np.array([b for _, b in pick.bias], np.float32)

    def select(self, row: np.ndarray, session: str, position: int) -> int:
        token = self.token(row, session, position)
        self.took([token])
        return token

    def took(self, tokens: list[int]) -> None:
        """The burst selected `tokens`: their uniforms taken (one a token, when sampling), and seen from
        now on, for the repetition penalty."""
        if self.pick.sample:
            self.uniforms.taken += len(tokens)
        if self.pick.penalty != 1.0:
            self.seen.update(tokens)
        if self.counting:
            for token in tokens:
                self.counts[token] = self.counts.get(token, 0) + 1

    def token(self, row: np.ndarray, session: str, position: int, drafts: list[int] = ()) -> int:
        """The selection from one row of logits after the text and `drafts`: the argmax, or the draw
        with the uniform of its position (`drafts` ahead of the next one; not taken)."""
        p = self.pick
        seen = self.seen.union(drafts) if drafts and p.penalty != 1.0 else self.seen
        counts = self.counts
        if drafts and self.counting:
            counts = dict(counts)
            for token in drafts:
                counts[token] = counts.get(token, 0) + 1
        if seen or p.banned or counts or p.bias:
            scores = row.astype(np.float32)  # a copy
            if p.bias:
                scores[self.biased] += self.biases
            if seen:
                ids = np.fromiter(seen, np.int64, len(seen))
                values = scores[ids]
                penalty = np.float32(p.penalty)
                scores[ids] = np.where(values < 0, values * penalty, values / penalty)
            if counts:
                ids = np.fromiter(counts, np.int64, len(counts))
                amounts = np.array([n * p.frequency + p.presence for n in counts.values()], np.float32)
                scores[ids] -= amounts
            if not float(scores.max()) < math.inf:  # NaN fails every comparison
                _broken(session, position)
            if p.banned:
                scores[list(p.banned)] = -np.inf
        else:  # nothing to change: the row itself, its NaN found by the selection
            scores = row if row.dtype == np.float32 else row.astype(np.float32)
        if not p.sample:
            token = int(scores.argmax())  # NaN wins numpy's argmax
            if not float(scores[token]) < math.inf:
                _broken(session, position)
            return token
        kept = self._top_k if self.top_k else self._all
        ids, wide = kept(scores, session, position)
        u = self.uniforms.peek(len(drafts))
        if len(ids) <= FEW:  # a few: Python's floats cost less than numpy's calls
            return _drawn_few(ids.tolist(), wide.tolist(), p, float(u))
        return _draw(*self._nucleus(ids, wide.astype(np.float64)), u)

    def _all(self, scores: np.ndarray, session: str, position: int) -> tuple[np.ndarray, np.ndarray]:
        """(ids, scores over the temperature) of every score above -inf."""
        scores = scores / self.temperature
        if not float(scores.max()) < math.inf:
            _broken(session, position)
        ids = np.flatnonzero(scores > -np.inf)
        return ids, scores[ids]

    def _top_k(self, scores: np.ndarray, session: str, position: int) -> tuple[np.ndarray, np.ndarray]:
        """(ids, scores over the temperature) of the scores over the temperature not below
        their k-th largest (ties kept).

        The k-th largest is looked for among the scores not below an estimate (the (k/4)-th largest of
        every 16th score, which about 160 of 8,192 scores pass for k 40; fewer than k passed in none of
        1,016 rows of the demo's logits and 5,000 random rows), else among all. Only the scores near the
        top are divided: division rounds monotonically, so the k-th largest quotient is the k-th largest
        score's, and a score more than 2^-20 (relative) below that one stays below it once divided."""
        k, n = self.top_k, len(scores)
        top = float(scores.max())
        if not top < math.inf:  # NaN fails every comparison
            _broken(session, position)
        near = None
        rank = max(4, k // 4)
        sample = scores[::16]
        if len(sample) > 4 * rank:
            estimate = np.partition(sample, len(sample) - rank)[len(sample) - rank]
            near = np.flatnonzero(scores >= estimate)
            if len(near) < k:
                near = None
        if near is None:
            estimate = floor = np.partition(scores, n - k)[n - k]
        else:
            values = scores[near]
            floor = np.partition(values, len(values) - k)[len(values) - k]
        t = self.temperature
        quotient = floor / t
        normal = 1e-30 < abs(float(floor)) and 1e-30 < abs(float(quotient)) and top / t < 3e38
        if floor == -np.inf or not normal:
            ids, wide = self._all(scores, session, position)  # fewer than k scores, or near 0 or overflow
            if floor == -np.inf:
                return ids, wide
            kept = wide >= quotient
            return ids[kept], wide[kept]
        low = floor - abs(floor) * np.float32(2**-20)
        if near is None or estimate > low:
            near = np.flatnonzero(scores >= low)
        divided = scores[near] / t
        kept = divided >= quotient
        return near[kept], divided[kept]

    def _nucleus(self, ids: np.ndarray, wide: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The ids top-p and min-p leave of `ids` (in index order, their scores `wide`), and
        exp(score - the largest) of each in float64 (a dropped score adds an exact 0 to every sum, so
        leaving it out changes none). The largest score is never dropped, so exp is computed once
        and later steps read the same values the kernels compute again."""
        p = self.pick
        e = np.exp(wide - wide.max())
        if p.top_p < 1.0:
            order = np.argsort(-wide, kind="stable")  # ties: the lower id first
            # the probability above each score, highest first, below top_p: the first always is (0)
            above = (e / e.cumsum()[-1])[order].cumsum()
            kept = wide >= wide[order[np.count_nonzero(above[:-1] < p.top_p)]]
            ids, wide, e = ids[kept], wide[kept], e[kept]
        if p.min_p > 0.0:
            probs = e / e.cumsum()[-1]
            kept = probs >= probs.max() * p.min_p
            ids, e = ids[kept], e[kept]
        return ids, e

    def sample(self, row: np.ndarray, session: str, position: int, drafts: list[int]) -> int:
        """A draft model's draft after `drafts` (`row`: its logits), drawn with the uniform of its
        position (not taken: the model's selections take them)."""
        return self.token(row, session, position, drafts)

    def check(self, rows: np.ndarray, drafts: list[int], session: str, position: int) -> tuple[int, int]:
        """(drafts accepted, the token after them) of a speculative round whose check gave `rows` (one
        per checked position): the longest prefix of drafts equal to the rows' own selections, each
        as a plain step there would select (sampling: with the uniform of its position, left for
        `took` to take)."""
        for i in range(len(drafts) + 1):
            token = self.token(rows[i], session, position + i, drafts[:i])
            if i == len(drafts) or token != drafts[i]:
                return i, token
        raise AssertionError("unreachable")


class Uniforms:
    """The uniform numbers of a burst (`Pick.uniforms`, drawn by the core before it), one a token, taken
    in order."""

    def __init__(self, values: tuple[float, ...]):
        self.values, self.taken = values, 0

    def peek(self, i: int) -> np.float32:
        """The i-th number after those taken, not taken."""
        return np.float32(self.values[self.taken + i])


def _broken(session: str, position: int) -> None:
    raise OrtpipeError(f'session "{session}" gave NaN or infinite logits on the decode step at position '
                       f"{position}: the model's weights or inputs are broken")


def _drawn_few(ids: list[int], wide: list[float], p: Pick, u: float) -> int:
    """`Picker._nucleus` and `_draw` in Python's floats (float64, the same operations in the same
    order), for a few ids."""
    top = max(wide)
    e = [math.exp(v - top) for v in wide]
    if p.top_p < 1.0:
        total = _sum(e)
        order = sorted(range(len(wide)), key=wide.__getitem__, reverse=True)  # stable: ties, the lower id
        above = list(accumulate([e[j] / total for j in order]))
        threshold = wide[order[bisect_left(above, p.top_p, 0, len(above) - 1)]]
        kept = [j for j, v in enumerate(wide) if v >= threshold]
        ids, e = [ids[j] for j in kept], [e[j] for j in kept]
    if p.min_p > 0.0:
        total = _sum(e)
        least = max(e) / total * p.min_p
        kept = [j for j, x in enumerate(e) if x / total >= least]
        ids, e = [ids[j] for j in kept], [e[j] for j in kept]
    cdf = list(accumulate(e))
    return ids[bisect_left(cdf, u * cdf[-1])]


def _sum(values: list[float]) -> float:
    """The sum in order, one addition at a time (as numpy's cumsum; Python's sum compensates)."""
    total = 0.0
    for value in values:
        total += value
    return total


def _draw(ids: np.ndarray, e: np.ndarray, u: np.float32) -> int:
    """The first id whose running sum of `e`, in index order, reaches u times the sum."""
    cdf = e.cumsum()
    return int(ids[np.searchsorted(cdf, float(u) * cdf[-1], "left")])
