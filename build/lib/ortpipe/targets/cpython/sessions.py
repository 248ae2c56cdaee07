"""What the core needs of an onnxruntime session besides running it: its signature.

Sessions are opened by `providers.open_session` (the session's execution providers, their options,
where onnxruntime placed the nodes).
"""

from __future__ import annotations

from typing import Any

import onnxruntime as ort

from ...signature import Signature, TensorInfo

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


def signature_of(session: ort.InferenceSession) -> Signature:
    def info(arg: Any) -> TensorInfo:
        return TensorInfo(arg.name, ORT_TYPES.get(arg.type, arg.type), tuple(arg.shape))

    return Signature(tuple(map(info, session.get_inputs())), tuple(map(info, session.get_outputs())))
