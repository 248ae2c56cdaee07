"""Speculative rounds inside a fused `Decode` burst on onnxruntime (loops/speculative.py).

Each round drafts (prompt lookup through the core's Speculator, or steps of the draft model: its
argmax, or when the request samples a draw from its processed distribution with the uniform number
of the draft's position), runs the decoder once over the pending token and the drafts, keeps the
longest prefix of drafts equal to the model's own selections (the argmax, or as the request's Picker
selects, sampling.py) plus its selection after them, and rolls both caches back to what was kept. A
round with no draft is a plain step. The burst ends as a plain one does: at the limit, an eos, or
after its time.

A shared buffer runs through the session's fused binding, with input ids, positions and logits
arrays bound per width (tokens in one run); rolling it back moves only its length, which the next
run's mask says. A concat cache runs plain `run()`s and is narrowed along its sequence axis.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import TYPE_CHECKING

import numpy as np
import onnxruntime as ort

from ...errors import OrtpipeError
from ...execute.work import Decode, Decoded, FusedStep
from ...loops.speculative import agreeing, cut_at_eos
from .sampling import Picker

if TYPE_CHECKING:
    from ...loops.speculative import Speculator
    from .driver import Driver


def speculate(driver: Driver, d: Decode, seconds: float) -> Decoded:
    """Speculative rounds for `d` until its limit, an eos, or `seconds` (one round when traced)."""
    spec = d.speculation
    speculator = spec.speculator
    target = Tokens(driver, d, spec.seq_axes)
    picker = Picker(d.pick, d.step.logits_shape[-1]) if d.pick is not None else None
    draft, drafter = _draft_model(driver, d, picker)
    text = list(spec.tokens)  # ends with d.token
    position, drafted_to = d.position, spec.draft.length if draft else 0
    out: list[int] = []
    burst = d.limit > 1 and driver.trace is None
    end = time.perf_counter() + seconds if burst else 0.0
    try:
        while True:
            k = speculator.draft_length(d.limit - len(out) - 1)
            drafts: list[int] = []
            if k or not speculator.length.wait:
                drafts, drafted_to = _propose(speculator, draft, drafter, text, drafted_to, k, d.eos)
            if not drafts and burst:  # a plain step, or a pause's: the driver's own, then their shadows
                new = _pause(speculator, target, text, position, d.limit - len(out), picker, end)
            else:
                # the round's cost: the run, the checks, and the cache rolled back
                started = time.perf_counter()
                rows = target.run([text[-1], *drafts], position)
                accepted, token = _checked(target, picker, rows, drafts, position)
                new = cut_at_eos([*drafts[:accepted], token], d.eos)
                target.keep(position + len(new))
                speculator.timed(len(drafts) + 1, time.perf_counter() - started)
                if picker is not None:
                    picker.took(new)
                if drafts:
                    speculator.update(len(drafts), min(accepted, len(new)))
                else:
                    speculator.shadow(text, new[0])
                if draft is not None:
                    drafted_to = min(drafted_to, position + 1 + min(accepted, len(new)))
                    draft.keep(drafted_to)
            out += new
            text += new
            position += len(new)
            if not burst or len(out) >= d.limit or out[-1] in d.eos or time.perf_counter() >= end:
                break
    finally:
        target.close()
        if draft is not None:
            draft.close()
    return Decoded(out, target.cache, (draft.cache, drafted_to) if draft is not None else None)


def _pause(speculator: Speculator, target: Tokens, text: list[int], position: int, room: int,
           picker: Picker | None, end: float) -> list[int]:
    """A step that drafts nothing and the rest of the pause in drafting, run as the driver's own fused
    steps (a round without drafts costs more), prompt lookup's proposals checked in their shadow
    afterwards."""
    started = time.perf_counter()
    new = target.steps(text[-1], position, min(speculator.plain_steps(), room), picker, end)
    speculator.timed(1, (time.perf_counter() - started) / len(new))
    speculator.stepped(text, new)
    speculator.ran_plain(len(new))
    return new


def _propose(speculator: Speculator, draft: Tokens | None, drafter: Picker | None, text: list[int],
             drafted_to: int, k: int, eos: frozenset[int]) -> tuple[list[int], int]:
    """A round's drafts (up to k), and how much of the text the draft model has seen after them."""
    if not k:
        return [], drafted_to
    if draft is None:
        return speculator.lookup(text, k), drafted_to
    k = speculator.drafting(k)
    if not k:
        return [], drafted_to
    started = time.perf_counter()
    drafts, drafted_to = _draft(draft, drafter, text, drafted_to, k, eos)
    speculator.length.drafted(len(drafts), time.perf_counter() - started)
    return drafts, drafted_to


