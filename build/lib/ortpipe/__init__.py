"""ortpipe: run generative ONNX models from a folder of ONNX files and one JSON config."""

from __future__ import annotations

from .errors import ConfigError, GenerationError, OrtpipeError

__version__ = "0.1.0"
__all__ = ["ConfigError", "GenerationError", "OrtpipeError", "load"]

TYPE_CHECKING = False  # typing's, without importing typing: the package's own import stays small
if TYPE_CHECKING:
    from typing import Any


def load(model_dir: Any, **options: Any) -> Any:
    """Load a model folder with the CPython target (onnxruntime); see targets.cpython.load."""
    from .targets.cpython import load as load_cpython

    return load_cpython(model_dir, **options)
