"""Tiny hand-built decoder graphs, one per KV-cache layout ortpipe supports, for tests.

Each graph is a real (if small) causal decoder with random but fixed weights: token and position
embeddings, then per layer pre-norm attention over the concatenation of the past cache and the new
keys/values, a final norm and a projection to the vocabulary. Cache bugs therefore change tokens:
the logits depend on the current token, its position and the cached keys/values.

Layouts:
- `build_separate`: `past_key_values.{i}.key/.value` [batch, heads, past, head_size] ->
  `present.{i}.key/.value`; sparse layer indices and per-layer head counts/sizes allowed.
- `build_combined`: GPT-2 style `past_{i}` [2, batch, heads, past, head_size] -> `present_{i}`.
- `build_sliding`: like separate, but in `window_layers` a query at position t sees only keys in
  (t - window, t]. Such a layer counts positions inside its own cache (its past input may be
  shorter than the attention mask, which it reads right-aligned), so the runtime may trim its
  present to the last `window` positions before feeding it back: the tokens are the same.

All layouts take batches with left padding (attention_mask 0) and positions up to MAX_POSITIONS - 1.
The same seed gives the same weights in every builder: `build_sliding` differs from
`build_separate` only by the window.

Special tokens: bos = pad = 0 and eos = 1 by default. The output projection gives both a large
negative bias, so greedy decoding never picks them and a fixed number of tokens comes out; a test
that needs to stop early passes `eos=[some id the model emits]` (it only changes genai_config.json).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 17
IR_VERSION = 8
VOCAB = 96
HIDDEN = 32
MAX_POSITIONS = 256
BOS = PAD = 0
EOS = 1
SUPPRESSED_BIAS = -30.0  # on bos/pad and eos: never the argmax
LOGIT_SCALE = 12.0  # peaky logits: clear greedy margins
ATTENTION_SCALE = 1.5  # attention spread over many positions: most cached entries move the logits
MASKED = -1e9  # not -inf: a fully masked (padding) row stays finite
INT64_MAX = 2**63 - 1

BATCH, SEQ, PAST, TOTAL = "batch_size", "sequence_length", "past_sequence_length", "total_sequence_length"
WINDOW_PAST, WINDOW_TOTAL = "window_past_sequence_length", "window_total_sequence_length"


@dataclass(frozen=True)
class Spec:
    """What a graph looks like; the builders below fill it in."""

    layout: str  # "separate" or "combined"
    layers: tuple[int, ...]  # layers with a cache; any other layer below the last is a cache-free MLP block
    heads: Mapping[int, int]
    head_size: Mapping[int, int]
    position_ids: bool = True
    attention_mask: bool = True
    window: int | None = None
    window_layers: tuple[int, ...] = ()

    def windowed(self, layer: int) -> bool:
        return layer in self.window_layers


class _Graph:
    """Collects nodes and initializers; every op returns its (unique) output name."""

    def __init__(self, rng: np.random.RandomState):
        self.rng = rng
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []

    def weight(self, name: str, shape: tuple[int, ...], scale: float) -> str:
        values = (self.rng.standard_normal(shape) * scale).astype(np.float32)
        self.initializers.append(numpy_helper.from_array(values, name))
        return name

    def const(self, values: Sequence[int] | Sequence[float] | np.ndarray, dtype: type = np.int64) -> str:
        name = f"const_{len(self.initializers)}"
        self.initializers.append(numpy_helper.from_array(np.asarray(values, dtype=dtype), name))
        return name

    def op(self, op_type: str, *inputs: str, out: str | None = None, **attrs: object) -> str:
        out = out or f"{op_type.lower()}_{len(self.nodes)}"
        self.nodes.append(helper.make_node(op_type, list(inputs), [out], **attrs))
        return out

    def scalar_dim(self, tensor: str, axis: int) -> str:
        """One dimension of `tensor` as an int64 scalar (what Range wants)."""
        dim = self.op("Shape", tensor, start=axis, end=axis + 1)
        return self.op("Squeeze", dim, self.const([0]))

    def norm(self, x: str) -> str:
        return self.op("LayerNormalization", x, self.const(np.ones(HIDDEN), np.float32), axis=-1)

    def linear(self, x: str, name: str, n_in: int, n_out: int, gain: float = 1.0) -> str:
        return self.op("MatMul", x, self.weight(name, (n_in, n_out), gain / np.sqrt(n_in)))


def _tensor(name: str, elem: int, shape: Sequence[str | int]) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, elem, list(shape))


def _allowed(g: _Graph, keys: str, queries: str, mask: str | None, window: int | None) -> str:
    """bool [batch or 1, 1, S, T]: which of the T keys each of the S queries may see.

    Positions are counted inside this layer's own cache (past + new), never from the attention
    mask's length, so a windowed layer whose past was trimmed to the last `window` positions works.
    The attention mask is aligned to the right: its last T columns are this layer's keys.
    """
    total = g.scalar_dim(keys, 2)
    past = g.op("Sub", total, g.scalar_dim(queries, 2))
    one, zero = g.const(1), g.const(0)
    key_pos = g.op("Unsqueeze", g.op("Range", zero, total, one), g.const([0]))  # [1, T]
    query_pos = g.op("Unsqueeze", g.op("Range", past, total, one), g.const([1]))  # [S, 1]
    allowed = g.op("LessOrEqual", key_pos, query_pos)
    if window is not None:  # a query at t sees keys in (t - window, t], cache trimmed or not
        allowed = g.op("And", allowed, g.op("Greater", key_pos, g.op("Sub", query_pos, g.const(window))))
    if mask is not None:
        start = g.op("Neg", g.op("Shape", keys, start=2, end=3))
        recent = g.op("Slice", mask, start, g.const([INT64_MAX]), g.const([1]))
        padding = g.op("Unsqueeze", g.op("Cast", recent, to=TensorProto.BOOL), g.const([1, 2]))
        allowed = g.op("And", allowed, padding)
    return allowed


def _attention(g: _Graph, spec: Spec, layer: int, x: str, past_key: str, past_value: str,
               mask: str | None) -> tuple[str, str, str]:
    """x + attention(norm(x)) over past + new; returns (x, present key, present value)."""
    heads, size = spec.heads[layer], spec.head_size[layer]
    h = g.norm(x)

    def split_heads(name: str, gain: float) -> str:  # [B, S, heads*size] -> [B, heads, S, size]
        flat = g.linear(h, f"layer{layer}.{name}", HIDDEN, heads * size, gain)
        return g.op("Transpose", g.op("Reshape", flat, g.const([0, 0, heads, size])), perm=[0, 2, 1, 3])

    query = split_heads("query", ATTENTION_SCALE)
    key = g.op("Concat", past_key, split_heads("key", ATTENTION_SCALE), axis=2)
    value = g.op("Concat", past_value, split_heads("value", 1.0), axis=2)
    scores = g.op("Mul", g.op("MatMul", query, g.op("Transpose", key, perm=[0, 1, 3, 2])),
                  g.const(1 / np.sqrt(size), np.float32))
    window = spec.window if spec.windowed(layer) else None
    scores = g.op("Where", _allowed(g, key, query, mask, window), scores, g.const(MASKED, np.float32))
    context = g.op("MatMul", g.op("Softmax", scores, axis=-1), value)
    merged = g.op("Reshape", g.op("Transpose", context, perm=[0, 2, 1, 3]), g.const([0, 0, heads * size]))
    return g.op("Add", x, g.linear(merged, f"layer{layer}.out", heads * size, HIDDEN, 2.0)), key, value


def _mlp(g: _Graph, layer: int, x: str) -> str:
    """A layer with no cache (what sparse cache indices skip over)."""
    hidden = g.op("Tanh", g.linear(g.norm(x), f"layer{layer}.up", HIDDEN, 2 * HIDDEN))
    return g.op("Add", x, g.linear(hidden, f"layer{layer}.down", 2 * HIDDEN, HIDDEN))


def _cache_io(spec: Spec, layer: int) -> tuple[list[onnx.ValueInfoProto], list[onnx.ValueInfoProto]]:
    """(past inputs, present outputs) of one layer; a windowed layer's lengths have their own dim names."""
    past, total = (WINDOW_PAST, WINDOW_TOTAL) if spec.windowed(layer) else (PAST, TOTAL)
    stacked = [2] if spec.layout == "combined" else []  # key and value on axis 0

    heads, size = spec.heads[layer], spec.head_size[layer]

    def info(name: str, length: str) -> onnx.ValueInfoProto:
        return _tensor(name, TensorProto.FLOAT, [*stacked, BATCH, heads, length, size])

    if spec.layout == "combined":
        return [info(f"past_{layer}", past)], [info(f"present_{layer}", total)]
    kinds = ("key", "value")
    return ([info(f"past_key_values.{layer}.{k}", past) for k in kinds],
            [info(f"present.{layer}.{k}", total) for k in kinds])


