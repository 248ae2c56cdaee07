"""What the core knows of an ONNX session: the names, element types and shapes of its I/O."""

from __future__ import annotations

from dataclasses import dataclass

Dim = int | str | None  # a fixed size, a symbolic name, or unknown


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str  # numpy-style name: "float32", "float16", "int64", "int32", "bool", ...
    shape: tuple[Dim, ...]

    @property
    def rank(self) -> int:
        return len(self.shape)


@dataclass(frozen=True)
class Signature:
    inputs: tuple[TensorInfo, ...]
    outputs: tuple[TensorInfo, ...]

    def input(self, name: str) -> TensorInfo | None:
        return next((t for t in self.inputs if t.name == name), None)

    def output(self, name: str) -> TensorInfo | None:
        return next((t for t in self.outputs if t.name == name), None)

    @property
    def input_names(self) -> list[str]:
        return [t.name for t in self.inputs]

    @property
    def output_names(self) -> list[str]:
        return [t.name for t in self.outputs]
