"""Opening onnxruntime sessions for a model's sessions: providers, options, signatures."""

from __future__ import annotations

import warnings
from typing import Any

import onnxruntime as ort

from ...config.schema import SessionSpec
from ...errors import ConfigError
from ...execute.work import Open
from ...signature import Signature, TensorInfo

PROVIDERS = {
    "cpu": "CPUExecutionProvider",
    "cuda": "CUDAExecutionProvider",
    "dml": "DmlExecutionProvider",
    "openvino": "OpenVINOExecutionProvider",
    "qnn": "QNNExecutionProvider",
    "coreml": "CoreMLExecutionProvider",
    "webgpu": "WebGpuExecutionProvider",
    "tensorrt": "TensorrtExecutionProvider",
}
ORT_TYPES = {
    "tensor(float)": "float32",
    "tensor(float16)": "float16",
    "tensor(double)": "float64",
    "tensor(int64)": "int64",
    "tensor(int32)": "int32",
    "tensor(bool)": "bool",
    "tensor(uint8)": "uint8",
    "tensor(int8)": "int8",
    "tensor(bfloat16)": "bfloat16",
}
_OPT_LEVELS = {
    "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
    "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
    "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
    "disable": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
}
_MODES = {"sequential": ort.ExecutionMode.ORT_SEQUENTIAL, "parallel": ort.ExecutionMode.ORT_PARALLEL}


def provider_name(name: str) -> str:
    return PROVIDERS.get(name.lower(), name)


def choose_provider(spec: SessionSpec, override: str | None) -> tuple[str, dict[str, Any]]:
    """The first available provider of the session's list; a fallback is a warning, never silent."""
    wanted = [override] if override else list(spec.providers)
    available = ort.get_available_providers()
    for name in wanted:
        full = provider_name(name)
        if full in available:
            if full != provider_name(wanted[0]):
                warnings.warn(
                    f'session "{spec.name}": {wanted[0]} is not available in this onnxruntime '
                    f"({', '.join(available)}); using {full}",
                    stacklevel=3,
                )
            return full, dict(spec.provider_options.get(name, {}))
    raise ConfigError(
        f'session "{spec.name}" asks for execution provider {" or ".join(wanted)}, but this '
        f"onnxruntime has only {', '.join(available)}. Install the matching onnxruntime package "
        "(one flavour per environment) or choose another provider"
    )


def session_options(spec: SessionSpec, threads: int | None) -> ort.SessionOptions:
    options = ort.SessionOptions()
    options.log_severity_level = 3  # failures reach the user as ortpipe errors with context, once
    for key, value in spec.session_options.items():
        if key == "graph_optimization_level":
            options.graph_optimization_level = _OPT_LEVELS[value]
        elif key == "execution_mode":
            options.execution_mode = _MODES[value]
        elif key == "config_entries":
            for entry, text in value.items():
                options.add_session_config_entry(entry, text)
        else:
            setattr(options, key, value)
    if threads:
        options.intra_op_num_threads = threads
    return options


def open_session(work: Open, provider: str | None, threads: int | None) -> ort.InferenceSession:
    spec = work.spec
    name, provider_options = choose_provider(spec, provider)
    path = work.path
    try:
        session = ort.InferenceSession(
            path, session_options(spec, threads), providers=[name], provider_options=[provider_options]
        )
    except Exception as e:  # onnxruntime raises its own types; give them context
        raise ConfigError(
            f'session "{spec.name}" could not be created from {work.shown} with {name}: {str(e)[:500]}'
        ) from None
    got = session.get_providers()[0]
    if got != name:
        warnings.warn(f'session "{spec.name}": asked for {name}, onnxruntime gave {got}', stacklevel=3)
    return session


def signature_of(session: ort.InferenceSession) -> Signature:
    def info(arg: Any) -> TensorInfo:
        return TensorInfo(arg.name, ORT_TYPES.get(arg.type, arg.type), tuple(arg.shape))

    return Signature(tuple(map(info, session.get_inputs())), tuple(map(info, session.get_outputs())))
