"""Token selection of fused decode steps (a `Decode`'s `Pick`), with numpy: the sampler's chain of
kernel graphs (build/kernels.py, sampling/sampler.py) over one row of logits, as web/sampling.js
computes it in the browser. Both follow the same arithmetic, so that a seeded run gives the same
tokens on every target:

- scores in float32, as the `process` kernel computes them: a seen id's score divided by the
  penalty (multiplied when negative), banned ids -inf, everything divided by the temperature;
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

import numpy as np

from ...errors import OrtpipeError
from ...sampling.sampler import Pick


class Picker:
    """Selects the tokens of one burst of fused steps: each `select` is the burst's next step; a burst
    of speculative rounds draws (`sample`) and checks (`check`) drafts. The uniform numbers are taken
    in the core's order from `uniforms` (a draft model's Picker shares the model's)."""

    def __init__(self, pick: Pick, vocab: int, uniforms: Uniforms | None = None):
        self.pick, self.vocab = pick, vocab
        self.seen = set(pick.seen)
        self.uniforms = uniforms or Uniforms(pick.uniforms)
        self.top_k = pick.top_k if 0 < pick.top_k < vocab else 0

    def select(self, row: np.ndarray, session: str, position: int) -> int:
        scores = self.scores(row, session, position)
        token = _draw(*self.kept(scores), self.uniforms.peek(0)) if self.pick.sample else int(scores.argmax())
        self.took([token])
        return token

    def took(self, tokens: list[int]) -> None:
        """The burst selected `tokens`: their uniforms taken (one a token, when sampling), and seen from
        now on, for the repetition penalty."""
        if self.pick.sample:
            self.uniforms.taken += len(tokens)
        if self.pick.penalty != 1.0:
            self.seen.update(tokens)

    def scores(self, row: np.ndarray, session: str, position: int, drafts: list[int] = ()) -> np.ndarray:
        """The processed float32 scores of one row of logits, after the text and `drafts`."""
        p = self.pick
        scores = row.astype(np.float32)  # a copy, also of float32 rows
        top = scores.max()
        if np.isnan(top) or top == np.inf:
            raise OrtpipeError(f'session "{session}" gave NaN or infinite logits on the decode step at '
                               f"position {position}: the model's weights or inputs are broken")
        seen = self.seen.union(drafts) if drafts and p.penalty != 1.0 else self.seen
        if seen:
            ids = np.fromiter(seen, np.int64, len(seen))
            values = scores[ids]
            penalty = np.float32(p.penalty)
            scores[ids] = np.where(values < 0, values * penalty, values / penalty)
        if p.banned:
            scores[list(p.banned)] = -np.inf
        if p.sample:
            scores /= np.float32(p.temperature)
        return scores

    def kept(self, scores: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The ids top-k, top-p and min-p leave, in index order, and exp(score - the largest) of each in
        float64 (a dropped score adds an exact 0 to every sum, so leaving it out changes none). The
        largest score is never dropped, so exp is computed once and later steps read the same values
        the kernels compute again."""
        p, vocab, top_k = self.pick, self.vocab, self.top_k
        floor = np.partition(scores, vocab - top_k)[vocab - top_k] if top_k else -np.inf
        ids = np.flatnonzero(scores >= floor) if floor > -np.inf else np.flatnonzero(scores > -np.inf)
        wide = scores[ids].astype(np.float64)
        e = np.exp(wide - wide.max())
        if p.top_p < 1.0:
            order = np.argsort(-wide, kind="stable")[: top_k or vocab]  # ties: the lower id first
            probs = e / e.cumsum()[-1]
            above = np.concatenate(([0.0], probs[order].cumsum()[:-1]))
            kept = wide >= wide[order[np.count_nonzero(above < p.top_p) - 1]]
            ids, wide, e = ids[kept], wide[kept], e[kept]
        if p.min_p > 0.0:
            probs = e / e.cumsum()[-1]
            kept = probs >= probs.max() * p.min_p
            ids, e = ids[kept], e[kept]
        return ids, e

    def sample(self, row: np.ndarray, session: str, position: int, drafts: list[int]) -> int:
        """A draft model's draft after `drafts` (`row`: its logits), drawn with the uniform of its
        position (not taken: the model's selections take them)."""
        return _draw(*self.kept(self.scores(row, session, position, drafts)), self.uniforms.peek(len(drafts)))

    def check(self, rows: np.ndarray, drafts: list[int], session: str, position: int) -> tuple[int, int]:
        """(drafts accepted, the token after them) of a speculative round whose check gave `rows` (one
        per checked position): the longest prefix of drafts equal to the rows' own selections, each
        as a plain step there would select (sampling: with the uniform of its position, left for
        `took` to take)."""
        for i in range(len(drafts) + 1):
            scores = self.scores(rows[i], session, position + i, drafts[:i])
            sampled = self.pick.sample
            token = _draw(*self.kept(scores), self.uniforms.peek(i)) if sampled else int(scores.argmax())
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


def _draw(ids: np.ndarray, e: np.ndarray, u: np.float32) -> int:
    """The first id whose running sum of `e`, in index order, reaches u times the sum."""
    cdf = e.cumsum()
    return int(ids[np.searchsorted(cdf, float(u) * cdf[-1], "left")])
