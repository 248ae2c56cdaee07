"""Continuous batching: the decode steps of several requests as rows of one batched decoder run.

A request prefills alone (its own TokenGenerator, batch 1), then joins the batch between steps: its
KV cache becomes a row of the batch's cache. Each `step` runs the decoder once for every row, each
at its own position, and gives every row its next token; a row that is done (eos, its length, a
stop string, an interrupt) leaves between steps, taking its cache rows back, so its generator can
go on alone (a chat's next turn, a prompt cache) or join again.

Rows may have different lengths. Two cache layouts are batched:
- shared: the model builder's graphs (GroupQueryAttention over one shared past/present buffer per
  layer) read each row's length from its attention mask (the sum of the row, right-padded), write
  the row's new key and value at that position and rotate by it. Every row is sized to the batch's
  capacity.
- concat: a graph that returns present = past + new (Optimum's exports) takes one past length for
  every row, so rows are aligned on the right: a shorter row's cache is padded on the left with
  zeros that its attention mask hides, and its position ids say where it really is. When a row
  leaves, its padding is cut off, and the columns every remaining row pads are dropped.
Either way a row attends to exactly what it would alone. Other plans are served one request at a
time.

Rows that speculate check their drafts together on a concat cache (`speculate`): each row's pending token
and drafts in one run, right-padded with masked positions to the longest, and each row keeps what its
speculator accepts; a gather kernel then keeps each row's accepted positions, lined up on the right again.
A shared buffer's GroupQueryAttention takes several new tokens over a past for one row only, so its rows
speculate alone (serve/engine.py chooses).
"""

from __future__ import annotations

from ..errors import GenerationError
from ..execute.work import Backend, Handle, Run, Work, kernel
from ..plan import CacheEntry, Plan
from ..state.kv import END, narrow_seq
from .autoregressive import TokenGenerator
from .speculative import cannot_verify, verify_picks


def batchable(plan: Plan) -> str | None:
    """Why the plan's requests cannot be batched, or None when they can."""
    step = plan.fused
    if step is None:
        return "its step phase is not a single decoder run over a KV cache (a multi-session pipeline)"
    session = plan.step_phase[0]
    if session.kv.format != "separate" or any(e.window is not None for e in session.kv.entries):
        return "its KV cache is combined or slides (rows of such caches are not batched yet)"
    if step.fixed:
        return ("its decoder takes inputs fixed for each request (an encoder's states, a cache-branch flag), "
                "which rows of a batch do not share")
    if any(e.frozen or e.batch_axis != 0 for e in session.kv.entries):
        return "its KV cache keeps cross-attention entries or has no leading batch axis"
    if step.mask is None:
        return "its decoder takes no attention mask, which is how rows of different lengths are told apart"
    if step.layout == "concat" and step.positions is None:
        return ("its decoder takes no position ids, and a row padded on the left to the batch's length "
                "needs them to be placed where it is")
    return None


