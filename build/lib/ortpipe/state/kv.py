"""The KV cache of one session for one request.

Two ways to carry it (format and sizes come from the plan, detected from the graph):
- concat: the graph returns present = past + new; the present is the next past.
- shared buffer: one buffer per entry, sized to the request's max length (never the model's
  context length), passed as past and written in place as present (onnxruntime-genai's
  GroupQueryAttention graphs with past_present_share_buffer).
Sliding-window entries keep only their last `window` positions: concat caches are sliced by a
kernel; a shared buffer is sized to the window and the graph's attention keeps it as a ring.
"""

from __future__ import annotations

from collections.abc import Mapping

from ..errors import GenerationError
from ..execute.work import Backend, Handle, Run, Work, kernel
from ..plan import CacheEntry, KVPlan


class KVCache:
    def __init__(self, plan: KVPlan, backend: Backend, batch: int, max_length: int):
        self.plan = plan
        self.length = 0  # positions the graph has seen
        self.feeds: dict[str, Handle] = {
            e.past_input: backend.full(
                _shape(e, batch, _capacity(e, plan.share_buffer, max_length)), 0, e.dtype
            )
            for e in plan.entries
        }
        self.inplace = {e.present_output: e.past_input for e in plan.entries} if plan.share_buffer else None
        self._windowed = [e for e in plan.entries if e.window is not None and not plan.share_buffer]

    def update(self, outputs: dict[str, Handle], new: int, backend: Backend) -> Work:
        """Take the run's presents as the next pasts. A shared buffer was written in place, unless the
        target could not: then it answered the present, which becomes the buffer."""
        first = self.length == 0
        self.length += new
        if self.plan.share_buffer:
            for e in self.plan.entries:
                if e.present_output in outputs:
                    self.feeds[e.past_input] = outputs[e.present_output]
            return
        feeds = self.feeds
        for e in self.plan.entries:
            if first or not e.frozen:
                feeds[e.past_input] = outputs[e.present_output]
        for e in self._windowed:
            if backend.shape(feeds[e.past_input])[e.seq_axis] > e.window:
                feeds[e.past_input] = yield from narrow_seq(backend, e, feeds[e.past_input], -e.window, END)

    def take(self, cache: Mapping[str, Handle], steps: int) -> None:
        """After `steps` fused decode steps: the cache the target answered is this cache from now on."""
        # adopted as it is, not copied: a target that keeps the cache between steps (the browser's JS
        # Decoder) knows its own mapping again on the next Decode
        self.feeds = cache if isinstance(cache, dict) else dict(cache)

        self.length += steps

    def truncate(self, length: int, backend: Backend) -> Work:
        """Forget every position from `length` on (a chat rewind)."""
        if length > self.length:
            raise GenerationError(f"cannot truncate a {self.length}-position cache to {length}")
        if self._windowed and self.length > min(e.window for e in self._windowed):
            raise GenerationError(
                "a sliding-window cache cannot be rewound once it has slid; start over instead"
            )
        if not self.plan.share_buffer:
            for e in self.plan.entries:
                past = self.feeds[e.past_input]
                self.feeds[e.past_input] = yield from narrow_seq(backend, e, past, 0, length)
        self.length = length

    def reorder(self, rows: list[int], backend: Backend) -> Work:
        """Rebuild the cache from the given batch rows, in order (beam search follows its beams)."""
        index = backend.tensor(rows, (len(rows),), "int64")
        for e in self.plan.entries:
            out = yield Run(
                kernel(f"gather_rows{e.batch_axis}", e.dtype),
                {"x": self.feeds[e.past_input], "rows": index},
                ("y",),
            )
            self.feeds[e.past_input] = out["y"]
        if self.plan.share_buffer:  # new buffers: bind the presents to them
            self.inplace = {e.present_output: e.past_input for e in self.plan.entries}


END = 2**62  # "to the end" for the narrow kernel


def narrow_seq(backend: Backend, e: CacheEntry, x: Handle, start: int, end: int) -> Work:
    out = yield Run(
        kernel("narrow", e.dtype),
        {
            "x": x,
            "start": backend.tensor([start], (1,), "int64"),
            "end": backend.tensor([end], (1,), "int64"),
            "axis": backend.tensor([e.seq_axis], (1,), "int64"),
        },
        ("y",),
    )
    return out["y"]


def _capacity(e: CacheEntry, share_buffer: bool, max_length: int) -> int:
    """Positions a fresh past holds: none for concat caches; for a shared buffer, the request's max
    length, or the window for a sliding-window layer (its attention keeps a ring of that size)."""
    if not share_buffer:
        return 0
    return e.window or max_length


def _shape(e: CacheEntry, batch: int, seq: int) -> tuple[int, ...]:
    shape = list(e.shape)
    shape[e.batch_axis], shape[e.seq_axis] = batch, seq
    return tuple(d or 0 for d in shape)
