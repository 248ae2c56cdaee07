"""Write the model variants of a folder's graph with onnxruntime's quantization tools.

    python -m build.variants FOLDER [--file onnx/model.onnx] [--dtypes q8,q4,fp16,q4f16]
                             [--accuracy-level 4] [--from-q4] [--optimize-ahead]

From the fp32 graph (`--file`, default: the first of model.onnx and onnx/model.onnx), beside it
and named as transformers.js names them (py/ortpipe/variants.py), so that ortpipe's `dtype` and
transformers.js's pick them:

- q8, `model_quantized.onnx`: `quantize_dynamic` with int8 weights (MatMul becomes onnxruntime's
  DynamicQuantizeMatMul, Gather reads an int8 table);
- q4, `model_q4.onnx`: `MatMulNBitsQuantizer` (int4 blocks of 32, symmetric, `--accuracy-level`,
  0 by default: the same arithmetic on every target);
- fp16, `model_fp16.onnx`, and q4f16, `model_q4f16.onnx`: onnxruntime's float16 converter over the
  fp32 and q4 graphs, inputs and outputs included (logits and the KV cache in float16).

`--optimize-ahead`: the q8 variant (the one wasm and CPUs run) is written as onnxruntime's CPU
provider optimizes it, marked so (`optimize_ahead`): ortpipe's sessions on CPUs start faster.

`--from-q4`: the folder has only an int4 graph (the model builder's MatMulNBits and
GatherBlockQuantized, `--file`): its fp32 graph is written first, each weight dequantized
(`model.onnx`), and the variants come from that. The demo model is made this way: its training
checkpoint is not kept. Graphs up to 1 GB keep their weights inside; larger ones in `FILE_data`.

The model builder declares the KV cache's head dimension by a name ("kv_cache_dim"), which
transformers.js reads as 0 when it makes an empty cache: in what this writes it is the number the
graph's attention nodes say (ortpipe's graphfacts).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ortpipe.graphfacts import decoder_facts
from ortpipe.onnxinfo import read_model
from ortpipe.variants import OPTIMIZED_FOR, SUFFIXES, split

INLINE_LIMIT = 1 << 30  # bytes of weights a graph keeps inside its file
BLOCK_SIZE = 32


def save(model: onnx.ModelProto, path: Path) -> Path:
    """Write `model` to `path`: one file, or `path`_data beside it for large weights; a KV cache
    head dimension declared by name becomes the number (see the module's docstring)."""
    concrete_cache_dims(model)
    size = sum(t.ByteSize() for t in model.graph.initializer)
    if size <= INLINE_LIMIT:
        onnx.save(model, path)
    else:
        onnx.save(model, path, save_as_external_data=True, all_tensors_to_one_file=True,
                  location=path.name + "_data", size_threshold=1024)
    return path


def concrete_cache_dims(model: onnx.ModelProto) -> onnx.ModelProto:
    """The last dimension of past_* inputs and present_* outputs, when a name, set to the head size."""
    head = decoder_facts(read_model(model.SerializeToString())).head_size  # the structure, not the weights
    for value in [*model.graph.input, *model.graph.output]:
        dims = value.type.tensor_type.shape.dim
        if head and value.name.startswith(("past_", "present")) and len(dims) == 4 and dims[3].dim_param:
            dims[3].dim_value = head
    return model


def variant_path(fp32: Path, dtype: str) -> Path:
    base, _ = split(fp32.name)
    return fp32.with_name(f"{base}{SUFFIXES[dtype]}.onnx")


# --- int4 back to fp32 -----------------------------------------------------------------------------


def _unpack_int4(packed: np.ndarray, rows: int, columns: int, scales: np.ndarray, block: int) -> np.ndarray:
    """[rows, columns] float32 from int4 blocks along the columns: uint8 pairs, low nibble first,
    zero point 8 (symmetric: the builder writes no zero points), one scale per block."""
    values = np.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(rows, -1)[:, :columns]
    blocks = -(-columns // block)
    scale = np.repeat(scales.reshape(rows, blocks).astype(np.float32), block, axis=1)[:, :columns]
    return (values.astype(np.float32) - 8.0) * scale


def dequantized(model: onnx.ModelProto) -> onnx.ModelProto:
    """The fp32 graph of an int4 one: MatMulNBits -> MatMul, GatherBlockQuantized -> Gather."""
    weights = {t.name: t for t in model.graph.initializer}
    producers = {out: node for node in model.graph.node for out in node.output}

    def array(name: str) -> np.ndarray:
        if name in weights:
            return numpy_helper.to_array(weights[name])
        node = producers[name]  # the builder reshapes a shared table before GatherBlockQuantized
        if node.op_type != "Reshape":
            raise ValueError(f"{name} is made by a {node.op_type} node, not read from a weight")
        return numpy_helper.to_array(weights[node.input[0]])

    nodes, added, dropped = [], [], set()
    for node in model.graph.node:
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        if node.op_type == "MatMulNBits" and len(node.input) <= 3 and attrs.get("bits", 4) == 4:
            k, n, block = attrs["K"], attrs["N"], attrs["block_size"]
            w = _unpack_int4(array(node.input[1]), n, k, array(node.input[2]), block)
            name = node.input[1] + "_fp32"
            added.append(numpy_helper.from_array(np.ascontiguousarray(w.T), name))
            nodes.append(helper.make_node("MatMul", [node.input[0], name], list(node.output), name=node.name))
            dropped.update(node.input[1:])
        elif (node.op_type == "GatherBlockQuantized" and len(node.input) == 3
              and attrs.get("quantize_axis") == 1):
            scales = array(node.input[2])
            rows, block = scales.shape[0], attrs["block_size"]
            table = _unpack_int4(array(node.input[0]).reshape(rows, -1), rows, scales.shape[1] * block,
                                 scales, block)
            name = node.input[0].strip("/").replace("/", ".") + "_fp32"
            added.append(numpy_helper.from_array(table, name))
            nodes.append(helper.make_node("Gather", [name, node.input[1]], list(node.output), name=node.name))
        elif node.op_type in ("MatMulNBits", "GatherBlockQuantized"):
            raise ValueError(f"{node.name}: a {node.op_type} this tool does not dequantize ({attrs})")
        else:
            nodes.append(node)
    used = {i for node in nodes for i in node.input}
    nodes = [n for n in nodes if n.op_type != "Reshape" or any(o in used for o in n.output)]
    used = {i for node in nodes for i in node.input}
    out = onnx.ModelProto()
    out.CopyFrom(model)
    del out.graph.node[:]
    out.graph.node.extend(nodes)
    del out.graph.initializer[:]
    out.graph.initializer.extend([t for t in model.graph.initializer if t.name in used] + added)
    return out


# --- the variants -----------------------------------------------------------------------------------


def untied_tables(model: onnx.ModelProto) -> onnx.ModelProto:
    """The graph with each embedding table that is read through a Transpose of another weight (the
    model builder's fp32 export shares the output layer's [hidden, vocab] weight with the embedding
    this way) stored as a table of its own: quantize_dynamic quantizes a Gather's table, never a
    Transpose's input, and would leave the table in fp32 (12.6 MB of the demo's 25 MB q8 graph)."""
    weights = {t.name: t for t in model.graph.initializer}
    readers: dict[str, list[onnx.NodeProto]] = {}
    for node in model.graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node)
    out = onnx.ModelProto()
    out.CopyFrom(model)
    kept = []
    for node in out.graph.node:
        users = readers.get(node.output[0], []) if node.output else []
        if (node.op_type == "Transpose" and node.input[0] in weights and users
                and all(u.op_type == "Gather" and u.input[0] == node.output[0] for u in users)):
            perm = [a.ints for a in node.attribute if a.name == "perm"]
            table = numpy_helper.to_array(weights[node.input[0]]).transpose(*(perm[0] if perm else ()))
            out.graph.initializer.append(numpy_helper.from_array(np.ascontiguousarray(table), node.output[0]))
        else:
            kept.append(node)
    del out.graph.node[:]
    out.graph.node.extend(kept)
    return out


def quantize_q8(fp32: Path, out: Path) -> Path:
    from onnxruntime.quantization import QuantType, quantize_dynamic

    with tempfile.TemporaryDirectory() as scratch:
        untied = Path(scratch) / "untied.onnx"
        save(untied_tables(onnx.load(fp32)), untied)
        staged = Path(scratch) / out.name
        quantize_dynamic(untied, staged, weight_type=QuantType.QInt8)
        return save(onnx.load(staged), out)


def optimize_ahead(source: Path, out: Path) -> Path:
    """`source` as onnxruntime's CPU execution provider optimizes it at the extended level (its
    fusions into contrib ops: MatMulIntegerToFloat, SkipLayerNormalization, ...; the demo's int8 graph
    goes from 1,748 nodes to 704), with the metadata entry that says so (ortpipe.variants.OPTIMIZED_FOR),
    so that ortpipe creates its CPU sessions (CPython's CPU provider, wasm) without optimizing it again:
    the same kernels, and a session made in about half the time on a cold wasm start. Other engines and
    devices load it as any graph (they optimize it again, and find less to do). Graphs with external
    weights are not taken."""
    import onnxruntime as ort

    if any(t.data_location == onnx.TensorProto.EXTERNAL for t in onnx.load(source, load_external_data=False)
           .graph.initializer):
        raise ValueError(f"{source} keeps its weights in another file: optimize_ahead takes graphs with "
                         "their weights inside")
    with tempfile.TemporaryDirectory() as scratch:
        staged = Path(scratch) / out.name
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
        options.optimized_model_filepath = str(staged)
        ort.InferenceSession(str(source), options, providers=["CPUExecutionProvider"])
        model = onnx.load(staged)
    kept = [e for e in model.metadata_props if e.key != OPTIMIZED_FOR]
    del model.metadata_props[:]
    model.metadata_props.extend(kept)
    model.metadata_props.add(key=OPTIMIZED_FOR, value="CPUExecutionProvider")
    return save(model, out)


def quantize_q4(fp32: Path, out: Path, accuracy_level: int) -> Path:
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    quantizer = MatMulNBitsQuantizer(onnx.load(fp32), block_size=BLOCK_SIZE, is_symmetric=True,
                                     accuracy_level=accuracy_level)
    quantizer.process()
    return save(quantizer.model.model, out)


def to_fp16(source: Path, out: Path) -> Path:
    from onnxruntime.transformers.float16 import convert_float_to_float16

    model = convert_float_to_float16(onnx.load(source), keep_io_types=False, disable_shape_infer=True)
    return save(model, out)


def with_accuracy_level(source: Path, out: Path, level: int) -> Path:
    """The same int4 graph with every MatMulNBits at accuracy `level` (0 or 1: float compute; 4:
    int8 activations, where the CPU has a kernel for it)."""
    model = onnx.load(source)
    for node in model.graph.node:
        if node.op_type == "MatMulNBits":
            for attr in node.attribute:
                if attr.name == "accuracy_level":
                    attr.i = level
                    break
            else:
                node.attribute.append(helper.make_attribute("accuracy_level", level))
    return save(model, out)


def write_variants(fp32: Path, dtypes: Sequence[str], accuracy_level: int = 0,
                   ahead: bool = False) -> dict[str, Path]:
    """Each of `dtypes` beside the fp32 graph `fp32`; q4f16 is made from the q4 graph (written first
    when the folder has none). `ahead`: q8 optimized ahead for CPUs (`optimize_ahead`)."""
    written: dict[str, Path] = {}
    for dtype in dtypes:
        path = variant_path(fp32, dtype)
        if dtype == "q8":
            written[dtype] = quantize_q8(fp32, path)
            if ahead:
                optimize_ahead(path, path)
        elif dtype == "q4":
            written[dtype] = quantize_q4(fp32, path, accuracy_level)
        elif dtype == "fp16":
            written[dtype] = to_fp16(fp32, path)
        elif dtype == "q4f16":
            q4 = variant_path(fp32, "q4")
            if not q4.is_file():
                q4 = written["q4"] = quantize_q4(fp32, q4, accuracy_level)
            written[dtype] = to_fp16(q4, path)
        else:
            raise ValueError(f"cannot write dtype {dtype}: choose from q8, q4, fp16, q4f16")
    return written


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m build.variants", description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--file", help="the graph to start from, relative to the folder")
    parser.add_argument("--dtypes", default="q8,q4,fp16,q4f16", help="comma-separated: q8,q4,fp16,q4f16")
    parser.add_argument("--accuracy-level", type=int, default=0, choices=(0, 1, 2, 3, 4),
                        help="of q4's MatMulNBits: 0 (the default) computes in float everywhere; 4 uses int8 "
                        "activations where onnxruntime has the kernel (x86 and ARM CPUs, not wasm), which "
                        "is faster there and gives other tokens than the browser")
    parser.add_argument("--from-q4", action="store_true", help="--file is an int4 graph: dequantize it first")
    parser.add_argument("--optimize-ahead", action="store_true",
                        help="write q8 as onnxruntime's CPU provider optimizes it (ortpipe then skips "
                        "that step)")
    args = parser.parse_args(argv)
    names = [args.file] if args.file else ["model.onnx", "onnx/model.onnx"]
    source = next((args.folder / n for n in names if (args.folder / n).is_file()), None)
    if source is None:
        parser.error(f"{args.folder} has none of {', '.join(names)}")
    fp32 = variant_path(source, "fp32")
    if args.from_q4:
        save(dequantized(onnx.load(source)), fp32)
        print(f"wrote {fp32}")
    dtypes = [d for d in args.dtypes.split(",") if d]
    for dtype, path in write_variants(fp32, dtypes, args.accuracy_level, args.optimize_ahead).items():
        print(f"wrote {path} ({dtype})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
