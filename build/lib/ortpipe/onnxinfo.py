"""What an ONNX file says about its graph, read without onnx, numpy or the tensors' data.

A minimal reader of the protobuf wire format for `ModelProto` (onnx/onnx.proto), standard library
only so it runs inside Pyodide too. It reads:

- the model: ir_version, opset imports, producer, metadata_props, local functions (their nodes);
- each graph: inputs, outputs and value_info (name, element type, dims: an int, a symbolic name
  or None), nodes (op_type, domain, name, inputs, outputs, attributes) and initializers (name,
  element type, dims, whether the data is external and in which file);
- attributes of every kind but sparse tensors and type protos: int, float, bytes, ints, floats,
  strings, a tensor or tensors (as `Tensor`, without data), a graph or graphs (If/Loop/Scan
  bodies, read like the main graph, so `Graph.walk` reaches nodes at any depth).

Tensor payloads (raw_data, float_data, ...) and doc strings are never loaded: on a file they are
skipped by seeking, so a model with gigabytes of embedded weights costs one small read per tensor.
Sparse initializers are not read.

Anything that is not a well-formed ModelProto with a graph (truncated, random bytes, a length past
its message's end, graphs nested deeper than MAX_GRAPH_DEPTH, a name over MAX_FIELD_BYTES) raises
one `ConfigError` naming the file (in a graph's value_info, which is read when first asked for:
`Graph.value_info`). Where no ONNX writer differs, this is stricter than protobuf: a
known field with the wrong wire type, or a name that is not UTF-8, is an error rather than an
unknown field. Fields this reader skips are not checked inside. Every field read advances past at
least one byte of the input, so reading is linear in the input's size.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import BinaryIO, NamedTuple

from .errors import ConfigError

MAX_GRAPH_DEPTH = 32  # subgraphs inside subgraphs; real models nest two or three deep
MAX_FIELD_BYTES = 1 << 20  # the most one field may load into memory (a name, an attribute's value)
_FIRST_READ, _LONGEST_READ = 1 << 12, 1 << 20  # a read after a seek; sequential reads double up to this

Dim = int | str | None  # a fixed size, a symbolic name, or unknown

# TensorProto.DataType -> the numpy-style names of signature.TensorInfo.dtype
DTYPES = {1: "float32", 2: "uint8", 3: "int8", 4: "uint16", 5: "int16", 6: "int32", 7: "int64", 8: "string",
          9: "bool", 10: "float16", 11: "float64", 12: "uint32", 13: "uint64", 14: "complex64",
          15: "complex128", 16: "bfloat16", 17: "float8e4m3fn", 18: "float8e4m3fnuz", 19: "float8e5m2",
          20: "float8e5m2fnuz", 21: "uint4", 22: "int4", 23: "float4e2m1"}


@dataclass(frozen=True)
class ValueInfo:
    """A graph input, output or value_info entry; elem_type 0 and dims None for non-tensor types."""

    name: str
    elem_type: int
    dims: tuple[Dim, ...] | None  # None: the rank is unknown

    @property
    def dtype(self) -> str | None:
        return DTYPES.get(self.elem_type)


@dataclass(frozen=True)
class Tensor:
    """An initializer or a tensor-valued attribute, without its data."""

    name: str
    elem_type: int
    dims: tuple[int, ...]
    external: bool = False  # data_location EXTERNAL
    location: str | None = None  # the external data file, relative to the model's folder

    @property
    def dtype(self) -> str | None:
        return DTYPES.get(self.elem_type)


@dataclass(frozen=True)
class Omitted:
    """An attribute value over MAX_FIELD_BYTES (an EP context blob, a huge list), skipped unread."""

    size: int  # bytes in the file


@dataclass(frozen=True)
class Node:
    op_type: str
    domain: str  # "" for the default ONNX domain
    name: str
    inputs: tuple[str, ...]  # "" for an omitted optional input
    outputs: tuple[str, ...]
    attributes: Mapping[str, AttributeValue] = field(default_factory=dict)

    def subgraphs(self) -> Iterator[Graph]:
        for value in self.attributes.values():
            if isinstance(value, Graph):
                yield value
            elif isinstance(value, tuple):
                yield from (v for v in value if isinstance(v, Graph))


@dataclass(frozen=True)
class Graph:
    name: str
    inputs: tuple[ValueInfo, ...]
    outputs: tuple[ValueInfo, ...]
    nodes: tuple[Node, ...]
    initializers: tuple[Tensor, ...]
    # each ValueInfoProto as written, (where it starts in the file, its bytes), or read already (one over
    # MAX_FIELD_BYTES, walked in place), and what errors call the file: value_info is read when first asked
    # for (an exporter may write thousands that nothing here needs)
    value_info_raw: tuple[tuple[int, bytes] | ValueInfo, ...] = field(default=(), repr=False, compare=False)
    source: str = field(default="", repr=False, compare=False)

    @cached_property
    def value_info(self) -> tuple[ValueInfo, ...]:
        """The graph's value_info entries, read and checked (a `ConfigError` naming the file) on first use."""
        infos = []
        for entry in self.value_info_raw:
            if isinstance(entry, ValueInfo):
                infos.append(entry)
                continue
            start, raw = entry
            reader = _Reader(raw, self.source)
            reader.base, reader.size = start, start + len(raw)  # positions are the file's
            infos.append(reader.value_info(_Span(start, start + len(raw))))
        return tuple(infos)

    def walk(self) -> Iterator[tuple[Node, Graph]]:
        """(node, the graph it is in) for every node, subgraphs' nodes right after their parent's."""
        for node in self.nodes:
            yield node, self
            for sub in node.subgraphs():
                yield from sub.walk()


