"""One request's pass through the flow: init steps once, step-phase steps per iteration, final.

Feeds come from the plan: generation roles (input_ids, attention_mask, position_ids), the KV
cache, values produced by earlier steps (dataflow), and the request's own inputs. Values are kept
only when a later step reads them.
"""

from __future__ import annotations

from ..errors import GenerationError
from ..plan import (ATTENTION_MASK, CACHE_BRANCH, COUNTER, INPUT_IDS, PAST, POSITION_IDS, REQUEST, STATE,
                    VALUE, Plan, StepPlan)
from ..state.kv import KVCache
from .work import Backend, Handle, Run, RunAll, Work


class FlowRun:
    def __init__(self, plan: Plan, backend: Backend, batch: int, max_length: int,
                 inputs: dict[str, Handle] | None = None):
        self.plan, self.backend, self.batch = plan, backend, batch
        self.inputs = dict(inputs or {})
        self.length = 0  # positions the step phase has consumed
        steps = [s for level in plan.init for s in level] + list(plan.step) + list(plan.final)
        self.caches = {s.session: KVCache(s.kv, backend, batch, max_length) for s in steps if s.kv}
        needed = {f.source for s in steps for f in s.feeds if f.kind in (VALUE, STATE)}
        self._keep = {s.session: [o for o in s.outputs if f"{s.session}.{o}" in needed] for s in steps}
        self.values: dict[str, Handle] = {}
        self.skipped: list[str] = []

    def run_init(self, ids: list[int]) -> Work:
        for level in self.plan.init:
            ready = [s for s in level if not self._skip(s)]
            runs = [self._run(s, ids) for s in ready]
            if len(runs) == 1:
                results = [(yield runs[0])]
            elif runs:
                results = yield RunAll(runs)
            else:
                continue
            for s, out in zip(ready, results):
                self._kept(s, out)

    def run_step(self, ids: list[int], rows: list[list[int]] | None = None) -> Work:
        """Run the step phase on new token ids (the same for every row, or one list per row);
        returns the generator step's logits handle."""
        logits = None
        n = len(rows[0]) if rows else len(ids)
        for s in self.plan.step:
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
        return logits

    def run_final(self) -> Work:
        for s in self.plan.final:
            if not self._skip(s):
                self._kept(s, (yield self._run(s, [])))

    def _skip(self, s: StepPlan) -> bool:
        missing = [n for n in s.request_inputs if n not in self.inputs]
        if not missing:
            return False
        if s.step.optional or self.plan.config.pipeline.sessions[s.session].optional:
            self.skipped.append(s.session)
            return True
        raise GenerationError(f'Session "{s.session}" needs the request input(s) {", ".join(missing)}, '
                              "which this request does not provide. Pass them (inputs={name: array}, "
                              "images=, audios=), or mark the flow step \"optional\": true")

    def reorder(self, rows: list[int]) -> Work:
        for cache in self.caches.values():
            yield from cache.reorder(rows, self.backend)

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
                feeds[f.input] = b.tensor(list(range(past, past + n)) * self.batch, (self.batch, n), f.dtype)
            elif kind == CACHE_BRANCH:
                feeds[f.input] = b.tensor([int(past > 0)], (1,), f.dtype)
            elif kind == COUNTER:
                feeds[f.input] = b.tensor([counter], (1,), f.dtype)
            elif kind == REQUEST:
                feeds[f.input] = self.inputs[f.input]
            else:
                feeds[f.input] = self._value(s, f.input, f.source)
        inplace = None
        if s.kv:
            cache = self.caches[s.session]
            feeds.update(cache.feeds)
            inplace = cache.inplace
        return Run(s.session, feeds, s.outputs, inplace)

    def _value(self, s: StepPlan, name: str, source: str) -> Handle:
        if source in self.values:
            return self.values[source]
        if source.split(".")[0] == s.session:  # carried state, first iteration: zeros
            info = self.plan.signatures[s.session].input(name)
            shape = tuple(self.batch if i == 0 else (d if isinstance(d, int) else 0)
                          for i, d in enumerate(info.shape))
            return self.backend.full(shape, 0, info.dtype)
        raise GenerationError(f'Session "{s.session}" input "{name}" comes from {source}, which has not run '
                              "(it was skipped or runs later in the flow)")

    def _kept(self, s: StepPlan, out: dict[str, Handle]) -> None:
        for name in self._keep[s.session]:
            self.values[f"{s.session}.{name}"] = out[name]
