"""What a decoder graph says about itself: head counts, head size, position limit, vocabulary.

"Detect, don't declare": a model builder export declares its cache's head size as a symbolic
dim, but its attention nodes and weights fix it. `decoder_facts` reads an `onnxinfo.Model` and
returns `DecoderFacts`; each fact is the value every piece of evidence that shows one agrees on
(across the evidence at one attention site, then across sites), or None when the graph shows none
or its evidence disagrees: never a guess. `how` says where each came from.

Attention sites, and what each shows:
- com.microsoft GroupQueryAttention: num_heads, kv_num_heads (attributes). Head size from the
  query's width (the N of the MatMul / MatMulNBits / Gemm that makes it, through a bias Add):
  N / num_heads, or with packed QKV (no key input) N / (num_heads + 2 * kv_num_heads); the key's
  width / kv_num_heads; the past key input's last dim; the output projection's K / num_heads.
  With do_rotary, cos_cache [positions, rotary_dim / 2] gives the position limit.
- com.microsoft MultiHeadAttention: num_heads; kv heads = num_heads. Head size as above, a key
  that is a graph input (a cross-attention cache) counts as a cache.
- com.microsoft Attention: num_heads; its packed weight [in, q + k + v] (qkv_hidden_sizes, else
  thirds) gives the query width; its combined past [2, batch, heads, past, head_size].
- ONNX Attention (opset 23): q_num_heads, kv_num_heads when given (3-D inputs); 4-D inputs
  leave the heads to the past key's dims and the output projection.
- Plain attention (Optimum, torch exports): a Softmax over MatMul(Q, K) scores. The key and value
  are traced back (through layout ops and the Concat with the new keys) to a past input, whose
  [batch, kv_heads, past, head_size] dims give kv heads and head size (the layout of the HF
  cache); heads = output projection K / head size. Softmaxes over a MatMul with a weight (routers,
  classifiers) are not attention.
Past inputs are read as [batch, kv_heads, past, head_size], or [2, batch, heads, past, head_size]
when combined (rank 5), as the ops above define them.

Position limit: the rows of rotary cos caches (GroupQueryAttention with do_rotary, RotaryEmbedding
of com.microsoft, or of ONNX when it takes position_ids; a cache chosen by an If, as the builder's
LongRoPE does, counts its largest branch) and of learned position tables (a table gathered by the
`position_ids` input, or a Gather/Slice of a 2-D weight added to the token embedding). Where
several limit positions, the smallest holds. Rotary computed from positions (Cos/Sin nodes, as
Optimum exports do) has no table and no limit: None.

Vocabulary: the last dim of the `logits` output, else the N of the projection that makes it,
else the rows of the token embedding (the 2-D weight gathered by `input_ids`).

Traces follow at most a few nodes each, so the cost is linear in the graph's size. Nodes inside
If/Loop/Scan bodies are searched like the main graph's (Optimum's merged decoders); a name a
body does not define is looked up in the graphs around it.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

from .onnxinfo import Graph, Model, Node, Tensor, ValueInfo

MS = "com.microsoft"


@dataclass(frozen=True)
class AttentionSite:
    """One attention node (or plain MatMul/Softmax attention) and what it shows."""

    node: str  # the node's name; for plain attention, the Softmax's
    op: str  # "com.microsoft.GroupQueryAttention", "Attention", "Softmax" (plain attention), ...
    num_heads: int | None
    kv_num_heads: int | None
    head_size: int | None
    past_key: str | None = None  # the graph input its keys come from (a combined cache: that input)
    past_value: str | None = None
    sliding_window: int | None = None  # GroupQueryAttention's local_window_size, when positive
    how: Mapping[str, str] = field(default_factory=dict)  # "num_heads" / "kv_num_heads" / "head_size" -> why


@dataclass(frozen=True)
class DecoderFacts:
    num_attention_heads: int | None
    num_key_value_heads: int | None
    head_size: int | None
    max_positions: int | None  # positions 0 .. max_positions - 1 can be run
    rotary_dim: int | None
    vocab_size: int | None
    attention: tuple[AttentionSite, ...] = ()  # a merged decoder's two branches give two sites per layer
    how: Mapping[str, str] = field(default_factory=dict)  # fact name -> where the graph shows it
    # past inputs a Concat node joins with the new positions into a graph output: a present that
    # cannot be written into its past's buffer
    concatenated: frozenset[str] = frozenset()
    # the op that quantizes a run's activations with one scale for the whole run (onnxruntime's dynamic int8
    # quantization), or None: rows of a batched run then round one another's activations
    run_scaled: str | None = None

    def for_cache(self, name: str) -> AttentionSite | None:
        """The attention site that reads the past input `name` (its kv heads and head size)."""
        return next((s for s in self.attention if name in (s.past_key, s.past_value)), None)


def decoder_facts(model: Model) -> DecoderFacts:
    ix = _Index(model)
    sites = [site for node, scope in ix.nodes() if (site := _site(ix, node, scope)) is not None]
    facts: dict[str, int | None] = {}
    how: dict[str, str] = {}
    for fact, key in (("num_attention_heads", "num_heads"), ("num_key_value_heads", "kv_num_heads"),
                      ("head_size", "head_size")):
        facts[fact], why = _agreed(sites, key)
        if why:
            how[fact] = why
    for fact, (value, why) in (("max_positions", _max_positions(ix)), ("rotary_dim", _rotary_dim(ix)),
                               ("vocab_size", _vocab_size(ix))):
        facts[fact] = value
        if why:
            how[fact] = why
    scaled = next((node.op_type for node, _ in ix.nodes() if node.op_type in _RUN_SCALED
                   and _RUN_SCALED[node.op_type] == ("" if node.domain == "ai.onnx" else node.domain)), None)
    return DecoderFacts(**facts, attention=tuple(sites), how=how, concatenated=_concatenated(ix),
                        run_scaled=scaled)


# ops (and their domain) that quantize their input with one scale and zero point over the whole tensor
_RUN_SCALED = {"DynamicQuantizeLinear": "", "DynamicQuantizeMatMul": MS}


def _concatenated(ix: _Index) -> frozenset[str]:
    """Graph inputs that a Concat node (through Identity nodes) makes into a graph output."""
    producers = {out: node for node in ix.root.graph.nodes for out in node.outputs}
    joined = set()
    for output in ix.root.graph.outputs:
        node = producers.get(output.name)
        while node is not None and node.op_type == "Identity" and node.inputs:
            node = producers.get(node.inputs[0])
        if node is not None and node.op_type == "Concat":
            joined.update(name for name in node.inputs if name in ix.inputs)
    return frozenset(joined)


def _agreed(sites: list[AttentionSite], key: str) -> tuple[int | None, str]:
    """The value every site that shows one agrees on; sites that show none (a branch without a cache,
    say) neither confirm nor contradict it."""
    known = [s for s in sites if getattr(s, key) is not None]
    if not known or len({getattr(s, key) for s in known}) > 1:
        return None, ""
    first = known[0]
    more = f" (and {len(known) - 1} more sites)" if len(known) > 1 else ""
    silent = len(sites) - len(known)
    silent_how = f"; {silent} of {len(sites)} sites show none" if silent else ""
    return getattr(first, key), f"{first.how.get(key, '')}: {first.op} {first.node}{more}{silent_how}"


# --- where names are defined ---------------------------------------------------------------------

@dataclass
class _Scope:
    """One graph's names; lookups fall back to the graphs around it (a subgraph's outer scope)."""

    graph: Graph
    parent: _Scope | None
    producers: dict[str, Node] = field(default_factory=dict)
    consumers: dict[str, list[Node]] = field(default_factory=dict)
    tensors: dict[str, Tensor] = field(default_factory=dict)  # initializers and Constant values
    infos: dict[str, ValueInfo] | None = None  # inputs, outputs and value_info: made when first looked up

    def __post_init__(self) -> None:
        self.tensors.update((t.name, t) for t in self.graph.initializers)
        for node in self.graph.nodes:
            for name in node.outputs:
                if name:
                    self.producers[name] = node
            for name in node.inputs:
                self.consumers.setdefault(name, []).append(node)
            value = node.attributes.get("value")
            if node.op_type == "Constant" and isinstance(value, Tensor) and node.outputs:
                self.tensors[node.outputs[0]] = value

    def chain(self) -> Iterator[_Scope]:
        scope: _Scope | None = self
        while scope is not None:
            yield scope
            scope = scope.parent

    def producer(self, name: str) -> tuple[Node, _Scope] | None:
        return next(((s.producers[name], s) for s in self.chain() if name in s.producers), None)

    def tensor(self, name: str) -> Tensor | None:
        return next((s.tensors[name] for s in self.chain() if name in s.tensors), None)

    def info(self, name: str) -> ValueInfo | None:
        return next((s.declared()[name] for s in self.chain() if name in s.declared()), None)

    def declared(self) -> dict[str, ValueInfo]:
        """The graph's declared types by name (its value_info is read on first use)."""
        if self.infos is None:
            graph = self.graph
            self.infos = {v.name: v for v in (*graph.inputs, *graph.outputs, *graph.value_info)}
        return self.infos


