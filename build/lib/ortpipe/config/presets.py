"""Built-in presets for `pipeline.extends` (seed 000, section 3.5).

A preset is a raw v2 `pipeline` mapping. The user's keys replace the preset's keys of the same
name; inside `state`, each sub-key (kv_cache, position_ids, cross_cache) replaces the preset's.
"""

from __future__ import annotations

import copy
from typing import Any

_DECODER_STATE = {"kv_cache": {"format": "auto"}, "position_ids": {"strategy": "auto"}}

PRESETS: dict[str, dict[str, Any]] = {
    "autoregressive-decoder": {
        "sessions": {"decoder": {"file": "model.onnx"}},
        "flow": [{"run": "decoder", "when": "step"}],
        "state": _DECODER_STATE,
    },
    "vision-language": {
        "sessions": {
            "vision": {"file": "vision_encoder/model.onnx"},
            "embedding": {"file": "embedding/model.onnx"},
            "decoder": {"file": "decoder/model.onnx"},
        },
        "flow": [
            {"run": "vision", "when": "init", "loop": "batched", "optional": True},
            {"run": "embedding", "when": "init"},
            {"run": "decoder", "when": "step"},
        ],
        "state": _DECODER_STATE,
    },
    "encoder-decoder": {
        "sessions": {
            "encoder": {"file": "encoder/model.onnx"},
            "decoder": {"file": "decoder/model.onnx"},
        },
        "flow": [{"run": "encoder", "when": "init"}, {"run": "decoder", "when": "step"}],
        "state": {**_DECODER_STATE, "cross_cache": {"source": "encoder", "frozen": True}},
    },
    "speech-language": {
        "sessions": {
            "speech": {"file": "audio_encoder/model.onnx"},
            "embedding": {"file": "embedding/model.onnx"},
            "decoder": {"file": "decoder/model.onnx"},
        },
        "flow": [
            {"run": "speech", "when": "init", "optional": True},
            {"run": "embedding", "when": "init"},
            {"run": "decoder", "when": "step"},
        ],
        "state": _DECODER_STATE,
    },
    "multimodal": {
        "sessions": {
            "vision": {"file": "vision_encoder/model.onnx"},
            "speech": {"file": "audio_encoder/model.onnx"},
            "embedding": {"file": "embedding/model.onnx"},
            "decoder": {"file": "decoder/model.onnx"},
        },
        "flow": [
            {"run": "vision", "when": "init", "optional": True},
            {"run": "speech", "when": "init", "optional": True},
            {"run": "embedding", "when": "init"},
            {"run": "decoder", "when": "step"},
        ],
        "state": _DECODER_STATE,
    },
}


def expand(pipeline: dict[str, Any], preset: str) -> dict[str, Any]:
    """The preset's pipeline with the user's keys laid over it (the caller checks the name)."""
    merged = copy.deepcopy(PRESETS[preset])
    for key, value in pipeline.items():
        if key == "state" and isinstance(value, dict):
            merged["state"] = {**merged.get("state", {}), **value}
        elif key != "extends":
            merged[key] = value
    merged["extends"] = preset
    return merged
