"""Translate onnxruntime-genai's v1 genai_config.json (what its model builder writes) to v2.

`model.type` becomes metadata: it is never dispatched on, so an unknown type still runs. The v1
keys are checked against what onnxruntime-genai reads: a known key with a wrong type is a problem
(a ConfigError); an unknown key, or one ortpipe has no use for, is a note (a warning naming the
closest known key): configs written by newer builders keep loading.
"""

from __future__ import annotations

from typing import Any

from ..errors import ConfigError, Problems, did_you_mean
from ..jsonfile import quote
from .settings import SETTINGS, V1_OTHER_SEARCH_KEYS

# v1 decoder input/output keys that name a single tensor, kept as role maps on the session.
_INPUT_ROLES = ("input_ids", "attention_mask", "position_ids", "inputs_embeds")
_OUTPUT_ROLES = ("logits",)
_KV_KEYS = {
    "past_key_names": "past_key_pattern", "past_value_names": "past_value_pattern",
    "present_key_names": "present_key_pattern", "present_value_names": "present_value_pattern",
    "past_names": "past_pattern", "present_names": "present_pattern",
}
# Sections that become init sessions, in the order they run, and whether a request may omit their input.
_ENCODERS = (("vision", True), ("speech", True), ("encoder", False), ("embedding", False))

# What onnxruntime-genai reads, and the type of each: (type or types, whether ortpipe uses it).
_TOP = {"model": (dict, True), "search": (dict, True), "speculative": (dict, True)}
_MODEL = {
    "type": (str, True),
    "bos_token_id": (int, True),
    "eos_token_id": ((int, list), True),
    "pad_token_id": (int, True),
    "decoder_start_token_id": (int, True),
    "image_token_id": (int, True),
    "context_length": (int, True),
    "vocab_size": (int, True),
    "sep_token_id": (int, False),
    "video_token_id": (int, False),
    "vision_start_token_id": (int, False),
    "decoder": (dict, True),
    "encoder": (dict, True),
    "embedding": (dict, True),
    "vision": (dict, True),
    "speech": (dict, True),
}
_SECTION = {
    "filename": (str, True),
    "session_options": (dict, True),
    "inputs": (dict, True),
    "outputs": (dict, True),
    "head_size": (int, True),
    "hidden_size": (int, True),
    "num_attention_heads": (int, True),
    "num_hidden_layers": (int, True),
    "num_key_value_heads": (int, True),
    "sliding_window": (dict, True),
    "pipeline": (list, True),
    "run_options": (dict, False),
    "config_filename": (str, False),
    "adapter_filename": (str, False),
    "spatial_merge_size": (int, False),
}
# sliding_window keys besides window_size and layers describe onnxruntime-genai's own cache
# mechanics (slack, alignment), which ortpipe derives from the graph: known, not used.
_SLIDING = {
    "window_size": (int, True),
    "layers": (list, True),
    "cache_slack": (int, True),
    "slide_inputs": (bool, True),
    "slide_key_value_cache": (bool, True),
    "alignment": (str, True),
}
# the v1 session_options that carry over to v2 as they are (names and values: config/ep.py's table)
_SESSION_OPTIONS = ("intra_op_num_threads", "inter_op_num_threads", "enable_cpu_mem_arena",
                    "enable_mem_pattern", "graph_optimization_level", "config_entries")
_SESSION_KEYS = {
    "log_id": (str, True),
    "provider_options": (list, True),
    "log_severity_level": (int, False),
    "ep_context_enable": (bool, False),
    "ep_context_embed_mode": (bool, False),
    "ep_context_file_path": (str, False),
    "custom_ops_library": (str, False),
    "disable_cpu_ep_fallback": (bool, False),
    "disable_quant_qdq": (bool, False),
    "enable_quant_qdq_cleanup": (bool, False),
    "use_env_allocators": (bool, False),
    "enable_profiling": (str, False),
    **{
        k: (
            (
                dict
                if k == "config_entries"
                else str
                if k == "graph_optimization_level"
                else bool
                if k.startswith("enable")
                else int
            ),
            True,
        )
        for k in _SESSION_OPTIONS
    },
}
def _v1_keys(block: str) -> dict[str, tuple[Any, bool]]:
    """The settings table's v1 keys of `block`: "search", or a top-level block ("speculative")."""
    keys = {}
    for s in SETTINGS:
        head, _, key = (s.v1 or "").rpartition(".")
        if s.v1 and (head or "search") == block:
            keys[key] = ((bool if s.kind == "bool" else int if s.kind == "int" else (int, float)), True)
    return keys


