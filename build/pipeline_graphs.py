"""Tiny multi-session pipelines for tests: vision-language, mRoPE, per-image crops, encoder-decoder,
speech, two parallel encoders, and a repeated step session.

Every builder writes a folder of random-weight fp32 graphs (fixed seeds) plus a v2 genai_config.json,
and returns the folder. `*_inputs(seed)` gives a deterministic request for it: prompt ids (one
placeholder id per image or audio clip; the runtime expands it to that item's feature rows) and
the request's arrays by input name. tests/pipeline_refs.py holds the hand-written onnxruntime loops
that say what ortpipe must generate; docs/pipelines.md is the contract both follow.

The decoders reuse the attention blocks of build/graphs.py (hidden 32, two layers of two heads of
size 8, learned position tables), so a wrong cache, position or feature row changes the tokens.
Their output bias suppresses every special id (bos/pad, eos, decoder_start, image and audio
placeholders): greedy decoding never stops early and never emits a placeholder.

Pipelines (session: inputs -> outputs; B = batch, S = new tokens, P = past, T = total):

- `phi3v_style`: vision [batched] `pixel_values` f32 [n, 3, 8, 8] -> `image_features` f32 [n*4, 32];
  embedding `input_ids` i64 [B, S], `image_features` f32 [rows, 32] -> `inputs_embeds` f32 [B, S, 32];
  decoder `inputs_embeds`, `attention_mask` i64 [B, T], `position_ids` i64 [B, S],
  `past_key_values.{0,1}.key/.value` f32 [B, 2, P, 8] -> `logits` f32 [B, S, 96], `present.{0,1}.key/.value`.
- `qwen25vl_style`: vision [per_image] `pixel_values` f32 [1, 16, 12], `image_grid_thw` i64 [1, 3]
  -> `image_features` [4, 32] (2x2 merge: 4 consecutive patches -> 1 row); the same embedding; a decoder
  whose `position_ids` is i64 [3, B, S] (three position tables summed: t, h and w all matter).
- `qwen25vl_image_style`, `phi3v_image_style`: the same pipelines for requests with decoded images:
  a preprocessing config beside the graphs (Qwen2-VL patches of 2x2 pixels, CLIP 8x8 crops), and
  for qwen the vision graph reads Qwen2-VL's flat patches `pixel_values` f32 [P, 12].
- `pixtral_style`: vision [per_image, cropped] `pixel_values` f32 [1, 3, H, W] (H, W multiples of 4)
  -> `image_features` [(H/4)*(W/4), 32] (row and column embeddings per patch); embedding and
  decoder as phi3v. The request's `pixel_values` [n, 3, 12, 12] hold garbage outside each image.
- `whisper_style`: encoder `input_features` f32 [B, 8, F] -> `encoder_hidden_states` f32 [B, F/2, 32],
  `present_key_cross_{0,1}` / `present_value_cross_{0,1}` f32 [B, 2, F/2, 8]; decoder `input_ids`
  i32 [B, S], `encoder_hidden_states`, `past_key_self_{i}` / `past_value_self_{i}` f32 [B, 2, P, 8],
  `past_key_cross_{i}` / `past_value_cross_{i}` f32 [B, 2, F/2, 8] -> `logits`, `present_key_self_{i}` /
  `present_value_self_{i}`. No attention_mask or position_ids: positions come from the self cache's length.
- `speech_language_style`: speech [batched] `input_features` f32 [n, 8, F] -> `audio_features` f32
  [n*F/2, 32]; embedding `input_ids`, `audio_features` -> `inputs_embeds`; decoder as phi3v.
- `two_encoders`: phi3v's vision and the speech encoder, each with a heavy branch (a chain of
  512x512 MatMuls, tens of ms), both feeding one embedding (`image_features`, `audio_features`).
- `talker_repeat`: decoder `input_ids` i64 [B, S], `attention_mask`, `position_ids`, cache ->
  `last_hidden_state` f32 [B, S, 32], presents; code_predictor (`repeat: 3`, `counter: step_index`)
  `last_hidden_state` f32 [B, S, 32], `inputs_embeds` f32 [B, 32], `step_index` i64 [1] ->
  `codec_embeddings` f32 [B, 32] (self-wired to its `inputs_embeds`), `logits` f32 [B, 1, 96].
  See `talker_repeat` for what the runtime must do.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper

from build import graphs
from build.graphs import (
    ATTENTION_SCALE,
    BATCH,
    HIDDEN,
    LOGIT_SCALE,
    MAX_POSITIONS,
    PAST,
    SEQ,
    SUPPRESSED_BIAS,
    TOTAL,
    VOCAB,
    _attention,
    _Graph,
    _tensor,
)

BOS = PAD = graphs.BOS
EOS = graphs.EOS
DECODER_START = 2
IMAGE_TOKEN = 90
AUDIO_TOKEN = 91
SPECIAL = (BOS, EOS, DECODER_START, IMAGE_TOKEN, AUDIO_TOKEN)

LAYERS = (0, 1)
HEADS, HEAD_SIZE = 2, 8
SPEC = graphs.Spec("separate", LAYERS, {i: HEADS for i in LAYERS}, {i: HEAD_SIZE for i in LAYERS})

PATCH = 4  # pixels per patch side (phi3v, pixtral)
PHI3V_SIDE = 8  # phi3v images are 8x8: 2x2 patches -> 4 rows per image
QWEN_PATCH_DIM = 12  # qwen: channels * temporal patch * patch^2 already flattened by the preprocessor
QWEN_PATCHES = 16  # patches per image; 2x2 merge -> 4 rows
MERGE = 2  # qwen's spatial merge size (the doc's default)
MELS = 8
FRAMES = 16  # whisper and speech: frames are paired, so F/2 feature rows
MAX_PATCHES_PER_SIDE = 16
HEAVY_WIDTH, HEAVY_DEPTH = 512, 4  # two_encoders: 4 MatMuls of 512x512x512 per encoder
REPEAT = 3  # talker_repeat: code_predictor runs per generation step
GENERATION_MAX_LENGTH = 256

NUM_IMAGES, NUM_ROWS, NUM_PATCHES, HEIGHT, WIDTH = "num_images", "num_rows", "num_patches", "height", "width"
NUM_CLIPS, FRAMES_DIM, ENCODER_SEQ = "num_clips", "frames", "encoder_sequence_length"
FLOAT, INT64, INT32 = TensorProto.FLOAT, TensorProto.INT64, TensorProto.INT32
Infos = list[onnx.ValueInfoProto]


@dataclass(frozen=True)
class Request:
    """What one test request sends: prompt ids with placeholders, and arrays by input name."""

    prompt_ids: list[int]
    inputs: dict[str, np.ndarray]


# graph pieces


def _model(g: _Graph, name: str, inputs: Infos, outputs: Infos) -> onnx.ModelProto:
    graph = helper.make_graph(g.nodes, name, inputs, outputs, g.initializers)
    model = helper.make_model(graph, producer_name="ortpipe-tests",
                              opset_imports=[helper.make_opsetid("", graphs.OPSET)])
    model.ir_version = graphs.IR_VERSION
    onnx.checker.check_model(model)
    return model


def _lm_head(g: _Graph, x: str, out: str = "logits") -> str:
    """Peaky logits over the vocabulary; special ids are never the argmax."""
    bias = np.zeros(VOCAB, dtype=np.float32)
    bias[list(SPECIAL)] = SUPPRESSED_BIAS
    head = g.linear(g.norm(x), "lm_head", HIDDEN, VOCAB, LOGIT_SCALE)
    return g.op("Add", head, g.const(bias, np.float32), out=out)


def _logits_info(length: str | int = SEQ) -> onnx.ValueInfoProto:
    return _tensor("logits", FLOAT, [BATCH, length, VOCAB])


def _cache_info(name: str, length: str) -> onnx.ValueInfoProto:
    return _tensor(name, FLOAT, [BATCH, HEADS, length, HEAD_SIZE])


def _self_attention_stack(g: _Graph, x: str, mask: str | None, past: str, present: str,
                          cross: bool = False) -> tuple[str, Infos, Infos]:
    """Causal attention layers over past + new (graphs._attention), optionally each followed by
    cross-attention over `past_key_cross_{i}`; `past`/`present` are name patterns with {layer} and {kind}.
    Returns (x, cache inputs, cache outputs)."""
    inputs, outputs = [], []
    for layer in LAYERS:
        past_key, past_value = (past.format(layer=layer, kind=k) for k in ("key", "value"))
        present_key, present_value = (present.format(layer=layer, kind=k) for k in ("key", "value"))
        inputs += [_cache_info(past_key, PAST), _cache_info(past_value, PAST)]
        outputs += [_cache_info(present_key, TOTAL), _cache_info(present_value, TOTAL)]
        x, key, value = _attention(g, SPEC, layer, x, past_key, past_value, mask)
        g.op("Identity", key, out=present_key)
        g.op("Identity", value, out=present_value)
        if cross:
            cross_key, cross_value = f"past_key_cross_{layer}", f"past_value_cross_{layer}"
            inputs += [_cache_info(cross_key, ENCODER_SEQ), _cache_info(cross_value, ENCODER_SEQ)]
            x = _cross_attention(g, layer, x, cross_key, cross_value)
    return x, inputs, outputs


def _split_heads(g: _Graph, x: str, name: str, n_in: int, gain: float) -> str:
    """[B, S, n_in] -> [B, heads, S, head_size]."""
    flat = g.linear(x, name, n_in, HEADS * HEAD_SIZE, gain)
    return g.op("Transpose", g.op("Reshape", flat, g.const([0, 0, HEADS, HEAD_SIZE])), perm=[0, 2, 1, 3])


def _cross_attention(g: _Graph, layer: int, x: str, key: str, value: str) -> str:
    """x + attention(norm(x)) over the encoder's keys and values: no mask, nothing cached here."""
    query = _split_heads(g, g.norm(x), f"layer{layer}.cross_query", HIDDEN, ATTENTION_SCALE)
    scores = g.op("Mul", g.op("MatMul", query, g.op("Transpose", key, perm=[0, 1, 3, 2])),
                  g.const(1 / np.sqrt(HEAD_SIZE), np.float32))
    context = g.op("MatMul", g.op("Softmax", scores, axis=-1), value)
    merged = g.op("Reshape", g.op("Transpose", context, perm=[0, 2, 1, 3]),
                  g.const([0, 0, HEADS * HEAD_SIZE]))
    return g.op("Add", x, g.linear(merged, f"layer{layer}.cross_out", HEADS * HEAD_SIZE, HIDDEN, 2.0))