class Batch:
    """Rows decoding together. `join` and `leave` between steps; `step` runs them all once.

    Shared-buffer rows live in one buffer of `slots` rows per cache entry, allocated at the first join
    (more when more rows join): a row joining is copied into the next free slot, a row leaving takes
    a copy of its slot, and the last row moves into the slot it freed, each copy only of the positions
    a row has seen. Each step runs over a view of the first rows, written in place (the target's
    `row_views`). Concat rows are joined into new tensors, which their caches are anyway every step.
    """

    def __init__(self, plan: Plan, backend: Backend, capacity: int, slots: int = 4):
        why = batchable(plan)
        if why:
            raise GenerationError(f"this model's requests cannot be batched: {why}")
        # slots: the buffer's rows (once it is allocated; doubled each time rows fill it)
        self.plan, self.backend, self.capacity, self.slots = plan, backend, capacity, max(1, slots)
        self.fused = plan.fused
        self.shared = self.fused.layout == "shared"
        if self.shared and not getattr(backend, "row_views", False):
            raise GenerationError("this target cannot batch rows: its tensors are not views of one buffer")
        self.entries = plan.step_phase[0].kv.entries
        self.rows: list[TokenGenerator] = []
        self.cache: dict[str, Handle] = {}  # past input -> [rows, heads, positions, head_size]
        self.buffer: dict[str, Handle] = {}  # shared: past input -> [slots, heads, capacity, head_size]
        self.width = 0  # concat: the positions every row's cache holds, its left padding included
        self.steps = 0
        self.prefills = 0  # runs of `prefill`

    def __len__(self) -> int:
        return len(self.rows)

    def join(self, gen: TokenGenerator) -> Work:
        """Add a prefilled generator (READY, one id pending) as the batch's last row."""
        if gen.flow.iterations == 0 or len(gen.pending) != 1 or gen.state != "ready":
            raise GenerationError("a row joins a batch after its prefill, with one token to feed")
        if self.shared:
            self._check_capacity(gen)
        own = dict(gen.flow.caches[self.fused.session].feeds)
        if self.shared:
            yield from self._join_slot(own, gen.flow.position)
        else:
            yield from self._join_concat(own, gen.flow.position)
        self.rows.append(gen)

    def prefill(self, gens: list[TokenGenerator]) -> Work:
        """Prefill fresh generators together and add them as the batch's last rows: one run over their
        prompts, right-padded (the shared buffer's graphs read each row's length from its mask, so a row
        sees exactly its own prompt), written into the next slots; each row's first token selected by its
        own sampler. Returns those tokens. Shared-buffer batches only: a concat row prefills alone."""
        step, b = self.fused, self.backend
        self._check_fresh(gens)
        n, k = len(self.rows), len(gens)
        own = gens[0].flow.caches[step.session].feeds
        while not self.buffer or n + k > self.slots:
            yield from self._grow(own)
            if n:  # the rows' cache: views of the new buffer, even if this prefill fails
                yield from self._view(n)
        lengths = [len(gen.pending) for gen in gens]
        width = max(lengths)
        try:
            for gen in gens:
                gen.begin_external()
            feeds = {}
            for e in self.entries:
                feeds[e.past_input] = yield from self._narrow0(self.buffer[e.past_input], e, n, n + k)
            ids = [t for gen, m in zip(gens, lengths, strict=True) for t in gen.pending + [0] * (width - m)]
            feeds[step.ids[0]] = b.tensor(ids, (k, width), step.ids[1])
            mask = [v for m in lengths for v in [1] * m + [0] * (width - m)]
            feeds[step.mask[0]] = b.tensor(mask, (k, width), step.mask[1])
            if step.positions:
                feeds[step.positions[0]] = b.tensor(list(range(width)) * k, (k, width), step.positions[1])
            out = yield Run(step.session, feeds, step.outputs, dict(step.presents), "batch prefill")
            for e in self.entries:  # a target that could not write in place
                if e.present_output in out:
                    rows, present = list(range(n, n + k)), out[e.present_output]
                    self.buffer[e.past_input] = yield from self._put(e, rows, present, width)
            tokens = yield from self._first_tokens(out[step.logits], gens, lengths)
        except BaseException as e:
            for gen in gens:
                gen.fail_external(e)
            raise
        for gen, token, m in zip(gens, tokens, lengths, strict=True):
            gen.end_external([token], fed=m)
        self.rows.extend(gens)
        self.prefills += 1
        yield from self._view(n + k)
        return tokens

    @property
    def prefills_together(self) -> bool:
        """Whether fresh rows can prefill in one run (`prefill`): a shared buffer, every position's logits."""
        return self.shared and len(self.fused.logits_shape) == 3

    def _check_fresh(self, gens: list[TokenGenerator]) -> None:
        if not self.prefills_together:
            raise GenerationError("only a shared-buffer batch whose graph gives every position's logits "
                                  "prefills rows together; prefill each alone and join it")
        for gen in gens:
            if gen.flow.iterations or gen.state != "ready" or not gen.pending:
                raise GenerationError("rows prefill together from a fresh generator with its prompt appended")
            self._check_capacity(gen)

    def _check_capacity(self, gen: TokenGenerator) -> None:
        if gen.flow.max_length != self.capacity:
            raise GenerationError(
                f"a row's cache holds {gen.flow.max_length} positions; this batch's rows hold "
                f"{self.capacity}: make the generator with max_length {self.capacity}"
            )

    def _first_tokens(self, logits: Handle, gens: list[TokenGenerator], lengths: list[int]) -> Work:
        """Each prefilled row's token, from the logits of its last prompt position."""
        tokens, dtype = [], self._logits_dtype()
        for i, (gen, m) in enumerate(zip(gens, lengths, strict=True)):
            row = yield from self._narrow(logits, dtype, 0, i, i + 1)
            last = yield from self._narrow(row, dtype, 1, m - 1, m)
            gen.sampler.label = "batch prefill"
            tokens.append((yield from gen.sampler.select(last, gen.tokens, gen.generated)))
        return tokens

    def leave(self, gen: TokenGenerator) -> Work:
        """Take a row out: its cache rows go back to its generator, the others stay batched."""
        i = self.rows.index(gen)
        own = gen.flow.caches[self.fused.session]
        if self.shared:
            yield from self._leave_slot(i, own.feeds)
            own.inplace = {e.present_output: e.past_input for e in self.entries}
        else:
            yield from self._leave_concat(i, own.feeds)

    # shared buffers: slots

    def _join_slot(self, own: dict[str, Handle], length: int) -> Work:
        n = len(self.rows)
        if not self.buffer or n == self.slots:
            yield from self._grow(own)
        for e in self.entries:
            self.buffer[e.past_input] = yield from self._put(e, n, own[e.past_input], length)
        yield from self._view(n + 1)

    def _leave_slot(self, i: int, feeds: dict[str, Handle]) -> Work:
        """The row's positions go back into its generator's own buffers (kept while it was batched, so
        nothing is allocated); the last row moves into the slot it frees."""
        last, seen = len(self.rows) - 1, self.rows[i].flow.position
        for e in self.entries:
            row = yield from self._narrow0(self.buffer[e.past_input], e, i, i + 1)
            feeds[e.past_input] = yield from self._put(e, 0, row, seen, into=feeds[e.past_input])
        if i != last:  # the last row moves into the slot this one frees
            moved = self.rows[last]
            for e in self.entries:
                row = yield from self._narrow0(self.buffer[e.past_input], e, last, last + 1)
                self.buffer[e.past_input] = yield from self._put(e, i, row, moved.flow.position)
            self.rows[i] = moved
        self.rows.pop()
        if self.rows:
            yield from self._view(len(self.rows))
        else:
            self.cache = {}  # the buffer stays for the next rows

    def _grow(self, own: dict[str, Handle]) -> Work:
        """A buffer of more slots (twice as many once rows fill it), the rows so far copied into it."""
        old, n = self.buffer, len(self.rows)
        if old:
            self.slots *= 2
        seen = max((g.flow.position for g in self.rows), default=0)
        self.buffer = {}
        for e in self.entries:
            shape = (self.slots, *self.backend.shape(own[e.past_input])[1:])
            self.buffer[e.past_input] = self.backend.full(shape, 0, e.dtype)
            if n:
                rows = yield from self._narrow0(old[e.past_input], e, 0, n)
                self.buffer[e.past_input] = yield from self._put(e, list(range(n)), rows, seen)

    def _put(
        self, e: CacheEntry, rows: int | list[int], values: Handle, length: int, into: Handle | None = None
    ) -> Work:
        """Positions [0, length) of `values` written into those rows of `into` (the batch's buffer by
        default), in place; the tensor that holds them after (a target that could not write in place
        answers a new one)."""
        b = self.backend
        x = self.buffer[e.past_input] if into is None else into
        index = [rows] if isinstance(rows, int) else rows
        feeds = {
            "x": x, "rows": b.tensor(index, (len(index),), "int64"),
            "values": values, "length": b.tensor([length], (1,), "int64"),
        }
        out = yield Run(kernel("put_rows", e.dtype), feeds, ("y",), {"y": "x"}, "batch rows")
        return out.get("y", x)

    def _view(self, n: int) -> Work:
        """The batch's cache: views of the buffers' first `n` rows, which each step writes in place."""
        for e in self.entries:
            self.cache[e.past_input] = yield from self._narrow0(self.buffer[e.past_input], e, 0, n)

    def _narrow0(self, x: Handle, e: CacheEntry, start: int, end: int) -> Work:
        return (yield from self._narrow(x, e.dtype, 0, start, end))

    def _narrow(self, x: Handle, dtype: str, axis: int, start: int, end: int) -> Work:
        b = self.backend
        feeds = {"x": x, "start": b.tensor([start], (1,), "int64"), "end": b.tensor([end], (1,), "int64"),
                 "axis": b.tensor([axis], (1,), "int64")}
        return (yield Run(kernel("narrow", dtype), feeds, ("y",), None, "batch rows"))["y"]

    # concat caches: rows padded on the left

    def _join_concat(self, own: dict[str, Handle], length: int) -> Work:
        if not self.rows:
            self.cache, self.width = own, length
            return
        if length != self.width:  # pad the shorter side on the left
            wider = max(length, self.width)
            for e in self.entries:
                own[e.past_input] = yield from self._pad(own[e.past_input], e, wider - length)
                batched = self.cache[e.past_input]
                self.cache[e.past_input] = yield from self._pad(batched, e, wider - self.width)
            self.width = wider
        for e in self.entries:
            out = yield Run(
                kernel("concat0", e.dtype),
                {"a": self.cache[e.past_input], "b": own[e.past_input]},
                ("y",),
                None,
                "join",
            )
            self.cache[e.past_input] = out["y"]

    def _leave_concat(self, i: int, feeds: dict[str, Handle]) -> Work:
        keep = [j for j in range(len(self.rows)) if j != i]
        padding = [self.width - g.flow.position for g in self.rows]
        trim = min((padding[j] for j in keep), default=0)  # columns every other row pads
        for e in self.entries:
            batched = self.cache[e.past_input]
            picked = batched if not keep else (yield from self._rows(batched, e.dtype, [i]))
            if padding[i]:
                picked = yield from narrow_seq(self.backend, e, picked, padding[i], END)
            feeds[e.past_input] = picked
            if keep:
                rest = yield from self._rows(batched, e.dtype, keep)
                if trim:
                    rest = yield from narrow_seq(self.backend, e, rest, trim, END)
                self.cache[e.past_input] = rest
        del self.rows[i]
        self.width -= trim
        if not self.rows:
            self.cache, self.width = {}, 0

    def step(self) -> Work:
        """One decoder run for every row; each row's generator takes its next token."""
        rows, b, step = self.rows, self.backend, self.fused
        for gen in rows:
            gen.begin_external()
        try:
            lengths = [gen.flow.position + 1 for gen in rows]  # what each row's graph will have seen
            feeds = dict(self.cache)
            feeds[step.ids[0]] = b.tensor([gen.pending[0] for gen in rows], (len(rows), 1), step.ids[1])
            if self.shared:  # right-padded: the graph reads each row's length from its mask
                width = max(lengths)
                mask = [v for n in lengths for v in [1] * n + [0] * (width - n)]
            else:  # left-padded to the cache's width, plus the new position
                width = self.width + 1
                mask = [v for n in lengths for v in [0] * (width - n) + [1] * n]
            feeds[step.mask[0]] = b.tensor(mask, (len(rows), width), step.mask[1])
            if step.positions:
                feeds[step.positions[0]] = b.tensor(
                    [n - 1 for n in lengths], (len(rows), 1), step.positions[1]
                )
            inplace = dict(step.presents) if self.shared else None
            out = yield Run(step.session, feeds, step.outputs, inplace, f"batch step {self.steps}")
            answered = [e for e in self.entries if e.present_output in out]
            for e in answered:  # concat: the presents; shared: a target that could not write in place
                if self.shared:
                    every, present = list(range(len(rows))), out[e.present_output]
                    self.buffer[e.past_input] = yield from self._put(e, every, present, max(lengths))
                else:
                    self.cache[e.past_input] = out[e.present_output]
            if self.shared and answered:
                yield from self._view(len(rows))
            tokens = yield from self._select(out[step.logits])
        except BaseException as e:
            for gen in rows:
                gen.fail_external(e)
            raise
        self.steps += 1
        if not self.shared:
            self.width += 1
        for gen, token in zip(rows, tokens, strict=True):
            gen.end_external([token])
        return tokens

    @property
    def verifies_together(self) -> bool:
        """Whether rows check drafted tokens together, each its own number of positions in one run
        (`speculate`): a concat cache [rows, heads, positions, size] whose graph gives every position's
        logits. A shared buffer's GroupQueryAttention takes several new tokens over a past for one row
        only (onnxruntime: "batch_size must be 1 when sequence_length > 1 and past context is given")."""
        return (not self.shared and cannot_verify(self.plan) is None
                and all(len(e.shape) == 4 and e.seq_axis == 2 for e in self.entries))

    def speculate(self, budgets: list[int | None]) -> Work:
        """One step in which rows that speculate check their drafts (a batch that `verifies_together`): each
        row's pending token and its speculator's drafts (none for a row that does not speculate or drafts
        nothing this step) in one run, padded to the longest; each row keeps the tokens its speculator
        accepts, and its cache the positions they fed. A plain `step` when no row drafts. `budgets`: the
        new tokens each row's request may still take (None: no limit). Returns each row's new tokens."""
        if not self.verifies_together:
            raise GenerationError("this batch's rows cannot check drafted tokens together: its decoder's "
                                  "cache is not a concat cache, or it gives the last position's logits only")
        drafts: list[list[int]] = []
        for gen, budget in zip(self.rows, budgets, strict=True):
            drafts.append([] if gen.speculator is None else (yield from gen.speculator.drafts(gen, budget)))
        if any(drafts):
            new = yield from self._verify(drafts)
        else:
            new = [[token] for token in (yield from self.step())]
        for gen, drafted, tokens in zip(self.rows, drafts, new, strict=True):
            if gen.speculator is not None and not drafted:  # a plain step for it, counted as one
                gen.speculator.stepped(gen.tokens[: len(gen.tokens) - len(tokens)], tokens)
                gen.speculator.ran_plain(1)
        return new

    def _verify(self, drafts: list[list[int]]) -> Work:
        """One run over every row's pending token and drafts, right-padded with masked positions; each row's
        tokens; the cache cut back to the positions each row keeps (`_keep`)."""
        rows, b, step = self.rows, self.backend, self.fused
        width = 1 + max(len(d) for d in drafts)  # new positions a row
        for gen in rows:
            gen.begin_external()
        try:
            seen = [gen.flow.position for gen in rows]
            ids: list[int] = []
            mask: list[int] = []
            positions: list[int] = []
            for gen, drafted, p in zip(rows, drafts, seen, strict=True):
                fed = [gen.pending[0], *drafted]
                pad = width - len(fed)  # masked from every position; placed at the row's last
                ids += fed + [fed[-1]] * pad
                mask += [0] * (self.width - p) + [1] * (p + len(fed)) + [0] * pad
                positions += list(range(p, p + len(fed))) + [p + len(fed) - 1] * pad
            feeds = dict(self.cache)
            feeds[step.ids[0]] = b.tensor(ids, (len(rows), width), step.ids[1])
            feeds[step.mask[0]] = b.tensor(mask, (len(rows), self.width + width), step.mask[1])
            feeds[step.positions[0]] = b.tensor(positions, (len(rows), width), step.positions[1])
            label = f"batch step {self.steps}"
            out = yield Run(step.session, feeds, step.outputs, None, label)
            picks = yield from self._picks(out[step.logits], drafts, width, label)
            new = []
            for gen, drafted, p, picked in zip(rows, drafts, seen, picks, strict=True):
                new.append((yield from gen.speculator.settle(gen, drafted, picked, p)) if drafted else picked)
            yield from self._keep(out, seen, [len(tokens) for tokens in new], width)
        except BaseException as e:
            for gen in rows:
                gen.fail_external(e)
            raise
        self.steps += 1
        for gen, tokens in zip(rows, new, strict=True):
            gen.end_external(tokens, fed=len(tokens))
        return new

    def _picks(self, logits: Handle, drafts: list[list[int]], width: int, label: str) -> Work:
        """The model's choices at each row's checked positions (logits [rows, width, vocab]): one argmax
        over the batch for the rows that are plain greedy; each other row's through its sampler (all its
        positions as a speculative round checks them; its first alone, as a step selects, when it drafted
        nothing)."""
        rows, dtype = self.rows, self._logits_dtype()
        greedy: list[int] = []
        if any(gen.sampler.settings.plain_greedy for gen in rows):
            out = yield Run(kernel("argmax_all", dtype), {"logits": logits}, ("tokens",), None, label)
            greedy = self.backend.to_list(out["tokens"])
        picks = []
        for i, (gen, drafted) in enumerate(zip(rows, drafts, strict=True)):
            n = len(drafted) + 1
            if gen.sampler.settings.plain_greedy:
                picks.append(greedy[i * width : i * width + n])
                continue
            row = yield from self._rows(logits, dtype, [i])
            row = yield from self._narrow(row, dtype, 1, 0, n)
            gen.sampler.label = label
            if drafted:
                picks.append((yield from verify_picks(gen.sampler, row, drafted, gen.tokens, gen.generated)))
            else:
                picks.append([(yield from gen.sampler.select(row, gen.tokens, gen.generated))])
        return picks

    def _keep(self, out: dict[str, Handle], seen: list[int], kept: list[int], fed: int) -> Work:
        """The presents of a run that fed several positions a row, as the batch's cache: each row's first
        seen + kept positions, lined up on the right again (a gather of each row's positions; the columns
        every row would pad are left out)."""
        lengths = [p + k for p, k in zip(seen, kept, strict=True)]
        width = max(lengths)
        index = []
        for p, n in zip(seen, lengths, strict=True):
            pad, shift = width - n, self.width - p  # its padding now, and where its position 0 was
            index += [0] * pad + list(range(shift, shift + n))
        # every row kept every position it was fed: the presents as they are
        whole = width == self.width + fed and all(k == fed for k in kept)
        rows = self.backend.tensor(index, (len(seen), width), "int64")
        for e in self.entries:
            present = out[e.present_output]
            if not whole:
                feeds = {"x": present, "index": rows}
                present = (yield Run(kernel("gather_seq", e.dtype), feeds, ("y",), None, "batch rows"))["y"]
            self.cache[e.past_input] = present
        self.width = width

    def _select(self, logits: Handle) -> Work:
        """Each row's token: one argmax over the batch when every row is plain greedy, else each row
        through its own sampler (penalties, bans, its own seeded generator)."""
        rows = self.rows
        if all(gen.sampler.settings.plain_greedy for gen in rows):
            out = yield Run(
                kernel("argmax_last", self._logits_dtype()),
                {"logits": logits},
                ("token",),
                None,
                f"batch step {self.steps}",
            )

            return self.backend.to_list(out["token"])
        tokens = []
        for i, gen in enumerate(rows):
            row = yield from self._rows(logits, self._logits_dtype(), [i])
            gen.sampler.label = f"batch step {self.steps}"
            tokens.append((yield from gen.sampler.select(row, gen.tokens, gen.generated)))
        return tokens

    def _logits_dtype(self) -> str:
        gen = self.plan.generator
        return self.plan.signatures[gen.session].output(gen.logits).dtype

    def _rows(self, x: Handle, dtype: str, rows: list[int]) -> Work:
        index = self.backend.tensor(rows, (len(rows),), "int64")
        out = yield Run(kernel("gather_rows0", dtype), {"x": x, "rows": index}, ("y",), None, "batch rows")
        return out["y"]

    def _pad(self, x: Handle, e: CacheEntry, count: int) -> Work:
        """`count` zero positions before the first of a concat cache's sequence axis."""
        if not count:
            return x
        rank = len(self.backend.shape(x))
        pads = [0] * (2 * rank)
        pads[e.seq_axis] = count
        feeds = {"x": x, "pads": self.backend.tensor(pads, (len(pads),), "int64")}
        out = yield Run(kernel("pad", e.dtype), feeds, ("y",), None, "batch rows")
        return out["y"]
