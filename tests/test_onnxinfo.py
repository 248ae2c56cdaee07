"""The pure-Python ONNX reader (onnxinfo) against the onnx package, and what graphfacts derives
from real exports against the configs their exporters wrote.

- Structure: every export among the test models, the demo model and build/graphs.py's decoders
  (embedded and external data) read the same as `onnx.load` reads them, attributes included.
- Facts: every builder export (fp32, int4) and Optimum export gives the heads, kv heads, head size,
  position limit and vocabulary of its genai_config.json / config.json; hand-made graphs cover each
  attention op, rotary op, subgraph nesting and the ambiguous cases (which give None).
- A few hundred MB of embedded weights are read with a few KB of file reads and little memory.
- Fuzz: thousands of seeded mutations of real models raise ConfigError or read, nothing else,
  each visiting no more fields than the input has bytes.
"""

from __future__ import annotations

import io
import json
import random
import struct
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import pytest
from build import graphs, hfmodels
from onnx import TensorProto, helper, numpy_helper

from ortpipe import graphfacts, onnxinfo
from ortpipe.errors import ConfigError

REPO = Path(__file__).resolve().parent.parent
DEMO = REPO / "models" / "demo"
DEMO_Q4 = DEMO / "onnx" / "model_q4.onnx"  # the model builder's int4 export
BUILDER = ("llama-builder-fp32", "llama-builder-int4", "qwen2-builder-fp32", "phi3-builder-fp32",
           "gemma2-builder-fp32")
OPTIMUM = ("llama-concat", "gpt2-optimum")


# --- the onnx package's reading, in onnxinfo's terms -----------------------------------------------

def _float(value: float) -> bytes:
    return struct.pack("<f", value)  # NaN-safe, and float32 as stored


def _onnx_info(v: onnx.ValueInfoProto) -> tuple:
    kind = v.type.WhichOneof("value")
    if kind not in ("tensor_type", "sparse_tensor_type"):
        return v.name, 0, None
    t = getattr(v.type, kind)
    if not t.HasField("shape"):
        return v.name, t.elem_type, None
    dims = tuple(d.dim_value if d.HasField("dim_value") else d.dim_param if d.HasField("dim_param") else None
                 for d in t.shape.dim)
    return v.name, t.elem_type, dims


def _onnx_tensor(t: onnx.TensorProto) -> tuple:
    location = next((e.value for e in t.external_data if e.key == "location"), None)
    return t.name, t.data_type, tuple(t.dims), t.data_location == TensorProto.EXTERNAL, location


def _onnx_attribute(a: onnx.AttributeProto) -> object:
    A = onnx.AttributeProto
    readers: dict[int, Callable[[], object]] = {
        A.FLOAT: lambda: _float(a.f), A.INT: lambda: a.i, A.STRING: lambda: a.s,
        A.TENSOR: lambda: _onnx_tensor(a.t), A.GRAPH: lambda: _onnx_graph(a.g),
        A.FLOATS: lambda: tuple(_float(f) for f in a.floats), A.INTS: lambda: tuple(a.ints),
        A.STRINGS: lambda: tuple(a.strings), A.TENSORS: lambda: tuple(_onnx_tensor(t) for t in a.tensors),
        A.GRAPHS: lambda: tuple(_onnx_graph(g) for g in a.graphs)}
    return readers[a.type]() if a.type in readers else None


def _onnx_graph(g: onnx.GraphProto) -> dict:
    nodes = [(n.op_type, n.domain, n.name, tuple(n.input), tuple(n.output),
              {a.name: v for a in n.attribute if (v := _onnx_attribute(a)) is not None}) for n in g.node]
    return {"name": g.name, "inputs": [_onnx_info(v) for v in g.input],
            "outputs": [_onnx_info(v) for v in g.output], "value_info": [_onnx_info(v) for v in g.value_info],
            "nodes": nodes,
            "initializers": [_onnx_tensor(t) for t in g.initializer]}


def _onnx_model(m: onnx.ModelProto) -> dict:
    return {"ir_version": m.ir_version, "opsets": {o.domain: o.version for o in m.opset_import},
            "producer": (m.producer_name, m.producer_version),
            "metadata": {p.key: p.value for p in m.metadata_props}, "graph": _onnx_graph(m.graph),
            "functions": [(f.domain, f.name, tuple(f.input), tuple(f.output), len(f.node))
                          for f in m.functions]}


# --- onnxinfo's reading, in the same terms ---------------------------------------------------------

def _info(v: onnxinfo.ValueInfo) -> tuple:
    return v.name, v.elem_type, v.dims


def _tensor(t: onnxinfo.Tensor) -> tuple:
    return t.name, t.elem_type, t.dims, t.external, t.location


def _value(v: object) -> object:
    if isinstance(v, float):
        return _float(v)
    if isinstance(v, onnxinfo.Tensor):
        return _tensor(v)
    if isinstance(v, onnxinfo.Graph):
        return _graph(v)
    if isinstance(v, tuple):
        return tuple(_value(x) for x in v)
    return v


def _graph(g: onnxinfo.Graph) -> dict:
    nodes = [(n.op_type, n.domain, n.name, n.inputs, n.outputs,
              {k: _value(v) for k, v in n.attributes.items()}) for n in g.nodes]
    return {"name": g.name, "inputs": [_info(v) for v in g.inputs], "outputs": [_info(v) for v in g.outputs],
            "value_info": [_info(v) for v in g.value_info], "nodes": nodes,
            "initializers": [_tensor(t) for t in g.initializers]}


def _model(m: onnxinfo.Model) -> dict:
    return {"ir_version": m.ir_version, "opsets": dict(m.opset_imports),
            "producer": (m.producer_name, m.producer_version), "metadata": dict(m.metadata),
            "graph": _graph(m.graph),
            "functions": [(f.domain, f.name, f.inputs, f.outputs, len(f.nodes)) for f in m.functions]}


def assert_reads_like_onnx(path: Path) -> onnxinfo.Model:
    expected = _onnx_model(onnx.load(str(path), load_external_data=False))
    from_file = onnxinfo.read_model(path)
    assert _model(from_file) == expected
    assert _model(onnxinfo.read_model(path.read_bytes())) == expected
    return from_file


# --- structure: every test model, the demo, build/graphs.py ---------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("name", [*BUILDER, *OPTIMUM, "whisper-builder-fp32"])
def test_exports_read_like_onnx(name: str) -> None:
    files = sorted(hfmodels.get(name).glob("*.onnx"))
    assert files
    for path in files:
        model = assert_reads_like_onnx(path)
        assert model.graph.nodes and model.graph.inputs


