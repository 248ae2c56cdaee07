"""Model variants: several exports of one graph in one folder, and which one a device runs.

Files are named as transformers.js names them: `model.onnx` (fp32), `model_quantized.onnx` (q8),
`model_q4.onnx`, `model_fp16.onnx`, `model_q4f16.onnx`, ... (the same under onnx/, and for any
graph: `decoder_model_merged_q4.onnx`). A config names one of them, or the plain name; every
variant of that graph the folder holds is a candidate. A `dtype` (load's option, the CLI's
--dtype, a session's "dtype" in the config, transformers.js_config.dtype in config.json) picks
one; without it, the device's row of DEFAULTS does: the first dtype of the row the folder has.
"""

from __future__ import annotations

import posixpath
from collections.abc import Mapping
from typing import Any

from .errors import ConfigError, did_you_mean
from .folder import Folder
from .jsonfile import quote

# dtype -> what transformers.js appends to a graph's file name.
SUFFIXES = {
    "fp32": "",
    "fp16": "_fp16",
    "q8": "_quantized",
    "int8": "_int8",
    "uint8": "_uint8",
    "q4": "_q4",
    "q4f16": "_q4f16",
    "bnb4": "_bnb4",
}

# A device's order of preference (docs/benchmarks.md, "Model variants", measured on the demo model):
# - wasm: q8 (int8 weights, dynamically quantized activations) decodes as fast as fp32 and fp16,
#   prefills about twice as fast and is a quarter of fp32's size; int4 MatMulNBits graphs (q4,
#   q4f16) have no fast wasm kernel in onnxruntime-web 1.30: 7 to 8 times slower, at any accuracy level.
# - cpu (CPython's onnxruntime): q4 at accuracy level 4 (int8 activations: the model builder's
#   exports, the demo's) decodes 5 times faster than fp32 and a little faster than q8; at level 0
#   (transformers.js's exports) half as fast as q8, still twice as fast as fp32; q4f16 a little
#   slower than q8; fp16 is no faster than fp32 on CPUs.
# - webgpu and CPython's GPU providers: not timed here (this machine's WebGPU is a software
#   adapter); the order follows what they run natively: fp16 and fp32 graphs, int4 MatMulNBits,
#   and last the int8 graphs, whose dynamic quantization ops fall back to the CPU.
DEFAULTS: dict[str, tuple[str, ...]] = {
    "wasm": ("q8", "int8", "uint8", "fp32", "fp16", "q4", "q4f16", "bnb4"),
    "cpu": ("q4", "q8", "int8", "uint8", "q4f16", "fp32", "fp16", "bnb4"),
    "gpu": ("fp16", "fp32", "q4f16", "q4", "bnb4", "q8", "int8", "uint8"),
}
# Variants that compute in float16: a WebGPU adapter without the shader-f16 feature cannot run them.
HALF = ("fp16", "q4f16")
# Which row each device and execution provider reads (an unknown provider: "cpu").
ROWS = {
    "wasm": "wasm",
    "webgpu": "gpu",
    "cuda": "gpu",
    "tensorrt": "gpu",
    "dml": "gpu",
    "coreml": "gpu",
}


# A graph that onnxruntime has already optimized for an execution provider (build/variants.py
# `optimize_ahead`) says so in its metadata_props: this key, the provider's onnxruntime name. Sessions on
# that provider are created without optimizing it again (the same kernels, a faster start); sessions
# elsewhere optimize it as any graph.
OPTIMIZED_FOR = "ortpipe.optimized_for"


def optimized_ahead(optimized_for: str | None, provider: str) -> bool:
    """Whether a graph whose OPTIMIZED_FOR entry is `optimized_for` (None: it has none) was optimized ahead
    for `provider` (an onnxruntime name, or "wasm": onnxruntime-web's CPU provider, the CPU provider
    compiled to WebAssembly)."""
    provider = "CPUExecutionProvider" if provider == "wasm" else provider
    return optimized_for is not None and optimized_for == provider


def split(file: str) -> tuple[str, str]:
    """("onnx/model", "q4") for "onnx/model_q4.onnx": the graph's plain name and its dtype."""
    stem = file[: -len(".onnx")] if file.endswith(".onnx") else file
    for dtype, suffix in sorted(SUFFIXES.items(), key=lambda item: -len(item[1])):
        if suffix and stem.endswith(suffix) and len(stem) > len(suffix) and not stem.endswith("/" + suffix):
            return stem[: -len(suffix)], dtype
    return stem, "fp32"


def file_of(base: str, dtype: str) -> str:
    return f"{base}{SUFFIXES[dtype]}.onnx"


def present(folder: Folder, file: str) -> dict[str, str]:
    """Every variant of `file`'s graph in the folder: dtype -> file name."""
    base, _ = split(file)
    found = {}
    for dtype in SUFFIXES:
        name = file_of(base, dtype)
        try:
            if folder.exists(name):
                found[dtype] = name
        except ConfigError:
            continue  # a link leading out: not a candidate (the configured file reports it)
    return found


def device_row(device: str) -> tuple[str, ...]:
    """The preference order of a device ("wasm", "webgpu") or execution provider ("cpu", "cuda",
    "OpenVINOExecutionProvider", ...)."""
    name = device.lower().removesuffix("executionprovider")
    return DEFAULTS[ROWS.get(name, "cpu")]


def check_dtype(dtype: Any, where: str = "dtype") -> str | dict[str, str] | None:
    """A dtype option as given (None, a dtype, or session name -> dtype); a ConfigError otherwise."""
    if dtype is None:
        return None
    values = dtype.values() if isinstance(dtype, Mapping) else [dtype]
    for value in values:
        if not isinstance(value, str) or value not in SUFFIXES:
            shown = value if isinstance(value, str) else ""
            also = " or a map of session names to them" if where == "dtype" else ""
            raise ConfigError(
                f"{where} must be one of {', '.join(SUFFIXES)}{also}, found {quote(value)}."
                f"{did_you_mean(shown, SUFFIXES)}"
            )
    if isinstance(dtype, Mapping):
        if not all(isinstance(k, str) for k in dtype):
            raise ConfigError(f"{where} maps session names to dtypes, found {quote(dtype)}")
        return dict(dtype)
    return dtype


def choose(folder: Folder, file: str, device: str, dtype: str | None = None, session: str = "",
           f16: bool = True) -> str:
    """The file the session runs: the variant `dtype` names, else the device's first the folder has
    (without float16 graphs unless the device runs them: `f16`). A ConfigError names the variants
    the folder has when the one asked for is missing or cannot run."""
    found = present(folder, file)
    who = f'session "{session}": ' if session else ""
    if dtype in HALF and not f16:
        raise ConfigError(f"{who}dtype {dtype} computes in float16, which this {device} device cannot (a "
                          "WebGPU adapter without shader-f16); choose another: "
                          f"{', '.join(d for d in found if d not in HALF) or 'none is in the folder'}")
    if dtype is not None:
        if dtype in found:
            return found[dtype]
        have = ", ".join(f"{d} ({f})" for d, f in found.items()) or "none"
        raise ConfigError(
            f"{who}dtype {dtype} needs {folder.describe(file_of(split(file)[0], dtype))}, which does not "
            f"exist; the variants of this graph in the folder: {have}"
        )
    for candidate in device_row(device):
        if candidate in found and (f16 or candidate not in HALF):
            return found[candidate]
    return file  # none at all: the config's check reports the missing file


def dtype_of(file: str) -> str:
    """The dtype a file's name says (a file without a suffix is fp32)."""
    return split(posixpath.basename(file))[1]
