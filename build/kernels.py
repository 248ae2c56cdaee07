"""Build ortpipe's kernel graphs: the numeric work that is not a model, as tiny ONNX graphs.

Run `python -m build.kernels` to rewrite py/ortpipe/kernels/*.onnx. The files are shipped as
package data; a test checks that a fresh build equals them byte for byte.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

import onnx
from onnx import TensorProto, helper

OPSET = 17
IR_VERSION = 8
OUT_DIR = Path(__file__).resolve().parent.parent / "py" / "ortpipe" / "kernels"
FLOAT_TYPES = {"float32": TensorProto.FLOAT, "float16": TensorProto.FLOAT16}
INT64_MAX = 2**63 - 1


def _const(name: str, values: list[int]) -> onnx.NodeProto:
    return helper.make_node("Constant", [], [name], value=helper.make_tensor(name, TensorProto.INT64,
                                                                              [len(values)], values))


def argmax_last(elem: int) -> onnx.GraphProto:
    """logits [batch, seq, vocab] -> token int64 [batch]: the argmax of the last position."""
    nodes = [
        _const("start", [-1]), _const("end", [INT64_MAX]), _const("axis1", [1]),
        helper.make_node("Slice", ["logits", "start", "end", "axis1"], ["last"]),
        helper.make_node("ArgMax", ["last"], ["arg"], axis=-1, keepdims=0),
        helper.make_node("Squeeze", ["arg", "axis1"], ["token"]),
    ]
    return helper.make_graph(
        nodes, "argmax_last",
        [helper.make_tensor_value_info("logits", elem, ["batch", "seq", "vocab"])],
        [helper.make_tensor_value_info("token", TensorProto.INT64, ["batch"])])


def keep_last(elem: int) -> onnx.GraphProto:
    """x, keep [1], axis [1] -> the last `keep` positions of x along `axis` (sliding-window caches)."""
    nodes = [
        _const("end", [INT64_MAX]),
        helper.make_node("Neg", ["keep"], ["start"]),
        helper.make_node("Slice", ["x", "start", "end", "axis"], ["y"]),
    ]
    # Any rank: a tensor type with no shape field at all.
    x = helper.make_value_info("x", helper.make_tensor_type_proto(elem, shape=None))
    y = helper.make_value_info("y", helper.make_tensor_type_proto(elem, shape=None))
    ints = [helper.make_tensor_value_info(n, TensorProto.INT64, [1]) for n in ("keep", "axis")]
    return helper.make_graph(nodes, "keep_last", [x, *ints], [y])


KERNELS: dict[str, Callable[[int], onnx.GraphProto]] = {"argmax_last": argmax_last, "keep_last": keep_last}


def build_all() -> dict[str, bytes]:
    """File name -> serialized model, for every kernel and float type."""
    files = {}
    for name, make in KERNELS.items():
        for type_name, elem in FLOAT_TYPES.items():
            model = helper.make_model(make(elem), producer_name="ortpipe",
                                      opset_imports=[helper.make_opsetid("", OPSET)])
            model.ir_version = IR_VERSION
            files[f"{name}_{type_name}.onnx"] = model.SerializeToString()
    return files


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUT_DIR)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for name, data in build_all().items():
        (args.out / name).write_bytes(data)
        print(f"wrote {args.out / name} ({len(data)} bytes)")


if __name__ == "__main__":
    main()
