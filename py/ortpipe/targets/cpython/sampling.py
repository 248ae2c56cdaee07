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

Speculative rounds (`check`) decide as the `spec_accept` and `spec_accept_q` kernels, in the same
float64 arithmetic: row i's scores see the drafts before it (the penalty); p = e / the sum of e over
the kept ids (q: the draft model's, from the row its draft was drawn from); a looked-up draft is
kept when u_i <= p(draft), a sampled one when u_i * q(draft) <= p(draft); at the first rejection the
token is drawn with the round's last uniform from e with the draft's entry 0 (lookup) or from
max(p - q, 0) (a draft model; p's e where that sums to 0), after all were kept from the last row.
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
        if self.pick.sample:
            ids, e = self.kept(scores)
            token = _draw(ids, e, self.uniforms.next())
        else:
            token = int(scores.argmax())
        self.took([token])
        return token

    def took(self, tokens: list[int]) -> None:
        """The burst selected `tokens`: seen from now on, for the repetition penalty."""
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

    def sample(self, row: np.ndarray, session: str, position: int, drafts: list[int]) -> tuple[int, Dist]:
        """A draft model's sampled draft after `drafts` (`row`: its logits), and the distribution it
        was drawn from."""
        ids, e = self.kept(self.scores(row, session, position, drafts))
        return _draw(ids, e, self.uniforms.next()), (ids, e)

    def check(self, rows: np.ndarray, drafts: list[int], session: str, position: int,
              dists: list[Dist] | None = None) -> tuple[int, int]:
        """(drafts accepted, the token after them) of a speculative round whose check gave `rows` (one
        per checked position), as the core's kernels decide (loops/speculative.py): greedy, the
        longest prefix of drafts the processed argmax agrees with; sampling, the speculative-sampling
        rule, for drafts that were chosen (`dists` None: prompt lookup, spec_accept) or sampled from
        `dists` (a draft model's, spec_accept_q). Takes len(drafts) + 1 uniforms when sampling."""
        if not self.pick.sample:
            for i in range(len(drafts) + 1):
                pick = int(self.scores(rows[i], session, position + i, drafts[:i]).argmax())
                if i == len(drafts) or pick != drafts[i]:
                    return i, pick
        us = [self.uniforms.next() for _ in range(len(drafts) + 1)]
        for i, draft in enumerate(drafts):
            ids, e = self.kept(self.scores(rows[i], session, position + i, drafts[:i]))
            total = e.cumsum()[-1]
            p = _share(ids, e, draft) / total
            if dists is None:
                if float(us[i]) <= p:
                    continue
                residual = e.copy()
                at = np.searchsorted(ids, draft)
                if at < len(ids) and ids[at] == draft:
                    residual[at] = 0.0
            else:
                q_ids, q_e = dists[i]
                q_total = q_e.cumsum()[-1]
                if float(us[i]) * (_share(q_ids, q_e, draft) / q_total) <= p:
                    continue
                residual = np.maximum(e / total - _shares(q_ids, q_e, ids) / q_total, 0.0)
            if residual.cumsum()[-1] == 0.0:  # rounding left nothing: p itself
                residual = e
            return i, _draw(ids, residual, us[-1])
        n = len(drafts)
        ids, e = self.kept(self.scores(rows[n], session, position + n, drafts))
        return n, _draw(ids, e, us[-1])


class Uniforms:
    """The uniform numbers of a burst, taken in order: the core drew them before it (`Pick.uniforms`) and
    winds its generator to how many were taken (`taken`)."""

    def __init__(self, values: tuple[float, ...]):
        self.values, self.taken = values, 0

    def next(self) -> np.float32:
        u = np.float32(self.values[self.taken])
        self.taken += 1
        return u


Dist = tuple  # (ids in index order, their exp(score - the largest) in float64): Picker.kept


def _share(ids: np.ndarray, e: np.ndarray, token: int) -> float:
    """e of `token` (0 where it was dropped)."""
    at = int(np.searchsorted(ids, token))
    return float(e[at]) if at < len(ids) and ids[at] == token else 0.0


def _shares(ids: np.ndarray, e: np.ndarray, wanted: np.ndarray) -> np.ndarray:
    """e of each of the ids `wanted` (0 where dropped)."""
    out = np.zeros(len(wanted))
    at = np.searchsorted(ids, wanted)
    inside = at < len(ids)
    hit = np.zeros(len(wanted), bool)
    hit[inside] = ids[at[inside]] == wanted[inside]
    out[hit] = e[at[hit]]
    return out


def _draw(ids: np.ndarray, e: np.ndarray, u: np.float32) -> int:
    """The first id whose running sum of `e`, in index order, reaches u times the sum."""
    cdf = e.cumsum()
    return int(ids[np.searchsorted(cdf, float(u) * cdf[-1], "left")])
