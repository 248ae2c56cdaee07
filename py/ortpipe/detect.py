"""Structural detection: a v2 config for a folder that has no genai_config.json.

Covers the Optimum and transformers.js export layout (`model.onnx` beside `config.json`,
`generation_config.json`, `tokenizer.json`), with any of its variants (`onnx/model_q4.onnx`, ...;
variants.py) and the dtype transformers.js_config in config.json names. What the graph is
(decoder, KV layout, layers) is read from its signature by `plan`; here we only find the file
and the special tokens.
"""

from __future__ import annotations

from typing import Any

from . import variants
from .errors import ConfigError
from .folder import Folder
from .jsonfile import optional_json

DECODER_FILES = (
    "model.onnx", "decoder_model_merged.onnx", "decoder_model.onnx",
    "onnx/model.onnx", "onnx/decoder_model_merged.onnx", "onnx/decoder_model.onnx",
)
_LENGTH_KEYS = ("max_position_embeddings", "n_positions", "n_ctx", "max_sequence_length")


def detect_config(folder: Folder) -> dict[str, Any]:
    file = next((f for f in DECODER_FILES if variants.present(folder, f)), None)
    if file is None:
        raise ConfigError(f"{folder.describe()} has no genai_config.json and no decoder graph "
                          f"(looked for {', '.join(DECODER_FILES)} and their variants, e.g. "
                          "onnx/model_q4.onnx). Add a genai_config.json naming the ONNX files (see the "
                          "README's config reference)")
    hf = optional_json(folder, "config.json")
    gen = optional_json(folder, "generation_config.json")
    decoder: dict[str, Any] = {"file": file}
    dtype = _transformers_js_dtype(hf, file)
    if dtype is not None:
        decoder["dtype"] = dtype
    raw: dict[str, Any] = {
        "version": 2,
        "pipeline": {"extends": "autoregressive-decoder", "sessions": {"decoder": decoder}},
        "tokens": _tokens(gen, hf),
        "generation": {},
        "metadata": {"model_type": hf.get("model_type"), "detected_from": file},
    }
    length = next((hf[k] for k in _LENGTH_KEYS if isinstance(hf.get(k), int) and hf[k] > 0), None)
    if length:
        raw["generation"]["max_length"] = length
    return raw


def _transformers_js_dtype(hf: dict[str, Any], file: str) -> Any:
    """The variant config.json's transformers.js_config.dtype names for `file`: a dtype, or one
    per graph ({"model": "q4"}); its checks are the config's."""
    custom = hf.get("transformers.js_config")
    dtype = custom.get("dtype") if isinstance(custom, dict) else None
    if isinstance(dtype, dict):
        dtype = dtype.get(variants.split(file)[0].rsplit("/", 1)[-1])
    return None if dtype == "auto" else dtype  # "auto": the device's default


def _tokens(gen: dict[str, Any], hf: dict[str, Any]) -> dict[str, Any]:
    """Special tokens, generation_config.json first (it is what transformers' generate uses)."""
    def pick(key: str) -> Any:
        return gen.get(key, hf.get(key))

    eos = pick("eos_token_id")
    eos = [] if eos is None else eos if isinstance(eos, list) else [eos]
    tokens: dict[str, Any] = {"eos": [e for e in eos if isinstance(e, int) and not isinstance(e, bool)]}
    for hf_key, key in (
        ("bos_token_id", "bos"),
        ("pad_token_id", "pad"),
        ("decoder_start_token_id", "decoder_start"),
    ):
        value = pick(hf_key)
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            tokens[key] = value
    return tokens
