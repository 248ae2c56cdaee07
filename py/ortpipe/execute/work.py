"""The work the sans-IO core asks a target to do, and the target's small tensor interface.

Core generators yield `Run` / `RunAll` and receive the outputs (psycopg's generators.py shape):
the CPython driver answers with InferenceSession.run, the browser driver with onnxruntime-web.
Tensors are opaque handles owned by the target; the core only creates small integer tensors and
reads small integer results through `Backend`.
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass
from typing import Any, Protocol

Handle = Any  # a target's tensor (numpy array, OrtValue, ort.Tensor proxy)

KERNEL = "kernel:"  # session names starting with this are ortpipe's kernel graphs


@dataclass(slots=True)
class Run:
    """Run one session. `inplace` maps an output to the input whose buffer it must be written into."""

    session: str
    feeds: dict[str, Handle]
    outputs: tuple[str, ...]
    inplace: dict[str, str] | None = None
    label: str = ""  # the phase or step this run belongs to, for traces


@dataclass(slots=True)
class RunAll:
    """Runs that do not depend on each other; a target may run them side by side."""

    runs: list[Run]


@dataclass(slots=True)
class Decode:
    """Greedy decode steps that a target may run fused (see `fused_decode` below).

    One step: feed `token` to `ids` at position `past` (the attention mask all ones over
    `past + 1` positions, 1D position ids `past`), run `session` with the cache `cache` (`presents`:
    present output -> past input), and select the argmax of the last row of `logits`.
    With `shared` the present is written into the past's buffer in place (a shared buffer); else
    the present, one position longer, is the next past (concat), and the target keeps `cache`
    current: by the time the core reads `cache[past]` again it must be the latest present.

    The target may run up to `limit` such steps in a row, each feeding the token the step before
    selected at the next position, and must stop after a token in `eos`. It answers the selected
    tokens as a list of ints, at least one. The flow yields one object per request and updates
    `token`, `past` and `limit`.
    """

    session: str
    ids: tuple[str, str]  # (input name, dtype)
    mask: tuple[str, str] | None
    positions: tuple[str, str] | None
    cache: dict[str, Handle]
    presents: dict[str, str]
    shared: bool
    outputs: tuple[str, ...]
    logits: str
    logits_shape: tuple[int, ...]  # of one decode run: (1, 1, vocab) or (1, vocab)
    capacity: int  # the most positions a request's mask can cover
    eos: frozenset[int] = frozenset()
    token: int = 0
    past: int = 0
    limit: int = 1
    label: str = ""


Work = Generator[Run | RunAll | Decode, Any, Any]


class Backend(Protocol):
    """The few tensor operations the core needs from a target."""

    def tensor(self, values: list[int], shape: tuple[int, ...], dtype: str) -> Handle: ...

    def full(self, shape: tuple[int, ...], value: float, dtype: str) -> Handle: ...

    def shape(self, handle: Handle) -> tuple[int, ...]: ...

    def dtype(self, handle: Handle) -> str: ...

    def to_list(self, handle: Handle) -> list[int]: ...

    # A backend whose driver carries out `Decode` names the cache layouts it fuses in
    # `fused_decode`: a set of "shared" and "concat". Without it the core never yields one.
    # `decode_burst` (default 1) is the most steps one `Decode` asks for: running several steps
    # per answer saves the core's work per token, and in the browser a crossing (Python <-> JS).


def kernel(name: str, dtype: str) -> str:
    """The session name of a kernel graph specialised for one element type."""
    return f"{KERNEL}{name}_{dtype}"