def _position_embedding(g: _Graph, position_ids: str, rank: int) -> str:
    """[B, S, H] from [B, S] ids, or the sum of three tables (t, h, w) from [3, B, S] ids."""
    if rank == 2:
        return g.op("Gather", g.weight("position_embedding", (MAX_POSITIONS, HIDDEN), 1.0), position_ids)
    axes = []
    for axis, name in enumerate(("t", "h", "w")):
        ids = g.op("Gather", position_ids, g.const(axis), axis=0)  # [B, S]
        axes.append(g.op("Gather", g.weight(f"position_embedding_{name}", (MAX_POSITIONS, HIDDEN), 1.0), ids))
    return g.op("Add", g.op("Add", axes[0], axes[1]), axes[2])


def _rows(g: _Graph, x: str, width: int) -> str:
    return g.op("Reshape", x, g.const([-1, width]))


def _heavy(g: _Graph, rows: str, name: str) -> str:
    """[1, HIDDEN] from [N, HIDDEN] rows through a chain of HEAVY_WIDTH^3 MatMuls: real work whose
    result reaches the outputs (so no optimizer drops it), small enough to keep the features readable."""
    summary = g.op("ReduceMean", rows, axes=[0], keepdims=1)  # [1, H]
    seed_row = g.linear(summary, f"{name}.heavy_in", HIDDEN, HEAVY_WIDTH)  # [1, W]
    a = g.op("Tanh", g.op("Mul", g.weight(f"{name}.heavy_grid", (HEAVY_WIDTH, HEAVY_WIDTH), 1.0), seed_row))
    for k in range(HEAVY_DEPTH):
        a = g.op("Tanh", g.linear(a, f"{name}.heavy_{k}", HEAVY_WIDTH, HEAVY_WIDTH, 1.5))
    pooled = g.op("ReduceMean", a, axes=[0], keepdims=1)  # [1, W]
    return g.linear(pooled, f"{name}.heavy_out", HEAVY_WIDTH, HIDDEN, 0.5)


