"""Execution providers as a config names them: the vocabulary, where each comes from, and the checks
on `execution_provider`, `provider_options` and `session_options` that need no onnxruntime.

A session's `execution_provider` is a name or an ordered fallback list (`["openvino", "cpu"]`).
`provider_options` holds options per provider name; `session_options` holds onnxruntime session
settings (onnxruntime-genai's key names) and, under a provider's name, settings that apply only when
that provider is the one picked: `{"intra_op_num_threads": 4, "openvino": {"intra_op_num_threads": 1}}`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from ..errors import Problems, did_you_mean, one_of


@dataclass(frozen=True)
class Provider:
    key: str  # the name configs use: "openvino"
    ort_name: str  # onnxruntime's name: "OpenVINOExecutionProvider"
    extra: str | None  # the extra of ortpipe that installs it (pip install "ortpipe[openvino]"), or None
    packages: tuple[str, ...]  # the PyPI packages that carry it
    plugin: str | None = None  # a plugin EP package's module, whose get_library_path() onnxruntime registers


PROVIDERS = {p.key: p for p in (
    Provider("cpu", "CPUExecutionProvider", "cpu", ("onnxruntime",)),
    Provider("openvino", "OpenVINOExecutionProvider", "openvino",
             ("onnxruntime-openvino", "onnxruntime-ep-openvino"), plugin="onnxruntime_ep_openvino"),
    Provider("qnn", "QNNExecutionProvider", "qnn", ("onnxruntime-qnn",), plugin="onnxruntime_qnn"),
    Provider("dml", "DmlExecutionProvider", "directml", ("onnxruntime-directml",)),
    Provider("cuda", "CUDAExecutionProvider", "cuda", ("onnxruntime-gpu",)),
    Provider("tensorrt", "TensorrtExecutionProvider", "cuda", ("onnxruntime-gpu",)),
    Provider("coreml", "CoreMLExecutionProvider", "cpu", ("onnxruntime",)),  # in the macOS wheels
    # named by onnxruntime-genai's model builder (-e webgpu, -e NvTensorRtRtx): such folders load, and a
    # CPython session passes over them to the next provider; the browser target runs every session on its
    # own device whatever the config names
    Provider("webgpu", "WebGpuExecutionProvider", None, ("onnxruntime-web",)),
    Provider("nv_tensorrt_rtx", "NvTensorRTRTXExecutionProvider", None, ()),
)}
ALIASES = {"directml": "dml", "trt": "tensorrt", "nvtensorrtrtx": "nv_tensorrt_rtx",
           "trt-rtx": "nv_tensorrt_rtx"}
_BY_ORT_NAME = {p.ort_name.lower(): p.key for p in PROVIDERS.values()}

# onnxruntime-genai's session_options keys, with the type each takes: the one table of session options
# (config/parse.py checks a config's with it, config/v1.py translates into it)
SESSION_OPTION_TYPES: dict[str, type] = {
    "intra_op_num_threads": int, "inter_op_num_threads": int,
    "enable_cpu_mem_arena": bool, "enable_mem_pattern": bool, "enable_mem_reuse": bool,
    "log_id": str, "log_severity_level": int, "enable_profiling": str,
    "graph_optimization_level": str, "execution_mode": str,
    "disable_cpu_ep_fallback": bool, "disable_quant_qdq": bool, "enable_quant_qdq_cleanup": bool,
    "ep_context_enable": bool, "ep_context_embed_mode": bool, "ep_context_file_path": str,
    "config_entries": dict,
}
SESSION_OPTION_CHOICES = {
    "graph_optimization_level": ("ORT_DISABLE_ALL", "ORT_ENABLE_BASIC", "ORT_ENABLE_EXTENDED",
                                 "ORT_ENABLE_ALL"),
    "execution_mode": ("ORT_SEQUENTIAL", "ORT_PARALLEL"),
}
# the short names onnxruntime-web uses (and ortpipe's configs did before), taken as the names above
SESSION_OPTION_ALIASES = {
    "graph_optimization_level": {"disable": "ORT_DISABLE_ALL", "basic": "ORT_ENABLE_BASIC",
                                 "extended": "ORT_ENABLE_EXTENDED", "all": "ORT_ENABLE_ALL"},
    "execution_mode": {"sequential": "ORT_SEQUENTIAL", "parallel": "ORT_PARALLEL"},
}
MAX_THREADS = 1024
_INT_LIMITS = {"intra_op_num_threads": MAX_THREADS, "inter_op_num_threads": MAX_THREADS,
               "log_severity_level": 4}
# provider options whose values are checked here; the rest go to the provider as written
_OPENVINO_DEVICE = re.compile(r"^(CPU|GPU(\.\d+)?|NPU(\.\d+)?|(AUTO|HETERO|MULTI):[A-Z0-9.,]+)$")
_QNN_BACKENDS = ("htp", "cpu", "gpu", "saver", "ir")
_TYPE_NAMES = {bool: "true or false", int: "an integer", str: "a string", dict: "an object"}


def provider_key(name: Any) -> str | None:
    """The config key of a provider named by key, alias or onnxruntime name (any case), else None."""
    if not isinstance(name, str):
        return None
    low = name.strip().lower()
    low = ALIASES.get(low, low)
    if low in PROVIDERS:
        return low
    return _BY_ORT_NAME.get(low)


def provider_names(value: Any, path: str, problems: Problems) -> tuple[str, ...]:
    """An `execution_provider` value (a name or a list of names) as provider keys, in order."""
    names = [value] if isinstance(value, str) else value
    if not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names):
        problems.add(f"{path} must be a provider name or a list of names ({one_of(PROVIDERS)}), "
                     f"found {value!r}")
        return ()
    keys = []
    for name in names:
        key = provider_key(name)
        if key is None:
            problems.add(f'Unknown execution provider "{name}" in {path}. Known providers: '
                         f"{one_of(PROVIDERS)}.{did_you_mean(name.lower(), [*PROVIDERS, *ALIASES])}")
        elif key not in keys:
            keys.append(key)
    return tuple(keys)


def check_provider_options(value: Any, path: str, problems: Problems) -> dict[str, dict[str, str]]:
    """`provider_options` ({provider: {option: value}}) keyed by provider key, values as strings."""
    if not isinstance(value, dict):
        problems.add(f"{path} must be an object of options per provider name, found {value!r}")
        return {}
    out: dict[str, dict[str, str]] = {}
    for name, options in value.items():
        key = provider_names(name, f"{path} key", problems)
        if not key:
            continue
        where = f"{path}.{name}"
        if not isinstance(options, dict):
            problems.add(f"{where} must be an object of option names and values, found {options!r}")
            continue
        out[key[0]] = {}
        for option, v in options.items():
            if isinstance(v, bool) or not isinstance(v, (str, int, float)):
                problems.add(f"{where}.{option} must be a string or a number as the provider documents it "
                             f'(onnxruntime takes provider options as strings, e.g. "1" or "True"), '
                             f"found {v!r}")
                continue
            out[key[0]][option] = str(v)
        _check_known_options(key[0], out[key[0]], where, problems)
    return out


def _check_known_options(key: str, options: dict[str, str], where: str, problems: Problems) -> None:
    device = options.get("device_type")
    if key == "openvino" and device is not None and not _OPENVINO_DEVICE.match(device):
        problems.add(f'{where}.device_type "{device}" is not an OpenVINO device: use CPU, GPU (or GPU.0, '
                     "GPU.1), NPU, or AUTO:/HETERO:/MULTI: followed by a comma-separated list of them")
    backend = options.get("backend_type")
    if key == "qnn" and backend is not None and backend not in _QNN_BACKENDS:
        problems.add(f'{where}.backend_type "{backend}" is not a QNN backend: use one of '
                     f"{one_of(_QNN_BACKENDS)}.{did_you_mean(backend, _QNN_BACKENDS)}")


def check_session_options(value: Any, path: str, problems: Problems, nested: bool = False) -> dict[str, Any]:
    """`session_options`: onnxruntime-genai's keys, and under a provider's key the same keys for it."""
    if not isinstance(value, dict):
        problems.add(f"{path} must be an object, found {value!r}")
        return {}
    out: dict[str, Any] = {}
    for name, v in value.items():
        key = None if nested else provider_key(name)
        if key is not None:
            out[key] = check_session_options(v, f"{path}.{name}", problems, nested=True)
        elif name in SESSION_OPTION_TYPES:
            v = SESSION_OPTION_ALIASES.get(name, {}).get(v, v) if isinstance(v, str) else v
            if _check_option(name, v, f"{path}.{name}", problems):
                out[name] = v
        else:
            allowed = list(SESSION_OPTION_TYPES) + ([] if nested else ["(a provider name)"])
            problems.add(f'Unknown key "{name}" in {path}.{did_you_mean(name, SESSION_OPTION_TYPES)} '
                         f"Allowed keys: {one_of(allowed)}")
    return out


def _check_option(name: str, value: Any, path: str, problems: Problems) -> bool:
    kind = SESSION_OPTION_TYPES[name]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        problems.add(f"{path} must be {_TYPE_NAMES[kind]}, found {value!r}")
        return False
    high = _INT_LIMITS.get(name)
    if kind is int and (value < 0 or (high is not None and value > high)):
        low = "0 (onnxruntime decides)" if name.endswith("_threads") else "0"
        problems.add(f"{path} must be from {low} to {high}, found {value}" if high is not None
                     else f"{path} must be {low} or more, found {value}")
        return False
    choices = SESSION_OPTION_CHOICES.get(name)
    if choices and value not in choices:
        problems.add(f'{path} "{value}" is not one of {one_of(choices)}.{did_you_mean(value, choices)}')
        return False
    if kind is dict and not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        problems.add(f"{path} maps onnxruntime session config keys to string values, found {value!r}")
        return False
    return True


def options_for(session_options: dict[str, Any], provider: str) -> dict[str, Any]:
    """The session options that apply when `provider` is picked: the common ones, then the provider's own."""
    common = {k: v for k, v in session_options.items() if k not in PROVIDERS}
    own = session_options.get(provider, {})
    entries = {**common.get("config_entries", {}), **own.get("config_entries", {})}
    merged = {**common, **own}
    if entries:
        merged["config_entries"] = entries
    return merged