AttributeValue = int | float | bytes | tuple | Tensor | Graph | Omitted


@dataclass(frozen=True)
class Function:
    """A model-local function (FunctionProto): its body's nodes, called as op_type `name` in `domain`."""

    domain: str
    name: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    nodes: tuple[Node, ...]


@dataclass(frozen=True)
class Model:
    ir_version: int
    opset_imports: Mapping[str, int]  # domain -> version, as written ("" is the default domain)
    producer_name: str
    producer_version: str
    graph: Graph
    functions: tuple[Function, ...] = ()
    metadata: Mapping[str, str] = field(default_factory=dict)


Source = bytes | bytearray | memoryview | BinaryIO | str | os.PathLike


def read_model(source: Source, name: str | None = None) -> Model:
    """The structure of an ONNX model: bytes, a seekable binary file, or a path.

    `name` is what errors call the file (default: the path or the file object's name).
    """
    if isinstance(source, (str, os.PathLike)):
        with open(source, "rb") as f:
            return _Reader(f, name or os.fspath(source)).model()
    if isinstance(source, (bytes, bytearray, memoryview)):
        return _Reader(source, name or "<bytes>").model()
    return _Reader(source, name or str(getattr(source, "name", "<file>"))).model()


# --- the wire format ---------------------------------------------------------------------------

_VARINT, _FIXED64, _BYTES, _FIXED32 = 0, 1, 2, 5
_SIGN, _MASK = 1 << 63, (1 << 64) - 1


class _Span(NamedTuple):
    """The payload of a length-delimited field: [start, end) in the input."""

    start: int
    end: int

    @property
    def size(self) -> int:
        return self.end - self.start


def _signed(value: int) -> int:
    """An int64 from a varint (protobuf keeps the low 64 bits of longer ones)."""
    value &= _MASK
    return value - (1 << 64) if value >= _SIGN else value


