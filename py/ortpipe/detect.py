"""Structural detection: a v2 config for a folder that has no genai_config.json.

Covers the Optimum and transformers.js export layout (`model.onnx` beside `config.json`,
`generation_config.json`, `tokenizer.json`), with any of its variants (`onnx/model_q4.onnx`, ...;
variants.py) and the dtype transformers.js_config in config.json names. What the graph is
(decoder, KV layout, layers) is read from its signature by `plan`; here we only find the file
and the special tokens.

Three layouts run loops that make no tokens (docs/pipelines.md): optimum's diffusers export
(`model_index.json`, `text_encoder/`, `unet/`, `vae_decoder/`, `scheduler/`, `tokenizer/`: denoising), a
sentence-transformers folder (`modules.json`, `1_Pooling/config.json`, an ONNX export: single_pass, pooled
embeddings) a transformers.js-style speech folder (`config.json` with `sampling_rate`, an ONNX graph
giving `waveform`: single_pass, audio). A folder of the decoder layout whose graph is an encoder
(`last_hidden_state`, no `logits`; model.py reads it before opening its session) becomes embeddings,
mean-pooled (`encoder_embeddings`). An optimum MusicGen export (`text_encoder.onnx`,
`decoder_model_merged.onnx`, `encodec_decode.onnx`) runs the autoregressive loop over codebooks with a final
audio decoder. Tensor names are optimum's; the plan checks them against the graphs.
"""

from __future__ import annotations

import json
from typing import Any

from . import variants
from .errors import ConfigError
from .folder import Folder
from .jsonfile import optional_json, read_json

DECODER_FILES = (
    "model.onnx", "decoder_model_merged.onnx", "decoder_model.onnx",
    "onnx/model.onnx", "onnx/decoder_model_merged.onnx", "onnx/decoder_model.onnx",
)
_LENGTH_KEYS = ("max_position_embeddings", "n_positions", "n_ctx", "max_sequence_length")


def detect_config(folder: Folder) -> dict[str, Any]:
    for layout in (_diffusers, _sentence_transformers, _musicgen, _seq2seq, _speech):
        raw = layout(folder)
        if raw is not None:
            return raw
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
    _generation(folder, gen, raw)
    return raw


# what transformers' generate samples with when generation_config.json leaves a key out (its
# GenerationConfig defaults: top_k 50, not off)
_TRANSFORMERS_SAMPLING = {"temperature": 1.0, "top_k": 50, "top_p": 1.0, "min_p": None}


def _sampling(folder: Folder, gen: dict[str, Any], keys: tuple[str, ...]) -> dict[str, Any]:
    """generation.sampling as transformers' generate reads generation_config.json: with do_sample true, the
    temperature, top_k, top_p and min_p it gives or transformers' defaults; a repetition_penalty always (a
    logits processor of greedy search too). A value ortpipe refuses is a ConfigError naming the file's key."""
    from .config.settings import BY_NAME  # not at the top: the config package imports this module

    out: dict[str, Any] = {}
    samples = gen.get("do_sample") is True
    for key in ("do_sample", *keys):
        if key == "do_sample":
            value = True if samples else None
        elif key == "repetition_penalty":
            value = gen.get(key) if gen.get(key) != 1.0 else None
        else:
            value = gen.get(key, _TRANSFORMERS_SAMPLING[key]) if samples else None
        if value is None:
            continue
        checked, problem = BY_NAME[key].check(value)
        if problem:
            raise ConfigError(
                f"{folder.describe('generation_config.json')}: {key} {problem}; fix it there, or "
                "give the model a genai_config.json"
            )
        out[key] = checked
    return out


# generation_config.json's keys that transformers' generate applies and ortpipe's settings of the same name
# read (generation.KEY): beam search, bans and minimum lengths
_SEARCH_KEYS = ("num_beams", "length_penalty", "early_stopping", "num_return_sequences",
                "no_repeat_ngram_size", "min_length", "min_new_tokens", "suppress_tokens",
                "begin_suppress_tokens", "prompt_lookup_num_tokens", "forced_bos_token_id",
                "forced_eos_token_id", "renormalize_logits")