def _draft_model(driver: Driver, d: Decode, picker: Picker | None) -> tuple[Tokens | None, Picker | None]:
    """The draft model's session runs, and the Picker that samples its drafts (a sampled request's: the
    model's uniforms and seen tokens), or Nones."""
    dd = d.speculation.draft
    if dd is None:
        return None, None
    alone = Decode(dd.step, dd.cache, dd.capacity, d.eos, 0, dd.length, 1, "draft")
    draft = Tokens(driver, alone, dd.seq_axes)
    if picker is None or not picker.pick.sample:
        return draft, None
    drafter = Picker(picker.pick, dd.step.logits_shape[-1], picker.uniforms)
    drafter.seen, drafter.counts = picker.seen, picker.counts
    return draft, drafter


def _checked(target: Tokens, picker: Picker | None, rows: np.ndarray, drafts: list[int],
             position: int) -> tuple[int, int]:
    """(drafts accepted, the token after them): the argmax's agreement, or as the request's Picker checks."""
    if picker is None:
        picks = target.picks(rows, position)
        accepted = agreeing(drafts, picks)
        return accepted, picks[accepted]
    return picker.check(rows, drafts, target.step.session, position)


def _draft(draft: Tokens, drafter: Picker | None, text: list[int], length: int, k: int,
           eos: frozenset[int]) -> tuple[list[int], int]:
    """Up to k tokens of the draft model after `text`, of which it has seen `length`: its argmax, or
    drawn by `drafter` (a sampled request's, with the uniforms of their positions); and how much it
    has seen after them (all the text, and the drafts but the last)."""
    fed, drafts = text[length:], []
    while True:
        rows = draft.run(fed, length)
        if drafter is None:
            token = draft.picks(rows[-1:], length + len(fed) - 1)[0]
        else:
            token = drafter.sample(rows[-1], draft.step.session, length + len(fed) - 1, drafts)
        length += len(fed)
        drafts.append(token)
        if len(drafts) == k or token in eos:
            return drafts, length
        fed = [token]


class _Width:
    """Input ids (and positions) and logits arrays of a shared-buffer session bound for runs of
    `n` tokens, with the OrtValues over them."""

    def __init__(self, step: FusedStep, n: int, logits_type: np.dtype):
        self.ids = np.zeros((1, n), step.ids[1])
        self.positions = np.zeros((1, n), step.positions[1]) if step.positions else None
        self.logits = np.empty((1, n, step.logits_shape[-1]), logits_type)
        self.rows = self.logits.reshape(n, -1)
        self.values = [ort.OrtValue.ortvalue_from_numpy(a) for a in (self.ids, self.positions, self.logits)
                       if a is not None]