class _Reader:
    """Reads ModelProto fields from bytes, or from a file through a window of the bytes last read.

    `fields` counts the fields visited (what tests bound).
    """

    def __init__(self, source: bytes | bytearray | memoryview | BinaryIO, name: str):
        self.name = name
        self.fields = 0
        if isinstance(source, (bytes, bytearray, memoryview)):
            self.file: BinaryIO | None = None
            self.data = bytes(source)
            self.origin = 0
            self.size = len(self.data)
        else:
            self.file = source
            self.origin = source.tell()
            self.size = source.seek(0, os.SEEK_END) - self.origin
            self.data = b""
        self.base = 0  # the input offset of self.data[0]
        self.read_size = _FIRST_READ

    # errors and raw access

    def error(self, why: str, pos: int) -> ConfigError:
        return ConfigError(f'"{self.name}" is not a readable ONNX model: {why} (at byte {pos})')

    def window(self, pos: int, n: int) -> int:
        """The offset in self.data of input bytes [pos, pos + n), reading the file if needed."""
        off = pos - self.base
        if 0 <= off and off + n <= len(self.data):
            return off
        if self.file is None or pos + n > self.size:
            raise self.error("the input ends inside a field", pos)
        self.file.seek(self.origin + pos)
        # Sequential reads grow (node lists); a read after a skipped payload starts small again.
        sequential = self.base <= pos <= self.base + len(self.data)
        self.read_size = min(2 * self.read_size, _LONGEST_READ) if sequential else _FIRST_READ
        chunk = self.file.read(max(n, min(self.read_size, self.size - pos)))
        while len(chunk) < n:  # a raw file may return less than asked
            more = self.file.read(n - len(chunk))
            if not more:
                raise self.error("the file ended while it was being read", pos)
            chunk += more
        self.data, self.base = chunk, pos
        return 0

    def varint(self, pos: int, end: int) -> tuple[int, int]:
        """(value, position after it) of the varint at pos, which must end before `end`."""
        off = pos - self.base
        if pos < end and 0 <= off < len(self.data) and self.data[off] < 0x80:  # one byte: most are
            return self.data[off], pos + 1
        n = min(10, end - pos)
        off = self.window(pos, n)
        data, result, shift = self.data, 0, 0
        for i in range(off, off + n):
            byte = data[i]
            result |= (byte & 0x7F) << shift
            if byte < 0x80:
                return result, pos + (i - off) + 1
            shift += 7
        raise self.error("a varint runs past its message or over 10 bytes", pos)

    def fields_of(self, span: _Span, what: str) -> Iterator[tuple[int, int, int | _Span]]:
        """(field number, wire type, value) for each field in span: an int for varints and
        fixed-size values (the offset of the latter), a _Span for length-delimited ones."""
        pos, end = span.start, span.end
        while pos < end:
            off = pos - self.base
            if 0 <= off < len(self.data) and self.data[off] < 0x80:  # varint's one-byte case, inlined
                key, pos = self.data[off], pos + 1
            else:
                key, pos = self.varint(pos, end)
            number, wire = key >> 3, key & 7
            if number == 0:
                raise self.error(f"field number 0 in a {what}", pos)
            self.fields += 1
            if wire == _VARINT:
                value, pos = self.varint(pos, end)
                yield number, wire, value
            elif wire == _BYTES:
                off = pos - self.base
                if pos < end and 0 <= off < len(self.data) and self.data[off] < 0x80:
                    length, pos = self.data[off], pos + 1
                else:
                    length, pos = self.varint(pos, end)
                if length > end - pos:
                    raise self.error(f"a field of {length} bytes runs past the end of its {what}", pos)
                yield number, wire, _Span(pos, pos + length)
                pos += length
            elif wire in (_FIXED32, _FIXED64):
                size = 4 if wire == _FIXED32 else 8
                if size > end - pos:
                    raise self.error(f"a fixed-size field runs past the end of its {what}", pos)
                yield number, wire, pos
                pos += size
            else:
                raise self.error(f"wire type {wire} (field {number} of a {what})", pos)

    def bytes_of(self, span: _Span) -> bytes:
        if span.size > MAX_FIELD_BYTES:
            raise self.error(f"a field of {span.size} bytes where a name or short value belongs", span.start)
        off = self.window(span.start, span.size)
        return self.data[off:off + span.size]

    # typed values of one field

    def expect(self, wire: int, want: int, number: int, what: str, value: int | _Span) -> None:
        if wire != want:
            raise self.error(f"field {number} of a {what} has wire type {wire}, not {want}",
                             value.start if isinstance(value, _Span) else value)

    def span(self, wire: int, value: int | _Span, number: int, what: str) -> _Span:
        self.expect(wire, _BYTES, number, what, value)
        assert isinstance(value, _Span)
        return value

    def string(self, wire: int, value: int | _Span, number: int, what: str) -> str:
        span = self.span(wire, value, number, what)
        try:
            start, end = span.start - self.base, span.end - self.base
            if 0 <= start and end <= len(self.data) and span.end - span.start <= MAX_FIELD_BYTES:
                return self.data[start:end].decode("utf-8")  # bytes_of's case in the window, inlined
            return self.bytes_of(span).decode("utf-8")
        except UnicodeDecodeError:
            raise self.error(f"a string that is not UTF-8 in a {what}", span.start) from None

    def integer(self, wire: int, value: int | _Span, number: int, what: str) -> int:
        self.expect(wire, _VARINT, number, what, value)
        assert isinstance(value, int)
        return _signed(value)

    def floating(self, wire: int, value: int | _Span, number: int, what: str) -> float:
        self.expect(wire, _FIXED32, number, what, value)
        assert isinstance(value, int)
        off = self.window(value, 4)
        return struct.unpack_from("<f", self.data, off)[0]

    def integers(self, wire: int, value: int | _Span, number: int, what: str) -> list[int]:
        """A repeated int64: one unpacked element, or a packed run."""
        if wire != _BYTES:
            return [self.integer(wire, value, number, what)]
        assert isinstance(value, _Span)
        data, out, pos = self.bytes_of(value), [], 0
        while pos < len(data):  # decoded from the loaded copy: no window per element
            result = shift = 0
            while True:
                if pos >= len(data) or shift > 63:
                    raise self.error(f"a packed list of numbers is cut off in a {what}", value.start)
                byte = data[pos]
                pos += 1
                result |= (byte & 0x7F) << shift
                shift += 7
                if byte < 0x80:
                    break
            out.append(_signed(result))
        return out

    def floats(self, wire: int, value: int | _Span, number: int, what: str) -> list[float]:
        if wire != _BYTES:
            return [self.floating(wire, value, number, what)]
        assert isinstance(value, _Span)
        if value.size % 4:
            raise self.error(f"a packed list of floats of {value.size} bytes in a {what}", value.start)
        return list(struct.unpack(f"<{value.size // 4}f", self.bytes_of(value)))

    # messages

    def model(self) -> Model:
        ir_version, opsets, producer, version = 0, {}, "", ""
        graphs: list[_Span] = []
        functions: list[Function] = []
        metadata: dict[str, str] = {}
        what = "ModelProto"
        for number, wire, value in self.fields_of(_Span(0, self.size), what):
            if number == 1:
                ir_version = self.integer(wire, value, number, what)
            elif number == 2:
                producer = self.string(wire, value, number, what)
            elif number == 3:
                version = self.string(wire, value, number, what)
            elif number == 7:  # a second graph field merges into the first, as protobuf merges messages
                graphs.append(self.span(wire, value, number, what))
            elif number == 8:
                domain, opset = self.opset(self.span(wire, value, number, what))
                opsets[domain] = opset
            elif number == 14:
                key, text = self.entry(self.span(wire, value, number, what))
                metadata[key] = text
            elif number == 25:
                functions.append(self.function(self.span(wire, value, number, what)))
        if not graphs:
            raise self.error("no graph", 0)
        graph = self.graph(graphs, 0)
        return Model(ir_version, opsets, producer, version, graph, tuple(functions), metadata)

    def opset(self, span: _Span) -> tuple[str, int]:
        domain, version, what = "", 0, "OperatorSetIdProto"
        for number, wire, value in self.fields_of(span, what):
            if number == 1:
                domain = self.string(wire, value, number, what)
            elif number == 2:
                version = self.integer(wire, value, number, what)
        return domain, version

    def entry(self, span: _Span) -> tuple[str, str]:
        """A StringStringEntryProto (metadata_props, external_data)."""
        key, text, what = "", "", "StringStringEntryProto"
        for number, wire, value in self.fields_of(span, what):
            if number == 1:
                key = self.string(wire, value, number, what)
            elif number == 2:
                text = self.string(wire, value, number, what)
        return key, text

    def graph(self, spans: list[_Span], depth: int) -> Graph:
        """The graph in `spans` (one, or the occurrences of a field to merge)."""
        if depth > MAX_GRAPH_DEPTH:
            raise self.error(f"graphs nested over {MAX_GRAPH_DEPTH} deep", spans[0].start)
        name, what = "", "GraphProto"
        nodes: list[Node] = []
        initializers: list[Tensor] = []
        infos: dict[int, list[ValueInfo]] = {11: [], 12: []}  # input, output
        raw: list[tuple[int, bytes] | ValueInfo] = []  # value_info, read on first use (Graph.value_info)
        fields = (f for span in spans for f in self.fields_of(span, what))
        for number, wire, value in fields:
            if number == 1:
                nodes.append(self.node(self.span(wire, value, number, what), depth))
            elif number == 2:
                name = self.string(wire, value, number, what)
            elif number == 5:
                initializers.append(self.tensor(self.span(wire, value, number, what)))
            elif number in infos:
                infos[number].append(self.value_info(self.span(wire, value, number, what)))
            elif number == 13:
                span = self.span(wire, value, number, what)
                if span.size > MAX_FIELD_BYTES:  # not held in memory: read now, a window at a time
                    raw.append(self.value_info(span))
                else:
                    off = self.window(span.start, span.size)
                    raw.append((span.start, self.data[off : off + span.size]))
        return Graph(name, tuple(infos[11]), tuple(infos[12]), tuple(nodes), tuple(initializers), tuple(raw),
                     self.name)

    def function(self, span: _Span) -> Function:
        domain = name = ""
        inputs: list[str] = []
        outputs: list[str] = []
        nodes: list[Node] = []
        what = "FunctionProto"
        for number, wire, value in self.fields_of(span, what):
            if number == 1:
                name = self.string(wire, value, number, what)
            elif number == 4:
                inputs.append(self.string(wire, value, number, what))
            elif number == 5:
                outputs.append(self.string(wire, value, number, what))
            elif number == 7:
                nodes.append(self.node(self.span(wire, value, number, what), 0))
            elif number == 10:
                domain = self.string(wire, value, number, what)
        return Function(domain, name, tuple(inputs), tuple(outputs), tuple(nodes))

    def node(self, span: _Span, depth: int) -> Node:
        texts = {3: "", 4: "", 7: ""}  # name, op_type, domain
        inputs: list[str] = []
        outputs: list[str] = []
        attributes: dict[str, AttributeValue] = {}
        what = "NodeProto"
        for number, wire, value in self.fields_of(span, what):
            if number == 1:
                inputs.append(self.string(wire, value, number, what))
            elif number == 2:
                outputs.append(self.string(wire, value, number, what))
            elif number in texts:
                texts[number] = self.string(wire, value, number, what)
            elif number == 5:
                name, attribute = self.attribute(self.span(wire, value, number, what), depth)
                if attribute is not None:
                    attributes[name] = attribute
        return Node(texts[4], texts[7], texts[3], tuple(inputs), tuple(outputs), attributes)

    def attribute(self, span: _Span, depth: int) -> tuple[str, AttributeValue | None]:
        """(name, value); the value is None for kinds not read (sparse tensors, type protos, refs)."""
        name, kind, what = "", 0, "AttributeProto"
        found: dict[int, list] = {}  # fields 2 .. 11 (f, i, s, t, g, floats, ints, strings, tensors, graphs)
        for number, wire, value in self.fields_of(span, what):
            if number == 1:
                name = self.string(wire, value, number, what)
            elif number == 20:
                kind = self.integer(wire, value, number, what)
            elif 2 <= number <= 11:
                found.setdefault(number, []).extend(self.elements(number, wire, value, depth))
        return name, _attribute_value(kind, found)

    def elements(self, number: int, wire: int, value: int | _Span, depth: int) -> list:
        """The values one attribute field holds: one, or a packed run."""
        what = "AttributeProto"
        if isinstance(value, _Span) and value.size > MAX_FIELD_BYTES and number in (4, 7, 8, 9):
            return [Omitted(value.size)]
        if number == 2:
            return [self.floating(wire, value, number, what)]
        if number == 3:
            return [self.integer(wire, value, number, what)]
        if number == 7:
            return self.floats(wire, value, number, what)
        if number == 8:
            return self.integers(wire, value, number, what)
        span = self.span(wire, value, number, what)
        if number in (4, 9):
            return [self.bytes_of(span)]
        if number in (5, 10):
            return [self.tensor(span)]
        return [self.graph([span], depth + 1)]

    def tensor(self, span: _Span) -> Tensor:
        name, elem_type, external, location, what = "", 0, False, None, "TensorProto"
        dims: list[int] = []
        for number, wire, value in self.fields_of(span, what):
            if number == 1:
                dims.extend(self.integers(wire, value, number, what))
            elif number == 2:
                elem_type = self.integer(wire, value, number, what)
            elif number == 8:
                name = self.string(wire, value, number, what)
            elif number == 14:
                external = self.integer(wire, value, number, what) == 1
            elif number == 13:
                key, text = self.entry(self.span(wire, value, number, what))
                location = text if key == "location" else location
        return Tensor(name, elem_type, tuple(dims), external, location)

    def value_info(self, span: _Span) -> ValueInfo:
        name, elem_type, dims, what = "", 0, None, "ValueInfoProto"
        for number, wire, value in self.fields_of(span, what):
            if number == 1:
                name = self.string(wire, value, number, what)
            elif number == 2:
                elem_type, dims = self.type_proto(self.span(wire, value, number, what))
        return ValueInfo(name, elem_type, dims)

    def type_proto(self, span: _Span) -> tuple[int, tuple[Dim, ...] | None]:
        """(elem type, dims) of a tensor type (dense or sparse); (0, None) for other types."""
        elem_type, dims, what = 0, None, "TypeProto"
        for number, wire, value in self.fields_of(span, what):
            if number in (1, 8):  # tensor_type, sparse_tensor_type
                elem_type, dims = 0, None
                for inner, inner_wire, inner_value in self.fields_of(self.span(wire, value, number, what),
                                                                     "TypeProto.Tensor"):
                    if inner == 1:
                        elem_type = self.integer(inner_wire, inner_value, inner, "TypeProto.Tensor")
                    elif inner == 2:
                        dims = self.shape(self.span(inner_wire, inner_value, inner, "TypeProto.Tensor"))
        return elem_type, dims

    def shape(self, span: _Span) -> tuple[Dim, ...]:
        dims: list[Dim] = []
        for number, wire, value in self.fields_of(span, "TensorShapeProto"):
            if number == 1:
                dims.append(self.dimension(self.span(wire, value, number, "TensorShapeProto")))
        return tuple(dims)

    def dimension(self, span: _Span) -> Dim:
        dim: Dim = None
        what = "TensorShapeProto.Dimension"
        for number, wire, value in self.fields_of(span, what):
            if number == 1:
                dim = self.integer(wire, value, number, what)
            elif number == 2:
                dim = self.string(wire, value, number, what)
        return dim


# Absent singular fields read as proto2 defaults, by field number (f, i, s, t, g).
_DEFAULTS = {2: 0.0, 3: 0, 4: b"", 5: Tensor("", 0, ()), 6: Graph("", (), (), (), ())}


def _attribute_value(kind: int, found: dict[int, list]) -> AttributeValue | None:
    """The value in the field AttributeType `kind` names: FLOAT (1) is field 2 ... GRAPHS (10) field 11.

    No kind (which no writer since IR version 2 leaves) and sparse tensors or type protos give None.
    """
    number = kind + 1
    if not 2 <= number <= 11:
        return None
    values = found.get(number, [])
    omitted = [v.size for v in values if isinstance(v, Omitted)]
    if omitted:
        return Omitted(sum(omitted))
    if number <= 6:
        return values[-1] if values else _DEFAULTS[number]
    return tuple(values)