# keys that change transformers' tokens and that ortpipe does not apply, each with the values that change
# nothing (a folder that sets another is loaded with a warning naming the key, not silently)
_NOT_APPLIED: dict[str, tuple[Any, ...]] = {
    "typical_p": (1.0,), "epsilon_cutoff": (0.0,), "eta_cutoff": (0.0,), "diversity_penalty": (0.0,),
    "num_beam_groups": (1,), "penalty_alpha": (None,), "encoder_repetition_penalty": (1.0,),
    "encoder_no_repeat_ngram_size": (0,), "exponential_decay_length_penalty": (None,),
    "sequence_bias": (None, []), "force_words_ids": (None, []), "constraints": (None, []),
    "guidance_scale": (None, 1), "max_new_tokens": (None,), "max_time": (None,), "top_h": (None,),
    "dola_layers": (None,), "watermarking_config": (None,), "token_healing": (False,),
}


def _generation(folder: Folder, gen: dict[str, Any], raw: dict[str, Any]) -> None:
    """generation's settings from generation_config.json, as transformers' generate applies them: sampling
    (`_sampling`), beam search, bans (`suppress_tokens`, `begin_suppress_tokens`, one-id `bad_words_ids`),
    minimum lengths, `stop_strings`, and a `max_length` below the position table's. A key that changes
    transformers' tokens and that ortpipe does not apply becomes a note (a warning at load)."""
    from .config.settings import BY_NAME  # not at the top: the config package imports this module

    out = raw["generation"]
    sampling = _sampling(folder, gen, ("temperature", "top_k", "top_p", "min_p", "repetition_penalty"))
    if sampling:
        out["sampling"] = sampling
    given, notes = _search_keys(gen)
    for key, value in given.items():
        checked, problem = BY_NAME[key].check(value)
        if problem:
            raise ConfigError(f"{folder.describe('generation_config.json')}: {key} {problem}; fix it there, "
                              "or give the model a genai_config.json")
        if checked != BY_NAME[key].default:
            out[key] = checked
    most = gen.get("max_length")
    if _count(most) and (out.get("max_length") is None or most < out["max_length"]):
        out["max_length"] = most
    for key, nothing in _NOT_APPLIED.items():
        if key in gen and gen[key] not in nothing:
            notes.append(_not_applied(key, gen[key]))
    if notes:
        raw["metadata"]["notes"] = notes


