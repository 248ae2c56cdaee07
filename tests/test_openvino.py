"""OpenVINO in its own virtualenv (build/flavours.py; onnxruntime-openvino runs on this machine's CPU).

ortpipe from this checkout runs there as a subprocess (tests/flavour_probe.py, or `ortpipe` itself). A
vision-language pipeline with its vision session on OpenVINO and the rest on the CPU gives the all-CPU
reference's tokens, whether the config asks for it, `ortpipe.load(provider={"vision": "openvino"})` or
`ortpipe run --ep vision=openvino` (and with every session on OpenVINO); the placement report says where
each session's nodes went (`Pipeline.assignments`, `ortpipe inspect`); a graph OpenVINO claims and then
cannot compile (opset-23 Attention) falls back to the CPU along the session's list, with a warning, alone
and as a pipeline's vision session; nodes OpenVINO leaves to the CPU are a warning unless the list accepts
the CPU; a missing device is a warning. Skipped, with the reason, where the virtualenv cannot be made (no
wheels for the platform, no network).
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
from tests.flavour_env import REPO, flavour_cli, flavour_python, probe, session_request, with_config
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
    inputs = pg.BUILDERS["phi3v"][1](0).inputs
    np.savez(root / "inputs.npz", **inputs)
    np.save(root / "pixel_values.npy", inputs["pixel_values"])
    return {"cpu": cpu, "openvino": ov, "inputs": root / "inputs.npz",
            "pixel_values": root / "pixel_values.npy"}


@pytest.fixture(scope="module")
def expected(vl: dict[str, Path]) -> list[int]:
    """The all-CPU reference: plain onnxruntime driven by hand, in this (the test suite's) environment."""
    r = pg.BUILDERS["phi3v"][1](0)
    return reference_tokens(vl["cpu"], r.prompt_ids, r.inputs, NEW)


def generate(python: Path, folder: Path, inputs: Path, tmp_path: Path, **options: object) -> dict:
    request = {"generate": str(folder), "prompt_ids": pg.BUILDERS["phi3v"][1](0).prompt_ids,
               "inputs": str(inputs), "new": NEW, **options}
    return probe(python, request, tmp_path)


def test_vision_on_openvino_gives_the_all_cpu_tokens(openvino: Path, vl: dict[str, Path], expected: list[int],
                                                     tmp_path: Path) -> None:
    providers = {}
    for folder, provider in (("cpu", None), ("openvino", None), ("cpu", {"vision": "openvino"}),
                             ("cpu", "openvino")):
        answer = generate(openvino, vl[folder], vl["inputs"], tmp_path, provider=provider)
        assert answer["tokens"] == expected, (folder, provider)  # the last: every session on OpenVINO
        assert answer["warnings"] == []
        providers[folder, str(provider)] = {n: a["provider"] for n, a in answer["assignments"].items()}
    vision_on_openvino = {"vision": "openvino", "embedding": "cpu", "decoder": "cpu"}
    assert providers == {
        ("cpu", "None"): {"vision": "cpu", "embedding": "cpu", "decoder": "cpu"},
        ("openvino", "None"): vision_on_openvino, ("cpu", "{'vision': 'openvino'}"): vision_on_openvino,
        ("cpu", "openvino"): {"vision": "openvino", "embedding": "openvino", "decoder": "openvino"}}


def test_the_cli_puts_the_vision_session_on_openvino(openvino: Path, vl: dict[str, Path], expected: list[int],
                                                     tmp_path: Path) -> None:
    r = pg.BUILDERS["phi3v"][1](0)
    run = flavour_cli(openvino, "run", str(vl["cpu"]), "--prompt-ids", ",".join(map(str, r.prompt_ids)),
                      "--input", f"pixel_values={vl['pixel_values']}", "--max-new-tokens", str(NEW),
                      "--threads", "1", "--ep", "vision=openvino", "--json")
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout.splitlines()[-1])["tokens"] == expected
    assert "warning" not in run.stderr

    inspect = flavour_cli(openvino, "inspect", str(vl["cpu"]), "--ep", "vision=openvino", "--json")
    assert inspect.returncode == 0, inspect.stderr
    sessions = json.loads(inspect.stdout)["sessions"]
    placed = {n: (s["provider"], s["placement"]["requested"], s["placement"]["shares"])
              for n, s in sessions.items()}
    assert placed == {"vision": ("openvino", ["openvino"], {"openvino": 1.0}),
                      "embedding": ("cpu", ["cpu"], {"cpu": 1.0}), "decoder": ("cpu", ["cpu"], {"cpu": 1.0})}
    text = flavour_cli(openvino, "inspect", str(vl["cpu"]), "--ep", "vision=openvino")
    n = sessions["vision"]["placement"]["total_nodes"]
    vision = f"vision: openvino, {n} of {n} nodes (100%) on openvino"
    assert f"providers:\n  {vision}\n  embedding: cpu, " in text.stdout


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
    assert alone["error"].startswith('session "attention" could not be created from attention.onnx on '
                                     "openvino: openvino: it failed to create the session:")
    assert "Attention" in alone["error"]


def with_attention_23(vision: Path) -> None:
    """The vision graph plus an opset-23 Attention over its patches whose result is added times 0: the
    same features on the CPU, a graph OpenVINO's compiler refuses."""
    model = onnx.load(vision)
    del model.opset_import[:]
    model.opset_import.append(helper.make_opsetid("", 23))
    model.ir_version = 10
    graph = model.graph
    out = next(n for n in graph.node if "image_features" in n.output)
    out.output[0] = "features_before"
    graph.initializer.extend([onnx.numpy_helper.from_array(np.array([0, 1, 4, -1], np.int64), "qkv_shape"),
                              onnx.numpy_helper.from_array(np.array(0.0, np.float32), "zero")])
    graph.node.extend([
        helper.make_node("Reshape", ["pixel_values", "qkv_shape"], ["qkv"]),  # [n, 1, 4, 48]
        helper.make_node("Attention", ["qkv", "qkv", "qkv"], ["attended"]),
        helper.make_node("ReduceSum", ["attended"], ["attended_sum"], keepdims=0),
        helper.make_node("Mul", ["attended_sum", "zero"], ["nothing"]),
        helper.make_node("Add", ["features_before", "nothing"], ["image_features"])])
    onnx.checker.check_model(model)
    onnx.save(model, vision)


def test_a_pipeline_session_openvino_cannot_compile_falls_back_to_cpu(
        openvino: Path, vl: dict[str, Path], expected: list[int], tmp_path: Path) -> None:
    config = json.loads((vl["cpu"] / "genai_config.json").read_text())
    config["pipeline"]["sessions"]["vision"]["execution_provider"] = ["openvino", "cpu"]
    folder = with_config(vl["cpu"], tmp_path / "attention", config)
    with_attention_23(folder / config["pipeline"]["sessions"]["vision"]["file"])
    answer = generate(openvino, folder, vl["inputs"], tmp_path)
    assert answer["tokens"] == expected
    vision = answer["assignments"]["vision"]
    assert vision["provider"] == "cpu" and [s["provider"] for s in vision["skipped"]] == ["openvino"]
    reason = vision["skipped"][0]["reason"]
    assert "OpenVINO does not support the following ONNX operations: Attention" in reason
    assert len(answer["warnings"]) == 1
    assert answer["warnings"][0].startswith('session "vision": openvino was passed over: it failed to create')


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
