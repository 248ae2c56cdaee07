"""ortpipe's kernel graphs: small ONNX graphs for the numeric work that is not a model (token
selection, cache slicing, image and audio preprocessing), built by build/kernels.py and shipped
here. Targets run them like any session, opened on first use."""

from __future__ import annotations

from pathlib import Path

from ..errors import OrtpipeError
from ..execute.work import KERNEL

KERNEL_DIR = Path(__file__).resolve().parent
# Preprocessing kernels take decoded pixels and samples, which are on the CPU, and compute in
# float64, as the noise kernel does (Box-Muller on the core's uniforms): a target with a GPU device runs
# them on its CPU provider.
CPU_ONLY = tuple(f"{KERNEL}{name}" for name in ("resize_", "normalize_", "patchify_", "log_mel_", "normal_"))


def kernel_file(session: str) -> Path:
    """The graph file of a kernel session name ("kernel:argmax_last_float32"); an OrtpipeError
    when the name is no kernel's (a bug: sessions the plan names are loaded with the model)."""
    path = KERNEL_DIR / f"{session[len(KERNEL):]}.onnx"
    if not session.startswith(KERNEL) or not path.is_file():
        raise OrtpipeError(f'no session "{session}" is loaded, and no kernel graph has that name')
    return path


def kernel_kind(session: str) -> str:
    """The kernel's name without its element type: "argmax_last" for "kernel:argmax_last_float32"."""
    return session[len(KERNEL):].rsplit("_", 1)[0]
