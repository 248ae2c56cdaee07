"""One request's pass through the flow: init steps once, step-phase steps per iteration, final.

Feeds come from the plan: generation roles (input_ids, attention_mask, position_ids), the KV
cache, values produced by earlier steps (dataflow), and the request's own inputs. Values are kept
only when a later step reads them. Placeholder tokens of images or audio clips in the prompt are
expanded to the rows their encoder produced (docs/pipelines.md).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..errors import GenerationError
from ..plan import (
    ATTENTION_MASK,
    CACHE_BRANCH,
    CARRIED,
    COUNTER,
    EMPTY,
    FROM_OUTPUT,
    FROM_REQUEST,
    GENERATED_IDS,
    INPUT_IDS,
    JOINED,
    KV_PAST,
    LOOP,
    POSITION_IDS,
    FlowStepPlan,
    Plan,
)
from ..state.kv import END, KVCache
from ..state.positions import mrope
from .work import Backend, FusedStep, Handle, Run, RunAll, Work, kernel


class FlowRun:
    def __init__(self, plan: Plan, backend: Backend, batch: int, max_length: int,
                 inputs: dict[str, Handle] | None = None, keep: tuple[str, ...] = ()):
        self.plan, self.backend, self.batch = plan, backend, batch
        self.inputs = dict(inputs or {})
        self.position = 0  # positions the step phase has consumed
        self.max_length = max_length
        self.iterations = 0  # of the step phase
        steps = plan.all_steps
        self.caches = {s.session: KVCache(s.kv, backend, batch, max_length) for s in steps if s.kv}
        read = {f.source for s in steps for f in s.feeds if f.kind in (FROM_OUTPUT, CARRIED)}
        read |= {part for s in steps for f in s.feeds if f.kind == JOINED for part in f.parts}
        read |= {o.source for o in plan.config.pipeline.outputs}  # what the request returns
        read |= set(plan.config.pipeline.exported)  # what later stages read
        read |= set(keep)  # what the loop reads itself ("session.output")
        # each session's outputs that a later step reads: only these are kept
        self._read_later = {s.session: [o for o in s.outputs if f"{s.session}.{o}" in read] for s in steps}
        self.values: dict[str, Handle] = {}
        # "session.output" -> its rows of every run of the step phase so far (FlowStep.accumulate)
        self.accumulated: dict[str, Handle] = {}
        self.loop_inputs: dict[str, Handle] = {}  # LOOP feeds, by Feed.source: set by the loop before a run
        self.skipped: list[str] = []
        self.item_rows: dict[str, list[int]] = {}  # encoder -> rows of its output per item
        self.rope_delta = 0
        self.label = "init"  # what the target's trace calls the current runs
        self._fixed: dict[str, Handle] | None = None  # FusedStep.fixed's values (fixed)

    def resize(self, max_length: int) -> None:
        """New, larger caches, before any step ran (the prompt grew when its placeholders expanded)."""
        for name, cache in self.caches.items():
            self.caches[name] = KVCache(cache.plan, self.backend, self.batch, max_length)
        self.max_length = max_length

    # init

    def run_init(self, ids: list[int]) -> Work:
        """Run the init phase on the prompt; returns the prompt with placeholders expanded."""
        self.label = "init"
        for level in self.plan.init_levels:
            ready = [s for s in level if not self._skip(s)]
            loops = [s for s in ready if s.step.loop == "per_image"]
            for s in loops:
                self._store(s, (yield from self._per_item(s, ids)))
            batched = [s for s in ready if s not in loops]
            runs = [self._run(s, ids) for s in batched]
            if len(runs) == 1:
                results = [(yield runs[0])]
            else:
                results = (yield RunAll(runs)) if runs else []
            for s, out in zip(batched, results, strict=True):
                self._store(s, out)
                self._count_rows(s, out, ids)
            ids = self._expand(ready, ids)
        yield from self._join_values()
        if self.batch > 1:
            yield from self._tile_values()
        return ids

    def _join_values(self) -> Work:
        """The joined wires' values: their init outputs joined along the last axis (concat_last), in order;
        with groups, each group so, then the groups along axis 1, each zero-padded on its last axis to the
        widest (`pad`, concat1)."""
        for s in (*self.plan.step_phase, *self.plan.final_phase):
            for f in s.feeds:
                if f.kind != JOINED or f.source in self.values:
                    continue
                missing = [p for p in f.parts if p not in self.values]
                if missing:
                    raise GenerationError(
                        f'Session "{s.session}" input "{f.input}" joins {", ".join(missing)}, which did not '
                        "run (a skipped optional session)"
                    )
                sizes = f.groups or (len(f.parts),)
                parts = iter(f.parts)
                runs: list[Any] = []  # a group's joined value, or the rows of a group of zeros
                for size, rows in zip(sizes, f.zeros or (0,) * len(sizes), strict=True):
                    run = [next(parts) for _ in range(size)]
                    runs.append(rows or (yield from self._join(run, "concat_last", f.dtype)))
                if len(runs) > 1:
                    runs = yield from self._padded(runs, f.dtype, f.width, f.source)
                self.values[f.source] = yield from self._join(runs, "concat1", f.dtype)

    def _join(self, parts: list[Any], how: str, dtype: str) -> Work:
        """Values (or the names of stored ones) joined in order by the kernel `how`."""
        values = [self.values[p] if isinstance(p, str) else p for p in parts]
        value = values[0]
        for other in values[1:]:
            value = (yield Run(kernel(how, dtype), {"a": value, "b": other}, ("y",), None, self.label))["y"]
        return value

    def _padded(self, values: list[Any], dtype: str, width: int | None, what: str) -> Work:
        """Each value zero-padded at the end of its last axis to `width` (the input's, when static), else to
        the widest; a number in `values` is that many rows of zeros, made by padding its neighbour's axis 1
        (the one before it, or the first after it)."""
        b = self.backend
        widest = max(b.shape(v)[-1] for v in values if not isinstance(v, int))
        if width is not None and widest > width:
            raise GenerationError(f"the joined value {what} is {widest} wide, wider than its input's "
                                  f"{width}: groups are zero-padded to the input's width, never cut; join "
                                  "fewer outputs side by side")
        width = width or widest
        padded: list[list[Any]] = []  # [value, zero rows before it, zero rows after it]
        before = 0
        for v in values:
            if not isinstance(v, int):
                padded.append([v, before, 0])
                before = 0
            elif padded:
                padded[-1][2] += v
            else:
                before += v
        out = []
        for v, head, tail in padded:
            rank, gap = len(b.shape(v)), width - b.shape(v)[-1]
            if head or tail or gap:
                pads = [0] * (2 * rank)
                pads[1] += head
                pads[rank + 1] += tail
                pads[-1] += gap
                feeds = {"x": v, "pads": b.tensor(pads, (2 * rank,), "int64")}
                v = (yield Run(kernel("pad", dtype), feeds, ("y",), None, self.label))["y"]
            out.append(v)
        return out

    def _tile_values(self) -> Work:
        """Init outputs made for one row (an encoder's states, a cross cache) repeated for every row
        of the step phase (beams)."""
        rows = self.backend.tensor([0] * self.batch, (self.batch,), "int64")
        for s in self.plan.step_phase:
            for f in s.feeds:
                value = self.values.get(f.source) if f.kind in (FROM_OUTPUT, JOINED) else None
                if value is not None and self.backend.shape(value)[0] == 1:
                    out = yield Run(kernel("gather_rows0", f.dtype), {"x": value, "rows": rows}, ("y",), None,
                                    self.label)
                    self.values[f.source] = out["y"]

    def _per_item(self, s: FlowStepPlan, ids: list[int]) -> Work:
        """Run once per item of the loop_over input: sliced (and cropped), outputs joined on dim 0."""
        b, name = self.backend, s.step.loop_over
        if name not in self.inputs:
            raise GenerationError(
                f'flow step "{s.session}" loops over "{name}", which the request does not give'
            )
        spans = self._spans(s, name)
        count = len(spans)
        sizes = self._sizes(s, count)
        joined: dict[str, Handle] = {}
        rows: list[int] = []
        for i, (start, end) in enumerate(spans):
            run = self._run(s, ids)
            for f in s.feeds:
                if f.kind == FROM_REQUEST and f.input != name and b.shape(run.feeds[f.input])[0] == count:
                    run.feeds[f.input] = yield from self._narrow(run.feeds[f.input], f.dtype, 0, i, i + 1)
            run.feeds[name] = yield from self._narrow(run.feeds[name], self._dtype(s, name), 0, start, end)
            if sizes:
                crop = run.feeds[name]
                for axis, size in zip(s.step.dynamic_shape.apply_to_dims, sizes[i], strict=False):
                    crop = yield from self._narrow(crop, self._dtype(s, name), axis, 0, size)
                run.feeds[name] = crop
            out = yield run
            for o in s.outputs:
                joined[o] = out[o] if o not in joined else (yield from self._concat(joined[o], out[o], s, o))
            if s.features:
                rows.append(b.shape(out[s.features[0]])[0])
        self.item_rows[s.session] = rows
        return joined

    def _spans(self, s: FlowStepPlan, name: str) -> list[tuple[int, int]]:
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
                    raise GenerationError(
                        f'"{name}" has {total} rows but the grids in "{grid}" account for {sum(sizes)}'
                    )
                starts = [sum(sizes[:i]) for i in range(len(sizes))]
                return [(a, a + n) for a, n in zip(starts, sizes, strict=True)]
        return [(i, i + 1) for i in range(total)]

    def _sizes(self, s: FlowStepPlan, count: int) -> list[list[int]]:
        dyn = s.step.dynamic_shape
        if dyn is None:
            return []
        if dyn.source not in self.inputs:
            raise GenerationError(
                f'flow step "{s.session}" crops with dynamic_shape.source "{dyn.source}", which '
                "the request does not give"
            )
        flat = self.backend.to_list(self.inputs[dyn.source])
        width = len(flat) // count
        return [flat[i * width : (i + 1) * width][: len(dyn.apply_to_dims)] for i in range(count)]

    def _count_rows(self, s: FlowStepPlan, out: dict[str, Handle], ids: list[int]) -> None:
        """A batched encoder's rows, shared evenly by the items its placeholders stand for."""
        if not s.placeholder:
            return
        items = ids.count(getattr(self.plan.config.tokens, s.placeholder))
        rows = self.backend.shape(out[s.features[0]])[0]
        if items and rows % items:
            raise GenerationError(
                f'session "{s.session}" made {rows} feature rows for {items} placeholder tokens: '
                "they cannot be shared evenly; use loop: per_image"
            )
        self.item_rows[s.session] = [rows // items] * items if items else []

    def _expand(self, ran: list[FlowStepPlan], ids: list[int]) -> list[int]:
        for s in ran:
            if s.session not in self.item_rows:
                continue
            token = getattr(self.plan.config.tokens, s.placeholder)
            rows = self.item_rows[s.session]
            if ids.count(token) != len(rows):
                raise GenerationError(
                    f"the prompt has {ids.count(token)} {s.placeholder} ids but session "
                    f'"{s.session}" encoded {len(rows)} items: put one {s.placeholder} '
                    f"({token}) in the prompt per item"
                )
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

    def run_iteration(self, ids: list[int], rows: list[list[int]] | None = None) -> Work:
        """Run the step phase once on new token ids (the same for every row, or one list per row);
        returns the generator step's logits handle."""
        logits = None
        n = len(rows[0]) if rows else len(ids)
        self.label = f"step {self.iterations}"
        for s in self.plan.step_phase:
            if s.after_prefill and self.iterations == 0:
                continue  # the init phase embedded the prompt
            for counter in range(s.step.repeat):
                out = yield self._run(s, ids, counter, rows)
                cache = self.caches.get(s.session)
                if cache is not None:
                    yield from cache.update(out, n, self.backend)
                if self._read_later[s.session]:
                    self._store(s, out)
                if s.step.accumulate and counter == s.step.repeat - 1:
                    yield from self._accumulate(s, out)
                if s.logits:
                    logits = out[s.logits]
        self.position += n
        self.iterations += 1
        return logits

    def fixed(self, step: FusedStep) -> dict[str, Handle]:
        """The values of `step.fixed` for this request (the same at every decode step), made once."""
        if self._fixed is None:
            s = next(p for p in self.plan.step_phase if p.session == step.session)
            cache, b, values = self.caches[s.session].feeds, self.backend, {}
            for f in s.feeds:
                if f.input not in step.fixed:
                    continue
                if f.kind == KV_PAST:  # a frozen cross-attention entry, as the first run made it
                    values[f.input] = cache[f.input]
                elif f.kind == CACHE_BRANCH:
                    values[f.input] = b.tensor([1], (1,), f.dtype)  # decode steps all have a past
                elif f.kind == FROM_REQUEST:
                    own = f"{s.session}.{f.input}"
                    values[f.input] = self.inputs[own] if own in self.inputs else self.inputs[f.input]
                else:
                    values[f.input] = self._value(s, f.input, f.source)
            self._fixed = values
        return self._fixed

    def advance(self, session: str, cache: Mapping[str, Handle], n: int) -> None:
        """Account for n iterations the target ran as a `Decode` on `session`, whose cache it answered."""
        self.caches[session].take(cache, n)
        self.position += n
        self.iterations += n

    def run_steps(self) -> Work:
        """One pass of the step phase for a loop that makes no tokens (a denoising step): the last
        session's outputs."""
        self.label = f"step {self.iterations}"
        out = {}
        for s in self.plan.step_phase:
            out = yield self._run(s, [])
            self._store(s, out)
        self.iterations += 1
        return out

    def set_generated(self, ids: list[int], dims: tuple[int, ...]) -> None:
        """The whole generated sequence (`dims`, row-major) as "generated.ids", for the final steps that read
        it: with leading dims of 1 up to each input's rank, in its integer type."""
        for s in self.plan.final_phase:
            for f in s.feeds:
                if f.kind == FROM_OUTPUT and f.source == GENERATED_IDS:
                    rank = self.plan.signatures[s.session].input(f.input).rank
                    shape = (1,) * (rank - len(dims)) + dims
                    self.values[GENERATED_IDS] = self.backend.tensor(ids, shape, f.dtype)

    def run_final(self) -> Work:
        self.label = "final"
        for s in self.plan.final_phase:
            if not self._skip(s):
                self._store(s, (yield self._run(s, [])))

    def reorder(self, rows: list[int]) -> Work:
        for cache in self.caches.values():
            yield from cache.reorder(rows, self.backend)

    # feeds

    def _skip(self, s: FlowStepPlan) -> bool:
        inputs = self.inputs
        missing = [n for n in s.request_inputs if n not in inputs and f"{s.session}.{n}" not in inputs]
        if not missing:
            return False
        if s.step.optional or self.plan.config.pipeline.sessions[s.session].optional:
            self.skipped.append(s.session)
            return True
        raise GenerationError(
            f'Session "{s.session}" needs the request input(s) {", ".join(missing)}, '
            "which this request does not provide. Pass them (inputs={name: array}), "
            'or mark the flow step "optional": true'
        )

    def _run(
        self, s: FlowStepPlan, ids: list[int], counter: int = 0, rows: list[list[int]] | None = None
    ) -> Run:
        b, n = self.backend, len(rows[0]) if rows else len(ids)
        past = self.caches[s.session].length if s.kv else self.position
        feeds: dict[str, Handle] = {}
        for f in s.feeds:
            kind = f.kind
            if kind == KV_PAST:
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
            elif kind == FROM_REQUEST:  # the session's own ("session.input": its tokenizer's), else by name
                own = f"{s.session}.{f.input}"
                feeds[f.input] = self.inputs[own] if own in self.inputs else self.inputs[f.input]
            elif kind == LOOP:
                feeds[f.input] = self.loop_inputs[f.source]
            elif kind == EMPTY:
                feeds[f.input] = self._empty(s, f.input)
            else:  # FROM_OUTPUT, CARRIED, JOINED (its value made once the init phase ran)
                feeds[f.input] = self._value(s, f.input, f.source)
        inplace = None
        if s.kv:
            cache = self.caches[s.session]
            feeds.update(cache.feeds)
            inplace = cache.inplace
        return Run(s.session, feeds, s.outputs, inplace, self.label)

    def _positions(self, s: FlowStepPlan, ids: list[int], past: int, n: int, dtype: str) -> Handle:
        b = self.backend
        if s.positions != "mrope_3d":
            return b.tensor(list(range(past, past + n)) * self.batch, (self.batch, n), dtype)
        if past == 0:
            spec = self.plan.config.pipeline.state.position_ids
            source = spec.grid_source.split(".", 1)[-1]
            flat = b.to_list(self.inputs[source]) if source in self.inputs else []
            grids = [flat[i : i + 3] for i in range(0, len(flat), 3)]
            axes, self.rope_delta = mrope(
                ids, self.plan.config.tokens.image_token, grids, spec.spatial_merge_size
            )
        else:
            axes = [list(range(past + self.rope_delta, past + n + self.rope_delta))] * 3
        return b.tensor([p for axis in axes for p in axis * self.batch], (3, self.batch, n), dtype)

    def _accumulate(self, s: FlowStepPlan, out: dict[str, Handle]) -> Work:
        for name in s.step.accumulate:
            key, value = f"{s.session}.{name}", out[name]
            if key in self.accumulated:
                dtype = self.plan.signatures[s.session].output(name).dtype
                feeds = {"a": self.accumulated[key], "b": value}
                value = (yield Run(kernel("concat1", dtype), feeds, ("y",), None, self.label))["y"]
            self.accumulated[key] = value

    def _value(self, s: FlowStepPlan, name: str, source: str) -> Handle:
        if s.step.when == "final" and source in self.accumulated:  # the whole loop's rows
            return self.accumulated[source]
        if source in self.values:
            return self.values[source]
        producer = source.split(".")[0]
        if producer in self.skipped:
            return self._empty(s, name)
        if producer == s.session:  # carried state, first iteration: zeros
            info = self.plan.signatures[s.session].input(name)
            shape = tuple(
                self.batch if i == 0 else (d if isinstance(d, int) else 0) for i, d in enumerate(info.shape)
            )
            return self.backend.full(shape, 0, info.dtype)
        raise GenerationError(
            f'Session "{s.session}" input "{name}" comes from {source}, which has not run '
            "(it was skipped or runs later in the flow)"
        )

    def _empty(self, s: FlowStepPlan, name: str) -> Handle:
        """No items: dim 0 is 0, the other dims as the graph fixes them."""
        info = self.plan.signatures[s.session].input(name)
        shape = [0] + [d if isinstance(d, int) else -1 for d in info.shape[1:]]
        if -1 in shape:
            raise GenerationError(
                f'Session "{s.session}" input "{name}" would be empty here (its producer was '
                f"skipped), but its shape {list(info.shape)} has symbolic dims ortpipe cannot "
                "size. Export the graph with fixed feature sizes"
            )
        return self.backend.full(tuple(shape), 0, info.dtype)

    def _store(self, s: FlowStepPlan, out: dict[str, Handle]) -> None:
        for name in self._read_later[s.session]:
            self.values[f"{s.session}.{name}"] = out[name]

    # small tensor work

    def _dtype(self, s: FlowStepPlan, name: str) -> str:
        return self.plan.signatures[s.session].input(name).dtype

    def _narrow(self, x: Handle, dtype: str, axis: int, start: int, end: int) -> Work:
        b = self.backend
        out = yield Run(
            kernel("narrow", dtype),
            {
                "x": x,
                "start": b.tensor([start], (1,), "int64"),
                "end": b.tensor([min(end, END)], (1,), "int64"),
                "axis": b.tensor([axis], (1,), "int64"),
            },
            ("y",),
            None,
            self.label,
        )
        return out["y"]

    def _concat(self, a: Handle, b: Handle, s: FlowStepPlan, output: str) -> Work:
        dtype = self.plan.signatures[s.session].output(output).dtype
        out = yield Run(kernel("concat0", dtype), {"a": a, "b": b}, ("y",), None, self.label)
        return out["y"]
