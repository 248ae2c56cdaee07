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
"""

from __future__ import annotations

import numpy as np

from ...errors import OrtpipeError
from ...sampling.sampler import Pick


class Picker:
    """Selects the tokens of one burst of fused steps: each `select` is the burst's next step."""

    def __init__(self, pick: Pick, vocab: int):
        self.pick, self.vocab = pick, vocab
        self.seen = set(pick.seen)
        self.step = 0

    def select(self, row: np.ndarray, session: str, position: int) -> int:
        p = self.pick
        scores = row.astype(np.float32)  # a copy, also of float32 rows
        top = scores.max()
        if np.isnan(top) or top == np.inf:
            raise OrtpipeError(f'session "{session}" gave NaN or infinite logits on the decode step at '
                               f"position {position}: the model's weights or inputs are broken")
        if self.seen:
            ids = np.fromiter(self.seen, np.int64, len(self.seen))
            seen = scores[ids]
            penalty = np.float32(p.penalty)
            scores[ids] = np.where(seen < 0, seen * penalty, seen / penalty)
        if p.banned:
            scores[list(p.banned)] = -np.inf
        if p.sample:
            scores /= np.float32(p.temperature)
            token = self._draw(scores, np.float32(p.uniforms[self.step]))
        else:
            token = int(scores.argmax())
        self.step += 1
        if p.penalty != 1.0:
            self.seen.add(token)
        return token

    def _draw(self, scores: np.ndarray, u: np.float32) -> int:
        """The draw over the scores left: `ids` in index order and their scores in float64 (a
        dropped score adds an exact 0 to every sum, so leaving it out changes none). exp(score - the
        largest) is computed once: the largest score is never dropped, so every later step reads the
        same values the kernels compute again."""
        p, vocab = self.pick, self.vocab
        top_k = p.top_k if 0 < p.top_k < vocab else 0
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
        cdf = e.cumsum()
        return int(ids[np.searchsorted(cdf, float(u) * cdf[-1], "left")])
