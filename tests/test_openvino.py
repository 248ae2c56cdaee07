"""OpenVINO in its own virtualenv (build/flavours.py; onnxruntime-openvino runs on this machine's CPU).

ortpipe from this checkout runs there as a subprocess (tests/flavour_probe.py). A vision-language
pipeline with its vision session on OpenVINO and the rest on the CPU gives the all-CPU reference's
tokens (so does `ortpipe.load(..., provider="openvino")`, every session on OpenVINO); the placement
report says where each session's nodes went; a graph OpenVINO claims and then cannot compile (opset-23
Attention) falls back to the CPU along the session's list, with a warning; nodes OpenVINO leaves to the
CPU are a warning unless the list accepts the CPU; a missing device is a warning. Skipped, with the
reason, where the virtualenv cannot be made (no wheels for the platform, no network).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from build import pipeline_graphs as pg
from onnx import TensorProto, helper

from ortpipe.config.profiles import layer_profile, load_profile
from tests.flavour_env import REPO, flavour_python, probe, session_request, with_config
from tests.pipeline_refs import reference_tokens

NEW = 12
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def openvino() -> Path:
    return flavour_python("openvino")


@pytest.fixture(scope="module")
def vl(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The phi3v-style pipeline all on the CPU, and with its vision on OpenVINO; its request's inputs."""
    root = tmp_path_factory.mktemp("vl")
    cpu = pg.BUILDERS["phi3v"][0](root / "cpu", 0)
    config = json.loads((cpu / "genai_config.json").read_text())
    sessions = config["pipeline"]["sessions"]
    sessions["vision"]["execution_provider"] = "openvino"
    sessions["embedding"]["execution_provider"] = sessions["decoder"]["execution_provider"] = "cpu"
    ov = with_config(cpu, root / "openvino", config)
    np.savez(root / "inputs.npz", **pg.BUILDERS["phi3v"][1](0).inputs)
    return {"cpu": cpu, "openvino": ov, "inputs": root / "inputs.npz"}


def test_vision_on_openvino_gives_the_all_cpu_tokens(openvino: Path, vl: dict[str, Path],
                                                     tmp_path: Path) -> None:
    r = pg.BUILDERS["phi3v"][1](0)
    expected = reference_tokens(vl["cpu"], r.prompt_ids, r.inputs, NEW)  # plain onnxruntime, CPU, this venv
    for folder, provider in (("cpu", None), ("openvino", None), ("cpu", "openvino")):
        answer = probe(openvino, {"generate": str(vl[folder]), "prompt_ids": r.prompt_ids,
                                  "inputs": str(vl["inputs"]), "new": NEW, "provider": provider}, tmp_path)
        assert answer["tokens"] == expected, (folder, provider)  # the last: every session on OpenVINO
        assert answer["warnings"] == []


def test_the_report_shows_each_session_on_its_provider(openvino: Path, vl: dict[str, Path],
                                                       tmp_path: Path) -> None:
    shares = {}
    for name in ("vision", "embedding", "decoder"):
        answer = probe(openvino, session_request(vl["openvino"], name), tmp_path)
        assert answer["warnings"] == [] and answer["skipped"] == []
        assert answer["total_nodes"] > 0
        shares[name] = (answer["provider"], answer["shares"])
    assert shares == {"vision": ("openvino", {"openvino": 1.0}), "embedding": ("cpu", {"cpu": 1.0}),
                      "decoder": ("cpu", {"cpu": 1.0})}
    vision = probe(openvino, session_request(vl["openvino"], "vision"), tmp_path)
    n = vision["total_nodes"]
    assert vision["describe"] == f"vision: openvino, {n} of {n} nodes (100%) on openvino"
    assert vision["session_providers"] == ["OpenVINOExecutionProvider", "CPUExecutionProvider"]


def attention_23(path: Path) -> Path:
    """One opset-23 Attention node: OpenVINO's EP claims it, then its compiler has no such operation."""
    qkv = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [1, 2, 4, 8]) for n in "qkv"]
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2, 4, 8])
    node = helper.make_node("Attention", ["q", "k", "v"], ["y"], is_causal=1)
    graph = helper.make_graph([node], "attention", qkv, [y])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)], ir_version=10)
    onnx.checker.check_model(model)
    onnx.save(model, path)
    return path


