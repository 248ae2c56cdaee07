"""Reference greedy decoding for the pipelines of build/pipeline_graphs.py, written by hand against
onnxruntime and numpy from docs/pipelines.md: what ortpipe is tested against.

Batch of one, attention_mask all ones. Every `*_reference` function has the shape
`(folder, prompt_ids, inputs, max_new_tokens, *, cache=True, ...) -> generated ids` and two modes:
- `cache=True`: the usual loop. Encoders run once; the embedding runs on the expanded prompt with
  the feature rows, then once per step on the new token with empty feature inputs ([0, hidden]);
  the decoder's presents come back as its pasts.
- `cache=False`: no cache at all. Every step reruns the embedding on the whole sequence (with the
  features) and the decoder with zero-length pasts.
On graphs whose caches are right both give the same tokens. A few keyword switches (mrope, crop,
counters) compute what a runtime that got one rule wrong would produce, so tests can check that the
graphs notice.

Only the encoders' outputs are computed once in both modes: they do not depend on the tokens.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import numpy as np
import onnxruntime as ort
from build import pipeline_graphs as pg

Arrays = Mapping[str, np.ndarray]
Positions = Callable[[int], np.ndarray]  # sequence length -> position ids for indices 0..length-1


def session(folder: Path | str, file: str) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    return ort.InferenceSession(str(Path(folder) / file), options, providers=["CPUExecutionProvider"])


def run(s: ort.InferenceSession, feeds: Arrays) -> dict[str, np.ndarray]:
    names = [o.name for o in s.get_outputs()]
    return dict(zip(names, s.run(names, dict(feeds)), strict=True))


def zero_pasts(s: ort.InferenceSession, prefix: str) -> dict[str, np.ndarray]:
    """Every input named `prefix...`, batch 1 and zero positions: [1, heads, 0, head_size]."""
    return {i.name: np.zeros((1, i.shape[1], 0, i.shape[3]), dtype=np.float32)
            for i in s.get_inputs() if i.name.startswith(prefix)}


def presents_as_pasts(outputs: Arrays, pasts: Arrays,
                      to_present: Callable[[str], str]) -> dict[str, np.ndarray]:
    return {name: outputs[to_present(name)] for name in pasts}


def decoder_present(past: str) -> str:
    """past_key_values.{i}.key -> present.{i}.key"""
    return "present." + past.removeprefix("past_key_values.")


def argmax_last(logits: np.ndarray) -> int:
    return int(np.argmax(logits[0, -1]))


# placeholders and positions


def expand(ids: Sequence[int], token: int, rows: Sequence[int]) -> list[int]:
    """Each occurrence of `token` repeated to the row count of its item, in order."""
    if list(ids).count(token) != len(rows):
        raise ValueError(f"{list(ids).count(token)} placeholders {token} for {len(rows)} items")
    out, item = [], 0
    for i in ids:
        if i == token:
            out += [token] * rows[item]
            item += 1
        else:
            out.append(i)
    return out


def default_positions(length: int) -> np.ndarray:
    return np.arange(length, dtype=np.int64)[None, :]


def mrope_positions(prompt: Sequence[int], image_token: int, grids: Sequence[Sequence[int]],
                    merge: int = pg.MERGE) -> Positions:
    """docs/pipelines.md's Qwen2-VL rule. Text: t = h = w = one more than the largest position so
    far. A run of image i's tokens: base + (ti, hi, wi) over the merged grid T x H/m x W/m, row-major,
    base being the next position. Sequence index k >= len(prompt): k + delta on every axis,
    delta = max(prompt positions) + 1 - len(prompt)."""
    columns: list[tuple[int, int, int]] = []
    k, image = 0, 0
    while k < len(prompt):
        base = max((max(c) for c in columns), default=-1) + 1
        if prompt[k] != image_token:
            columns.append((base, base, base))
            k += 1
            continue
        t, h, w = grids[image][0], grids[image][1] // merge, grids[image][2] // merge
        columns += [(base + ti, base + hi, base + wi)
                    for ti in range(t) for hi in range(h) for wi in range(w)]
        k += t * h * w
        image += 1
    prompt_positions = np.array(columns, dtype=np.int64).T  # [3, S]
    delta = int(prompt_positions.max()) + 1 - len(prompt)

    def positions(length: int) -> np.ndarray:
        later = np.arange(len(prompt), length, dtype=np.int64) + delta
        return np.concatenate([prompt_positions[:, :length], np.tile(later, (3, 1))], axis=1)[:, None, :]

    return positions


# the embedding + decoder loop shared by every vision / speech pipeline


def embed_and_decode(folder: Path | str, prompt: Sequence[int], features: Arrays, max_new_tokens: int,
                     positions: Positions = default_positions, cache: bool = True) -> list[int]:
    """Greedy tokens from embedding/ + decoder/ on an already expanded prompt; `features` maps each
    embedding feature input to its rows (dim 0 may be 0)."""
    embedding, decoder = session(folder, pg.VL_FILES["embedding"]), session(folder, pg.VL_FILES["decoder"])
    empty = {name: np.zeros((0, *rows.shape[1:]), dtype=np.float32) for name, rows in features.items()}

    def embed(ids: Sequence[int], rows: Arrays) -> np.ndarray:
        return run(embedding, {"input_ids": np.array([ids], dtype=np.int64), **rows})["inputs_embeds"]

    def decode(embeds: np.ndarray, total: int, pasts: Arrays) -> dict[str, np.ndarray]:
        new = embeds.shape[1]
        return run(decoder, {"inputs_embeds": embeds, "attention_mask": np.ones((1, total), dtype=np.int64),
                             "position_ids": positions(total)[..., total - new:], **pasts})

    ids, generated = list(prompt), []
    if not cache:
        while len(generated) < max_new_tokens:
            out = decode(embed(ids, features), len(ids), zero_pasts(decoder, "past_key_values."))
            generated.append(argmax_last(out["logits"]))
            ids.append(generated[-1])
        return generated
    pasts = zero_pasts(decoder, "past_key_values.")
    embeds = embed(ids, features)
    while True:
        out = decode(embeds, len(ids), pasts)
        generated.append(argmax_last(out["logits"]))
        if len(generated) == max_new_tokens:
            return generated
        ids.append(generated[-1])
        pasts = presents_as_pasts(out, pasts, decoder_present)
        embeds = embed([generated[-1]], empty)


def _no_rows() -> np.ndarray:
    return np.zeros((0, pg.HIDDEN), dtype=np.float32)


def _text_only(folder: Path | str, prompt_ids: Sequence[int], features: str, max_new_tokens: int,
               cache: bool) -> list[int]:
    """No media in the request: no encoder, the embedding's feature input empty throughout."""
    return embed_and_decode(folder, prompt_ids, {features: _no_rows()}, max_new_tokens, cache=cache)