class _Index:
    def __init__(self, model: Model):
        self.root = _Scope(model.graph, None)
        self.scopes: dict[int, _Scope] = {}  # id(graph) -> its scope
        self._add(self.root)
        self.inputs = {v.name: v for v in model.graph.inputs if v.name not in self.root.tensors}
        for function in model.functions:  # a scope of its own: its names are not the graph's
            self._add(_Scope(Graph(function.name, (), (), function.nodes, ()), None))

    def _add(self, scope: _Scope) -> None:
        self.scopes[id(scope.graph)] = scope
        for node in scope.graph.nodes:
            for sub in node.subgraphs():
                self._add(_Scope(sub, scope))

    def nodes(self) -> Iterator[tuple[Node, _Scope]]:
        for scope in self.scopes.values():
            for node in scope.graph.nodes:
                yield node, scope

    def cache_dims(self, name: str) -> tuple[int | None, int | None] | None:
        """(kv heads, head size) of a past input [B, N, P, H] or combined [2, B, N, P, H]."""
        info = self.inputs.get(name)
        if info is None or info.dims is None or len(info.dims) not in (4, 5):
            return None
        heads, size = info.dims[-3], info.dims[-1]
        return (heads if isinstance(heads, int) else None), (size if isinstance(size, int) else None)