def _present_files() -> list[Path]:
    """Every graph already in the cache (pipelines' models too), and the kernels ortpipe ships."""
    root = hfmodels.cache_root()
    found = [p for pattern in ("*/*.onnx", "*/*/*.onnx") for p in root.glob(pattern)]
    return sorted(found) + sorted((REPO / "py" / "ortpipe" / "kernels").glob("*.onnx"))


@pytest.mark.parametrize("path", _present_files(), ids=lambda p: f"{p.parent.name}/{p.name}")
def test_every_graph_present_reads_like_onnx(path: Path) -> None:
    assert_reads_like_onnx(path)


def test_demo_reads_like_onnx() -> None:
    model = assert_reads_like_onnx(DEMO_Q4)
    assert all(t.external and t.location == "model_q4.onnx.data" for t in model.graph.initializers
               if len(t.dims) == 2)


GRAPH_CASES: dict[str, Callable[[Path], Path]] = {
    "separate": lambda d: graphs.build_separate(d),
    "dual-heads": lambda d: graphs.build_separate(d, layers=(0, 2), heads={0: 2, 2: 3},
                                                  head_size={0: 8, 2: 4}),
    "combined": lambda d: graphs.build_combined(d, heads=3, head_size=4),
    "sliding-no-position-ids": lambda d: graphs.build_sliding(d, with_position_ids=False),
}


@pytest.mark.parametrize("external", [False, True], ids=["embedded", "external"])
@pytest.mark.parametrize("case", GRAPH_CASES)
def test_test_graphs_read_like_onnx(tmp_path: Path, case: str, external: bool) -> None:
    path = GRAPH_CASES[case](tmp_path) / "model.onnx"
    if external:
        onnx.save(onnx.load(str(path)), str(path), save_as_external_data=True, location="weights.bin",
                  size_threshold=0)
    model = assert_reads_like_onnx(path)
    assert any(t.external for t in model.graph.initializers) == external
    assert {t.location for t in model.graph.initializers if t.external} <= {"weights.bin"}


def test_attributes_of_every_kind_and_functions_read_like_onnx(tmp_path: Path) -> None:
    body = helper.make_graph([helper.make_node("Identity", ["x"], ["y"], name="inner")], "body",
                             [helper.make_tensor_value_info("x", TensorProto.FLOAT, None)],
                             [helper.make_tensor_value_info("y", TensorProto.FLOAT, [])])
    tensor = numpy_helper.from_array(np.arange(6, dtype=np.int64).reshape(2, 3), "t")
    node = helper.make_node(
        "Custom", ["a", ""], ["b"], name="n", domain="my.domain", f=float("nan"), i=-(2 ** 62),
        s=b"\xff\x00bytes", floats=[1.5, -0.0, float("inf")], ints=[0, -1, 2 ** 40], strings=[b"x", b""],
        t=tensor, g=body, graphs=[body, body], tensors=[tensor])
    node.attribute.append(helper.make_attribute("empty", [], attr_type=onnx.AttributeProto.INTS))
    seq = helper.make_tensor_sequence_value_info("seq", TensorProto.FLOAT, None)
    a = helper.make_tensor_value_info("a", TensorProto.FLOAT16, ["n", 3, None])
    graph = helper.make_graph([node], "g", [a],
                              [helper.make_tensor_value_info("b", TensorProto.BFLOAT16, None), seq], [tensor])
    function = helper.make_function("my.domain", "Fn", ["p"], ["q"], [helper.make_node("Neg", ["p"], ["q"])],
                                     [helper.make_opsetid("", 21)])
    opsets = [helper.make_opsetid("", 21), helper.make_opsetid("my.domain", 1)]
    model = helper.make_model(graph, opset_imports=opsets, functions=[function], producer_name="tests",
                              producer_version="1")
    helper.set_model_props(model, {"k": "v"})
    onnx.save(model, str(tmp_path / "m.onnx"))
    read = assert_reads_like_onnx(tmp_path / "m.onnx")
    assert read.graph.nodes[0].attributes["i"] == -(2 ** 62)
    assert [n.name for n, _ in read.graph.walk()] == ["n", "inner", "inner", "inner"]
    assert read.functions[0].nodes[0].op_type == "Neg"


def test_a_file_object_is_read_from_where_it_stands() -> None:
    data = DEMO_Q4.read_bytes()
    f = io.BytesIO(b"junk" + data)
    f.seek(4)
    assert _model(onnxinfo.read_model(f)) == _model(onnxinfo.read_model(data))


# --- large models: seek past payloads --------------------------------------------------------------

class CountingFile(io.RawIOBase):
    """A binary file that counts what is read from it."""

    def __init__(self, f: io.BufferedIOBase | io.BytesIO, name: str):
        super().__init__()
        self.f, self.name = f, name
        self.bytes_read = self.reads = 0

    def read(self, n: int = -1) -> bytes:
        data = self.f.read(n)
        self.bytes_read += len(data)
        self.reads += 1
        return data

    def seek(self, offset: int, whence: int = 0) -> int:
        return self.f.seek(offset, whence)

    def tell(self) -> int:
        return self.f.tell()

    def seekable(self) -> bool:
        return True

    def close(self) -> None:
        self.f.close()


@pytest.fixture(scope="module")
def big_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A builder-like decoder with 12 embedded 26 MB weights (about 315 MB)."""
    path = tmp_path_factory.mktemp("big") / "model.onnx"
    weights = [numpy_helper.from_array(np.zeros((2560, 2560), np.float32), f"big{i}") for i in range(12)]
    model = _decoder_model(_gqa_packed_nbits(), extra_initializers=weights)
    onnx.save(model, str(path))
    return path


@pytest.mark.slow
def test_embedded_weights_are_skipped_not_read(big_model: Path) -> None:
    size = big_model.stat().st_size
    assert size > 300e6
    f = CountingFile(open(big_model, "rb"), str(big_model))
    tracemalloc.start()
    start = time.perf_counter()
    model = onnxinfo.read_model(f)
    seconds = time.perf_counter() - start
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    f.close()
    print(f"read {size / 1e6:.0f} MB model: {seconds * 1e3:.1f} ms, {f.reads} reads of {f.bytes_read} bytes "
          f"in all, peak {peak / 1e3:.0f} kB traced")
    assert [t.dims for t in model.graph.initializers if t.name.startswith("big")] == [(2560, 2560)] * 12
    assert f.bytes_read < 200_000 and peak < 2_000_000  # counted, not timed: the payloads are never read
    assert graphfacts.decoder_facts(model).head_size == 24


# --- malformed input: ConfigError, and nothing else -------------------------------------------------

def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
        n >>= 7
        if not n:
            return bytes(out)


def _field(number: int, payload: bytes | int, wire: int = 2) -> bytes:
    key = _varint(number << 3 | wire)
    if wire == 2:
        assert isinstance(payload, bytes)
        return key + _varint(len(payload)) + payload
    assert isinstance(payload, int)
    return key + _varint(payload)


def _nested_graphs(depth: int) -> bytes:
    """A model whose graph holds a node whose attribute holds a graph ... `depth` graphs deep."""
    graph = _field(2, b"leaf")
    for _ in range(depth):
        attribute = _field(1, b"body") + _field(20, 5, wire=0) + _field(6, graph)
        graph = _field(1, _field(4, b"If") + _field(5, attribute))
    return _field(7, graph)


def _every_value_info(model: onnxinfo.Model) -> onnxinfo.Model:
    """The model, each of its graphs' value_info read (which a graph reads when first asked for)."""
    for graph in (model.graph, *(sub for node, _ in model.graph.walk() for sub in node.subgraphs())):
        assert isinstance(graph.value_info, tuple)
    return model