_SEARCH = {**_v1_keys("search"), **{k: ((bool, int, float), k != "batch_size") for k in V1_OTHER_SEARCH_KEYS}}
# onnxruntime-genai's speculative decoding block; its n-gram chaining, adaptive floor and cooldown
# are its own tuning (ortpipe adapts the draft length its own way): known, not used.
_SPECULATIVE = {**_v1_keys("speculative"), "ngram_chained_lookup": (bool, False),
                "min_adaptive_k": (int, False), "cooldown": (bool, False)}


def is_v1(raw: Any) -> bool:
    return isinstance(raw, dict) and "version" not in raw and "model" in raw


def translate(raw: dict[str, Any]) -> tuple[dict[str, Any], tuple[str, ...]]:
    """(the v2 mapping, notes for the user); a ConfigError lists every mistyped key."""
    problems, notes = Problems(), []
    _check(raw, _TOP, "genai_config.json", problems, notes)
    model = raw.get("model")
    if not isinstance(model, dict) or not isinstance(model.get("decoder"), dict):
        raise ConfigError(
            'genai_config.json (v1) needs a "model.decoder" object with at least '
            '"filename"; or write a v2 config ("version": 2)'
        )
    _check(model, _MODEL, "model", problems, notes)
    decoder = model["decoder"]
    search = raw.get("search") if isinstance(raw.get("search"), dict) else {}
    _check(search, _SEARCH, "search", problems, notes)
    speculative = raw.get("speculative") if isinstance(raw.get("speculative"), dict) else {}
    _check(speculative, _SPECULATIVE, "speculative", problems, notes)
    if search.get("diversity_penalty", 0) not in (0, 0.0, None):
        problems.add(
            "search.diversity_penalty asks for group beam search, which ortpipe does not run; set it to 0"
        )
    sections = {name: model[name] for name, _ in _ENCODERS if isinstance(model.get(name), dict)}
    for name, sec in {**sections, "decoder": decoder}.items():
        _check(sec, _SECTION, f"model.{name}", problems, notes)
        if isinstance(sec.get("session_options"), dict):
            _check(sec["session_options"], _SESSION_KEYS, f"model.{name}.session_options", problems, notes)
        if isinstance(sec.get("sliding_window"), dict):
            _check(sec["sliding_window"], _SLIDING, f"model.{name}.sliding_window", problems, notes)
    problems.raise_if_any()
    if isinstance(decoder.get("pipeline"), list):
        sessions, flow = _decoder_pipeline(decoder)
    else:
        sessions, flow = {"decoder": _session(decoder)}, [{"run": "decoder", "when": "step"}]
    init = [
        {"run": name, "when": "init", **({"optional": True} if optional else {})}
        for name, optional in _ENCODERS
        if name in sections
    ]
    state: dict[str, Any] = {"kv_cache": _kv_cache(decoder, search)}
    if "encoder" in sections:
        state["cross_cache"] = {"source": "encoder", "frozen": True}
    v2 = {
        "version": 2,
        "pipeline": {
            "sessions": {**{name: _session(sec) for name, sec in sections.items()}, **sessions},
            "flow": init + flow,
            "dataflow": _renamed_wires({**sections, **{"decoder": decoder}}),
            "state": state,
        },
        "tokens": _tokens(model),
        "generation": _generation(search, speculative),
        "metadata": _metadata(model),
    }
    return v2, tuple(notes)


def _check(
    section: dict[str, Any],
    known: dict[str, tuple[Any, bool]],
    path: str,
    problems: Problems,
    notes: list[str],
) -> None:
    for key, value in section.items():
        if key not in known:
            notes.append(
                f'genai_config.json: unknown key "{quote(key)[1:-1]}" in {path}, not used.'
                f"{did_you_mean(key, known)}"
            )
            continue
        kind, used = known[key]
        if value is None:
            continue  # onnxruntime-genai writes null for an unset id
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            problems.add(f"genai_config.json: {path}.{key} has the wrong type: {quote(value)}")
        elif not used and value not in (False, 0, "", [], {}):
            notes.append(
                f"genai_config.json: {path}.{key} is an onnxruntime-genai setting that ortpipe does not apply"
            )