def _derived_positions(g: _Graph, spec: Spec) -> str:
    """[1, S] positions past .. past + S - 1, the past length read from the first full layer's cache."""
    full = [layer for layer in spec.layers if not spec.windowed(layer)]
    if not full:
        raise ValueError("a graph without position_ids needs at least one layer that is not windowed")
    pasts, _ = _cache_io(spec, full[0])
    past = g.scalar_dim(pasts[0].name, 3 if spec.layout == "combined" else 2)
    end = g.op("Add", past, g.scalar_dim("input_ids", 1))
    return g.op("Unsqueeze", g.op("Range", past, end, g.const(1)), g.const([0]))


def decoder(spec: Spec, seed: int) -> onnx.ModelProto:
    """The graph for `spec`; the same seed gives the same weights whatever the layout and window."""
    g = _Graph(np.random.RandomState(seed))
    inputs = [_tensor("input_ids", TensorProto.INT64, [BATCH, SEQ])]
    if spec.attention_mask:
        inputs.append(_tensor("attention_mask", TensorProto.INT64, [BATCH, TOTAL]))
    if spec.position_ids:
        inputs.append(_tensor("position_ids", TensorProto.INT64, [BATCH, SEQ]))
    outputs = [_tensor("logits", TensorProto.FLOAT, [BATCH, SEQ, VOCAB])]

    tokens = g.op("Gather", g.weight("token_embedding", (VOCAB, HIDDEN), 1.0), "input_ids")
    positions = "position_ids" if spec.position_ids else _derived_positions(g, spec)
    position_table = g.weight("position_embedding", (MAX_POSITIONS, HIDDEN), 1.0)
    x = g.op("Add", tokens, g.op("Gather", position_table, positions))
    mask = "attention_mask" if spec.attention_mask else None
    for layer in range(max(spec.layers) + 1):
        if layer not in spec.layers:
            x = _mlp(g, layer, x)
            continue
        pasts, presents = _cache_io(spec, layer)
        inputs += pasts
        outputs += presents
        if spec.layout == "combined":
            past_key, past_value = (g.op("Gather", pasts[0].name, g.const(i), axis=0) for i in (0, 1))
        else:
            past_key, past_value = (p.name for p in pasts)
        x, key, value = _attention(g, spec, layer, x, past_key, past_value, mask)
        if spec.layout == "combined":
            stacked = [g.op("Unsqueeze", t, g.const([0])) for t in (key, value)]
            g.op("Concat", *stacked, out=presents[0].name, axis=0)
        else:
            g.op("Identity", key, out=presents[0].name)
            g.op("Identity", value, out=presents[1].name)

    bias = np.zeros(VOCAB, dtype=np.float32)
    bias[[BOS, PAD, EOS]] = SUPPRESSED_BIAS
    head = g.linear(g.norm(x), "lm_head", HIDDEN, VOCAB, LOGIT_SCALE)
    g.op("Add", head, g.const(bias, np.float32), out="logits")
    graph = helper.make_graph(g.nodes, f"tiny_{spec.layout}_decoder", inputs, outputs, g.initializers)
    model = helper.make_model(graph, producer_name="ortpipe-tests",
                              opset_imports=[helper.make_opsetid("", OPSET)])
    model.ir_version = IR_VERSION
    return model