def _read(data: bytes) -> tuple[onnxinfo.Model | None, onnxinfo._Reader]:
    reader = onnxinfo._Reader(data, "fuzz.onnx")
    try:
        return _every_value_info(reader.model()), reader
    except ConfigError as e:
        assert '"fuzz.onnx" is not a readable ONNX model' in str(e)
        return None, reader


MALFORMED = {
    "empty": (b"", "no graph"),
    "text": (b"this is not a model\n", "wire type"),
    "truncated varint": (b"\x08\xff\xff", "varint"),
    "11-byte varint": (b"\x08" + b"\xff" * 10 + b"\x01", "varint"),
    "absurd length": (b"\x3a" + _varint(2 ** 62), "runs past"),
    "length past the end": (_field(7, _field(2, b"graph"))[:-2], "runs past"),
    "graph as a varint": (_field(7, 5, wire=0), "wire type 0"),
    "group wire type": (b"\x0b\x0c", "wire type 3"),
    "field number 0": (b"\x02\x00", "field number 0"),
    "name not UTF-8": (_field(7, _field(2, b"\xff\xfe")), "UTF-8"),
    "packed floats cut": (_field(7, _field(1, _field(5, _field(1, b"f") + _field(7, b"\x00\x00\x80")))),
                          "packed list of floats"),
    "packed ints cut": (_field(7, _field(5, _field(1, b"\xff"))), "cut off"),
    "nested too deep": (_nested_graphs(onnxinfo.MAX_GRAPH_DEPTH + 1), "nested"),
    "huge name": (_field(7, _field(2, b"x" * (onnxinfo.MAX_FIELD_BYTES + 1))), "where a name"),
}


@pytest.mark.parametrize("case", MALFORMED)
def test_malformed_input_is_a_config_error(case: str) -> None:
    data, why = MALFORMED[case]
    with pytest.raises(ConfigError, match="not a readable ONNX model") as error:
        onnxinfo.read_model(data, "bad.onnx")
    assert why in str(error.value) and '"bad.onnx"' in str(error.value)
    with pytest.raises(ConfigError, match=why):
        onnxinfo.read_model(io.BytesIO(data), "bad.onnx")


def test_graphs_nested_up_to_the_limit_are_read() -> None:
    model = onnxinfo.read_model(_nested_graphs(onnxinfo.MAX_GRAPH_DEPTH))
    assert sum(1 for _ in model.graph.walk()) == onnxinfo.MAX_GRAPH_DEPTH


def test_an_oversized_attribute_value_is_omitted_unread() -> None:
    blob = b"\x00" * (onnxinfo.MAX_FIELD_BYTES + 1)  # an EP context's compiled model, say
    attribute = _field(1, b"ep_cache_context") + _field(20, 3, wire=0) + _field(4, blob)
    data = _field(7, _field(1, _field(4, b"EPContext") + _field(5, attribute)))
    node = onnxinfo.read_model(data).graph.nodes[0]
    assert node.attributes["ep_cache_context"] == onnxinfo.Omitted(len(blob))


def _seeds() -> list[bytes]:
    seeds = [DEMO_Q4.read_bytes(), _decoder_model(_gqa_in_subgraphs()).SerializeToString(),
             _decoder_model(_onnx_attention_3d()).SerializeToString()]
    return seeds + [_nested_graphs(5)]


def _mutate(rng: random.Random, seeds: list[bytes], case: int) -> bytes:
    data = bytearray(rng.choice(seeds))
    at = rng.randrange(len(data))
    kind = case % 9
    if kind == 0:  # truncated
        return bytes(data[:at])
    if kind == 1:  # a few bytes changed
        for _ in range(rng.randint(1, 8)):
            data[rng.randrange(len(data))] = rng.randrange(256)
    elif kind == 2:  # a run of 0xff: absurd varints and lengths
        data[at:at + rng.randint(1, 12)] = b"\xff" * rng.randint(1, 12)
    elif kind == 3:  # random bytes inserted
        data[at:at] = rng.randbytes(rng.randint(1, 64))
    elif kind == 4:  # a range deleted
        del data[at:at + rng.randint(1, 256)]
    elif kind == 5:  # random bytes only
        return rng.randbytes(rng.randint(0, 4096))
    elif kind == 6:  # two models spliced
        other = rng.choice(seeds)
        return bytes(data[:at]) + other[rng.randrange(len(other)):]
    elif kind == 7:  # a range repeated
        data[at:at] = data[at:at + rng.randint(1, 512)] * rng.randint(2, 4)
    else:  # one byte made a letter: inside a name, the model still reads
        data[at] = rng.randrange(0x61, 0x7B)
    return bytes(data)


def _onnx_reads(data: bytes) -> dict | None:
    try:
        return _onnx_model(onnx.load_model_from_string(data))
    except Exception:  # protobuf's DecodeError, or onnx's own checks
        return None


