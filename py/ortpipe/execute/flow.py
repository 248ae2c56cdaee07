"""One request's pass through the flow: init steps once, step-phase steps per iteration, final.

Feeds come from the plan: generation roles (input_ids, attention_mask, position_ids), the KV
cache, values produced by earlier steps (dataflow), and the request's own inputs. Values are kept
only when a later step reads them. Placeholder tokens of images or audio clips in the prompt are
expanded to the rows their encoder produced (docs/pipelines.md).
"""

from __future__ import annotations

from ..errors import GenerationError
from ..plan import (ATTENTION_MASK, CACHE_BRANCH, COUNTER, EMPTY, INPUT_IDS, PAST, POSITION_IDS, REQUEST,
                    STATE, VALUE, Plan, StepPlan)
from ..state.kv import END, KVCache
from ..state.positions import mrope
from .work import Backend, Decode, Handle, Run, RunAll, Work, kernel


class FlowRun:
    def __init__(self, plan: Plan, backend: Backend, batch: int, max_length: int,
                 inputs: dict[str, Handle] | None = None):
        self.plan, self.backend, self.batch = plan, backend, batch
        self.inputs = dict(inputs or {})
        self.length = 0  # positions the step phase has consumed
        self.max_length = max_length
        self.steps_run = 0
        steps = [s for level in plan.init for s in level] + list(plan.step) + list(plan.final)
        self.caches = {s.session: KVCache(s.kv, backend, batch, max_length) for s in steps if s.kv}
        needed = {f.source for s in steps for f in s.feeds if f.kind in (VALUE, STATE)}
        self._keep = {s.session: [o for o in s.outputs if f"{s.session}.{o}" in needed] for s in steps}
        self.values: dict[str, Handle] = {}
        self.skipped: list[str] = []
        self.item_rows: dict[str, list[int]] = {}  # encoder -> rows of its output per item
        self.rope_delta = 0
        self.label = "init"  # what the target's trace calls the current runs

    def resize(self, max_length: int) -> None:
        """New, larger caches, before any step ran (the prompt grew when its placeholders expanded)."""
        for name, cache in self.caches.items():
            self.caches[name] = KVCache(cache.plan, self.backend, self.batch, max_length)
        self.max_length = max_length

    # init

    def run_init(self, ids: list[int]) -> Work:
        """Run the init phase on the prompt; returns the prompt with placeholders expanded."""
        self.label = "init"
        for level in self.plan.init:
            ready = [s for s in level if not self._skip(s)]
            loops = [s for s in ready if s.step.loop == "per_image"]
            for s in loops:
                self._kept(s, (yield from self._per_item(s, ids)))
            batched = [s for s in ready if s not in loops]
            runs = [self._run(s, ids) for s in batched]
            if len(runs) == 1:
                results = [(yield runs[0])]
            else:
                results = (yield RunAll(runs)) if runs else []
            for s, out in zip(batched, results):
                self._kept(s, out)
                self._count_rows(s, out, ids)
            ids = self._expand(ready, ids)
        if self.batch > 1:
            yield from self._tile_values()
        return ids

    def _tile_values(self) -> Work:
        """Init outputs made for one row (an encoder's states, a cross cache) repeated for every row
        of the step phase (beams)."""
        rows = self.backend.tensor([0] * self.batch, (self.batch,), "int64")
        for s in self.plan.step:
            for f in s.feeds:
                value = self.values.get(f.source) if f.kind == VALUE else None
                if value is not None and self.backend.shape(value)[0] == 1:
                    out = yield Run(kernel("gather_rows0", f.dtype), {"x": value, "rows": rows}, ("y",), None,
                                    self.label)
                    self.values[f.source] = out["y"]

    def _per_item(self, s: StepPlan, ids: list[int]) -> Work:
        """Run once per item of the loop_over input: sliced (and cropped), outputs joined on dim 0."""
        b, name = self.backend, s.step.loop_over
        if name not in self.inputs:
            raise GenerationError(f'flow step "{s.session}" loops over "{name}", which the request does not give')
        spans = self._spans(s, name)
        count = len(spans)
        sizes = self._sizes(s, count)
        joined: dict[str, Handle] = {}
        rows: list[int] = []
        for i, (start, end) in enumerate(spans):
            run = self._run(s, ids)
            for f in s.feeds:
                if f.kind == REQUEST and f.input != name and b.shape(run.feeds[f.input])[0] == count:
                    run.feeds[f.input] = yield from self._narrow(run.feeds[f.input], f.dtype, 0, i, i + 1)
            run.feeds[name] = yield from self._narrow(run.feeds[name], self._dtype(s, name), 0, start, end)
            if sizes:
                crop = run.feeds[name]
                for axis, size in zip(s.step.dynamic_shape.apply_to_dims, sizes[i]):
                    crop = yield from self._narrow(crop, self._dtype(s, name), axis, 0, size)
                run.feeds[name] = crop
            out = yield run
            for o in s.outputs:
                joined[o] = out[o] if o not in joined else (yield from self._concat(joined[o], out[o], s, o))
            if s.features:
                rows.append(b.shape(out[s.features[0]])[0])
        self.item_rows[s.session] = rows
        return joined

    def _spans(self, s: StepPlan, name: str) -> list[tuple[int, int]]:
        """Each item's rows of the loop_over input: one row each, or, when the session also reads a
        grid of n items that the input's rows do not match (Qwen2-VL's patches of all images in one
        [sum of t*h*w, dim] tensor), t*h*w rows each."""
        total = self.backend.shape(self.inputs[name])[0]
        grid = (self.plan.config.pipeline.state.position_ids.grid_source or "").split(".", 1)[-1]
        if grid and grid in self.inputs and grid in s.request_inputs:
            flat = self.backend.to_list(self.inputs[grid])
            sizes = [flat[i] * flat[i + 1] * flat[i + 2] for i in range(0, len(flat), 3)]
            if len(sizes) != total:
                if sum(sizes) != total:
                    raise GenerationError(f'"{name}" has {total} rows but the grids in "{grid}" account for '
                                          f"{sum(sizes)}")
                starts = [sum(sizes[:i]) for i in range(len(sizes))]
                return [(a, a + n) for a, n in zip(starts, sizes)]
        return [(i, i + 1) for i in range(total)]

    def _sizes(self, s: StepPlan, count: int) -> list[list[int]]:
        dyn = s.step.dynamic_shape
        if dyn is None:
            return []
        if dyn.source not in self.inputs:
            raise GenerationError(f'flow step "{s.session}" crops with dynamic_shape.source "{dyn.source}", which '
                                  "the request does not give")
        flat = self.backend.to_list(self.inputs[dyn.source])
        width = len(flat) // count
        return [flat[i * width:(i + 1) * width][:len(dyn.apply_to_dims)] for i in range(count)]

    def _count_rows(self, s: StepPlan, out: dict[str, Handle], ids: list[int]) -> None:
        """A batched encoder's rows, shared evenly by the items its placeholders stand for."""
        if not s.placeholder:
            return
        items = ids.count(getattr(self.plan.config.tokens, s.placeholder))
        rows = self.backend.shape(out[s.features[0]])[0]
        if items and rows % items:
            raise GenerationError(f'session "{s.session}" made {rows} feature rows for {items} placeholder tokens: '
                                  "they cannot be shared evenly; use loop: per_image")
        self.item_rows[s.session] = [rows // items] * items if items else []

    def _expand(self, ran: list[StepPlan], ids: list[int]) -> list[int]:
        for s in ran:
            if s.session not in self.item_rows:
                continue
            token = getattr(self.plan.config.tokens, s.placeholder)
            rows = self.item_rows[s.session]
            if ids.count(token) != len(rows):
                raise GenerationError(f"the prompt has {ids.count(token)} {s.placeholder} ids but session "
                                      f'"{s.session}" encoded {len(rows)} items: put one {s.placeholder} '
                                      f"({token}) in the prompt per item")
            expanded, item = [], 0
            for i in ids:
                if i == token:
                    expanded += [token] * rows[item]
                    item += 1
                else:
                    expanded.append(i)
            ids = expanded
        return ids

    # step and final

    def run_step(self, ids: list[int], rows: list[list[int]] | None = None) -> Work:
        """Run the step phase on new token ids (the same for every row, or one list per row);
        returns the generator step's logits handle."""
        logits = None
        n = len(rows[0]) if rows else len(ids)
        self.label = f"step {self.steps_run}"
        for s in self.plan.step:
            if s.after_prefill and self.steps_run == 0:
                continue  # the init phase embedded the prompt
            for counter in range(s.step.repeat):
                out = yield self._run(s, ids, counter, rows)
                cache = self.caches.get(s.session)
                if cache is not None:
                    yield from cache.update(out, n, self.backend)
                if self._keep[s.session]:
                    self._kept(s, out)
                if s.logits:
                    logits = out[s.logits]
        self.length += n
        self.steps_run += 1
        return logits

    def decode_step(self) -> Decode | None:
        """The step phase as one `Decode`, when its shape allows: one decoder session run once per
        token, fed only input ids, an attention mask, 1D position ids and a KV cache of a layout the
        backend fuses (a concat cache with no sliding window), giving logits of a fixed vocabulary
        and nothing a later step reads. Else None. Call it after the first step ran (the cache
        buffers are the request's from then on)."""
        if self.batch != 1 or len(self.plan.step) != 1:
            return None
        s = self.plan.step[0]
        if s.step.repeat != 1 or s.after_prefill or not s.kv or not s.logits:
            return None
        layout = "shared" if s.kv.share_buffer else "concat"
        if layout not in getattr(self.backend, "fused_decode", ()):
            return None
        if layout == "concat" and any(e.window is not None for e in s.kv.entries):
            return None
        if self._keep[s.session] or s.positions != "default":
            return None
        roles: dict[str, tuple[str, str]] = {}
        for f in s.feeds:
            if f.kind == PAST:
                continue
            if f.kind not in (INPUT_IDS, ATTENTION_MASK, POSITION_IDS) or f.kind in roles:
                return None
            roles[f.kind] = (f.input, f.dtype)
        info = self.plan.signatures[s.session].output(s.logits)
        vocab = info.shape[-1] if info.shape else None
        if INPUT_IDS not in roles or not isinstance(vocab, int) or info.rank not in (2, 3):
            return None
        if POSITION_IDS in roles and self.plan.signatures[s.session].input(roles[POSITION_IDS][0]).rank != 2:
            return None
        cache = self.caches[s.session]
        presents = {e.present: e.past for e in s.kv.entries}
        return Decode(s.session, roles[INPUT_IDS], roles.get(ATTENTION_MASK), roles.get(POSITION_IDS),
                      cache.feeds, presents, s.kv.share_buffer, s.outputs, s.logits,
                      (1, 1, vocab) if info.rank == 3 else (1, vocab), self.max_length)

    def advance(self, n: int) -> None:
        """Account for n steps the target ran as a `Decode`: n more positions in the flow and cache."""
        for cache in self.caches.values():
            cache.length += n
        self.length += n
        self.steps_run += n

    def run_final(self) -> Work:
        self.label = "final"
        for s in self.plan.final:
            if not self._skip(s):
                self._kept(s, (yield self._run(s, [])))

    def reorder(self, rows: list[int]) -> Work:
        for cache in self.caches.values():
            yield from cache.reorder(rows, self.backend)

    # feeds

    def _skip(self, s: StepPlan) -> bool:
        missing = [n for n in s.request_inputs if n not in self.inputs]
        if not missing:
            return False
        if s.step.optional or self.plan.config.pipeline.sessions[s.session].optional:
            self.skipped.append(s.session)
            return True
        raise GenerationError(f'Session "{s.session}" needs the request input(s) {", ".join(missing)}, '
                              "which this request does not provide. Pass them (inputs={name: array}), "
                              "or mark the flow step \"optional\": true")

    def _run(self, s: StepPlan, ids: list[int], counter: int = 0, rows: list[list[int]] | None = None) -> Run:
        b, n = self.backend, len(rows[0]) if rows else len(ids)
        past = self.caches[s.session].length if s.kv else self.length
        feeds: dict[str, Handle] = {}
        for f in s.feeds:
            kind = f.kind
            if kind == PAST:
                continue
            if kind == INPUT_IDS:
                flat = [i for r in rows for i in r] if rows else ids * self.batch
                feeds[f.input] = b.tensor(flat, (self.batch, n), f.dtype)
            elif kind == ATTENTION_MASK:
                feeds[f.input] = b.full((self.batch, past + n), 1, f.dtype)
            elif kind == POSITION_IDS:
                feeds[f.input] = self._positions(s, ids, past, n, f.dtype)
            elif kind == CACHE_BRANCH:
                feeds[f.input] = b.tensor([int(past > 0)], (1,), f.dtype)
            elif kind == COUNTER:
                feeds[f.input] = b.tensor([counter], (1,), f.dtype)
            elif kind == REQUEST:
                feeds[f.input] = self.inputs[f.input]
            elif kind == EMPTY:
                feeds[f.input] = self._empty(s, f.input)
            else:
                feeds[f.input] = self._value(s, f.input, f.source)
        inplace = None
        if s.kv:
            cache = self.caches[s.session]
            feeds.update(cache.feeds)
            inplace = cache.inplace
        return Run(s.session, feeds, s.outputs, inplace, self.label)

    def _positions(self, s: StepPlan, ids: list[int], past: int, n: int, dtype: str) -> Handle:
        b = self.backend
        if s.positions != "mrope_3d":
            return b.tensor(list(range(past, past + n)) * self.batch, (self.batch, n), dtype)
        if past == 0:
            spec = self.plan.config.pipeline.state.position_ids
            source = spec.grid_source.split(".", 1)[-1]
            flat = b.to_list(self.inputs[source]) if source in self.inputs else []
            grids = [flat[i:i + 3] for i in range(0, len(flat), 3)]
            axes, self.rope_delta = mrope(ids, self.plan.config.tokens.image_token, grids, spec.spatial_merge_size)
        else:
            axes = [list(range(past + self.rope_delta, past + n + self.rope_delta))] * 3
        return b.tensor([p for axis in axes for p in axis * self.batch], (3, self.batch, n), dtype)

    def _value(self, s: StepPlan, name: str, source: str) -> Handle:
        if source in self.values:
            return self.values[source]
        producer = source.split(".")[0]
        if producer in self.skipped:
            return self._empty(s, name)
        if producer == s.session:  # carried state, first iteration: zeros
            info = self.plan.signatures[s.session].input(name)
            shape = tuple(self.batch if i == 0 else (d if isinstance(d, int) else 0)
                          for i, d in enumerate(info.shape))
            return self.backend.full(shape, 0, info.dtype)
        raise GenerationError(f'Session "{s.session}" input "{name}" comes from {source}, which has not run '
                              "(it was skipped or runs later in the flow)")

    def _empty(self, s: StepPlan, name: str) -> Handle:
        """No items: dim 0 is 0, the other dims as the graph fixes them."""
        info = self.plan.signatures[s.session].input(name)
        shape = [0] + [d if isinstance(d, int) else -1 for d in info.shape[1:]]
        if -1 in shape:
            raise GenerationError(f'Session "{s.session}" input "{name}" would be empty here (its producer was '
                                  f"skipped), but its shape {list(info.shape)} has symbolic dims ortpipe cannot "
                                  "size. Export the graph with fixed feature sizes")
        return self.backend.full(tuple(shape), 0, info.dtype)

    def _kept(self, s: StepPlan, out: dict[str, Handle]) -> None:
        for name in self._keep[s.session]:
            self.values[f"{s.session}.{name}"] = out[name]

    # small tensor work

    def _dtype(self, s: StepPlan, name: str) -> str:
        return self.plan.signatures[s.session].input(name).dtype

    def _narrow(self, x: Handle, dtype: str, axis: int, start: int, end: int) -> Work:
        b = self.backend
        out = yield Run(kernel("narrow", dtype), {"x": x, "start": b.tensor([start], (1,), "int64"),
                                                  "end": b.tensor([min(end, END)], (1,), "int64"),
                                                  "axis": b.tensor([axis], (1,), "int64")}, ("y",), None, self.label)
        return out["y"]

    def _concat(self, a: Handle, b: Handle, s: StepPlan, output: str) -> Work:
        dtype = self.plan.signatures[s.session].output(output).dtype
        out = yield Run(kernel("concat0", dtype), {"a": a, "b": b}, ("y",), None, self.label)
        return out["y"]