def genai_config(spec: Spec, eos: Sequence[int]) -> dict[str, object]:
    kv_cache: dict[str, object] = {"format": spec.layout}
    if spec.window is not None:
        kv_cache["sliding_window"] = {"window_size": spec.window, "layers": list(spec.window_layers)}
    return {
        "version": 2,
        "pipeline": {"extends": "autoregressive-decoder", "sessions": {"decoder": {"file": "model.onnx"}},
                     "state": {"kv_cache": kv_cache}},
        "tokens": {"eos": list(eos), "bos": BOS, "pad": PAD},
        "generation": {"max_length": 128},
        "metadata": {"model_type": "tiny-decoder", "source": "build/graphs.py"},
    }


def write(spec: Spec, out_dir: Path | str, seed: int, config: bool, eos: Sequence[int]) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    onnx.save(decoder(spec, seed), str(out / "model.onnx"))
    if config:
        (out / "genai_config.json").write_text(json.dumps(genai_config(spec, eos), indent=2) + "\n")
    return out


def _per_layer(value: int | Mapping[int, int], layers: Sequence[int]) -> dict[int, int]:
    return {layer: value if isinstance(value, int) else value[layer] for layer in layers}


def build_separate(out_dir: Path | str, seed: int = 0, *, layers: Sequence[int] = (0, 1),
                   heads: int | Mapping[int, int] = 2, head_size: int | Mapping[int, int] = 8,
                   with_position_ids: bool = True, with_attention_mask: bool = True,
                   config: bool = False, eos: Sequence[int] = (EOS,)) -> Path:
    """past_key_values.{i}.key/.value -> present.{i}.key/.value; heads and head_size may be per layer."""
    spec = Spec("separate", tuple(layers), _per_layer(heads, layers), _per_layer(head_size, layers),
                position_ids=with_position_ids, attention_mask=with_attention_mask)
    return write(spec, out_dir, seed, config, eos)