def test_fuzz_only_config_errors_and_bounded_work() -> None:
    """Seeded mutations: ConfigError or a model; when onnx reads the input too, it reads the same.

    onnx reads some inputs this reader refuses (a known field with the wrong wire type, which protobuf
    keeps as an unknown field; a name that is not UTF-8), and refuses a few this reader reads (a
    corrupt message inside a field this reader skips, such as a doc string or metadata).
    """
    rng = random.Random(15)
    seeds = _seeds()
    outcomes = {"both read": 0, "ConfigError": 0, "refused, onnx reads": 0, "read, onnx refuses": 0}
    for case in range(4000):
        data = _mutate(rng, seeds, case)
        model, reader = _read(data)
        assert reader.fields <= len(data), f"case {case}: {reader.fields} fields in {len(data)} bytes"
        expected = _onnx_reads(data)
        if model is None:
            outcomes["ConfigError" if expected is None else "refused, onnx reads"] += 1
        elif expected is None:
            outcomes["read, onnx refuses"] += 1
        else:
            outcomes["both read"] += 1
            assert _model(model) == expected, f"case {case}"
        if model is not None:
            graphfacts.decoder_facts(model)  # whatever the graph: facts or None, never an exception
        if case % 10 == 0:  # through a file: the same outcome, and reads bounded by the fields visited
            f = CountingFile(io.BytesIO(data), "fuzz.onnx")
            try:
                assert (_every_value_info(onnxinfo.read_model(f)) is not None) == (model is not None)
            except ConfigError:
                assert model is None
            assert f.reads <= 3 * reader.fields + 3
    print(f"fuzz: {outcomes}")
    assert outcomes["both read"] > 200 and outcomes["ConfigError"] > 3000


# --- hand-made graphs: each attention op, rotary op and ambiguity ----------------------------------

V, H, HEADS, KV, SIZE, POSITIONS = 1000, 80, 6, 2, 24, 300  # no two alike: a mixed-up fact shows
B, S, P = "batch", "seq", "past"


def _weight(name: str, *dims: int, elem: int = TensorProto.FLOAT) -> onnx.TensorProto:
    """An initializer with dims and no data: onnxinfo never reads the data."""
    return onnx.TensorProto(name=name, data_type=elem, dims=list(dims))


def _io(name: str, dims: list, elem: int = TensorProto.FLOAT) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, elem, dims)


def _ms(op: str, inputs: list[str], outputs: list[str], **attrs: object) -> onnx.NodeProto:
    return helper.make_node(op, inputs, outputs, name=f"{op}_{outputs[0]}", domain="com.microsoft", **attrs)


def _node(op: str, inputs: list[str], outputs: list[str], **attrs: object) -> onnx.NodeProto:
    return helper.make_node(op, inputs, outputs, name=f"{op}_{outputs[0]}", **attrs)


class Part:
    """An attention block: nodes from `x` [B, S, H] to `attn` [B, S, HEADS * SIZE], its I/O and weights."""

    def __init__(self, nodes: list, inputs: list | None = None, weights: list | None = None,
                 outputs: list | None = None, opset: int = 21):
        self.nodes, self.inputs, self.weights = nodes, inputs or [], weights or []
        self.outputs, self.opset = outputs or [], opset


def _past(kv_heads: int | str = KV, size: int | str = "kv_cache_dim", layer: int = 0) -> list:
    return [_io(f"past_key_values.{layer}.{kind}", [B, kv_heads, P, size]) for kind in ("key", "value")]


def _rotary_weights(rows: int = POSITIONS, half: int = SIZE // 4) -> list:
    return [_weight("cos_cache", rows, half), _weight("sin_cache", rows, half)]  # partial rotary: SIZE / 2


def _decoder_model(part: Part, extra_initializers: list | None = None, logits: list | None = None,
                   embeddings: str = "tokens") -> onnx.ModelProto:
    """input_ids -> embeddings -> part -> output projection -> logits.

    embeddings: "tokens"; "positions" (+ a table gathered by position_ids); "bert" (+ a token type table
    gathered by token_type_ids, then + a position table gathered by a slice of a constant).
    """
    int64 = TensorProto.INT64
    nodes = [_node("Gather", ["embed", "input_ids"], ["x0"])]
    weights = [_weight("embed", V, H), _weight("o_proj", HEADS * SIZE, H), _weight("lm_head", H, V),
               _weight("positions", POSITIONS, H)]
    inputs = [_io("input_ids", [B, S], int64), _io("position_ids", [B, S], int64)]
    if embeddings == "positions":
        nodes += [_node("Gather", ["positions", "position_ids"], ["p"]), _node("Add", ["x0", "p"], ["x"])]
    elif embeddings == "bert":
        nodes += [_node("Gather", ["types", "token_type_ids"], ["t"]), _node("Add", ["x0", "t"], ["xt"]),
                  _node("Slice", ["position_buffer", "starts", "ends"], ["ids"]),
                  _node("Gather", ["positions", "ids"], ["p"]), _node("Add", ["xt", "p"], ["x"])]
        weights += [_weight("types", 2, H), _weight("position_buffer", 1, POSITIONS, elem=int64),
                    _weight("starts", 1, elem=int64), _weight("ends", 1, elem=int64)]
        inputs.append(_io("token_type_ids", [B, S], int64))
    else:
        nodes.append(_node("Identity", ["x0"], ["x"]))
    nodes += [*part.nodes, _node("MatMul", ["attn", "o_proj"], ["o"]),
              _node("MatMul", ["o", "lm_head"], ["logits"])]
    outputs = [_io("logits", logits or [B, S, V]), *part.outputs]
    graph = helper.make_graph(nodes, "decoder", inputs + part.inputs, outputs,
                              weights + part.weights + (extra_initializers or []))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", part.opset),
                                                   helper.make_opsetid("com.microsoft", 1)])


def _gqa(query: str, key: str = "", value: str = "", rotary: bool = True, layer: int = 0,
         heads: int = HEADS, out: str = "attn", **attrs: object) -> onnx.NodeProto:
    cos = ["cos_cache", "sin_cache"] if rotary else ["", ""]
    return _ms("GroupQueryAttention",
               [query, key, value, f"past_key_values.{layer}.key", f"past_key_values.{layer}.value",
                "seqlens_k", "total_len", *cos], [out, f"present.{layer}.key", f"present.{layer}.value"],
               num_heads=heads, kv_num_heads=KV, do_rotary=int(rotary), **attrs)


def _gqa_unpacked() -> Part:
    """Separate q/k/v MatMuls, a bias on q; the cache's head size symbolic."""
    nodes = [_node("MatMul", ["x", "wq"], ["q0"]), _node("Add", ["q0", "bq"], ["q"]),
             _node("MatMul", ["x", "wk"], ["k"]), _node("MatMul", ["x", "wv"], ["v"]),
             _gqa("q", "k", "v", local_window_size=64)]
    weights = [_weight("wq", H, HEADS * SIZE), _weight("bq", HEADS * SIZE), _weight("wk", H, KV * SIZE),
               _weight("wv", H, KV * SIZE), *_rotary_weights()]
    return Part(nodes, _past(), weights)