def _input(node: Node, index: int) -> str:
    return node.inputs[index] if index < len(node.inputs) else ""


def _int(node: Node, name: str, default: int | None = None) -> int | None:
    value = node.attributes.get(name, default)
    return value if isinstance(value, int) else default


def _const_rank2(scope: _Scope, name: str) -> tuple[int, int] | None:
    """The dims of a 2-D weight: an initializer or Constant, through casts, dequantisation, transposes."""
    swapped = False
    for _ in range(4):
        tensor = scope.tensor(name)
        if tensor is not None:
            if len(tensor.dims) != 2 or min(tensor.dims) <= 0:
                return None
            rows, columns = tensor.dims
            return (columns, rows) if swapped else (rows, columns)
        found = scope.producer(name)
        if found is None or found[0].op_type not in ("Cast", "Identity", "DequantizeLinear", "Transpose"):
            return None
        node, scope = found
        swapped ^= node.op_type == "Transpose"  # a 2-D transpose swaps the dims (perm [1, 0], the only other)
        name = _input(node, 0)
    return None


# --- projections: the MatMuls around attention -----------------------------------------------------

_WEIGHT_INPUT = {("", "MatMul"): 1, ("", "MatMulInteger"): 1, ("", "Gemm"): 1, ("", "QLinearMatMul"): 3,
                 (MS, "FusedMatMul"): 1, (MS, "DynamicQuantizeMatMul"): 1, (MS, "MatMulIntegerToFloat"): 1}


