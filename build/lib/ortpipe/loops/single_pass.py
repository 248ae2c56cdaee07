"""The single_pass loop: the init phase once, the final phase once, no token loop (VITS-style speech,
sentence embeddings, classifiers). A request returns the named outputs (pipeline.output).

Many texts (`embed`) run in batches of `batch_size`, longest first as sentence-transformers batches them
(less padding); each advance runs one batch, and the batches' embeddings are joined and put back in the
texts' order by kernels.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from ..config.schema import OutputSpec
from ..errors import GenerationError
from ..execute.flow import FlowRun
from ..execute.work import Backend, Handle, Run, Work, kernel
from ..outputs import OutputRequest, Progress, finish_outputs
from ..plan import Plan
from .text import TextSetup, text_inputs

DEFAULT_BATCH = 32


class SinglePassRequest(OutputRequest):
    """The flow once per batch of rows (token ids; none when the request gives the inputs itself)."""

    def __init__(
        self,
        plan: Plan,
        backend: Backend,
        rows: list[list[int]] | None,
        setup: TextSetup,
        inputs: dict[str, Handle] | None = None,
        batch_size: int = DEFAULT_BATCH,
        outputs: Sequence[OutputSpec] | None = None,
    ):
        super().__init__(plan)
        self.specs = outputs  # the outputs as the request changed them (an embedding's pooling), else None
        self.backend, self.setup, self.inputs = backend, setup, dict(inputs or {})
        if rows is None:
            self.batches, self.order = [[]], None
        else:
            order = sorted(range(len(rows)), key=lambda i: -len(rows[i]))  # stable, as numpy's argsort
            self.batches = [
                [rows[i] for i in order[at : at + batch_size]] for at in range(0, len(rows), batch_size)
            ]
            self.order = order if order != sorted(order) else None  # None: already in the texts' order
        if len(self.batches) > 1 and any(o.kind != "embedding" for o in plan.config.pipeline.outputs):
            raise GenerationError(
                f"{len(rows or [])} texts make {len(self.batches)} batches; only embedding "
                "outputs are joined across batches: raise batch_size or give fewer texts"
            )
        self._done = 0

    def _advance(self) -> Work:
        start = time.perf_counter()
        rows = self.batches[self._done]
        inputs, mask = text_inputs(self.plan, self.backend, rows, self.setup) if rows else ({}, None)
        flow = FlowRun(self.plan, self.backend, 1, 0, {**inputs, **self.inputs})
        yield from flow.run_init([])
        yield from flow.run_final()
        made = yield from finish_outputs(self.plan, self.backend, flow.values, mask, specs=self.specs)
        for name, value in made.items():
            joined = self.outputs.get(name)
            self.outputs[name] = value if joined is None else (yield from self._join(name, joined, value))
        self._done += 1
        if self._done == len(self.batches):
            if self.order is not None:
                yield from self._reorder()
            self.finish_reason = "done"
        elif self._interrupted:
            self.finish_reason, self.outputs = "interrupt", {}
        self.timings.prefill_ms += (time.perf_counter() - start) * 1000
        return Progress(self._done, len(self.batches), "batch")

    def _join(self, name: str, a: Handle, b: Handle) -> Work:
        return (yield Run(kernel("concat0", "float32"), {"a": a, "b": b}, ("y",), None, "final"))["y"]

    def _reorder(self) -> Work:
        """Rows back in the texts' order: row i of the result is the sorted batch's row where text i went."""
        where = [0] * len(self.order)
        for position, text in enumerate(self.order):
            where[text] = position
        rows = self.backend.tensor(where, (len(where),), "int64")
        for o in self.plan.config.pipeline.outputs:
            if o.name in self.outputs:
                out = yield Run(
                    kernel("gather_rows0", "float32"),
                    {"x": self.outputs[o.name], "rows": rows},
                    ("y",),
                    None,
                    "final",
                )
                self.outputs[o.name] = out["y"]
