"""The work the sans-IO core asks a target to do, the answers it expects, and the loop between them.

Core generators yield work items and receive their answers (psycopg's generators.py shape): the
CPython driver answers with onnxruntime, the browser's with onnxruntime-web. Work items are
immutable values; what changes hands (a KV cache after fused steps) comes back in the answer.

| work        | answer                                                                  |
| ----------- | ----------------------------------------------------------------------- |
| `ReadGraph` | the graph file: a path, bytes or a seekable binary file (onnxinfo reads) |
| `ReadWheel` | a local path Python can import the plugin's wheel from                  |
| `Open`      | `Opened`: the session and its signature                                 |
| `Run`       | {output name: tensor}                                                   |
| `RunAll`    | a list of those, in order                                               |
| `Decode`    | `Decoded`: token ids and the cache after                                |

Tensors are opaque handles owned by the target; the core only creates small integer tensors and
reads small integer results through `Backend`.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

from ..config.schema import SessionSpec
from ..signature import Signature

Handle = Any  # a target's tensor (numpy array, ort.Tensor proxy)

KERNEL = "kernel:"  # session names starting with this are ortpipe's kernel graphs


@dataclass(frozen=True)
class ReadGraph:
    """The graph file at `path` (a checked real path, or a URL), for the core to read its structure
    before the session is made (what its external data names, what its attention nodes say)."""

    path: str
    shown: str


@dataclass(frozen=True)
class ReadWheel:
    """A plugin's pure-Python wheel at `path` (plugins.py): answered with a path in this process's
    file system that Python can import it from (the file itself, or a copy)."""

    path: str
    shown: str


@dataclass(frozen=True)
class Open:
    """Create the session of `spec` (its providers and options) from its graph file, which the target
    finds at `path` (a checked real path, or a URL); `shown` names it in messages."""

    spec: SessionSpec
    path: str
    shown: str
    optimized_for: str | None = None  # the provider the graph was optimized for ahead (variants.py)


class Opened(NamedTuple):
    session: Any  # the target's session object
    signature: Signature


@dataclass(slots=True)
class Run:
    """Run one session. `inplace` maps an output to the input whose buffer it must be written into
    (a shared-buffer KV cache); a target that cannot write in place answers that output like any
    other, and the core takes it as the new buffer."""

    session: str
    feeds: dict[str, Handle]
    outputs: tuple[str, ...]
    inplace: dict[str, str] | None = None
    label: str = ""  # the phase or iteration this run belongs to, for traces


@dataclass(slots=True)
class Select:
    """The token the last row of `logits` gives as `pick` (sampling.sampler.Pick) selects it, chosen by
    the target as its fused steps choose theirs (targets with `fused_sampling`): a request's first
    token, after its prefill, with no kernel run. `step` and `position` name the logits in messages."""

    logits: Handle
    pick: Any
    step: str
    position: int

    def non_finite(self) -> str:
        return non_finite(self.step, self.position)


def non_finite(step: str, position: int) -> str:
    """What selecting a token from NaN or infinite logits is refused with (every target, and the kernels'
    path, in the same words)."""
    return (f"selecting the token after {step} failed: the model's logits are NaN or infinite at "
            f"position {position}; the model's weights or inputs are broken")


@dataclass(slots=True)
class RunAll:
    """Runs that do not depend on each other; a target may run them side by side."""

    runs: list[Run]


@dataclass(frozen=True)
class FusedStep:
    """How one iteration of the step phase runs as a single fused greedy decode step; the plan
    decides once per model whether it can (plan.fused_step).

    One step feeds a token to `ids` at a position (the attention mask all ones up to it, 1D
    position ids), runs `session` with the KV cache, whose `presents` (present output -> past
    input) become the next pasts, and selects the argmax of the last row of `logits`. `layout`
    "shared": the present is written into the past's buffer in place; "concat": the present, one
    position longer, is the next past.
    """

    session: str
    ids: tuple[str, str]  # (input name, dtype)
    mask: tuple[str, str] | None
    positions: tuple[str, str] | None
    presents: Mapping[str, str]
    layout: str
    outputs: tuple[str, ...]
    logits: str
    logits_shape: tuple[int, ...]  # of one decode run: (1, 1, vocab) or (1, vocab)
    # inputs fed the same value at every step of a request, `Decode.fixed` (an encoder-decoder's: the
    # encoder's states and mask, the cache-branch flag, the cross-attention cache of its first run)
    fixed: tuple[str, ...] = ()


class Decode(NamedTuple):
    """Up to `limit` fused decode steps (see FusedStep), the first feeding `token` at `position`,
    each later one the token the step before selected. The target must stop after a token in `eos`
    and answers a `Decoded` with 1 to `limit` tokens. `cache` is the KV cache as the core holds it
    (past input -> tensor): the target reads it and must not change the mapping; `capacity` is the
    most positions the request's mask can cover. `pick`: how each step selects its token when it is
    not the argmax of the logits (sampling/sampler.py `Pick`), for targets with `fused_sampling`.

    `speculation` (loops/speculative.py): the target may run the steps as speculative rounds, drafts
    checked in one run, which give the same tokens as plain steps (greedy) or follow the same
    distribution (sampling, by `pick`); a target that does not ignores it. Only targets with
    `fused_speculation` get one whose `pick` is not None."""

    step: FusedStep
    cache: Mapping[str, Handle]
    capacity: int
    eos: frozenset[int]
    token: int
    position: int
    limit: int
    label: str
    speculation: Any = None  # loops.speculative.Speculation
    pick: Any = None  # sampling.sampler.Pick
    fixed: Mapping[str, Handle] | None = None  # the values of `step.fixed`, fed to every step


class Decoded(NamedTuple):
    tokens: list[int]
    cache: Mapping[str, Handle]  # the cache after the steps, which the core holds from now on
    draft: tuple[Mapping[str, Handle], int] | None = None  # speculation's draft model: its cache and length


Work = Generator[Any, Any, Any]


class Backend(Protocol):
    """The few tensor operations the core needs from a target.

    `fused_layouts`: the cache layouts ("shared", "concat") whose `Decode` the target carries out;
    empty: the core never yields one. `decode_burst`: the most steps one `Decode` asks for (running
    several per answer saves the core's work per token and, in the browser, a crossing into Python).
    `fused_sampling`: the target selects tokens by a `Decode`'s `pick` (else only plain greedy
    requests are fused). `fused_speculation`: the target runs speculative rounds of requests that
    select by a `pick` too (else those run their rounds in the core, with kernels). `row_views`: the
    `narrow` kernel along the first axis answers a tensor over
    the same memory, so a run that writes it in place writes the whole (a batch of rows in one
    preallocated buffer needs it, loops/batched.py).
    """

    fused_layouts: frozenset[str]
    decode_burst: int
    fused_sampling: bool
    fused_speculation: bool
    row_views: bool

    def tensor(self, values: list[int], shape: tuple[int, ...], dtype: str) -> Handle: ...

    def full(self, shape: tuple[int, ...], value: float, dtype: str) -> Handle: ...

    def shape(self, handle: Handle) -> tuple[int, ...]: ...

    def dtype(self, handle: Handle) -> str: ...

    def to_list(self, handle: Handle) -> list[int]: ...


def kernel(name: str, dtype: str) -> str:
    """The session name of a kernel graph specialised for one element type."""
    return f"{KERNEL}{name}_{dtype}"


def drive(work: Work, execute: Callable[[Any], Any]) -> Any:
    """Answer a core generator's work items with `execute` until it returns; its return value.

    When `execute` raises (Ctrl-C included), the exception is thrown into the generator at the
    yield that asked for the work, so the core can record the failure (lifecycle ERROR) before it
    propagates.
    """
    try:
        item = next(work)
        while True:
            try:
                answer = execute(item)
            except BaseException as e:
                item = work.throw(e)
                continue
            item = work.send(answer)
    except StopIteration as stop:
        return stop.value