def _gqa_packed_nbits(n: int = (HEADS + 2 * KV) * SIZE) -> Part:
    """Packed QKV through an int4 MatMulNBits, as phi3/llama int4 builder exports."""
    nodes = [_ms("MatMulNBits", ["x", "wqkv", "scales"], ["qkv"], K=H, N=n, bits=4, block_size=16),
             _gqa("qkv")]
    weights = [_weight("wqkv", n, H // 16, 8, elem=TensorProto.UINT8), _weight("scales", n, H // 16),
               *_rotary_weights()]
    return Part(nodes, _past(), weights)


def _gqa_with_rotary_nodes() -> Part:
    """Rotary outside attention: com.microsoft RotaryEmbedding on q and k, then GroupQueryAttention."""
    part = _gqa_unpacked()
    part.nodes[-1:] = [_ms("RotaryEmbedding", ["q", "position_ids", "cos_cache", "sin_cache"], ["qr"]),
                       _ms("RotaryEmbedding", ["k", "position_ids", "cos_cache", "sin_cache"], ["kr"]),
                       _gqa("qr", "kr", "v", rotary=False)]
    return part


def _gqa_long_rope() -> Part:
    """The cos cache an If picks by length (the builder's LongRoPE): the larger branch counts."""
    part = _gqa_packed_nbits()
    branches = [helper.make_graph([_node("Identity", [f"{kind}_{size}"], [f"{kind}_out_{size}"])
                                   for kind in ("cos", "sin")], f"rope_{size}", [],
                                  [_io(f"{kind}_out_{size}", [None, None]) for kind in ("cos", "sin")])
                for size in ("short", "long")]
    select = _node("If", ["is_long"], ["cos_cache", "sin_cache"], then_branch=branches[1],
                   else_branch=branches[0])
    part.nodes.insert(0, select)
    part.weights = [w for w in part.weights if w.name not in ("cos_cache", "sin_cache")]
    part.weights += [_weight("cos_short", 128, SIZE // 4), _weight("sin_short", 128, SIZE // 4),
                     _weight("cos_long", POSITIONS, SIZE // 4), _weight("sin_long", POSITIONS, SIZE // 4)]
    part.inputs.append(_io("is_long", [], TensorProto.BOOL))
    return part


def _gqa_in_subgraphs() -> Part:
    """GroupQueryAttention inside an If inside a Loop body, reading the outer graph's caches."""
    inner = _gqa_packed_nbits()
    inner.nodes[-1] = _gqa("qkv", out="attn_inner")
    then = helper.make_graph(inner.nodes, "then", [], [_io("attn_inner", [B, S, HEADS * SIZE])])
    other = helper.make_graph([_node("Identity", ["x"], ["attn_else"])], "else", [], [_io("attn_else", None)])
    branch = _node("If", ["use_cache_branch"], ["attn_body"], then_branch=then, else_branch=other)
    body = helper.make_graph([branch, _node("Identity", ["cond"], ["cond_out"])], "body",
                             [_io("i", [], TensorProto.INT64), _io("cond", [], TensorProto.BOOL)],
                             [_io("cond_out", [], TensorProto.BOOL), _io("attn_body", None)])
    loop = _node("Loop", ["", "true"], ["attn"], body=body)
    true = _node("Constant", [], ["true"], value=helper.make_tensor("t", TensorProto.BOOL, [], [True]))
    return Part([true, loop], [*inner.inputs, _io("use_cache_branch", [1], TensorProto.BOOL)], inner.weights)


def _multi_head() -> Part:
    nodes = [_node("MatMul", ["x", "wq"], ["q"]), _node("MatMul", ["x", "wk"], ["k"]),
             _node("MatMul", ["x", "wv"], ["v"]),
             _ms("MultiHeadAttention", ["q", "k", "v", "", "", "", *(p.name for p in _past())],
                 ["attn", "present.0.key", "present.0.value"], num_heads=HEADS)]
    weights = [_weight(w, H, HEADS * SIZE) for w in ("wq", "wk", "wv")]
    return Part(nodes, _past(HEADS, SIZE), weights)


def _contrib_attention() -> Part:
    nodes = [_ms("Attention", ["x", "wqkv", "bqkv", "", "past_0"], ["attn", "present_0"], num_heads=HEADS,
                 unidirectional=1)]
    weights = [_weight("wqkv", H, 3 * HEADS * SIZE), _weight("bqkv", 3 * HEADS * SIZE)]
    return Part(nodes, [_io("past_0", [2, B, HEADS, P, "head_size"])], weights)


def _onnx_attention_3d() -> Part:
    nodes = [_node("MatMul", ["x", "wq"], ["q"]), _node("MatMul", ["x", "wk"], ["k"]),
             _node("MatMul", ["x", "wv"], ["v"]),
             _node("Attention", ["q", "k", "v", "", "past_key_values.0.key", "past_key_values.0.value"],
                   ["attn", "present.0.key", "present.0.value"], q_num_heads=HEADS, kv_num_heads=KV,
                   is_causal=1)]
    weights = [_weight("wq", H, HEADS * SIZE), _weight("wk", H, KV * SIZE), _weight("wv", H, KV * SIZE)]
    return Part(nodes, _past(KV, "h"), weights, opset=23)


def _onnx_attention_4d() -> Part:
    """4-D inputs, no head attributes: the cache's dims and the output projection tell."""
    nodes = [_node("MatMul", ["x", "wq"], ["q"]), _node("Reshape", ["q", "shape_q"], ["q4"]),
             _node("Transpose", ["q4"], ["qt"], perm=[0, 2, 1, 3]),
             _node("Attention", ["qt", "k4", "v4", "", "past_key_values.0.key", "past_key_values.0.value"],
                   ["a4", "present.0.key", "present.0.value"]),
             _node("Transpose", ["a4"], ["at"], perm=[0, 2, 1, 3]),
             _node("Reshape", ["at", "shape_o"], ["attn"])]
    inputs = [*_past(KV, SIZE), _io("k4", [B, KV, S, SIZE]), _io("v4", [B, KV, S, SIZE])]
    weights = [_weight("wq", H, HEADS * SIZE), _weight("shape_q", 4, elem=TensorProto.INT64),
               _weight("shape_o", 3, elem=TensorProto.INT64)]
    return Part(nodes, inputs, weights, opset=23)


def _onnx_rotary(position_ids: bool) -> Part:
    part = _onnx_attention_3d()
    cos = ["cos_cache", "sin_cache", "position_ids"] if position_ids else ["cos_bs", "sin_bs"]
    part.nodes[:1] = [_node("MatMul", ["x", "wq"], ["q_raw"]),
                      _node("RotaryEmbedding", ["q_raw", *cos], ["q"], num_heads=HEADS)]
    part.weights += _rotary_weights()
    if not position_ids:  # per-token caches [batch, seq, rotary / 2]: no position limit
        part.inputs += [_io("cos_bs", [B, S, SIZE // 4]), _io("sin_bs", [B, S, SIZE // 4])]
    return part


def _two_head_counts() -> Part:
    """Two layers with different head counts: no one count; each site keeps its own."""
    part = _gqa_packed_nbits()
    n = (8 + 2 * KV) * SIZE
    part.nodes += [_ms("MatMulNBits", ["x", "wqkv1", "scales1"], ["qkv1"], K=H, N=n, bits=4, block_size=16),
                   _gqa("qkv1", layer=1, heads=8, out="attn1")]
    part.weights += [_weight("wqkv1", n, H // 16, 8, elem=TensorProto.UINT8), _weight("scales1", n, H // 16)]
    part.inputs += _past(layer=1)
    return part


def _attention_without_a_cache() -> Part:
    """A second, cache-free attention (scores of two inputs): it shows no facts, and contradicts none."""
    part = _gqa_packed_nbits()
    part.nodes += [_node("MatMul", ["qa", "kb"], ["scores"]), _node("Softmax", ["scores"], ["probs"]),
                   _node("MatMul", ["probs", "vc"], ["mixed"])]
    part.inputs += [_io(name, [B, S, S]) for name in ("qa", "kb", "vc")]
    return part


def _router_softmax() -> Part:
    """A Softmax over x @ weight (a MoE router) is not attention; the cache dims alone say nothing."""
    part = _gqa_packed_nbits()
    part.nodes += [_node("MatMul", ["x", "router"], ["r"]), _node("Softmax", ["r"], ["gates"], axis=-1)]
    part.weights.append(_weight("router", H, 4))
    return part


# name -> (model, {fact: expected})
FACTS: dict[str, tuple[Callable[[], onnx.ModelProto], dict[str, int | None]]] = {
    "gqa-unpacked": (lambda: _decoder_model(_gqa_unpacked()),
                     {"num_attention_heads": HEADS, "num_key_value_heads": KV, "head_size": SIZE,
                      "max_positions": POSITIONS, "rotary_dim": SIZE // 2, "vocab_size": V}),
    "gqa-packed-int4": (lambda: _decoder_model(_gqa_packed_nbits()),
                        {"head_size": SIZE, "max_positions": POSITIONS}),
    "gqa-packed-not-whole": (lambda: _decoder_model(_gqa_packed_nbits(n=10 * SIZE + 5)),
                             {"num_attention_heads": HEADS, "head_size": None}),
    "gqa-packed-disagrees": (lambda: _decoder_model(_gqa_packed_nbits(n=10 * (SIZE + 1))),
                             {"num_attention_heads": HEADS, "head_size": None}),
    "rotary-embedding-nodes": (lambda: _decoder_model(_gqa_with_rotary_nodes()),
                               {"head_size": SIZE, "max_positions": POSITIONS, "rotary_dim": SIZE // 2}),
    "long-rope-if": (lambda: _decoder_model(_gqa_long_rope()),
                     {"head_size": SIZE, "max_positions": POSITIONS}),
    "subgraphs": (lambda: _decoder_model(_gqa_in_subgraphs()),
                  {"num_attention_heads": HEADS, "head_size": SIZE, "max_positions": POSITIONS}),
    "multi-head": (lambda: _decoder_model(_multi_head()),
                   {"num_attention_heads": HEADS, "num_key_value_heads": HEADS, "head_size": SIZE,
                    "max_positions": None, "rotary_dim": None}),
    "contrib-attention": (lambda: _decoder_model(_contrib_attention()),
                          {"num_attention_heads": HEADS, "head_size": SIZE}),
    "onnx-attention-3d": (lambda: _decoder_model(_onnx_attention_3d()),
                          {"num_attention_heads": HEADS, "num_key_value_heads": KV, "head_size": SIZE}),
    "onnx-attention-4d": (lambda: _decoder_model(_onnx_attention_4d()),
                          {"num_attention_heads": HEADS, "num_key_value_heads": KV, "head_size": SIZE}),
    "onnx-rotary": (lambda: _decoder_model(_onnx_rotary(True)),
                    {"max_positions": POSITIONS, "rotary_dim": SIZE // 2}),
    "onnx-rotary-per-token": (lambda: _decoder_model(_onnx_rotary(False)),
                              {"max_positions": None, "rotary_dim": None}),
    "learned-positions": (lambda: _decoder_model(_multi_head(), embeddings="positions"),
                          {"max_positions": POSITIONS}),
    "token-types-are-no-positions": (lambda: _decoder_model(_multi_head(), embeddings="bert"),
                                     {"max_positions": POSITIONS, "vocab_size": V}),
    "two-head-counts": (lambda: _decoder_model(_two_head_counts()),
                        {"num_attention_heads": None, "num_key_value_heads": KV, "head_size": SIZE}),
    "router-softmax": (lambda: _decoder_model(_router_softmax()), {"num_attention_heads": HEADS}),
    "site-without-cache": (lambda: _decoder_model(_attention_without_a_cache()),
                           {"num_attention_heads": HEADS, "num_key_value_heads": KV, "head_size": SIZE}),
    "vocab-from-lm-head": (lambda: _decoder_model(_gqa_unpacked(), logits=[B, S, "vocab"]),
                           {"vocab_size": V}),
}


@pytest.mark.parametrize("case", FACTS)
def test_facts_of_hand_made_graphs(case: str) -> None:
    build, expected = FACTS[case]
    proto = build()
    model = onnxinfo.read_model(proto.SerializeToString())
    assert _model(model) == _onnx_model(proto)
    facts = graphfacts.decoder_facts(model)
    assert {k: getattr(facts, k) for k in expected} == expected, facts.how
    for fact, value in expected.items():
        assert (fact in facts.how) == (value is not None)


def test_sites_name_their_caches_and_windows() -> None:
    def facts(part: Part) -> graphfacts.DecoderFacts:
        return graphfacts.decoder_facts(onnxinfo.read_model(_decoder_model(part).SerializeToString()))

    site = facts(_gqa_unpacked()).for_cache("past_key_values.0.value")
    assert site is not None and (site.kv_num_heads, site.head_size, site.sliding_window) == (KV, SIZE, 64)
    assert "query width" in site.how["head_size"] and "wq" not in site.how["head_size"]
    two = facts(_two_head_counts())
    assert [s.num_heads for s in two.attention] == [HEADS, 8]
    assert two.for_cache("past_key_values.1.key").num_heads == 8
    assert [s.op for s in facts(_router_softmax()).attention] == ["com.microsoft.GroupQueryAttention"]
    silent = facts(_attention_without_a_cache())
    assert [(s.op, s.num_heads, s.head_size) for s in silent.attention] == [
        ("com.microsoft.GroupQueryAttention", HEADS, SIZE), ("Softmax", None, None)]
    assert silent.how["head_size"].endswith("; 1 of 2 sites show none")


@pytest.mark.parametrize("case", GRAPH_CASES)
def test_facts_of_plain_attention_test_graphs(tmp_path: Path, case: str) -> None:
    """build/graphs.py: MatMul/Softmax attention, per-layer heads and sizes, a learned position table."""
    folder = GRAPH_CASES[case](tmp_path)
    facts = graphfacts.decoder_facts(onnxinfo.read_model(folder / "model.onnx"))
    proto = onnx.load(str(folder / "model.onnx"))
    pasts = [i for i in proto.graph.input if i.name.startswith("past") and not i.name.endswith("value")]
    expected = []
    for past in pasts:
        dims = [d.dim_value for d in past.type.tensor_type.shape.dim]
        expected.append((dims[-3], dims[-3], dims[-1]))  # graphs.py: kv heads == heads
    sites = [(s.num_heads, s.kv_num_heads, s.head_size) for s in facts.attention]
    assert sorted(sites) == sorted(expected)
    agreed = (facts.num_attention_heads, facts.num_key_value_heads, facts.head_size)
    assert agreed == (expected[0] if len(set(expected)) == 1 else (None, None, None))
    assert (facts.max_positions, facts.vocab_size) == (graphs.MAX_POSITIONS, graphs.VOCAB)


# --- facts of real exports against their configs ---------------------------------------------------

def _builder_expected(folder: Path, onnx_file: str = "model.onnx") -> dict[str, int | None]:
    model = json.loads((folder / "genai_config.json").read_text())["model"]
    section = model["decoder"]
    assert section["filename"] == onnx_file
    return {"num_attention_heads": section["num_attention_heads"],
            "num_key_value_heads": section["num_key_value_heads"], "head_size": section["head_size"],
            "max_positions": model["context_length"], "vocab_size": model["vocab_size"]}


def _optimum_expected(folder: Path) -> dict[str, int | None]:
    hf = json.loads((folder / "config.json").read_text())
    heads = hf.get("num_attention_heads", hf.get("n_head"))
    hidden = hf.get("hidden_size", hf.get("n_embd"))
    # GPT-2 learns a table of n_positions; Llama's RoPE is computed from positions (no table, no limit).
    return {"num_attention_heads": heads, "num_key_value_heads": hf.get("num_key_value_heads", heads),
            "head_size": hf.get("head_dim", hidden // heads), "max_positions": hf.get("n_positions"),
            "vocab_size": hf["vocab_size"]}


def _facts(path: Path) -> dict[str, int | None]:
    facts = graphfacts.decoder_facts(onnxinfo.read_model(path))
    return {k: getattr(facts, k) for k in ("num_attention_heads", "num_key_value_heads", "head_size",
                                           "max_positions", "vocab_size")}


@pytest.mark.slow
@pytest.mark.parametrize("name", BUILDER)
def test_builder_exports_give_their_genai_config(name: str) -> None:
    folder = hfmodels.get(name)
    assert _facts(folder / "model.onnx") == _builder_expected(folder)


def test_the_demo_gives_its_genai_config() -> None:
    assert _facts(DEMO_Q4) == _builder_expected(DEMO, "onnx/model_q4.onnx")
    # the int8 variant is Optimum's export (build/train_demo.py) as onnxruntime optimizes it ahead: plain
    # attention (its scores a FusedMatMul) shows the cache's heads and head size, the vocabulary, and the
    # query heads through the output projection (a MatMulIntegerToFloat), not a position limit (its rotary
    # angles are computed, not a table); its presents are Concat(past, new)
    q8 = DEMO / "onnx" / "model_quantized.onnx"
    expected = {**_builder_expected(DEMO, "onnx/model_q4.onnx"), "max_positions": None}
    assert _facts(q8) == expected
    assert graphfacts.decoder_facts(onnxinfo.read_model(q8)).concatenated == {
        f"past_key_values.{i}.{kind}" for i in range(6) for kind in ("key", "value")}
    assert not graphfacts.decoder_facts(onnxinfo.read_model(DEMO_Q4)).concatenated


@pytest.mark.slow
def test_whisper_decoder_gives_its_genai_config() -> None:
    folder = hfmodels.get("whisper-builder-fp32")
    assert _facts(folder / "decoder.onnx") == _builder_expected(folder, "decoder.onnx")


@pytest.mark.slow
@pytest.mark.parametrize("name", OPTIMUM)
def test_optimum_exports_give_their_config(name: str) -> None:
    folder = hfmodels.get(name)
    assert _facts(folder / "model.onnx") == _optimum_expected(folder)


@pytest.mark.slow
@pytest.mark.parametrize("name", BUILDER)
def test_builder_facts_do_not_need_value_info(name: str, tmp_path: Path) -> None:
    """Without the builder's value_info, the projections' weights tell the same."""
    proto = onnx.load(str(hfmodels.get(name) / "model.onnx"), load_external_data=False)
    del proto.graph.value_info[:]
    (tmp_path / "model.onnx").write_bytes(proto.SerializeToString())
    assert _facts(tmp_path / "model.onnx") == _facts(hfmodels.get(name) / "model.onnx")


# Exports the named test models lack: int4 of the other builder archs, and shapes where no two facts
# are equal (6 heads, 2 kv heads, head size 16, 384 positions, 640 tokens, phi3 with half rotary).
ODD = {"vocab_size": 640, "hidden_size": 96, "num_hidden_layers": 2, "num_attention_heads": 6,
       "num_key_value_heads": 2, "intermediate_size": 64, "max_position_embeddings": 384,
       "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}


def _odd_hf(arch: str, out: Path) -> Path:
    import shutil

    import torch
    import transformers

    if arch == "llama":
        config = transformers.LlamaConfig(head_dim=16, **ODD)
    else:
        config = transformers.Phi3Config(original_max_position_embeddings=ODD["max_position_embeddings"],
                                         partial_rotary_factor=0.5, **ODD)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy2(hfmodels.get("llama-hf") / name, out / name)
    return out


def _merged(out: Path) -> Path:
    """Optimum's merge_decoders on two copies of the with-past export: one If on use_cache_branch with
    a decoder in each branch, the layout of Optimum's decoder_model_merged.onnx."""
    import os
    import shutil
    import subprocess

    source = _extra("odd-llama-optimum")
    out.mkdir(parents=True)
    code = ("import sys; from optimum.onnx import merge_decoders; "
            "merge_decoders(sys.argv[1], sys.argv[1], save_path=sys.argv[2], strict=False)")
    subprocess.run([str(hfmodels.ensure_optimum_venv()), "-c", code, str(source / "model.onnx"),
                    str(out / "decoder_model_merged.onnx")], check=True, capture_output=True,
                   env={**os.environ, "PYTHONHASHSEED": "0"})
    shutil.copy2(source / "config.json", out / "config.json")
    return out


def _builder(hf: Callable[[], Path], precision: str) -> Callable[[Path], Path]:
    return lambda out: hfmodels.export_builder(hf(), out, precision)


EXTRA: dict[str, Callable[[Path], Path]] = {
    **{f"{arch}-builder-int4": _builder(lambda arch=arch: hfmodels.get(f"{arch}-hf"), "int4")
       for arch in ("qwen2", "phi3", "gemma2")},
    "odd-llama-hf": lambda out: _odd_hf("llama", out),
    "odd-phi3-hf": lambda out: _odd_hf("phi3", out),
    **{f"odd-{arch}-builder-{p}": _builder(lambda arch=arch: _extra(f"odd-{arch}-hf"), p)
       for arch in ("llama", "phi3") for p in ("fp32", "int4")},
    "odd-llama-optimum": lambda out: hfmodels.export_concat(_extra("odd-llama-hf"), out),
    "odd-llama-optimum-merged": _merged,
}


def _extra(name: str) -> Path:
    """Built once into the cache beside the named test models, like them."""
    recipe = f"tests/test_onnxinfo.py {name} {json.dumps(ODD, sort_keys=True)}"
    return hfmodels.cached(f"onnxinfo-{name}", EXTRA[name], recipe=recipe)


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in EXTRA if "-builder-" in n])
def test_more_builder_exports_give_their_genai_config(name: str) -> None:
    folder = _extra(name)
    assert _facts(folder / "model.onnx") == _builder_expected(folder)


@pytest.mark.slow
def test_odd_optimum_export_gives_its_config() -> None:
    folder = _extra("odd-llama-optimum")
    assert _facts(folder / "model.onnx") == _optimum_expected(folder)


@pytest.mark.slow
def test_merged_optimum_decoder_gives_its_config() -> None:
    folder = _extra("odd-llama-optimum-merged")
    model = assert_reads_like_onnx(folder / "decoder_model_merged.onnx")
    assert [n.op_type for n in model.graph.nodes] == ["If"]
    facts = graphfacts.decoder_facts(model)
    assert len(facts.attention) == 4  # each layer in each branch
    assert _facts(folder / "decoder_model_merged.onnx") == _optimum_expected(folder)


@pytest.mark.slow
def test_merged_optimum_decoder_decodes_fused_like_the_single_graph_export() -> None:
    """The merged graph's decode steps run fused, its use_cache_branch flag fixed to true (FusedStep.fixed),
    and give the tokens of optimum's single-graph export of the same weights."""
    import ortpipe

    merged = ortpipe.load(_extra("odd-llama-optimum-merged"), threads=1)
    single = ortpipe.load(_extra("odd-llama-optimum"), threads=1)
    assert merged.plan.fused.fixed == ("use_cache_branch",) and single.plan.fused.fixed == ()
    got = merged.generate(prompt_ids=[5, 17, 42, 8], max_new_tokens=24)
    assert got.tokens == single.generate(prompt_ids=[5, 17, 42, 8], max_new_tokens=24).tokens
    assert got.timings.fused_steps == 23


@pytest.mark.slow
def test_odd_phi3_half_rotary() -> None:
    facts = graphfacts.decoder_facts(onnxinfo.read_model(_extra("odd-phi3-builder-int4") / "model.onnx"))
    assert (facts.head_size, facts.rotary_dim) == (16, 8)


def test_value_info_is_read_when_first_asked_for() -> None:
    """A graph keeps its value_info as written and reads it when first asked for (graphfacts asks only when
    a width is not known otherwise); a broken entry is then a ConfigError naming the file and the entry's
    byte in it."""
    x, y = (helper.make_tensor_value_info(n, TensorProto.FLOAT, ["n", 3]) for n in "xy")
    graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "g", [x], [y],
                              value_info=[helper.make_tensor_value_info("t", TensorProto.INT64, [2, "m"])])
    model = helper.make_model(graph)
    read = onnxinfo.read_model(model.SerializeToString())
    assert "value_info" not in vars(read.graph)  # not read yet
    assert read.graph.value_info == (onnxinfo.ValueInfo("t", TensorProto.INT64, (2, "m")),)
    shipped = onnxinfo.read_model(DEMO / "onnx" / "model_quantized.onnx")  # 1,580 value_info entries
    assert graphfacts.decoder_facts(shipped).num_attention_heads and "value_info" not in vars(shipped.graph)
    entry = b"\x0a\x01\xff"  # a ValueInfoProto whose name is not UTF-8
    graph_bytes = model.graph.SerializeToString() + b"\x6a" + _varint(len(entry)) + entry
    model.ClearField("graph")
    data = model.SerializeToString() + b"\x3a" + _varint(len(graph_bytes)) + graph_bytes
    broken = onnxinfo.read_model(data, "broken.onnx")
    at = data.index(entry) + 2  # the name's bytes
    said = (rf'"broken.onnx" is not a readable ONNX model: a string that is not UTF-8 in a ValueInfoProto '
            rf"\(at byte {at}\)")
    with pytest.raises(ConfigError, match=said):
        _ = broken.graph.value_info


def test_a_value_info_entry_too_large_to_hold_is_read_in_place() -> None:
    """An entry over MAX_FIELD_BYTES (a long doc string) is not copied to be read later: it is read where it
    lies, its doc string skipped as everywhere else."""
    x, y = (helper.make_tensor_value_info(n, TensorProto.FLOAT, [1]) for n in "xy")
    info = helper.make_tensor_value_info("t", TensorProto.FLOAT, [4], doc_string="d" * 3_000_000)
    graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "g", [x], [y], value_info=[info])
    f = CountingFile(io.BytesIO(helper.make_model(graph).SerializeToString()), "long.onnx")
    model = onnxinfo.read_model(f)
    assert f.bytes_read < 200_000
    assert model.graph.value_info == (onnxinfo.ValueInfo("t", TensorProto.FLOAT, (4,)),)