def _decoder_pipeline(decoder: dict[str, Any]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """model.decoder.pipeline[]: stages that each run at every step, chained by forwarded names."""
    sessions, flow = {}, []
    for entry in decoder["pipeline"]:
        if not isinstance(entry, dict):
            raise ConfigError(
                f"genai_config.json: model.decoder.pipeline holds objects, found {quote(entry)}"
            )
        for name, stage in entry.items():
            if not isinstance(stage, dict):
                raise ConfigError(
                    f"genai_config.json: model.decoder.pipeline stage {quote(name)} must be an object"
                )
            if not (stage.get("run_on_prompt", True) and stage.get("run_on_token_gen", True)):
                raise ConfigError(
                    f"genai_config.json (v1) decoder pipeline stage {name!r} runs only on the prompt "
                    "or only on generated tokens; such split pipelines are not translated yet. "
                    "Write the pipeline as a v2 config"
                )
            sessions[name] = _session(
                {**stage, "session_options": stage.get("session_options", decoder.get("session_options"))}
            )
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
                if (
                    dst != src
                    and isinstance(in_name, str)
                    and in_name != out_name
                    and role in (other.get("inputs") or {})
                ):
                    wires.append({"from": f"{src}.{out_name}", "to": f"{dst}.{in_name}"})
    return wires


def _session(section: dict[str, Any]) -> dict[str, Any]:
    v1_options = section.get("session_options") or {}
    options = {k: v1_options[k] for k in _SESSION_OPTIONS if v1_options.get(k) is not None}
    session: dict[str, Any] = {"file": section.get("filename", "model.onnx"), "session_options": options}
    providers, provider_options = [], {}
    for entry in v1_options.get("provider_options") or []:
        if not isinstance(entry, dict):
            raise ConfigError(
                f"genai_config.json: session_options.provider_options holds objects like "
                f'{{"cuda": {{}}}}, found {quote(entry)}'
            )
        for name, opts in entry.items():
            providers.append(name)
            provider_options[name] = opts if isinstance(opts, dict) else {}
    if providers:
        session["execution_provider"] = providers + ["cpu"]
        session["provider_options"] = provider_options
    inputs, outputs = section.get("inputs") or {}, section.get("outputs") or {}
    session["inputs"] = {k: inputs[k] for k in _INPUT_ROLES if isinstance(inputs.get(k), str)}
    session["outputs"] = {k: outputs[k] for k in _OUTPUT_ROLES if isinstance(outputs.get(k), str)}
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
    eos = model.get("eos_token_id")
    tokens: dict[str, Any] = {"eos": [] if eos is None else eos if isinstance(eos, list) else [eos]}
    for v1_key, v2_key in (
        ("pad_token_id", "pad"),
        ("bos_token_id", "bos"),
        ("decoder_start_token_id", "decoder_start"),
        ("image_token_id", "image_token"),
    ):
        if isinstance(model.get(v1_key), int) and model[v1_key] >= 0:
            tokens[v2_key] = model[v1_key]
    return tokens


def _generation(search: dict[str, Any], speculative: dict[str, Any]) -> dict[str, Any]:
    gen: dict[str, Any] = {}
    for s in SETTINGS:
        block, _, v1_key = (s.v1 or "").rpartition(".")
        section = speculative if block == "speculative" else search
        if s.v1 is None or s.v2 is None or section.get(v1_key) is None:
            continue
        value = section[v1_key]
        if s.name == "seed" and value < 0:
            continue  # onnxruntime-genai's random_seed -1: a fresh seed per run, ortpipe's default
        head, _, key = s.v2.rpartition(".")
        (gen.setdefault(head, {}) if head else gen)[key] = value
    return gen


def _metadata(model: dict[str, Any]) -> dict[str, Any]:
    meta = {"model_type": model.get("type")}
    for key in ("context_length", "vocab_size"):
        if key in model:
            meta[key] = model[key]
    decoder = model["decoder"]
    for key in (
        "head_size",
        "hidden_size",
        "num_attention_heads",
        "num_hidden_layers",
        "num_key_value_heads",
    ):
        if key in decoder:
            meta[key] = decoder[key]
    return meta