# sessions


def patch_vision(seed: int, heavy: bool = False) -> onnx.ModelProto:
    """phi3v: `pixel_values` [n, 3, 8, 8] -> `image_features` [n*4, H]; images are independent,
    so one batched run equals n runs of one image."""
    g = _Graph(np.random.RandomState(seed))
    per_image = (PHI3V_SIDE // PATCH) ** 2
    depth = 3 * PATCH * PATCH
    blocks = g.op("SpaceToDepth", "pixel_values", blocksize=PATCH)  # [n, 48, 2, 2]
    patches = g.op("Transpose", g.op("Reshape", blocks, g.const([0, depth, per_image])), perm=[0, 2, 1])
    hidden = g.op("Tanh", g.op("Add", g.linear(patches, "vision.patch", depth, HIDDEN, 2.0),
                                g.weight("vision.patch_position", (per_image, HIDDEN), 1.0)))
    features = _rows(g, g.linear(hidden, "vision.project", HIDDEN, HIDDEN, 2.0), HIDDEN)
    if heavy:
        features = g.op("Add", features, _heavy(g, features, "vision"))
    g.op("Identity", features, out="image_features")
    return _model(g, "tiny_patch_vision",
                  [_tensor("pixel_values", FLOAT, [NUM_IMAGES, 3, PHI3V_SIDE, PHI3V_SIDE])],
                  [_tensor("image_features", FLOAT, [NUM_ROWS, HIDDEN])])


def merge_vision(seed: int, flat: bool = False) -> onnx.ModelProto:
    """qwen2.5-vl: one image per run, `pixel_values` [1, P, 12] + `image_grid_thw` [1, 3] ->
    `image_features` [P/4, H]. The grid adds one row to every feature row; an unsliced [n, 3]
    grid does not broadcast against the rows (n != P/4 in the tests) and fails the run. With
    `flat`, `pixel_values` is Qwen2-VL's own layout, [P, 12] per run out of every image's patches."""
    g = _Graph(np.random.RandomState(seed))
    merged = g.op("Reshape", "pixel_values", g.const([-1, MERGE * MERGE * QWEN_PATCH_DIM]))
    hidden = g.op("Tanh", g.linear(merged, "vision.merge", MERGE * MERGE * QWEN_PATCH_DIM, HIDDEN, 2.0))
    grid = g.op("Mul", g.op("Cast", "image_grid_thw", to=FLOAT), g.const(0.25, np.float32))
    features = g.op("Add", g.linear(hidden, "vision.project", HIDDEN, HIDDEN, 2.0),
                    g.linear(grid, "vision.grid", 3, HIDDEN, 2.0))
    g.op("Identity", features, out="image_features")
    return _model(g, "tiny_merge_vision",
                  [_tensor("pixel_values", FLOAT, [NUM_PATCHES, QWEN_PATCH_DIM] if flat
                           else [NUM_IMAGES, NUM_PATCHES, QWEN_PATCH_DIM]),
                   _tensor("image_grid_thw", INT64, [NUM_IMAGES, 3])],
                  [_tensor("image_features", FLOAT, [NUM_ROWS, HIDDEN])])


def sized_vision(seed: int) -> onnx.ModelProto:
    """pixtral: one image per run, `pixel_values` [1, 3, H, W] -> `image_features` [(H/4)*(W/4), H],
    row-major over the patch grid, each patch with its own row and column embedding. Padding left
    in (an uncropped run) adds patches and rows."""
    g = _Graph(np.random.RandomState(seed))
    depth = 3 * PATCH * PATCH
    blocks = g.op("SpaceToDepth", "pixel_values", blocksize=PATCH)  # [1, 48, H/4, W/4]
    patches = _rows(g, g.op("Transpose", blocks, perm=[0, 2, 3, 1]), depth)  # [(H/4)*(W/4), 48]
    one, zero = g.const(1), g.const(0)
    rows = g.op("Gather", g.weight("vision.row", (MAX_PATCHES_PER_SIDE, HIDDEN), 1.0),
                g.op("Range", zero, g.scalar_dim(blocks, 2), one))
    cols = g.op("Gather", g.weight("vision.col", (MAX_PATCHES_PER_SIDE, HIDDEN), 1.0),
                g.op("Range", zero, g.scalar_dim(blocks, 3), one))
    grid = g.op("Add", g.op("Unsqueeze", rows, g.const([1])), g.op("Unsqueeze", cols, g.const([0])))
    patch = g.linear(patches, "vision.patch", depth, HIDDEN, 2.0)
    hidden = g.op("Tanh", g.op("Add", patch, _rows(g, grid, HIDDEN)))
    g.op("Identity", g.linear(hidden, "vision.project", HIDDEN, HIDDEN, 2.0), out="image_features")
    return _model(g, "tiny_sized_vision", [_tensor("pixel_values", FLOAT, [NUM_IMAGES, 3, HEIGHT, WIDTH])],
                  [_tensor("image_features", FLOAT, [NUM_ROWS, HIDDEN])])


def _audio_frames(g: _Graph, features: str) -> str:
    """[B, 8, F] mel frames -> [B, F/2, H]: pairs of frames, projected, with a learned position."""
    pairs = g.op("Reshape", g.op("Transpose", features, perm=[0, 2, 1]), g.const([0, -1, 2 * MELS]))
    count = g.scalar_dim(pairs, 1)
    positions = g.op("Gather", g.weight("audio.position", (MAX_POSITIONS, HIDDEN), 1.0),
                     g.op("Range", g.const(0), count, g.const(1)))
    hidden = g.op("Tanh", g.op("Add", g.linear(pairs, "audio.frames", 2 * MELS, HIDDEN, 2.0), positions))
    up = g.op("Tanh", g.linear(g.norm(hidden), "audio.up", HIDDEN, 2 * HIDDEN))
    return g.op("Add", hidden, g.linear(up, "audio.down", 2 * HIDDEN, HIDDEN))


def speech_encoder(seed: int, heavy: bool = False) -> onnx.ModelProto:
    """`input_features` [n, 8, F] -> `audio_features` [n*F/2, H]; clips are independent."""
    g = _Graph(np.random.RandomState(seed))
    features = _rows(g, _audio_frames(g, "input_features"), HIDDEN)
    if heavy:
        features = g.op("Add", features, _heavy(g, features, "speech"))
    g.op("Identity", features, out="audio_features")
    return _model(g, "tiny_speech_encoder",
                  [_tensor("input_features", FLOAT, [NUM_CLIPS, MELS, FRAMES_DIM])],
                  [_tensor("audio_features", FLOAT, [NUM_ROWS, HIDDEN])])


def whisper_encoder(seed: int) -> onnx.ModelProto:
    """`input_features` [B, 8, F] -> `encoder_hidden_states` [B, F/2, H] and the decoder's
    cross-attention keys/values per layer, `present_key_cross_{i}` / `present_value_cross_{i}`."""
    g = _Graph(np.random.RandomState(seed))
    hidden = _audio_frames(g, "input_features")
    g.op("Identity", hidden, out="encoder_hidden_states")
    outputs = [_tensor("encoder_hidden_states", FLOAT, [BATCH, ENCODER_SEQ, HIDDEN])]
    for layer in LAYERS:
        for kind, gain in (("key", ATTENTION_SCALE), ("value", 1.0)):
            name = f"present_{kind}_cross_{layer}"
            g.op("Identity", _split_heads(g, hidden, f"layer{layer}.cross_{kind}", HIDDEN, gain), out=name)
            outputs.append(_cache_info(name, ENCODER_SEQ))
    return _model(g, "tiny_whisper_encoder", [_tensor("input_features", FLOAT, [BATCH, MELS, FRAMES_DIM])],
                  outputs)


def embedding(seed: int, placeholders: Sequence[tuple[int, str]]) -> onnx.ModelProto:
    """`input_ids` [B, S] + feature rows per (placeholder id, input name) -> `inputs_embeds` [B, S, H]:
    the k-th position holding a placeholder id takes row k of that input; others the token embedding.
    Empty inputs ([0, H]) are fine when the ids hold no placeholder."""
    g = _Graph(np.random.RandomState(seed))
    x = g.op("Gather", g.weight("token_embedding", (VOCAB, HIDDEN), 1.0), "input_ids")
    inputs = [_tensor("input_ids", INT64, [BATCH, SEQ])]
    for token, name in placeholders:
        inputs.append(_tensor(name, FLOAT, [f"{name}_rows", HIDDEN]))
        here = g.op("Equal", "input_ids", g.const(token))
        order = g.op("Sub", g.op("CumSum", g.op("Cast", here, to=INT64), g.const(1)), g.const(1))
        # one zero row after the features: the Gather below stays in range when there are none
        padded = g.op("Concat", name, g.const(np.zeros((1, HIDDEN)), np.float32), axis=0)
        picked = g.op("Gather", padded, g.op("Where", here, order, g.const(0)))
        x = g.op("Where", g.op("Unsqueeze", here, g.const([-1])), picked, x)
    g.op("Identity", x, out="inputs_embeds")
    return _model(g, "tiny_embedding", inputs, [_tensor("inputs_embeds", FLOAT, [BATCH, SEQ, HIDDEN])])


def embeds_decoder(seed: int, position_rank: int = 2) -> onnx.ModelProto:
    """`inputs_embeds`, `attention_mask`, `position_ids` ([B, S] or [3, B, S]), separate cache -> `logits`."""
    g = _Graph(np.random.RandomState(seed))
    position_shape = [BATCH, SEQ] if position_rank == 2 else [3, BATCH, SEQ]
    x = g.op("Add", "inputs_embeds", _position_embedding(g, "position_ids", position_rank))
    x, pasts, presents = _self_attention_stack(g, x, "attention_mask", "past_key_values.{layer}.{kind}",
                                               "present.{layer}.{kind}")
    _lm_head(g, x)
    inputs = [_tensor("inputs_embeds", FLOAT, [BATCH, SEQ, HIDDEN]),
              _tensor("attention_mask", INT64, [BATCH, TOTAL]),
              _tensor("position_ids", INT64, position_shape), *pasts]
    return _model(g, "tiny_embeds_decoder", inputs, [_logits_info(), *presents])


def whisper_decoder(seed: int) -> onnx.ModelProto:
    """int32 `input_ids`, self cache, frozen cross cache and `encoder_hidden_states` -> `logits`.
    Positions count on from the self cache's length; there is no mask (batch 1, no padding)."""
    g = _Graph(np.random.RandomState(seed))
    tokens = g.op("Gather", g.weight("token_embedding", (VOCAB, HIDDEN), 1.0), "input_ids")
    past = g.scalar_dim("past_key_self_0", 2)
    end = g.op("Add", past, g.scalar_dim("input_ids", 1))
    positions = g.op("Gather", g.weight("position_embedding", (MAX_POSITIONS, HIDDEN), 1.0),
                     g.op("Range", past, end, g.const(1)))
    pooled = g.op("ReduceMean", "encoder_hidden_states", axes=[1], keepdims=1)  # [B, 1, H]
    context = g.linear(pooled, "context", HIDDEN, HIDDEN)
    x = g.op("Add", g.op("Add", tokens, positions), context)
    x, caches, presents = _self_attention_stack(g, x, None, "past_{kind}_self_{layer}",
                                                "present_{kind}_self_{layer}", cross=True)
    _lm_head(g, x)
    inputs = [_tensor("input_ids", INT32, [BATCH, SEQ]),
              _tensor("encoder_hidden_states", FLOAT, [BATCH, ENCODER_SEQ, HIDDEN]), *caches]
    return _model(g, "tiny_whisper_decoder", inputs, [_logits_info(), *presents])


def hidden_decoder(seed: int) -> onnx.ModelProto:
    """A token decoder without a head: `input_ids`, mask, positions, cache -> `last_hidden_state`."""
    g = _Graph(np.random.RandomState(seed))
    tokens = g.op("Gather", g.weight("token_embedding", (VOCAB, HIDDEN), 1.0), "input_ids")
    x = g.op("Add", tokens, _position_embedding(g, "position_ids", 2))
    x, pasts, presents = _self_attention_stack(g, x, "attention_mask", "past_key_values.{layer}.{kind}",
                                               "present.{layer}.{kind}")
    g.op("Identity", g.norm(x), out="last_hidden_state")
    inputs = [_tensor("input_ids", INT64, [BATCH, SEQ]), _tensor("attention_mask", INT64, [BATCH, TOTAL]),
              _tensor("position_ids", INT64, [BATCH, SEQ]), *pasts]
    return _model(g, "tiny_hidden_decoder", inputs,
                  [_tensor("last_hidden_state", FLOAT, [BATCH, SEQ, HIDDEN]), *presents])


def code_predictor(seed: int) -> onnx.ModelProto:
    """One repeat: start from the decoder's last position when `step_index` is 0, else from the
    previous repeat's `codec_embeddings` (fed back as `inputs_embeds`); add the embedding of group
    `step_index`; -> new `codec_embeddings` [B, H] and `logits` [B, 1, V].
    `inputs_embeds` is ignored at step_index 0, so its first value (zeros, or the last generation
    step's) never changes the tokens."""
    g = _Graph(np.random.RandomState(seed))
    last = g.op("Gather", "last_hidden_state", g.const(-1), axis=1)  # [B, H]
    start = g.op("Equal", "step_index", g.const([0]))
    x = g.op("Where", start, last, "inputs_embeds")
    group = g.op("Gather", g.weight("group_embedding", (REPEAT, HIDDEN), 1.0), "step_index")  # [1, H]
    mixed = g.op("Add", g.linear(x, "codec.mix", HIDDEN, HIDDEN, 2.0), group)
    codec = g.op("Add", g.op("Tanh", mixed), g.op("Mul", last, g.const(0.5, np.float32)))
    g.op("Identity", codec, out="codec_embeddings")
    _lm_head(g, g.op("Unsqueeze", codec, g.const([1])))
    inputs = [_tensor("last_hidden_state", FLOAT, [BATCH, SEQ, HIDDEN]),
              _tensor("inputs_embeds", FLOAT, [BATCH, HIDDEN]), _tensor("step_index", INT64, [1])]
    return _model(g, "tiny_code_predictor", inputs,
                  [_tensor("codec_embeddings", FLOAT, [BATCH, HIDDEN]), _logits_info(1)])


# folders


def _write(out: Path | str, models: dict[str, onnx.ModelProto], config: dict[str, Any]) -> Path:
    folder = Path(out)
    for file, model in models.items():
        (folder / file).parent.mkdir(parents=True, exist_ok=True)
        onnx.save(model, str(folder / file))
    (folder / "genai_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return folder


def _config(pipeline: dict[str, Any], kind: str, **tokens: int) -> dict[str, Any]:
    return {
        "version": 2,
        "pipeline": pipeline,
        "tokens": {"eos": [EOS], "bos": BOS, "pad": PAD, **tokens},
        "generation": {"max_length": GENERATION_MAX_LENGTH},
        "metadata": {"model_type": kind, "source": "build/pipeline_graphs.py"},
    }


VL_FILES = {"vision": "vision_encoder/model.onnx", "embedding": "embedding/model.onnx",
            "decoder": "decoder/model.onnx"}
VL_DATAFLOW = [{"from": "vision.image_features", "to": "embedding.image_features"},
               {"from": "embedding.inputs_embeds", "to": "decoder.inputs_embeds"}]


def _vl_models(vision: onnx.ModelProto, seed: int, position_rank: int = 2) -> dict[str, onnx.ModelProto]:
    return {VL_FILES["vision"]: vision,
            VL_FILES["embedding"]: embedding(seed + 2, [(IMAGE_TOKEN, "image_features")]),
            VL_FILES["decoder"]: embeds_decoder(seed + 3, position_rank)}


def _sessions(files: dict[str, str]) -> dict[str, dict[str, str]]:
    return {name: {"file": file} for name, file in files.items()}


def phi3v_style(out: Path | str, seed: int = 0) -> Path:
    """Batched vision, embedding, rank-2 decoder; the vision step is optional (text-only prompts)."""
    models = _vl_models(patch_vision(seed + 1), seed)
    pipeline = {
        "extends": "vision-language",
        "sessions": _sessions(VL_FILES),
        "flow": [{"run": "vision", "when": "prompt", "loop": "batched", "optional": True},
                 {"run": "embedding", "when": "prompt"},
                 {"run": "decoder", "when": "always"}],
        "dataflow": VL_DATAFLOW,
        "state": {"kv_cache": {"format": "auto"}, "position_ids": {"strategy": "default"}},
    }
    return _write(out, models, _config(pipeline, "tiny-phi3v-style", image_token=IMAGE_TOKEN))


def qwen25vl_style(out: Path | str, seed: int = 0) -> Path:
    """Per-image vision with a grid, mRoPE decoder (position_ids [3, 1, S])."""
    models = _vl_models(merge_vision(seed + 1), seed, position_rank=3)
    pipeline = {
        "extends": "vision-language",
        "sessions": _sessions(VL_FILES),
        "flow": [{"run": "vision", "when": "prompt", "loop": "per_image", "loop_over": "pixel_values",
                  "optional": True},
                 {"run": "embedding", "when": "prompt"},
                 {"run": "decoder", "when": "always"}],
        "dataflow": VL_DATAFLOW,
        "state": {"kv_cache": {"format": "auto"},
                  "position_ids": {"strategy": "mrope_3d", "grid_source": "vision.image_grid_thw"}},
    }
    return _write(out, models, _config(pipeline, "tiny-qwen25vl-style", image_token=IMAGE_TOKEN))


# CLIP preprocessing for patch_vision: shortest edge to 8 (bicubic), centre crop 8x8.
PHI3V_IMAGE_PROCESSOR = {"image_processor_type": "CLIPImageProcessor", "size": {"shortest_edge": PHI3V_SIDE},
                         "crop_size": {"height": PHI3V_SIDE, "width": PHI3V_SIDE}}


def phi3v_image_style(out: Path | str, seed: int = 0) -> Path:
    """phi3v_style with an image_processor.json, for requests with images (`images=`)."""
    folder = phi3v_style(out, seed)
    (folder / "image_processor.json").write_text(json.dumps(PHI3V_IMAGE_PROCESSOR, indent=2) + "\n")
    return folder


# Qwen2-VL preprocessing for merge_vision: patches of 3 channels x 1 frame x 2x2 pixels (12 values),
# sides rounded to multiples of 4, 64 to 1024 pixels: an image becomes 4 to 64 feature rows.
QWEN_IMAGE_PROCESSOR = {"image_processor_type": "Qwen2VLImageProcessor", "patch_size": 2,
                        "temporal_patch_size": 1, "merge_size": MERGE, "min_pixels": 64, "max_pixels": 1024}


def qwen25vl_image_style(out: Path | str, seed: int = 0) -> Path:
    """qwen25vl_style for requests with images (`images=`): the vision graph reads Qwen2-VL's flat
    patches [sum of patches, 12], which the folder's preprocessor_config.json makes from pixels."""
    folder = qwen25vl_style(out, seed)
    onnx.save(merge_vision(seed + 1, flat=True), str(folder / VL_FILES["vision"]))
    (folder / "preprocessor_config.json").write_text(json.dumps(QWEN_IMAGE_PROCESSOR, indent=2) + "\n")
    return folder


def pixtral_style(out: Path | str, seed: int = 0) -> Path:
    """Per-image vision on images cropped to image_sizes; wiring left to same-name matching."""
    models = _vl_models(sized_vision(seed + 1), seed)
    pipeline = {
        "extends": "vision-language",
        "sessions": _sessions(VL_FILES),
        "flow": [{"run": "vision", "when": "prompt", "loop": "per_image", "loop_over": "pixel_values",
                  "dynamic_shape": {"source": "image_sizes", "apply_to_dims": [2, 3]}, "optional": True},
                 {"run": "embedding", "when": "prompt"},
                 {"run": "decoder", "when": "always"}],
    }
    return _write(out, models, _config(pipeline, "tiny-pixtral-style", image_token=IMAGE_TOKEN))


def whisper_style(out: Path | str, seed: int = 0) -> Path:
    """Encoder once (hidden states + cross cache), decoder every step with a frozen cross cache."""
    files = {"encoder": "encoder/model.onnx", "decoder": "decoder/model.onnx"}
    models = {files["encoder"]: whisper_encoder(seed + 1), files["decoder"]: whisper_decoder(seed + 2)}
    pipeline = {
        "extends": "encoder-decoder",
        "sessions": _sessions(files),
        "flow": [{"run": "encoder", "when": "once"},
                 {"run": "decoder", "when": "always", "cross_attention_from": "encoder"}],
        "state": {"kv_cache": {"format": "auto"}, "cross_cache": {"source": "encoder", "frozen": True}},
    }
    return _write(out, models, _config(pipeline, "tiny-whisper-style", decoder_start=DECODER_START))


def speech_language_style(out: Path | str, seed: int = 0) -> Path:
    """The speech-language preset as it is: speech (optional), embedding, decoder, same-name wiring."""
    files = {"speech": "audio_encoder/model.onnx", "embedding": "embedding/model.onnx",
             "decoder": "decoder/model.onnx"}
    models = {files["speech"]: speech_encoder(seed + 1),
              files["embedding"]: embedding(seed + 2, [(AUDIO_TOKEN, "audio_features")]),
              files["decoder"]: embeds_decoder(seed + 3)}
    pipeline = {"extends": "speech-language", "sessions": _sessions(files)}
    return _write(out, models, _config(pipeline, "tiny-speech-language-style", audio_token=AUDIO_TOKEN))


def two_encoders(out: Path | str, seed: int = 0) -> Path:
    """Seed 4.4 (Phi4mm style, no preset): heavy vision and speech encoders with no dependency
    between them (they may run side by side), both feeding the embedding, then the decoder."""
    files = {"vision": "vision_encoder/model.onnx", "speech": "audio_encoder/model.onnx",
             "embedding": "embedding/model.onnx", "decoder": "decoder/model.onnx"}
    placeholders = [(IMAGE_TOKEN, "image_features"), (AUDIO_TOKEN, "audio_features")]
    models = {files["vision"]: patch_vision(seed + 1, heavy=True),
              files["speech"]: speech_encoder(seed + 4, heavy=True),
              files["embedding"]: embedding(seed + 2, placeholders),
              files["decoder"]: embeds_decoder(seed + 3)}
    pipeline = {
        "sessions": _sessions(files),
        "flow": [{"run": "vision", "when": "prompt", "loop": "batched"},
                 {"run": "speech", "when": "prompt", "loop": "batched"},
                 {"run": "embedding", "when": "prompt"},
                 {"run": "decoder", "when": "always"}],
        "dataflow": [{"from": "vision.image_features", "to": "embedding.image_features"},
                     {"from": "speech.audio_features", "to": "embedding.audio_features"},
                     {"from": "embedding.inputs_embeds", "to": "decoder.inputs_embeds"}],
        "state": {"kv_cache": {"format": "auto"}, "position_ids": {"strategy": "default"}},
    }
    return _write(out, models, _config(pipeline, "tiny-two-encoders", image_token=IMAGE_TOKEN,
                                       audio_token=AUDIO_TOKEN))


def talker_repeat(out: Path | str, seed: int = 0) -> Path:
    """Seed 12.3's "repeat: N with counter": decoder, then code_predictor run REPEAT times per step.

    What the runtime must do at every generation step, after the decoder's run:
    - run code_predictor REPEAT (3) times, feeding `step_index` = [k] (int64 [1]) on repeat k;
    - feed `last_hidden_state` from this step's decoder run (all of its positions: the graph reads the last);
    - feed `inputs_embeds` from the previous repeat's `codec_embeddings` (the self-wire in dataflow).
      Before any run of code_predictor it has no value: feed zeros of the input's shape with dim 0
      = batch (1) and every other symbolic dim 0, here [1, 32]. On repeat 0 of later generation
      steps either the last repeat's value or zeros will do: the graph ignores the input when
      step_index is 0 (as a code predictor starts each step from the decoder's state);
    - pick the token from the LAST repeat's `logits` [1, 1, 96] (code_predictor is the last
      step-phase session with logits; the decoder has none), so the repeat count, the counter and
      the self-wire all change the tokens.
    """
    files = {"decoder": "decoder.onnx", "code_predictor": "code_predictor.onnx"}
    models = {files["decoder"]: hidden_decoder(seed + 1), files["code_predictor"]: code_predictor(seed + 2)}
    pipeline = {
        "sessions": _sessions(files),
        "flow": [{"run": "decoder", "when": "step"},
                 {"run": "code_predictor", "when": "step", "repeat": REPEAT, "counter": "step_index"}],
        "dataflow": [{"from": "decoder.last_hidden_state", "to": "code_predictor.last_hidden_state"},
                     {"from": "code_predictor.codec_embeddings", "to": "code_predictor.inputs_embeds"}],
        "state": {"kv_cache": {"format": "auto"}, "position_ids": {"strategy": "default"}},
    }
    config = _config(pipeline, "tiny-talker-repeat")
    config["generation"]["loop"] = "autoregressive"
    return _write(out, models, config)


# requests


def _rng(seed: int, salt: int) -> np.random.RandomState:
    return np.random.RandomState(1000 * seed + salt)


def phi3v_inputs(seed: int = 0) -> Request:
    pixels = _rng(seed, 1).standard_normal((2, 3, PHI3V_SIDE, PHI3V_SIDE)).astype(np.float32)
    return Request([5, 17, IMAGE_TOKEN, 42, 8, IMAGE_TOKEN, 23, 61, 3], {"pixel_values": pixels})


QWEN_GRIDS = ((1, 4, 4), (1, 2, 8), (2, 2, 4))  # 16 patches each; merged grids 2x2, 1x4 and 2x(1x2)


def qwen25vl_inputs(seed: int = 0) -> Request:
    pixels = _rng(seed, 2).standard_normal((len(QWEN_GRIDS), QWEN_PATCHES, QWEN_PATCH_DIM)).astype(np.float32)
    grids = np.array(QWEN_GRIDS, dtype=np.int64)
    return Request([5, IMAGE_TOKEN, 17, 42, IMAGE_TOKEN, 8, IMAGE_TOKEN, 23, 61],
                   {"pixel_values": pixels, "image_grid_thw": grids})


PIXTRAL_SIZES = ((8, 12), (12, 4))  # (H, W): 2x3 = 6 and 3x1 = 3 patches


def pixtral_inputs(seed: int = 0) -> Request:
    """pixel_values [2, 3, 12, 12]: each image top-left, garbage (not zeros) everywhere else."""
    side = max(max(h for h, _ in PIXTRAL_SIZES), max(w for _, w in PIXTRAL_SIZES))
    pixels = (_rng(seed, 3).standard_normal((len(PIXTRAL_SIZES), 3, side, side)) * 3 + 5).astype(np.float32)
    images = _rng(seed, 4).standard_normal(pixels.shape).astype(np.float32)
    for i, (h, w) in enumerate(PIXTRAL_SIZES):
        pixels[i, :, :h, :w] = images[i, :, :h, :w]
    return Request([5, 17, IMAGE_TOKEN, 42, IMAGE_TOKEN, 8, 23],
                   {"pixel_values": pixels, "image_sizes": np.array(PIXTRAL_SIZES, dtype=np.int64)})


def whisper_inputs(seed: int = 0) -> Request:
    features = _rng(seed, 5).standard_normal((1, MELS, FRAMES)).astype(np.float32)
    return Request([DECODER_START, 7, 9], {"input_features": features})


def speech_language_inputs(seed: int = 0) -> Request:
    features = _rng(seed, 6).standard_normal((2, MELS, FRAMES)).astype(np.float32)
    return Request([5, AUDIO_TOKEN, 17, 42, AUDIO_TOKEN, 8], {"input_features": features})


def two_encoders_inputs(seed: int = 0) -> Request:
    pixels = _rng(seed, 7).standard_normal((1, 3, PHI3V_SIDE, PHI3V_SIDE)).astype(np.float32)
    features = _rng(seed, 8).standard_normal((1, MELS, FRAMES)).astype(np.float32)
    return Request([5, IMAGE_TOKEN, 17, AUDIO_TOKEN, 42, 8],
                   {"pixel_values": pixels, "input_features": features})


def talker_inputs(seed: int = 0) -> Request:
    return Request([5, 17, 42, 8, 23], {})


BUILDERS = {
    "phi3v": (phi3v_style, phi3v_inputs),
    "qwen25vl": (qwen25vl_style, qwen25vl_inputs),
    "pixtral": (pixtral_style, pixtral_inputs),
    "whisper": (whisper_style, whisper_inputs),
    "speech": (speech_language_style, speech_language_inputs),
    "two_encoders": (two_encoders, two_encoders_inputs),
    "talker": (talker_repeat, talker_inputs),
}