# vision-language


def phi3v_reference(folder: Path | str, prompt_ids: Sequence[int], inputs: Arrays, max_new_tokens: int, *,
                    cache: bool = True) -> list[int]:
    """Batched vision: one run on every image, image i owns rows/n rows. No pixel_values: no vision."""
    if "pixel_values" not in inputs:
        return _text_only(folder, prompt_ids, "image_features", max_new_tokens, cache)
    pixels = inputs["pixel_values"]
    features = run(session(folder, pg.VL_FILES["vision"]), {"pixel_values": pixels})["image_features"]
    rows = [len(features) // len(pixels)] * len(pixels)
    prompt = expand(prompt_ids, pg.IMAGE_TOKEN, rows)
    return embed_and_decode(folder, prompt, {"image_features": features}, max_new_tokens, cache=cache)


MROPE_RULES = ("doc", "flat", "swap_hw", "no_delta")


def qwen25vl_reference(folder: Path | str, prompt_ids: Sequence[int], inputs: Arrays, max_new_tokens: int, *,
                       cache: bool = True, mrope: str = "doc") -> list[int]:
    """Per-image vision (pixel_values and image_grid_thw sliced to [i:i+1]), mRoPE positions from the
    grids by the doc's rule. Wrong rules, for sensitivity tests: "flat" (t = h = w = index, the grid
    ignored), "swap_hw" (h and w rows exchanged), "no_delta" (generated tokens at their index)."""
    if "pixel_values" in inputs:
        vision = session(folder, pg.VL_FILES["vision"])
        pixels, grids = inputs["pixel_values"], inputs["image_grid_thw"]
        per_image = [run(vision, {"pixel_values": pixels[i:i + 1],
                                  "image_grid_thw": grids[i:i + 1]})["image_features"]
                     for i in range(len(pixels))]
        features = np.concatenate(per_image, axis=0)
        prompt = expand(prompt_ids, pg.IMAGE_TOKEN, [len(f) for f in per_image])
    else:
        grids, features, prompt = np.zeros((0, 3), dtype=np.int64), _no_rows(), list(prompt_ids)
    positions = _mrope_rule(mrope, prompt, grids.tolist())
    return embed_and_decode(folder, prompt, {"image_features": features}, max_new_tokens, positions, cache)


def _mrope_rule(rule: str, prompt: Sequence[int], grids: Sequence[Sequence[int]]) -> Positions:
    doc = mrope_positions(prompt, pg.IMAGE_TOKEN, grids)

    def positions(length: int) -> np.ndarray:
        if rule == "flat":
            return np.tile(np.arange(length, dtype=np.int64), (3, 1))[:, None, :]
        ids = doc(length)
        if rule == "swap_hw":
            return ids[[0, 2, 1]]
        if rule == "no_delta":
            ids[..., len(prompt):] = np.arange(len(prompt), length, dtype=np.int64)
        return ids

    if rule not in MROPE_RULES:
        raise ValueError(f"mrope rule {rule!r} is not one of {MROPE_RULES}")
    return positions


def pixtral_reference(folder: Path | str, prompt_ids: Sequence[int], inputs: Arrays, max_new_tokens: int, *,
                      cache: bool = True, crop: bool = True) -> list[int]:
    """Per-image vision on pixel_values[i:i+1, :, :H_i, :W_i], (H_i, W_i) = image_sizes[i].
    `crop=False`: the padded image, what a runtime that forgot dynamic_shape would feed."""
    if "pixel_values" not in inputs:
        return _text_only(folder, prompt_ids, "image_features", max_new_tokens, cache)
    vision = session(folder, pg.VL_FILES["vision"])
    pixels, sizes = inputs["pixel_values"], inputs["image_sizes"]
    per_image = []
    for i, (height, width) in enumerate(sizes.tolist()):
        image = pixels[i:i + 1, :, :height, :width] if crop else pixels[i:i + 1]
        per_image.append(run(vision, {"pixel_values": np.ascontiguousarray(image)})["image_features"])
    prompt = expand(prompt_ids, pg.IMAGE_TOKEN, [len(f) for f in per_image])
    features = np.concatenate(per_image, axis=0)
    return embed_and_decode(folder, prompt, {"image_features": features}, max_new_tokens, cache=cache)


# speech


def speech_reference(folder: Path | str, prompt_ids: Sequence[int], inputs: Arrays, max_new_tokens: int, *,
                     cache: bool = True) -> list[int]:
    """Batched speech encoder: clip i owns rows/n rows; audio_token expanded like image_token."""
    if "input_features" not in inputs:
        return _text_only(folder, prompt_ids, "audio_features", max_new_tokens, cache)
    clips = inputs["input_features"]
    features = run(session(folder, "audio_encoder/model.onnx"), {"input_features": clips})["audio_features"]
    prompt = expand(prompt_ids, pg.AUDIO_TOKEN, [len(features) // len(clips)] * len(clips))
    return embed_and_decode(folder, prompt, {"audio_features": features}, max_new_tokens, cache=cache)


def two_encoders_reference(folder: Path | str, prompt_ids: Sequence[int], inputs: Arrays,
                           max_new_tokens: int, *, cache: bool = True) -> list[int]:
    """Vision and speech (batched, independent), each expanding its own placeholder, one embedding."""
    pixels, clips = inputs["pixel_values"], inputs["input_features"]
    image_rows = run(session(folder, "vision_encoder/model.onnx"), {"pixel_values": pixels})["image_features"]
    audio_rows = run(session(folder, "audio_encoder/model.onnx"), {"input_features": clips})["audio_features"]
    prompt = expand(prompt_ids, pg.IMAGE_TOKEN, [len(image_rows) // len(pixels)] * len(pixels))
    prompt = expand(prompt, pg.AUDIO_TOKEN, [len(audio_rows) // len(clips)] * len(clips))
    features = {"image_features": image_rows, "audio_features": audio_rows}
    return embed_and_decode(folder, prompt, features, max_new_tokens, cache=cache)


# encoder-decoder


def whisper_reference(folder: Path | str, prompt_ids: Sequence[int] | None, inputs: Arrays,
                      max_new_tokens: int, *, cache: bool = True) -> list[int]:
    """Encoder once; the decoder's cross cache is the encoder's present_*_cross_{i}, unchanged for the
    whole request; the self cache grows. No prompt: [decoder_start]. input_ids are int32."""
    encoder, decoder = session(folder, "encoder/model.onnx"), session(folder, "decoder/model.onnx")
    encoded = run(encoder, {"input_features": inputs["input_features"]})
    frozen = {i.name: encoded[i.name.replace("past", "present", 1)]
              for i in decoder.get_inputs() if i.name.startswith(("past_key_cross", "past_value_cross"))}
    frozen["encoder_hidden_states"] = encoded["encoder_hidden_states"]

    def decode(ids: Sequence[int], pasts: Arrays) -> dict[str, np.ndarray]:
        return run(decoder, {"input_ids": np.array([ids], dtype=np.int32), **frozen, **pasts})

    ids = list(prompt_ids) if prompt_ids else [pg.DECODER_START]
    generated: list[int] = []
    pasts = {**zero_pasts(decoder, "past_key_self_"), **zero_pasts(decoder, "past_value_self_")}
    new = list(ids)
    while len(generated) < max_new_tokens:
        out = decode(new if cache else ids, pasts)
        generated.append(argmax_last(out["logits"]))
        ids.append(generated[-1])
        new = [generated[-1]]
        if cache:
            pasts = presents_as_pasts(out, pasts, lambda past: past.replace("past", "present", 1))
    return generated


# repeated step session


def talker_reference(folder: Path | str, prompt_ids: Sequence[int], inputs: Arrays, max_new_tokens: int, *,
                     cache: bool = True, counters: Sequence[int] = tuple(range(pg.REPEAT))) -> list[int]:
    """Per step: the decoder, then code_predictor once per counter value, `inputs_embeds` = the previous
    repeat's `codec_embeddings` (zeros [1, hidden] before the first); the token comes from the last
    repeat's logits. `counters` other than 0..REPEAT-1 compute what a wrong repeat/counter gives."""
    decoder, predictor = session(folder, "decoder.onnx"), session(folder, "code_predictor.onnx")

    def step(new: Sequence[int], total: int, pasts: Arrays) -> tuple[int, dict[str, np.ndarray]]:
        out = run(decoder, {"input_ids": np.array([new], dtype=np.int64),
                            "attention_mask": np.ones((1, total), dtype=np.int64),
                            "position_ids": default_positions(total)[:, total - len(new):], **pasts})
        carry = np.zeros((1, pg.HIDDEN), dtype=np.float32)
        for k in counters:
            predicted = run(predictor, {"last_hidden_state": out["last_hidden_state"], "inputs_embeds": carry,
                                        "step_index": np.array([k], dtype=np.int64)})
            carry = predicted["codec_embeddings"]
        return argmax_last(predicted["logits"]), out

    ids, generated = list(prompt_ids), []
    pasts = zero_pasts(decoder, "past_key_values.")
    new = list(ids)
    while len(generated) < max_new_tokens:
        token, out = step(new if cache else ids, len(ids), pasts)
        generated.append(token)
        ids.append(token)
        new = [token]
        if cache:
            pasts = presents_as_pasts(out, pasts, decoder_present)
    return generated


REFERENCES: dict[str, Callable[..., list[int]]] = {
    "tiny-phi3v-style": phi3v_reference,
    "tiny-qwen25vl-style": qwen25vl_reference,
    "tiny-pixtral-style": pixtral_reference,
    "tiny-whisper-style": whisper_reference,
    "tiny-speech-language-style": speech_reference,
    "tiny-two-encoders": two_encoders_reference,
    "tiny-talker-repeat": talker_reference,
}


def reference_tokens(folder: Path | str, prompt_ids: Sequence[int] | None, inputs: Arrays,
                     max_new_tokens: int, **options: object) -> list[int]:
    """The reference loop for a folder of build/pipeline_graphs.py (picked by its metadata.model_type,
    which only these tests read)."""
    kind = json.loads((Path(folder) / "genai_config.json").read_text())["metadata"]["model_type"]
    return REFERENCES[kind](folder, prompt_ids, inputs, max_new_tokens, **options)