def build_combined(out_dir: Path | str, seed: int = 0, *, layers: Sequence[int] = (0, 1),
                   heads: int | Mapping[int, int] = 2, head_size: int | Mapping[int, int] = 8,
                   config: bool = False, eos: Sequence[int] = (EOS,)) -> Path:
    """past_{i} [2, batch, heads, past, head_size] (key, value) -> present_{i}."""
    spec = Spec("combined", tuple(layers), _per_layer(heads, layers), _per_layer(head_size, layers))
    return write(spec, out_dir, seed, config, eos)


def build_sliding(out_dir: Path | str, seed: int = 0, *, layers: Sequence[int] = (0, 1), window: int = 8,
                  window_layers: Sequence[int] = (1,), heads: int | Mapping[int, int] = 2,
                  head_size: int | Mapping[int, int] = 8, with_position_ids: bool = True,
                  with_attention_mask: bool = True, config: bool = False,
                  eos: Sequence[int] = (EOS,)) -> Path:
    """Separate layout; `window_layers` see only the last `window` positions (their cache may be trimmed)."""
    spec = Spec("separate", tuple(layers), _per_layer(heads, layers), _per_layer(head_size, layers),
                position_ids=with_position_ids, attention_mask=with_attention_mask,
                window=window, window_layers=tuple(window_layers))
    return write(spec, out_dir, seed, config, eos)
