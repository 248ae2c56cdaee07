"""The autoregressive loop over codebooks (generation.codebooks): each step's logits hold one row per codebook
([rows * count, seq, vocab]), and one token of each codebook is picked per step: greedy (transformers'
`generate` with do_sample false), or sampled with the request's temperature, top_k, top_p and min_p (the
sampler's kernels over the codebooks' rows; one uniform per codebook, codebook 0 first, from the seeded
generator, so a seeded request gives the same codes on every target).

Codebook k runs `delay[k]` steps behind the first: its first `delay[k] + 1` positions and its last
`max(delay) - delay[k]` are tokens.pad, whatever the model predicts there (transformers' delay pattern mask,
pads forced at both ends). With guidance_scale above 1 every step runs a conditional and an unconditional
row (the text encoder's states and mask zeroed, as transformers does), mixed by the `guide_last` kernel:
uncond + scale * (cond - uncond). After the loop the codes without their pads, [1, count, frames], are the
dataflow source "generated.ids" of the final steps (an audio decoder) and the request's "codes" output.
"""

from __future__ import annotations

import time
from typing import Any

from ..errors import GenerationError
from ..execute.flow import FlowRun
from ..execute.work import Backend, Handle, Run, Work, kernel
from ..outputs import OutputRequest, Progress, finish_outputs
from ..plan import FROM_OUTPUT, Plan
from ..request import Result
from ..sampling.sampler import Sampler
from .text import TextSetup, text_inputs


class CodebookRequest(OutputRequest):
    """One text's codes, step by step (each advance one decoder step; the last one runs the final phase)."""

    def __init__(self, plan: Plan, backend: Backend, row: list[int], setup: TextSetup, max_new_tokens: int,
                 guidance_scale: float, search: Any):
        super().__init__(plan)
        books = plan.config.generation.codebooks
        self.backend, self.row, self.setup = backend, row, setup
        self.delay, self.pad = books.delay, plan.config.tokens.pad
        self.scale = guidance_scale
        self.guided = guidance_scale > 1
        self.sampler = None
        if search.sampling:  # scores of float32 logits: the guided ones, or the decoder's cast
            dtype = "float32" if self.guided else self._dtype()
            self.sampler = Sampler(backend, dtype, search, frozenset())
        self.length = 1 + max_new_tokens  # transformers' max_length: the start column and the new ones
        last = max(self.delay)
        if max_new_tokens < 2 * last or max_new_tokens <= last:
            raise GenerationError(
                f"max_new_tokens must be at least {max(2 * last, last + 1)} for a delay pattern of "
                f"{list(self.delay)} (shorter ones are no pattern at all in transformers), found "
                f"{max_new_tokens}"
            )
        self.codes = [[self.pad] for _ in self.delay]  # each codebook's columns, pads forced
        self.flow: FlowRun | None = None

    def _forced(self, k: int, j: int) -> bool:
        d = self.delay[k]
        return j <= d or j >= self.length - (max(self.delay) - d)

    def _advance(self) -> Work:
        start = time.perf_counter()
        if self.flow is None:
            yield from self._init()
        t = len(self.codes[0]) - 1
        b, rows = self.backend, 2 if self.guided else 1
        column = [c[t] for c in self.codes] * rows
        self.flow.loop_inputs["input_ids"] = b.tensor(column, (len(column), 1), "int64")
        logits = yield from self.flow.run_iteration([0])
        if self.guided:
            scale = b.tensor([self.scale], (1,), "float32")
            logits = (yield Run(kernel("guide_last", self._dtype()), {"logits": logits, "scale": scale},
                                ("guided",), None, "pick"))["guided"]
            dtype = "float32"
        else:
            dtype = self._dtype()
        picked = yield from self._pick(logits, dtype)
        for k, codes in enumerate(self.codes):
            codes.append(self.pad if self._forced(k, t + 1) else int(picked[k]))
        step = len(self.codes[0]) - 1
        if step == self.length - 1 or self._interrupted:
            if step == self.length - 1:
                yield from self._final()
                self.finish_reason = "done"
            else:
                self.finish_reason, self.outputs = "interrupt", {}
        elapsed = (time.perf_counter() - start) * 1000
        if step == 1:
            self.timings.prefill_ms += elapsed
        else:
            self.timings.decode_ms += elapsed
        return Progress(step, self.length - 1, "step")

    def _pick(self, logits: Handle, dtype: str) -> Work:
        """One token per codebook from the last position's logits [count, seq, vocab]."""
        b, sampler = self.backend, self.sampler
        if sampler is None:
            token = yield Run(kernel("argmax_last", dtype), {"logits": logits}, ("token",), None, "pick")
            return b.to_list(token["token"])
        count = len(self.delay)
        none: list[list[int]] = [[] for _ in range(count)]
        scores = yield from sampler.scores(logits, none, none)
        uniforms = b.tensor([1.0 - sampler.rng.random() for _ in range(count)], (count,), "float32")
        token = yield Run(kernel("sample", "float32"), {"scores": scores, "u": uniforms}, ("token",), None,
                          "pick")
        return sampler.checked(b.to_list(token["token"]), len(self.codes[0]) - 1)

    def _dtype(self) -> str:
        s = self.plan.step_phase[0]
        return self.plan.signatures[s.session].output(s.logits).dtype

    def _init(self) -> Work:
        """The text encoder on the prompt; for guidance, its states and mask with zero rows after them."""
        b, rows = self.backend, 2 if self.guided else 1
        inputs, _ = text_inputs(self.plan, b, [self.row], self.setup)
        self.flow = FlowRun(self.plan, b, 1, self.length, inputs)
        yield from self.flow.run_init([])
        self.flow.batch = rows
        self.flow.resize(self.length)  # caches of both rows
        n = len(self.row)
        self.flow.loop_inputs["encoder_attention_mask"] = b.tensor([1] * n + [0] * n * (rows - 1), (rows, n),
                                                                   "int64")
        if self.guided:
            for s in self.plan.step_phase:
                for f in s.feeds:
                    if f.kind == FROM_OUTPUT and f.source in self.flow.values:
                        value = self.flow.values[f.source]
                        zeros = b.full(tuple(b.shape(value)), 0, f.dtype)
                        out = yield Run(kernel("concat0", f.dtype), {"a": value, "b": zeros}, ("y",), None,
                                        "init")
                        self.flow.values[f.source] = out["y"]

    def _final(self) -> Work:
        """The codes without their pads as "generated.ids", then the final phase and the named outputs."""
        b, last = self.backend, max(self.delay)
        frames = self.length - 1 - last
        flat = [c for d, row in zip(self.delay, self.codes, strict=True) for c in row[d + 1 : d + 1 + frames]]
        shape = (1, len(self.codes), frames)
        codes = b.tensor(flat, shape, "int64")
        self.flow.set_generated(flat, shape)
        yield from self.flow.run_final()
        self.outputs = yield from finish_outputs(self.plan, b, self.flow.values)
        self.outputs["codes"] = codes

    def result(self) -> Result:
        done = super().result()
        if "codes" in done.outputs:
            done.kinds["codes"] = {"kind": "tensor"}
        return done