def _projection(node: Node, scope: _Scope) -> tuple[int, int] | None:
    """(K, N) of a matrix product by a weight: x [.., K] -> [.., N]; None for other nodes."""
    domain = "" if node.domain == "ai.onnx" else node.domain
    if (domain, node.op_type) == (MS, "MatMulNBits"):
        k, n = _int(node, "K"), _int(node, "N")
        return (k, n) if k and n else None
    index = _WEIGHT_INPUT.get((domain, node.op_type))
    if index is None:
        return None
    dims = _const_rank2(scope, _input(node, index))
    if dims and node.op_type in ("Gemm", "FusedMatMul") and _int(node, "transB", 0):
        return dims[1], dims[0]
    return dims


def _width(scope: _Scope, name: str, hops: int = 4) -> tuple[int | None, str]:
    """(last dim, how) of a [batch, seq, width] activation: its declared shape or the projection making it."""
    info = scope.info(name)
    if info is not None and info.dims and len(info.dims) == 3 and isinstance(info.dims[-1], int):
        return info.dims[-1], f"{name}'s shape"
    found = scope.producer(name)
    if found is None or hops == 0:
        return None, ""
    node, where = found
    made = _projection(node, where)
    if made:
        return made[1], f"{node.op_type} {node.name} N={made[1]}"
    if node.op_type in ("Add", "Cast", "Identity"):  # a bias, a cast: the width of the data operand
        for operand in node.inputs:
            if operand and where.tensor(operand) is None:
                return _width(where, operand, hops - 1)
    return None, ""


_LAYOUT = {"Transpose", "Reshape", "Cast", "Identity"}


def _out_projection(scope: _Scope, name: str, hops: int = 4) -> tuple[int | None, str]:
    """(K, how) of the projection that reads attention output `name` (through reshapes and transposes)."""
    for node in scope.consumers.get(name, []):
        made = _projection(node, scope)
        if made and _input(node, 0) == name:
            return made[0], f"output projection {node.op_type} {node.name} K={made[0]}"
        if node.op_type in _LAYOUT and hops > 0 and node.outputs:
            found = _out_projection(scope, node.outputs[0], hops - 1)
            if found[0]:
                return found
    return None, ""


# --- evidence --------------------------------------------------------------------------------------