class Tokens:
    """One session of a fused step run on several new tokens at once, its cache kept here between
    runs: `run` gives each new token's row of logits (`picks`: their argmaxes), `keep` rolls the cache
    back, `close` leaves the session's binding as the plain fused steps expect it."""

    def __init__(self, driver: Driver, d: Decode, seq_axes: Mapping[str, int]):
        self.driver, self.d, self.step = driver, d, d.step
        self.seq_axes = seq_axes
        if self.step.layout == "shared":
            self.f = driver._shared(d)
            self.cache = d.cache
            self.width = 1
        else:
            self.f = driver._concat(d)
            self.cache = dict(d.cache)  # the core's stays as it was until the answer hands this one over

    def run(self, tokens: list[int], position: int) -> np.ndarray:
        """Feed `tokens` from `position`: the logits of each, a row each (valid until the next run)."""
        if self.step.layout == "shared":
            return self._shared(tokens, position)
        return self._concat(tokens, position)

    def picks(self, rows: np.ndarray, position: int) -> list[int]:
        """The argmax of each row (`position`: the first row's, for the message)."""
        picks = rows.argmax(-1)
        if not np.isfinite(rows[np.arange(len(picks)), picks]).all():
            raise OrtpipeError(f'session "{self.step.session}" gave NaN or infinite logits on the decode '
                               f"step at position {position}: the model's weights or inputs are broken")
        return picks.tolist()

    def steps(self, token: int, position: int, n: int, picker: Picker | None, end: float) -> list[int]:
        """Up to n plain steps from `token` at `position` (the driver's own fused steps), stopping after
        an eos or at `end`: the tokens they selected."""
        if self.step.layout == "shared" and self.width != 1:
            self._bind(1)
        step = self.driver._stepper(self.d, self.f, self.cache, picker)
        return self.driver._steps(step, token, position, n, self.d.eos, end)

    def keep(self, length: int) -> None:
        """Forget the positions from `length` on: a shared buffer's next run starts there (its mask
        says so); a concat cache is narrowed."""
        if self.step.layout == "shared":
            return
        for past, x in self.cache.items():
            axis = self.seq_axes[past]
            if x.shape[axis] > length:
                index = [slice(None)] * x.ndim
                index[axis] = slice(0, length)
                self.cache[past] = np.ascontiguousarray(x[tuple(index)])

    def close(self) -> None:
        if self.step.layout == "shared" and self.width != 1:
            self._bind(1)

    def _shared(self, tokens: list[int], position: int) -> np.ndarray:
        f, n = self.f, len(tokens)
        if n == 1:  # the plain fused step's own arrays
            if self.width != 1:
                self._bind(1)
            f.ids[0, 0] = tokens[0]
            if f.positions.size:
                f.positions[0, 0] = position
            rows = f.logits.reshape(1, -1)
        else:
            w = self._bind(n) if self.width != n else f.widths[n]
            w.ids[0] = tokens
            if w.positions is not None:
                w.positions[0] = np.arange(position, position + n)
            rows = w.rows
        if f.mask_name is not None:
            f.raw.bind_ortvalue_input(f.mask_name, f.mask(position + n))
        self.driver._fused_run(self.d, position, f.run, f.raw, None)
        return rows

    def _bind(self, n: int) -> _Width | None:
        """Bind the arrays of width n (1: the plain fused step's own)."""
        f, step = self.f, self.step
        self.width = n
        if n == 1:
            names = [step.ids[0], *(step.positions[:1] if step.positions else ()), step.logits]
            values = [f.values[name] for name in names]
            w = None
        else:
            w = f.widths.get(n)
            if w is None:
                w = f.widths[n] = _Width(step, n, f.logits.dtype)
            values = w.values
        f.raw.bind_ortvalue_input(step.ids[0], values[0]._ortvalue)
        if step.positions:
            f.raw.bind_ortvalue_input(step.positions[0], values[1]._ortvalue)
        f.raw.bind_ortvalue_output(step.logits, values[-1]._ortvalue)
        return w

    def _concat(self, tokens: list[int], position: int) -> np.ndarray:
        step, f, n = self.step, self.f, len(tokens)
        feeds = dict(self.cache)
        feeds[step.ids[0]] = np.array([tokens], step.ids[1])
        if step.mask:
            feeds[step.mask[0]] = f.ones[:, : position + n]
        if step.positions:
            feeds[step.positions[0]] = np.arange(position, position + n, dtype=step.positions[1])[None]
        values = self.driver._fused_run(self.d, position, f.run, step.outputs, feeds, None)
        for past, i in f.presents:
            self.cache[past] = values[i]
        logits = values[f.logits_at]
        return logits.reshape(-1, logits.shape[-1])[-n:]