def test_a_graph_openvino_cannot_compile_falls_back_to_cpu(openvino: Path, tmp_path: Path) -> None:
    path = attention_23(tmp_path / "attention.onnx")
    session = {"name": "attention", "file": "attention.onnx", "providers": ["openvino", "cpu"]}
    answer = probe(openvino, {"open": str(path), "session": session}, tmp_path)
    assert answer["provider"] == "cpu" and answer["nodes"] == {"cpu": 1}
    assert [s["provider"] for s in answer["skipped"]] == ["openvino"]
    reason = answer["skipped"][0]["reason"]
    assert "OpenVINO does not support the following ONNX operations: Attention" in reason
    assert len(answer["warnings"]) == 1
    assert "openvino was passed over" in answer["warnings"][0] and "using cpu" in answer["warnings"][0]

    alone = probe(openvino, {"open": str(path), "session": {**session, "providers": ["openvino"]}}, tmp_path)
    assert "none could run it" in alone["error"] and "Attention" in alone["error"]


def test_nodes_openvino_leaves_to_the_cpu_are_a_warning(openvino: Path, tmp_path: Path) -> None:
    """The demo model's GroupQueryAttention and GatherBlockQuantized: contrib ops OpenVINO lacks."""
    path = REPO / "models" / "demo" / "onnx" / "model_q4.onnx"
    session = {"name": "decoder", "file": "onnx/model_q4.onnx", "providers": ["openvino"]}
    answer = probe(openvino, {"open": str(path), "session": session}, tmp_path)
    assert answer["provider"] == "openvino" and set(answer["nodes"]) == {"openvino", "cpu"}
    assert "GroupQueryAttention" in answer["op_types"]["cpu"]
    assert "GroupQueryAttention" not in answer["op_types"]["openvino"]
    cpu, total, share = answer["nodes"]["cpu"], answer["total_nodes"], answer["shares"]["cpu"]
    assert answer["warnings"] == [
        f'session "decoder": {cpu} of {total} nodes ({share:.0%}) run on cpu, '
        f"which the session did not ask for ({', '.join(answer['op_types']['cpu'])}). "
        'Add "cpu" to its execution_provider list to accept this']

    accepted = probe(openvino, {"open": str(path), "session": {**session, "providers": ["openvino", "cpu"]}},
                     tmp_path)
    assert accepted["nodes"] == answer["nodes"] and accepted["warnings"] == []


def test_a_missing_device_is_a_warning(openvino: Path, vl: dict[str, Path], tmp_path: Path) -> None:
    if "GPU" in probe(openvino, {"installed": True}, tmp_path)["openvino_devices"]:
        pytest.skip("this machine has an OpenVINO GPU")
    request = session_request(vl["openvino"], "vision")
    request["session"]["provider_options"] = {"openvino": {"device_type": "GPU"}}
    answer = probe(openvino, request, tmp_path)
    assert answer["session_providers"] == ["CPUExecutionProvider"]
    assert any("onnxruntime created the session without openvino" in w for w in answer["warnings"])
    assert answer["nodes"] == {"cpu": answer["total_nodes"]}


def test_the_intel_cpu_profile_puts_every_session_on_openvino_and_caches_its_blobs(
        openvino: Path, vl: dict[str, Path], tmp_path: Path) -> None:
    profile_file = tmp_path / "intel-cpu-here.json"
    profile = json.loads((REPO / "edge" / "profiles" / "intel-cpu.json").read_text())
    profile["session"]["provider_options"]["openvino"]["cache_dir"] = str(tmp_path / "blobs")
    profile_file.write_text(json.dumps(profile))
    config = json.loads((vl["cpu"] / "genai_config.json").read_text())
    layered = layer_profile(config, load_profile(str(profile_file)))
    folder = with_config(vl["cpu"], tmp_path / "profiled", layered)
    for name in ("vision", "decoder"):
        answer = probe(openvino, session_request(folder, name), tmp_path)
        assert answer["provider"] == "openvino" and answer["requested"] == ["openvino", "cpu"]
        assert answer["options"]["device_type"] == "CPU"
    assert list((tmp_path / "blobs").glob("*.blob"))