class _Evidence:
    """Values for one fact from several places; the fact is their common value, or None."""

    def __init__(self) -> None:
        self.values: list[tuple[int, str]] = []
        self.conflict = False

    def add(self, value: int | None, how: str) -> None:
        if isinstance(value, int) and value > 0:
            self.values.append((value, how))

    def divide(self, total: int | None, parts: int | None, how: str) -> None:
        if total and parts:
            if total % parts:  # not a whole head size: the structure is not what we think
                self.conflict = True
            else:
                self.add(total // parts, f"{how} / {parts}")

    def result(self) -> tuple[int | None, str]:
        if self.conflict or not self.values or len({v for v, _ in self.values}) > 1:
            return None, ""
        return self.values[0][0], "; ".join(how for _, how in self.values)


@dataclass
class _Site:
    """The evidence gathered at one attention site."""

    node: Node
    op: str
    heads: _Evidence = field(default_factory=_Evidence)
    kv_heads: _Evidence = field(default_factory=_Evidence)
    size: _Evidence = field(default_factory=_Evidence)
    past_key: str | None = None
    past_value: str | None = None
    out_k: tuple[int | None, str] = (None, "")

    def cache(self, ix: _Index, past_key: str, past_value: str) -> None:
        dims = ix.cache_dims(past_key)
        if dims is None:
            return
        self.past_key, self.past_value = past_key, past_value or None
        self.kv_heads.add(dims[0], f"{past_key} dims")
        self.size.add(dims[1], f"{past_key} dims")

    def done(self, window: int | None = None) -> AttentionSite:
        size, size_how = self.size.result()
        if not self.heads.values and size and self.out_k[0]:  # no heads attribute: K = heads * head size
            self.heads.divide(self.out_k[0], size, self.out_k[1])
        heads, heads_how = self.heads.result()
        kv, kv_how = self.kv_heads.result()
        how = {k: v for k, v in (("num_heads", heads_how), ("kv_num_heads", kv_how), ("head_size", size_how))
               if v}
        return AttentionSite(self.node.name, self.op, heads, kv, size, self.past_key, self.past_value, window,
                             how)


def _site(ix: _Index, node: Node, scope: _Scope) -> AttentionSite | None:
    domain = "" if node.domain == "ai.onnx" else node.domain
    reader = _READERS.get((domain, node.op_type))
    return reader(ix, node, scope) if reader else None


def _group_query(ix: _Index, node: Node, scope: _Scope) -> AttentionSite:
    site = _Site(node, f"{MS}.GroupQueryAttention")
    heads, kv = _int(node, "num_heads"), _int(node, "kv_num_heads")
    site.heads.add(heads, "num_heads attribute")
    site.kv_heads.add(kv, "kv_num_heads attribute")
    width, how = _width(scope, _input(node, 0))
    if not _input(node, 1):  # packed QKV: [batch, seq, (heads + 2 * kv heads) * head size]
        site.size.divide(width, heads + 2 * kv if heads and kv else None, f"packed QKV width ({how})")
    else:
        site.size.divide(width, heads, f"query width ({how})")
        key_width, key_how = _width(scope, _input(node, 1))
        site.size.divide(key_width, kv, f"key width ({key_how})")
    site.cache(ix, _input(node, 3), _input(node, 4))
    out_k, out_how = _out_projection(scope, node.outputs[0]) if node.outputs else (None, "")
    site.size.divide(out_k, heads, out_how)
    window = _int(node, "local_window_size", -1)
    return site.done(window if window and window > 0 else None)


def _multi_head(ix: _Index, node: Node, scope: _Scope) -> AttentionSite:
    site = _Site(node, f"{MS}.MultiHeadAttention")
    heads = _int(node, "num_heads")
    site.heads.add(heads, "num_heads attribute")
    site.kv_heads.add(heads, "num_heads attribute (MultiHeadAttention has no kv heads)")
    width, how = _width(scope, _input(node, 0))
    site.size.divide(width, heads, f"query width ({how})")
    key = _input(node, 1)
    if key in ix.inputs:  # a cross-attention cache fed straight in
        site.cache(ix, key, _input(node, 2))
    elif key:
        key_width, key_how = _width(scope, key)
        site.size.divide(key_width, heads, f"key width ({key_how})")
    if _input(node, 6):
        site.cache(ix, _input(node, 6), _input(node, 7))
    out_k, out_how = _out_projection(scope, node.outputs[0]) if node.outputs else (None, "")
    site.size.divide(out_k, heads, out_how)
    return site.done()


def _contrib_attention(ix: _Index, node: Node, scope: _Scope) -> AttentionSite:
    site = _Site(node, f"{MS}.Attention")
    heads = _int(node, "num_heads")
    site.heads.add(heads, "num_heads attribute")
    site.kv_heads.add(heads, "num_heads attribute (Attention has no kv heads)")
    sizes = node.attributes.get("qkv_hidden_sizes")
    weight = _const_rank2(scope, _input(node, 1))
    if isinstance(sizes, tuple) and sizes and isinstance(sizes[0], int):
        site.size.divide(sizes[0], heads, f"qkv_hidden_sizes[0] {sizes[0]}")
    elif weight and weight[1] % 3 == 0:  # without qkv_hidden_sizes, q, k and v are equal thirds
        site.size.divide(weight[1] // 3, heads, f"a third of the QKV weight's {weight[1]} columns")
    site.cache(ix, _input(node, 4), _input(node, 4))
    out_k, out_how = _out_projection(scope, node.outputs[0]) if node.outputs else (None, "")
    site.size.divide(out_k, heads, out_how)
    return site.done()


def _onnx_attention(ix: _Index, node: Node, scope: _Scope) -> AttentionSite:
    site = _Site(node, "Attention")
    heads, kv = _int(node, "q_num_heads"), _int(node, "kv_num_heads")
    site.heads.add(heads, "q_num_heads attribute")
    site.kv_heads.add(kv, "kv_num_heads attribute")
    if heads:  # 3-D inputs [batch, seq, heads * head size]
        width, how = _width(scope, _input(node, 0))
        site.size.divide(width, heads, f"query width ({how})")
        key_width, key_how = _width(scope, _input(node, 1))
        site.size.divide(key_width, kv, f"key width ({key_how})")
    site.cache(ix, _input(node, 4), _input(node, 5))
    site.out_k = _out_projection(scope, node.outputs[0]) if node.outputs else (None, "")
    site.size.divide(site.out_k[0], heads, site.out_k[1])
    return site.done()


# --- plain attention: MatMul, Softmax, MatMul -------------------------------------------------------

_SCORE_OPS = {"Add", "Sub", "Mul", "Div", "Where", "Cast", "Identity", "Tanh"}  # masks, scales, softcaps
_CACHE_PATH = {"Transpose", "Reshape", "Expand", "Unsqueeze", "Squeeze", "Cast", "Identity", "Concat", "Mul",
               "Div", "Gather", "Slice", "Split", "Tile"}  # a key from its cache to the scores
_DATA_FIRST = {"Reshape", "Expand", "Unsqueeze", "Squeeze", "Gather", "Slice", "Split", "Tile", "Transpose",
               "Cast", "Identity"}  # ops whose other inputs are shapes, axes or indices


def _data_inputs(node: Node) -> tuple[str, ...]:
    if node.op_type in _DATA_FIRST:
        return node.inputs[:1]
    return node.inputs[1:] if node.op_type == "Where" else node.inputs  # Where's first input is a condition


def _is_product(node: Node, scope: _Scope) -> bool:
    """A MatMul of two activations (attention scores), not of an activation and a weight; or onnxruntime's
    FusedMatMul, into which its optimizer folds the key's Transpose and the scores' scale (a graph
    optimized ahead, build/variants.py)."""
    product = ((node.op_type == "MatMul" and node.domain in ("", "ai.onnx"))
               or (node.op_type == "FusedMatMul" and node.domain == MS))
    return product and all(scope.tensor(n) is None for n in node.inputs[:2])


def _upstream(scope: _Scope, name: str, ops: set[str], hops: int) -> Iterator[tuple[Node, _Scope]]:
    """Nodes that feed `name` through `ops`, nearest first (at most `hops` deep)."""
    frontier, seen = [(name, scope)], {name}
    for _ in range(hops):
        nxt = []
        for current, where in frontier:
            found = where.producer(current)
            if found is None:
                continue
            yield found
            node, at = found
            if node.op_type in ops:
                nxt += [(n, at) for n in _data_inputs(node) if n and n not in seen and at.tensor(n) is None]
                seen.update(n for n, _ in nxt)
        frontier = nxt


def _cache_input(ix: _Index, scope: _Scope, name: str) -> str | None:
    if name in ix.inputs:
        return name
    for node, _ in _upstream(scope, name, _CACHE_PATH, 8):
        if node.op_type in _CACHE_PATH:
            found = next((n for n in _data_inputs(node) if ix.cache_dims(n) is not None), None)
            if found:
                return found
    return None


def _plain_attention(ix: _Index, node: Node, scope: _Scope) -> AttentionSite | None:
    scores = next((n for n, at in _upstream(scope, _input(node, 0), _SCORE_OPS, 4) if _is_product(n, at)),
                  None)
    weighted = next((c for c in _downstream(scope, node.outputs[0] if node.outputs else "")
                     if _is_product(c, scope)), None)
    if scores is None or weighted is None:
        return None
    site = _Site(node, "Softmax")
    past_key = _cache_input(ix, scope, _input(scores, 1))
    if past_key:
        site.cache(ix, past_key, _cache_input(ix, scope, _input(weighted, 1)) or "")
    site.out_k = _out_projection(scope, weighted.outputs[0]) if weighted.outputs else (None, "")
    return site.done()


def _downstream(scope: _Scope, name: str, hops: int = 3) -> Iterator[Node]:
    """Consumers of softmax output `name`, through NaN guards, casts and dropouts."""
    for node in scope.consumers.get(name, []):
        yield node
        if node.op_type in ("Where", "Cast", "Identity", "Dropout") and hops > 0 and node.outputs:
            yield from _downstream(scope, node.outputs[0], hops - 1)


_READERS = {(MS, "GroupQueryAttention"): _group_query, (MS, "MultiHeadAttention"): _multi_head,
            (MS, "Attention"): _contrib_attention, ("", "Attention"): _onnx_attention,
            ("", "Softmax"): _plain_attention}


# --- positions -------------------------------------------------------------------------------------

def _table_dims(ix: _Index, scope: _Scope, name: str, depth: int = 0) -> list[tuple[int, ...]]:
    """Dims of the constant `name`; an If's output gives each branch's (the builder's LongRoPE caches)."""
    tensor = scope.tensor(name)
    if tensor is not None:
        return [tensor.dims]
    found = scope.producer(name)
    if found is None or depth > 3:
        return []
    node, where = found
    if node.op_type in ("Cast", "Identity"):
        return _table_dims(ix, where, _input(node, 0), depth + 1)
    if node.op_type != "If":
        return []
    index = node.outputs.index(name)
    dims: list[tuple[int, ...]] = []
    for branch in node.subgraphs():
        if index < len(branch.outputs):
            dims += _table_dims(ix, ix.scopes[id(branch)], branch.outputs[index].name, depth + 1)
    return dims


def _rotary_caches(ix: _Index) -> Iterator[tuple[Node, list[tuple[int, ...]]]]:
    """(node, dims of its cos cache's candidates) for each rotary op with a [positions, rotary / 2] cache."""
    for node, scope in ix.nodes():
        domain = "" if node.domain == "ai.onnx" else node.domain
        cos = None
        if (domain, node.op_type) == (MS, "GroupQueryAttention") and _int(node, "do_rotary", 0):
            cos = _input(node, 7)
        elif (domain, node.op_type) == (MS, "RotaryEmbedding"):
            cos = _input(node, 2)
        elif (domain, node.op_type) == ("", "RotaryEmbedding") and _input(node, 3):
            cos = _input(node, 1)  # without position_ids, the caches are [batch, seq, ...]: no limit
        if cos:
            dims = [d for d in _table_dims(ix, scope, cos) if len(d) == 2 and min(d) > 0]
            if dims:
                yield node, dims


def _max_positions(ix: _Index) -> tuple[int | None, str]:
    limits: list[tuple[int, str]] = []
    for node, dims in _rotary_caches(ix):
        rows = max(d[0] for d in dims)  # an If picks among caches by length: the largest holds
        limits.append((rows, f"{node.op_type} {node.name} cos cache {rows} rows"))
    limits += _position_tables(ix)
    if not limits:
        return None, ""
    value = min(v for v, _ in limits)
    first = next(how for v, how in limits if v == value)
    more = f" (and {len(limits) - 1} more)" if len(limits) > 1 else ""
    return value, first + more


def _rotary_dim(ix: _Index) -> tuple[int | None, str]:
    dims = {d[1] * 2 for _, found in _rotary_caches(ix) for d in found}
    if len(dims) != 1:
        return None, ""
    return dims.pop(), "cos cache columns * 2"


def _position_tables(ix: _Index) -> list[tuple[int, str]]:
    """(rows, how) of learned position tables."""
    tokens = _token_lookups(ix)
    found = []
    for node, scope in ix.nodes():
        table = None
        if node.op_type == "Gather" and _feeding_input(ix, scope, _input(node, 1)) == "position_ids":
            table = _const_rank2(scope, _input(node, 0))
        elif node.op_type == "Add" and len(node.inputs) == 2:
            table = _added_table(ix, scope, node, tokens)
        if table:
            found.append((table[0], f"position table of {table[0]} rows ({node.op_type} {node.name})"))
    return found


def _added_table(ix: _Index, scope: _Scope, add: Node, tokens: dict[int, int]) -> tuple[int, int] | None:
    """A 2-D table added to the token embeddings, looked up by positions (computed ones, or a slice)
    rather than by another graph input (BERT's token_type_ids pick a table that is not positions)."""
    from_tokens = [_from_tokens(scope, name, tokens) for name in add.inputs]
    if from_tokens.count(True) != 1:
        return None
    found = _through_casts(scope, add.inputs[from_tokens.index(False)])
    if found is None:
        return None
    lookup, at = found
    if lookup.op_type == "Gather" and _int(lookup, "axis", 0) == 0:
        by = _feeding_input(ix, at, _input(lookup, 1))
        return _const_rank2(at, _input(lookup, 0)) if by in (None, "position_ids") else None
    return _const_rank2(at, _input(lookup, 0)) if lookup.op_type == "Slice" else None


def _from_tokens(scope: _Scope, name: str, tokens: dict[int, int], hops: int = 3) -> bool:
    """Whether `name` is the token embeddings, or a sum or cast of them."""
    found = scope.producer(name)
    if found is None:
        return False
    node, at = found
    if id(node) in tokens:
        return True
    return (node.op_type in ("Add", "Cast", "Identity") and hops > 0
            and any(_from_tokens(at, n, tokens, hops - 1) for n in node.inputs if n))


def _through_casts(scope: _Scope, name: str) -> tuple[Node, _Scope] | None:
    found = scope.producer(name)
    for _ in range(3):
        if found is None or found[0].op_type not in ("Cast", "Identity"):
            break
        found = found[1].producer(_input(found[0], 0))
    return found


def _feeding_input(ix: _Index, scope: _Scope, name: str) -> str | None:
    """The graph input `name` is, through reshapes and casts; None when it is computed."""
    for _ in range(4):
        if name in ix.inputs:
            return name
        found = scope.producer(name)
        if found is None or found[0].op_type not in ("Cast", "Identity", "Reshape", "Unsqueeze", "Squeeze",
                                                     "Flatten"):
            return None
        name, scope = _input(found[0], 0), found[1]
    return None


# --- vocabulary ------------------------------------------------------------------------------------

def _token_lookups(ix: _Index) -> dict[int, int]:
    """id(lookup node) -> its table's rows, for Gathers of a 2-D weight by `input_ids` (token embeddings)."""
    lookups = {}
    for node, scope in ix.nodes():
        lookup = node.op_type in ("Gather", "GatherBlockQuantized")
        if lookup and _feeding_input(ix, scope, _input(node, 1)) == "input_ids":
            table = scope.tensor(_input(node, 0))
            rows = table.dims[0] if table is not None and len(table.dims) == 2 else 0
            if rows > 0 and _int(node, "gather_axis", 0) == 0:
                lookups[id(node)] = rows
    return lookups


def _vocab_size(ix: _Index) -> tuple[int | None, str]:
    logits = next((v for v in ix.root.graph.outputs if v.name == "logits"), None)
    if logits is not None:
        if logits.dims and isinstance(logits.dims[-1], int) and logits.dims[-1] > 0:
            return logits.dims[-1], "logits output's last dim"
        width, how = _width(ix.root, logits.name)
        if width:
            return width, f"the projection making logits ({how})"
    rows = set(_token_lookups(ix).values())
    if len(rows) == 1:
        return rows.pop(), "token embedding rows"
    return None, ""
