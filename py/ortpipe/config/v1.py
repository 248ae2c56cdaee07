"""Translate onnxruntime-genai's v1 genai_config.json (what its model builder writes) to v2.

`model.type` becomes metadata: it is never dispatched on, so an unknown type still runs.
"""

from __future__ import annotations

from typing import Any

from ..errors import ConfigError

# v1 decoder input/output keys that name a single tensor, kept as role maps on the session.
_INPUT_ROLES = ("input_ids", "attention_mask", "position_ids", "inputs_embeds")
_OUTPUT_ROLES = ("logits",)
_KV_KEYS = {
    "past_key_names": "past_key_pattern", "past_value_names": "past_value_pattern",
    "present_key_names": "present_key_pattern", "present_value_names": "present_value_pattern",
    "past_names": "past_pattern", "present_names": "present_pattern",
}
_SEARCH_TO_SAMPLING = ("do_sample", "temperature", "top_k", "top_p", "repetition_penalty")
# Sections that become init sessions, in the order they run, and whether a request may omit their input.
_ENCODERS = (("vision", True), ("speech", True), ("encoder", False), ("embedding", False))


def is_v1(raw: Any) -> bool:
    return isinstance(raw, dict) and "version" not in raw and "model" in raw


def translate(raw: dict[str, Any]) -> dict[str, Any]:
    model = raw.get("model")
    if not isinstance(model, dict) or not isinstance(model.get("decoder"), dict):
        raise ConfigError('genai_config.json (v1) needs a "model.decoder" object with at least '
                          '"filename"; or write a v2 config ("version": 2)')
    decoder = model["decoder"]
    search = raw.get("search", {}) if isinstance(raw.get("search"), dict) else {}
    sections = {name: model[name] for name, _ in _ENCODERS if isinstance(model.get(name), dict)}
    if isinstance(decoder.get("pipeline"), list):
        sessions, flow = _decoder_pipeline(decoder)
    else:
        sessions, flow = {"decoder": _session(decoder)}, [{"run": "decoder", "when": "step"}]
    init = [{"run": name, "when": "init", **({"optional": True} if optional else {})}
            for name, optional in _ENCODERS if name in sections]
    state: dict[str, Any] = {"kv_cache": _kv_cache(decoder, search)}
    if "encoder" in sections:
        state["cross_cache"] = {"source": "encoder", "frozen": True}
    return {
        "version": 2,
        "pipeline": {
            "sessions": {**{name: _session(sec) for name, sec in sections.items()}, **sessions},
            "flow": init + flow,
            "dataflow": _renamed_wires({**sections, **{"decoder": decoder}}),
            "state": state,
        },
        "tokens": _tokens(model),
        "generation": _generation(search),
        "metadata": _metadata(model),
    }


def _decoder_pipeline(decoder: dict[str, Any]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """model.decoder.pipeline[]: stages that each run at every step, chained by forwarded names."""
    sessions, flow = {}, []
    for entry in decoder["pipeline"]:
        for name, stage in (entry or {}).items():
            if not (stage.get("run_on_prompt", True) and stage.get("run_on_token_gen", True)):
                raise ConfigError(f"genai_config.json (v1) decoder pipeline stage {name!r} runs only on the prompt "
                                  "or only on generated tokens; such split pipelines are not translated yet. "
                                  "Write the pipeline as a v2 config")
            sessions[name] = _session({**stage, "session_options": stage.get("session_options",
                                                                              decoder.get("session_options"))})
            flow.append({"run": name, "when": "step"})
    return sessions, flow


def _renamed_wires(sections: dict[str, dict[str, Any]]) -> list[dict[str, str]]:
    """v1 names a tensor by role ("encoder_hidden_states": "hidden_states"); where a producer's graph
    name differs from the consumer's, auto-matching by name cannot join them: wire them."""
    wires = []
    for src, sec in sections.items():
        for role, out_name in (sec.get("outputs") or {}).items():
            if not isinstance(out_name, str) or "%d" in out_name:
                continue
            for dst, other in sections.items():
                in_name = (other.get("inputs") or {}).get(role, role if dst != src else None)
                if dst != src and isinstance(in_name, str) and in_name != out_name and role in (other.get("inputs") or {}):
                    wires.append({"from": f"{src}.{out_name}", "to": f"{dst}.{in_name}"})
    return wires


def _session(decoder: dict[str, Any]) -> dict[str, Any]:
    options = dict(decoder.get("session_options") or {})
    provider_list = options.pop("provider_options", []) or []
    options.pop("log_id", None)
    session: dict[str, Any] = {"file": decoder.get("filename", "model.onnx"), "session_options": options}
    providers, provider_options = [], {}
    for entry in provider_list:
        for name, opts in (entry or {}).items():
            providers.append(name)
            provider_options[name] = opts
    if providers:
        session["execution_provider"] = providers + ["cpu"]
        session["provider_options"] = provider_options
    inputs, outputs = decoder.get("inputs") or {}, decoder.get("outputs") or {}
    session["inputs"] = {k: inputs[k] for k in _INPUT_ROLES if k in inputs}
    session["outputs"] = {k: outputs[k] for k in _OUTPUT_ROLES if k in outputs}
    return session


def _kv_cache(decoder: dict[str, Any], search: dict[str, Any]) -> dict[str, Any]:
    names = {**(decoder.get("inputs") or {}), **(decoder.get("outputs") or {})}
    kv: dict[str, Any] = {"format": "combined" if "past_names" in names else "auto"}
    for v1_key, v2_key in _KV_KEYS.items():
        if isinstance(names.get(v1_key), str):
            kv[v2_key] = names[v1_key].replace("%d", "{layer}")
    kv["share_buffer"] = bool(search.get("past_present_share_buffer", False))
    window = decoder.get("sliding_window")
    if isinstance(window, dict) and window.get("window_size"):
        kv["sliding_window"] = {"window_size": window["window_size"]}
        if window.get("layers") is not None:
            kv["sliding_window"]["layers"] = window["layers"]
    return kv


def _tokens(model: dict[str, Any]) -> dict[str, Any]:
    eos = model.get("eos_token_id", [])
    tokens: dict[str, Any] = {"eos": eos if isinstance(eos, list) else [eos]}
    for v1_key, v2_key in (("pad_token_id", "pad"), ("bos_token_id", "bos"),
                           ("decoder_start_token_id", "decoder_start"), ("image_token_id", "image_token")):
        if isinstance(model.get(v1_key), int):
            tokens[v2_key] = model[v1_key]
    return tokens


def _generation(search: dict[str, Any]) -> dict[str, Any]:
    gen: dict[str, Any] = {"sampling": {k: search[k] for k in _SEARCH_TO_SAMPLING if k in search}}
    if "random_seed" in search and isinstance(search["random_seed"], int) and search["random_seed"] >= 0:
        gen["sampling"]["seed"] = search["random_seed"]
    for key in ("max_length", "min_length", "num_beams", "length_penalty", "early_stopping",
                "num_return_sequences", "no_repeat_ngram_size"):
        if key in search:
            gen[key] = search[key]
    return gen


def _metadata(model: dict[str, Any]) -> dict[str, Any]:
    meta = {"model_type": model.get("type")}
    for key in ("context_length", "vocab_size"):
        if key in model:
            meta[key] = model[key]
    decoder = model["decoder"]
    for key in ("head_size", "hidden_size", "num_attention_heads", "num_hidden_layers", "num_key_value_heads"):
        if key in decoder:
            meta[key] = decoder[key]
    return meta
