"""Named outputs (pipeline.output): what a request returns beside tokens and text.

Each output is a session's tensor, turned by kernels into what its kind says: "tensor" and "audio" as
the session gave them (audio: mono float samples [batch, samples] at the output's sampling rate), "image"
from a VAE's [batch, 3, height, width] in [-1, 1] to float32 [batch, height, width, 3] in [0, 1],
"embedding" from token states [batch, tokens, dim] pooled (and normalised) to float32 [batch, dim].
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .config.schema import OutputSpec
from .errors import OrtpipeError
from .execute.work import Backend, Handle, Run, Work, kernel
from .plan import Plan
from .request import Result, Timings


def output_dtype(plan: Plan, o: OutputSpec) -> str:
    return plan.signatures[o.session].output(o.name).dtype


def finish_output(
    plan: Plan, backend: Backend, o: OutputSpec, value: Handle, mask: Handle | None, label: str = "final"
) -> Work:
    """The value of output `o` as its kind says, from the session's tensor (`mask`: the batch's attention
    mask, for pooling)."""
    dtype = output_dtype(plan, o)
    if o.kind == "image":
        return (yield Run(kernel("vae_image", dtype), {"sample": value}, ("image",), None, label))["image"]
    if o.kind != "embedding":
        return value
    feeds = {"states": value} if o.pooling == "cls" else {"states": value, "mask": mask}
    pooled = (yield Run(kernel(f"pool_{o.pooling}", dtype), feeds, ("embeddings",), None, label))[
        "embeddings"
    ]
    if o.normalize:
        pooled = (yield Run(kernel("l2_normalize", "float32"), {"x": pooled}, ("y",), None, label))["y"]
    return pooled


def finish_outputs(
    plan: Plan,
    backend: Backend,
    values: Mapping[str, Handle],
    mask: Handle | None = None,
    replace: Mapping[str, Handle] | None = None,
    specs: Sequence[OutputSpec] | None = None,
) -> Work:
    """{name: value} of every named output, from the flow's values (`replace`: values by source that stand
    for a session's, as the denoising loop's final latents stand for its UNet's output; `specs`: the
    outputs as a request changed them, e.g. another pooling)."""
    out = {}
    for o in plan.config.pipeline.outputs if specs is None else specs:
        value = (replace or {}).get(o.source, values.get(o.source))
        if value is not None:  # an optional session that was skipped gives nothing
            out[o.name] = yield from finish_output(plan, backend, o, value, mask)
    return out


def describe(plan: Plan) -> dict[str, dict[str, Any]]:
    """{name: {"kind", "sampling_rate"}} of the named outputs: what a result says of each."""
    out: dict[str, dict[str, Any]] = {}
    for o in plan.config.pipeline.outputs:
        out[o.name] = {"kind": o.kind}
        if o.sampling_rate is not None:
            out[o.name]["sampling_rate"] = o.sampling_rate
    return out


@dataclass(frozen=True)
class Progress:
    """What an advance of a loop that makes no tokens did: `step` of `steps` (a denoising step, a batch of
    texts) is done."""

    step: int
    steps: int
    what: str = "step"


class OutputRequest:
    """A request of a loop that makes no tokens, advanced like a token Request: `while not r.done:
    drive(r.advance())`; each advance returns its Progress. A step that raises ends it (`failed`)."""

    def __init__(self, plan: Plan):
        self.plan = plan
        self.timings = Timings()
        self.finish_reason: str | None = None
        self.outputs: dict[str, Handle] = {}
        self.failed = False
        self._interrupted = False

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def advance(self) -> Work:
        if self.failed:
            raise OrtpipeError("this request failed in an earlier step and cannot go on")
        try:
            progress = yield from self._advance()
        except BaseException:
            self.failed = True
            self.finish_reason = "error"
            raise
        return [progress]

    def _advance(self) -> Work:
        """One step of the loop, timed into self.timings; its Progress."""
        raise NotImplementedError

    def interrupt(self) -> None:
        self._interrupted = True

    def result(self) -> Result:
        return Result(
            [],
            "",
            self.timings,
            self.finish_reason or "done",
            outputs=dict(self.outputs),
            kinds={n: k for n, k in describe(self.plan).items() if n in self.outputs},
        )
