"""A tiny RNN transducer for the plugin example (examples/plugins/rnnt): three graphs with seeded random
weights, a genai_config.json that names the plugin, and the plugin's wheel beside them.

    python -m build.plugin_models OUT_DIR
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

REPO = Path(__file__).resolve().parent.parent
PLUGIN = REPO / "examples" / "plugins" / "rnnt"
FEATURES, HIDDEN, STATE, VOCAB = 8, 16, 16, 12
BLANK_ID = 0  # the transducer's blank symbol; the last id (VOCAB - 1) is eos

OPSET, IR_VERSION = 17, 8


def _weight(
    rng: np.random.Generator, name: str, shape: tuple[int, ...], scale: float = 1.0
) -> onnx.TensorProto:
    return numpy_helper.from_array((rng.standard_normal(shape) * scale).astype(np.float32), name)


def _model(graph: onnx.GraphProto) -> onnx.ModelProto:
    model = helper.make_model(
        graph, producer_name="ortpipe-tests", opset_imports=[helper.make_opsetid("", OPSET)]
    )
    model.ir_version = IR_VERSION
    return model


def encoder(rng: np.random.Generator) -> onnx.ModelProto:
    nodes = [
        helper.make_node("MatMul", ["features", "w"], ["proj"]),
        helper.make_node("Add", ["proj", "b"], ["pre"]),
        helper.make_node("Tanh", ["pre"], ["encoder_out"]),
    ]
    graph = helper.make_graph(
        nodes,
        "encoder",
        [helper.make_tensor_value_info("features", TensorProto.FLOAT, [1, "frames", FEATURES])],
        [helper.make_tensor_value_info("encoder_out", TensorProto.FLOAT, [1, "frames", HIDDEN])],
        [_weight(rng, "w", (FEATURES, HIDDEN), 0.7), _weight(rng, "b", (HIDDEN,), 0.2)],
    )
    return _model(graph)


def predictor(rng: np.random.Generator) -> onnx.ModelProto:
    """state_out = tanh(embedding[token] + state @ w); prediction = state_out @ p, as [1, 1, HIDDEN]."""
    nodes = [
        helper.make_node("Gather", ["embedding", "token"], ["embedded3"]),
        helper.make_node("Reshape", ["embedded3", "flat"], ["embedded"]),
        helper.make_node("MatMul", ["state", "w"], ["carried"]),
        helper.make_node("Add", ["embedded", "carried"], ["pre"]),
        helper.make_node("Tanh", ["pre"], ["state_out"]),
        helper.make_node("MatMul", ["state_out", "p"], ["projected"]),
        helper.make_node("Reshape", ["projected", "shape3"], ["prediction"]),
    ]
    graph = helper.make_graph(
        nodes,
        "predictor",
        [
            helper.make_tensor_value_info("token", TensorProto.INT64, [1, 1]),
            helper.make_tensor_value_info("state", TensorProto.FLOAT, [1, STATE]),
        ],
        [
            helper.make_tensor_value_info("prediction", TensorProto.FLOAT, [1, 1, HIDDEN]),
            helper.make_tensor_value_info("state_out", TensorProto.FLOAT, [1, STATE]),
        ],
        [
            _weight(rng, "embedding", (VOCAB, STATE)),
            _weight(rng, "w", (STATE, STATE), 0.5),
            _weight(rng, "p", (STATE, HIDDEN), 0.7),
            numpy_helper.from_array(np.array([1, STATE], np.int64), "flat"),
            numpy_helper.from_array(np.array([1, 1, HIDDEN], np.int64), "shape3"),
        ],
    )
    return _model(graph)


def joiner(rng: np.random.Generator) -> onnx.ModelProto:
    bias = np.zeros(VOCAB, np.float32)
    bias[0] = 0.8  # a blank now and then, so frames end and symbols are emitted both
    nodes = [
        helper.make_node("Add", ["encoder_frame", "prediction"], ["joined"]),
        helper.make_node("Tanh", ["joined"], ["hidden"]),
        helper.make_node("MatMul", ["hidden", "w"], ["proj"]),
        helper.make_node("Add", ["proj", "b"], ["logits"]),
    ]
    graph = helper.make_graph(
        nodes,
        "joiner",
        [
            helper.make_tensor_value_info("encoder_frame", TensorProto.FLOAT, [1, 1, HIDDEN]),
            helper.make_tensor_value_info("prediction", TensorProto.FLOAT, [1, 1, HIDDEN]),
        ],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, 1, VOCAB])],
        [_weight(rng, "w", (HIDDEN, VOCAB), 1.5), numpy_helper.from_array(bias, "b")],
    )
    return _model(graph)


def wheel(out: Path) -> str:
    """The plugin's wheel, built from examples/plugins/rnnt into `out`; its file name."""
    with tempfile.TemporaryDirectory() as tmp:
        source = shutil.copytree(PLUGIN, Path(tmp) / "source")  # setuptools writes build/ beside its sources
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "wheel",
                "--no-deps",
                "--no-build-isolation",
                "-q",
                "-w",
                tmp,
                str(source),
            ],
            check=True,
            capture_output=True,
        )
        built = next(Path(tmp).glob("*.whl"))
        (out / built.name).write_bytes(built.read_bytes())
        return built.name


def build_rnnt(out_dir: Path | str, seed: int = 0, with_wheel: bool = True) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    for name, make in (("encoder", encoder), ("predictor", predictor), ("joiner", joiner)):
        onnx.save(make(rng), str(out / f"{name}.onnx"))
    plugin: dict[str, str] = {"module": "ortpipe_rnnt:factory"}
    if with_wheel:
        plugin["wheel"] = wheel(out)
    config = {
        "version": 2,
        "pipeline": {
            "sessions": {name: {"file": f"{name}.onnx"} for name in ("encoder", "predictor", "joiner")},
            "plugin": plugin,
        },
        "tokens": {"eos": [VOCAB - 1]},
        "metadata": {"model_type": "rnnt-example", "source": "build/plugin_models.py"},
    }
    (out / "genai_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


def features(frames: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(100 + seed).standard_normal((1, frames, FEATURES)).astype(np.float32)


if __name__ == "__main__":
    print(build_rnnt(sys.argv[1]))