def _search_keys(gen: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """The search keys of generation_config.json as ortpipe's settings (unchecked), and notes on the parts
    that are not applied: bad_words_ids of several tokens, early_stopping "never"."""
    given = {k: gen[k] for k in _SEARCH_KEYS if gen.get(k) is not None}
    notes = []
    bad = gen.get("bad_words_ids")
    if isinstance(bad, list) and bad:
        single = [w[0] for w in bad if isinstance(w, list) and len(w) == 1]
        longer = [w for w in bad if not (isinstance(w, list) and len(w) == 1)]
        if longer:
            notes.append(_not_applied("bad_words_ids", longer, "(only its one-token entries are banned)"))
        if single:
            given["suppress_tokens"] = [*(given.get("suppress_tokens") or []), *single]
    if given.get("early_stopping") == "never":  # transformers' exhaustive beam search
        notes.append(_not_applied("early_stopping", "never", "(beam search stops when no beam can improve)"))
        del given["early_stopping"]
    if gen.get("stop_strings") is not None:
        given["stop"] = gen["stop_strings"]
    ends = given.get("forced_eos_token_id")
    if isinstance(ends, list):  # several ids: transformers forces one of them, which ortpipe does not
        if len(ends) > 1:
            notes.append(_not_applied("forced_eos_token_id", ends, "(one id is forced, not a list)"))
            del given["forced_eos_token_id"]
        else:
            given["forced_eos_token_id"] = ends[0] if ends else None
    return given, notes


def _not_applied(key: str, value: Any, why: str = "") -> str:
    shown = json.dumps(value)
    shown = shown if len(shown) <= 60 else shown[:57] + "..."
    return (f"generation_config.json sets {key} {shown}, which ortpipe does not apply"
            f"{' ' + why if why else ''}: its tokens may differ from transformers' generate")


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


DIFFUSERS_PARTS = {
    "text_encoder": "text_encoder/model.onnx",
    "unet": "unet/model.onnx",
    "vae_decoder": "vae_decoder/model.onnx",
}
VAE_ENCODER = "vae_encoder/model.onnx"  # optimum's export of the VAE's encoder (image-to-image)
GRAPH_FILES = ("onnx/model.onnx", "model.onnx")


def _diffusers(folder: Folder) -> dict[str, Any] | None:
    """optimum's export of a StableDiffusionPipeline: text encoder (init), UNet (step), VAE decoder
    (final); of a StableDiffusionXLPipeline: two text encoders, each with its tokenizer, whose penultimate
    states are joined for the UNet, the second's pooled projection and the loop's size conditioning beside."""
    if not folder.exists("model_index.json"):
        return None
    index = optional_json(folder, "model_index.json")
    kind = index.get("_class_name", "a diffusers pipeline")
    xl = _part(index, "text_encoder_2")
    sd3 = _part(index, "text_encoder_3") or _class(index, "transformer") == SD3
    if _part(index, "transformer") and sd3:
        return _sd3(folder, index, kind)
    other = [part for part in ("transformer", "prior", "decoder", "image_encoder") if _part(index, part)]
    if other or (xl and not _part(index, "text_encoder")):
        found = ", ".join(other) or "text_encoder_2 without text_encoder (a refiner)"
        raise ConfigError(
            f"{folder.describe('model_index.json')} is {kind}, with {found}: ortpipe detects "
            "StableDiffusionPipeline-style folders (text_encoder, unet, vae_decoder), "
            "StableDiffusionXLPipeline ones (text_encoder and text_encoder_2 beside them) and "
            "StableDiffusion3Pipeline ones (an SD3Transformer2DModel, with or without text_encoder_3); "
            "write a genai_config.json for this one"
        )
    parts = {**DIFFUSERS_PARTS, **({"text_encoder_2": "text_encoder_2/model.onnx"} if xl else {})}
    sessions = _exported(folder, parts, kind)
    flow = [{"run": "text_encoder", "when": "init"}, *_vae_encoder(folder, sessions)]
    wires = [{"from": "text_encoder.last_hidden_state", "to": "unet.encoder_hidden_states"}]
    generation: dict[str, Any] = {"loop": "denoising"}
    if xl:
        sessions["text_encoder_2"]["tokenizer"] = "tokenizer_2"
        flow.append({"run": "text_encoder_2", "when": "init"})
        wires = [
            # diffusers' hidden_states[-2] of each encoder (clip_skip unset), side by side
            {"from": [_penultimate(folder, "text_encoder"), _penultimate(folder, "text_encoder_2")],
             "to": "unet.encoder_hidden_states"},
            {"from": "text_encoder_2.text_embeds", "to": "unet.text_embeds"},
        ]
        zeros = index.get("force_zeros_for_empty_prompt", True)  # the pipeline's default
        generation.update(guidance_scale=5.0, force_zeros_for_empty_prompt=zeros is True)
    if kind == "LatentConsistencyModelPipeline":  # its defaults; its UNet takes the guidance embedded
        generation.update(guidance_scale=8.5, num_steps=4)
    return {
        "version": 2,
        "pipeline": {
            "sessions": sessions,
            "flow": [*flow, {"run": "unet", "when": "step"}, {"run": "vae_decoder", "when": "final"}],
            "dataflow": [*wires, {"from": "unet.out_sample", "to": "vae_decoder.latent_sample"}],
            "output": {"session": "vae_decoder", "name": "sample", "as": "image"},
            "preprocessing": {"text": {"tokenizer": "tokenizer"}},
        },
        "generation": generation,
        "metadata": {"model_type": kind, "detected_from": "model_index.json"},
    }


SD3_PARTS = {
    "text_encoder": "text_encoder/model.onnx",
    "text_encoder_2": "text_encoder_2/model.onnx",
    "text_encoder_3": "text_encoder_3/model.onnx",
    "transformer": "transformer/model.onnx",
    "vae_decoder": "vae_decoder/model.onnx",
}
T5_LENGTH = 256  # StableDiffusion3Pipeline's max_sequence_length
SD3 = "SD3Transformer2DModel"


def _vae_encoder(folder: Folder, sessions: dict[str, Any]) -> list[dict[str, Any]]:
    """optimum's VAE encoder, when the folder has one: a session whose output is the latent distribution
    (image-to-image's), and its optional init step (run on the request's image, when it gives one)."""
    if not folder.exists(VAE_ENCODER):
        return []
    sessions["vae_encoder"] = {"file": VAE_ENCODER, "outputs": {"latent_parameters": "latent_parameters"}}
    return [{"run": "vae_encoder", "when": "init", "optional": True}]


def _sd3(folder: Folder, index: dict[str, Any], kind: Any) -> dict[str, Any]:
    """optimum's export of a StableDiffusion3Pipeline: three text encoders, each with its tokenizer (T5's
    rows 256 ids long), the CLIP encoders' penultimate states side by side, zero-padded to T5's width, then
    T5's states after them along the sequence; their pooled projections side by side; the transformer's
    steps; the VAE (its latents unscaled and shifted). A pipeline saved without T5 (text_encoder_3=None, as
    diffusers' docs show to save memory) has 256 rows of zeros in place of T5's states, as the pipeline
    makes them, as wide as the transformer's joint attention."""
    t5 = _part(index, "text_encoder_3")
    parts = SD3_PARTS if t5 else {k: v for k, v in SD3_PARTS.items() if k != "text_encoder_3"}
    sessions = _exported(folder, parts, kind)
    sessions["text_encoder_2"]["tokenizer"] = "tokenizer_2"
    encoders = tuple(parts)[: 3 if t5 else 2]  # the text encoders, in the pipeline's order
    if t5:
        sessions["text_encoder_3"].update(tokenizer="tokenizer_3", max_length=T5_LENGTH)
    sessions["transformer"]["inputs"] = {"sample": "hidden_states"}
    clip = [_penultimate(folder, "text_encoder"), _penultimate(folder, "text_encoder_2")]
    return {
        "version": 2,
        "pipeline": {
            "sessions": sessions,
            "flow": [*({"run": name, "when": "init"} for name in encoders),
                     *_vae_encoder(folder, sessions),
                     {"run": "transformer", "when": "step"}, {"run": "vae_decoder", "when": "final"}],
            "dataflow": [
                {"from": [clip, "text_encoder_3.last_hidden_state" if t5 else {"zeros": T5_LENGTH}],
                 "to": "transformer.encoder_hidden_states"},
                {"from": ["text_encoder.text_embeds", "text_encoder_2.text_embeds"],
                 "to": "transformer.pooled_projections"},
                {"from": "transformer.out_hidden_states", "to": "vae_decoder.latent_sample"},
            ],
            "output": {"session": "vae_decoder", "name": "sample", "as": "image"},
            "preprocessing": {"text": {"tokenizer": "tokenizer"}},
        },
        # StableDiffusion3Pipeline's defaults; its image-to-image and inpainting pipelines' strength
        "generation": {"loop": "denoising", "num_steps": 28, "guidance_scale": 7.0, "strength": 0.6},
        "metadata": {"model_type": kind, "detected_from": "model_index.json"},
    }


def _exported(folder: Folder, parts: dict[str, str], kind: Any) -> dict[str, Any]:
    """A session per part ({"file": its graph}); a ConfigError naming the graphs optimum's export would have
    written and the folder lacks."""
    missing = [file for file in parts.values() if not folder.exists(file)]
    if missing:
        raise ConfigError(
            f"{folder.describe()} has model_index.json ({kind}) but not {', '.join(missing)}: export the "
            "pipeline with optimum (optimum-cli export onnx --task text-to-image)"
        )
    return {name: {"file": file} for name, file in parts.items()}


def _class(index: dict[str, Any], name: str) -> Any:
    """The class model_index.json names for a component (["diffusers", "SD3Transformer2DModel"])."""
    value = index.get(name)
    return value[1] if isinstance(value, list) and len(value) == 2 else None


def _part(index: dict[str, Any], name: str) -> bool:
    """Whether model_index.json lists a component (diffusers writes [null, null] for one left out)."""
    value = index.get(name)
    return isinstance(value, list) and any(v is not None for v in value)


def _penultimate(folder: Folder, encoder: str) -> str:
    """The output of a text encoder's last layer but one: optimum's `hidden_states.N` of a CLIP text model
    exported with its hidden states, N = num_hidden_layers - 1 from its config.json."""
    file = f"{encoder}/config.json"
    layers = optional_json(folder, file).get("num_hidden_layers")
    if not isinstance(layers, int) or isinstance(layers, bool) or layers < 1:
        raise ConfigError(
            f"{folder.describe(file)} gives no num_hidden_layers: the pipeline reads {encoder}'s last layer "
            "but one (hidden_states.N); write a genai_config.json naming it"
        )
    return f"{encoder}.hidden_states.{layers - 1}"


# sentence-transformers' pooling modes (1_Pooling/config.json), current names and legacy flags
POOLING = {
    "mean": "mean",
    "cls": "cls",
    "max": "max",
    "lasttoken": "lasttoken",
    "mean_tokens": "mean",
    "cls_token": "cls",
    "max_tokens": "max",
}
ST_MODULES = ("Transformer", "Pooling", "Normalize")


def _sentence_transformers(folder: Folder) -> dict[str, Any] | None:
    """A sentence-transformers folder: its Transformer's ONNX export, then Pooling and Normalize as
    kernels."""
    if not folder.exists("modules.json"):
        return None
    modules = read_json(folder, "modules.json", list)
    types = {str(m.get("type", "")).rsplit(".", 1)[-1]: m for m in modules if isinstance(m, dict)}
    other = [f"{t} ({m.get('path')})" for t, m in types.items() if t not in ST_MODULES]
    if other or "Pooling" not in types:
        raise ConfigError(
            f"{folder.describe('modules.json')} has the modules {', '.join(types)}: ortpipe "
            f"runs "
            f"{', '.join(ST_MODULES)} (Pooling required)"
        )
    file = next((f for f in GRAPH_FILES if folder.exists(f)), None)
    if file is None:
        raise ConfigError(
            f"{folder.describe()} is a sentence-transformers folder without an ONNX graph "
            f"(looked for "
            f"{', '.join(GRAPH_FILES)}): export its Transformer with optimum "
            f"(feature-extraction)"
        )
    pooling_file = f"{types['Pooling'].get('path') or '1_Pooling'}/config.json"
    pooling = _pooling_mode(read_json(folder, pooling_file), folder.describe(pooling_file))
    length = optional_json(folder, "sentence_bert_config.json").get("max_seq_length")
    return _embeddings({"file": file}, pooling, "Normalize" in types, "sentence-transformers", "modules.json",
                       length if isinstance(length, int) and length > 0 else None)


def _embeddings(session: dict[str, Any], pooling: str, normalize: bool, model_type: Any, detected_from: str,
                max_length: int | None = None) -> dict[str, Any]:
    text: dict[str, Any] = {"max_length": max_length} if max_length else {}
    return {
        "version": 2,
        "pipeline": {
            "sessions": {"encoder": session},
            "flow": [{"run": "encoder", "when": "init"}],
            "output": {
                "session": "encoder",
                "name": "last_hidden_state",
                "as": "embedding",
                "pooling": pooling,
                "normalize": normalize,
            },
            **({"preprocessing": {"text": text}} if text else {}),
        },
        "generation": {"loop": "single_pass"},
        "metadata": {"model_type": model_type, "detected_from": detected_from},
    }


def encoder_embeddings(raw: dict[str, Any], outputs: list[str], inputs: list[str]) -> dict[str, Any] | None:
    """The detected decoder config `raw` of a folder whose graph turns out to be an encoder (a
    `last_hidden_state` output, no `logits`, no past inputs: transformers.js's and optimum's
    feature-extraction exports, with no modules.json): embeddings, mean-pooled and not normalised, as
    sentence-transformers makes of a plain transformers model. Else None."""
    if "last_hidden_state" not in outputs or "logits" in outputs or any(n.startswith("past") for n in inputs):
        return None
    session = raw["pipeline"]["sessions"]["decoder"]
    metadata = raw.get("metadata", {})
    return _embeddings(session, "mean", False, metadata.get("model_type"),
                       f"{metadata.get('detected_from')} (an encoder: last_hidden_state, no logits)")


def _pooling_mode(config: dict[str, Any], where: str) -> str:
    """The one pooling mode of a Pooling config: `pooling_mode` (sentence-transformers 6) or its legacy
    flags."""
    mode = config.get("pooling_mode")
    modes = (
        [mode]
        if isinstance(mode, str)
        else [
            k.removeprefix("pooling_mode_")
            for k, v in config.items()
            if k.startswith("pooling_mode_") and v is True
        ]
    )
    if len(modes) != 1 or modes[0] not in POOLING:
        raise ConfigError(
            f"{where} pools by {', '.join(modes) or 'nothing'}: ortpipe pools by one of "
            "mean, cls, max, lasttoken"
        )
    if config.get("include_prompt", True) is not True:
        raise ConfigError(
            f"{where} sets include_prompt false (the prompt's tokens left out of the pooling), "
            f"which "
            "ortpipe does not run"
        )
    return POOLING[modes[0]]


def _speech(folder: Folder) -> dict[str, Any] | None:
    """A transformers.js-style text-to-speech folder (VITS, MMS-TTS): config.json's sampling_rate and one
    graph from token ids to a waveform."""
    hf = optional_json(folder, "config.json")
    rate = hf.get("sampling_rate")
    file = next((f for f in GRAPH_FILES if folder.exists(f)), None)
    if not isinstance(rate, int) or isinstance(rate, bool) or rate <= 0 or file is None:
        return None
    return {
        "version": 2,
        "pipeline": {
            "sessions": {"model": {"file": file}},
            "flow": [{"run": "model", "when": "init"}],
            "output": {"session": "model", "name": "waveform", "as": "audio", "sampling_rate": rate},
        },
        "generation": {"loop": "single_pass"},
        "metadata": {"model_type": hf.get("model_type"), "detected_from": "config.json"},
    }


SEQ2SEQ_PARTS = {"encoder": "encoder_model.onnx", "decoder": "decoder_model_merged.onnx"}
UNMERGED = ("decoder_model.onnx", "decoder_with_past_model.onnx")


def _seq2seq(folder: Folder) -> dict[str, Any] | None:
    """optimum's encoder-decoder export, as transformers.js runs it (in the folder or onnx/): the encoder
    once (init) on the prompt's text (T5, BART, Marian) or on audio features (Whisper), the merged decoder
    step by step from decoder_start_token_id, its cross-attention cache taken from its first run. What the
    encoder reads is the graph's: the plan feeds `input_ids` from the prompt, `input_features` from audio."""
    encoder = SEQ2SEQ_PARTS["encoder"]
    base = next((b for b in ("", "onnx/") if variants.present(folder, b + encoder)), None)
    if base is None:
        return None
    decoder = base + SEQ2SEQ_PARTS["decoder"]
    if not variants.present(folder, decoder):
        split = [base + f for f in UNMERGED if variants.present(folder, base + f)]
        found = f"has {base}{encoder}{''.join(', ' + f for f in split)} but no {decoder}"
        raise ConfigError(
            f"{folder.describe()} {found}: ortpipe runs an encoder-decoder's merged decoder (one graph for "
            "the first step and the steps with a cache). Export with optimum's exporter, which writes it, or "
            "merge the two decoders with optimum.onnx.merge_decoders into decoder_model_merged.onnx"
        )
    hf = optional_json(folder, "config.json")
    gen = optional_json(folder, "generation_config.json")
    sessions: dict[str, Any] = {}
    for name, file in (("encoder", base + encoder), ("decoder", decoder)):
        sessions[name] = {"file": file}
        dtype = _transformers_js_dtype(hf, file)
        if dtype is not None:
            sessions[name]["dtype"] = dtype
    tokens = _tokens(gen, hf)
    if "decoder_start" in tokens:
        tokens.update(_decoder_prompt(gen, tokens["decoder_start"]))
    raw: dict[str, Any] = {
        "version": 2,
        "pipeline": {
            "extends": "encoder-decoder",
            "sessions": sessions,
            "dataflow": [{"from": "encoder.last_hidden_state", "to": "decoder.encoder_hidden_states"}],
        },
        "tokens": tokens,
        "generation": {},
        "metadata": {"model_type": hf.get("model_type"), "detected_from": decoder},
    }
    # learned position tables: the decoder's (Whisper's max_target_positions; BART's and Marian's shared
    # max_position_embeddings) bounds the length, the encoder's the prompt; T5's relative positions neither
    positions = next((hf[k] for k in ("max_target_positions", "max_position_embeddings")
                      if _count(hf.get(k))), None)
    if positions and hf.get("model_type") != "t5":
        raw["generation"]["max_length"] = positions
    source = hf.get("max_position_embeddings")
    if _count(source) and "max_source_positions" not in hf and hf.get("model_type") != "t5":
        raw["pipeline"]["preprocessing"] = {"text": {"max_length": source}}
    _generation(folder, gen, raw)
    return raw


def _decoder_prompt(gen: dict[str, Any], start: int) -> dict[str, Any]:
    """tokens.decoder_start (and languages, tasks) as transformers' generate starts an encoder-decoder's
    decoder from generation_config.json: the start token, then `forced_decoder_ids`' ids from index 1 on as
    long as their indices follow each other (Whisper's language, task and no-timestamps tokens). With
    `lang_to_id`, a language not forced (a null there, or nothing after the start token) is the model's to
    choose among those (None, filled per request); without it, a null is left out. `no_timestamps_token_id`
    ends the ids unless `return_timestamps`."""
    forced = _forced(gen)
    languages = _names(gen.get("lang_to_id"))
    if languages and (not forced or forced[0] is None):
        forced = [None, *forced[1:]]
    forced = [i for i in forced if i is not None or languages]
    quiet = gen.get("no_timestamps_token_id")
    if _id(quiet) and gen.get("return_timestamps") is not True and forced[-1:] != [quiet]:
        forced.append(quiet)
    out: dict[str, Any] = {"decoder_start": [start, *forced]} if forced else {}
    tasks = _names(gen.get("task_to_id"))
    for key, named in (("languages", languages), ("tasks", tasks)):
        if named:
            out[key] = named
    return out


def _forced(gen: dict[str, Any]) -> list[int | None]:
    """The ids generation_config.json forces right after the decoder's start token: `forced_decoder_ids`'
    pairs [index, id] from index 1 on, as long as their indices follow each other (an id, or None: the
    model's choice). (`forced_bos_token_id` is no start id: transformers forces it as the first generated
    token, the setting of that name.)"""
    pairs = gen.get("forced_decoder_ids")
    ids: list[int | None] = []
    if isinstance(pairs, list):
        at = {p[0]: p[1] for p in pairs if isinstance(p, list) and len(p) == 2 and isinstance(p[0], int)
              and (p[1] is None or _id(p[1]))}
        while len(ids) + 1 in at:
            ids.append(at[len(ids) + 1])
    return ids


def _names(value: Any) -> dict[str, int]:
    """lang_to_id or task_to_id as {name: id}: Whisper's "<|en|>" keys as "en"; {} unless every entry is a
    name and an id."""
    if not isinstance(value, dict) or not all(isinstance(k, str) and _id(v) for k, v in value.items()):
        return {}
    named = {k.removeprefix("<|").removesuffix("|>"): v for k, v in value.items()}
    return named if all(named) and len(named) == len(value) else {}


def _id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _count(value: Any) -> bool:
    """A position table's size that bounds anything: a positive int up to the configs' own limit (a
    larger one is no limit ortpipe would reach)."""
    return isinstance(value, int) and not isinstance(value, bool) and 0 < value <= 1 << 20


MUSICGEN_PARTS = {
    "text_encoder": "text_encoder.onnx",
    "decoder": "decoder_model_merged.onnx",
    "audio_decoder": "encodec_decode.onnx",
}


def _musicgen(folder: Folder) -> dict[str, Any] | None:
    """optimum's text-to-audio export of MusicGen (as transformers.js runs it, in the folder or onnx/): the
    text encoder (init), the merged decoder over `num_codebooks` delayed codebooks (step), EnCodec's decoder
    on the generated codes (final). build_delay_pattern_mask.onnx is not used: its length is fixed at
    export."""
    audio = MUSICGEN_PARTS["audio_decoder"]
    base = next((b for b in ("", "onnx/") if variants.present(folder, b + audio)), None)
    if base is None:
        return None
    missing = [f for f in MUSICGEN_PARTS.values() if not variants.present(folder, base + f)]
    if missing:
        raise ConfigError(
            f"{folder.describe()} has {base}encodec_decode.onnx but not "
            f"{', '.join(base + f for f in missing)}: export MusicGen with optimum (--task "
            "text-to-audio) and merge its decoders into decoder_model_merged.onnx"
        )
    hf = optional_json(folder, "config.json")
    gen = optional_json(folder, "generation_config.json")
    decoder, audio = hf.get("decoder"), hf.get("audio_encoder")
    count = decoder.get("num_codebooks") if isinstance(decoder, dict) else None
    rate = audio.get("sampling_rate") if isinstance(audio, dict) else None
    if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (count, rate)):
        raise ConfigError(
            f"{folder.describe('config.json')} must give decoder.num_codebooks and "
            "audio_encoder.sampling_rate (MusicGen's config.json), found "
            f"{count!r} and {rate!r}"
        )
    if isinstance(decoder, dict) and decoder.get("audio_channels", 1) != 1:
        raise ConfigError(
            f"{folder.describe('config.json')} is a stereo MusicGen (audio_channels "
            f"{decoder.get('audio_channels')}): ortpipe runs mono MusicGen"
        )
    tokens = _tokens(gen, decoder if isinstance(decoder, dict) else {})
    tokens["eos"] = []  # MusicGen stops at its length
    tokens.setdefault("pad", tokens.get("decoder_start"))
    codebooks: dict[str, Any] = {"count": count}
    scale = gen.get("guidance_scale")
    if isinstance(scale, (int, float)) and not isinstance(scale, bool):
        codebooks["guidance_scale"] = scale
    generation: dict[str, Any] = {"codebooks": codebooks}
    if isinstance(gen.get("max_length"), int) and gen["max_length"] > 1:
        generation["max_length"] = gen["max_length"]
    sampling = _sampling(folder, gen, ("temperature", "top_k", "top_p", "min_p"))
    if sampling:
        generation["sampling"] = sampling
    tokenizer = "" if folder.exists("tokenizer.json") or not base else base.rstrip("/")
    return {
        "version": 2,
        "pipeline": {
            "sessions": {name: {"file": base + file} for name, file in MUSICGEN_PARTS.items()},
            "flow": [
                {"run": "text_encoder", "when": "init"},
                {"run": "decoder", "when": "step"},
                {"run": "audio_decoder", "when": "final"},
            ],
            "dataflow": [
                {"from": "text_encoder.last_hidden_state", "to": "decoder.encoder_hidden_states"},
                {"from": "generated.ids", "to": "audio_decoder.audio_codes"},
            ],
            "output": {
                "session": "audio_decoder",
                "name": "audio_values",
                "as": "audio",
                "sampling_rate": rate,
            },
            **({"preprocessing": {"text": {"tokenizer": tokenizer}}} if tokenizer else {}),
        },
        "tokens": {k: v for k, v in tokens.items() if v is not None},
        "generation": generation,
        "metadata": {"model_type": hf.get("model_type"), "detected_from": base + MUSICGEN_PARTS["decoder"]},
    }
