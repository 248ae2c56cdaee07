"""The QNN plugin execution provider (onnxruntime-qnn 2.x) in its own virtualenv (build/flavours.py).

On Linux x86_64 the plugin compiles ahead of time and runs nothing, which is enough to check what ortpipe
does around it: the package's library is registered with onnxruntime, the session is opened on the plugin's
devices with the snapdragon-npu profile's HTP options, and since the HTP takes none of the nodes the report
says so; a session the plugin cannot open (no backend for this device) falls back along its list.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from build import pipeline_graphs as pg

from ortpipe.config.profiles import layer_profile, load_profile
from tests.flavour_env import flavour_python, probe, session_request, with_config
from tests.pipeline_refs import reference_tokens

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def qnn() -> Path:
    return flavour_python("qnn")


@pytest.fixture(scope="module")
def snapdragon(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The phi3v-style pipeline with the snapdragon-npu profile layered over its config."""
    root = tmp_path_factory.mktemp("snapdragon")
    cpu = pg.BUILDERS["phi3v"][0](root / "cpu", 0)
    config = json.loads((cpu / "genai_config.json").read_text())
    return with_config(cpu, root / "profiled", layer_profile(config, load_profile("snapdragon-npu")))


def test_the_plugin_is_registered_and_the_report_says_the_htp_took_nothing(qnn: Path, snapdragon: Path,
                                                                           tmp_path: Path) -> None:
    installed = probe(qnn, {"installed": True}, tmp_path)["installed"]
    assert installed == {"cpu": "built in", "qnn": "onnxruntime_qnn"}
    vision = probe(qnn, session_request(snapdragon, "vision"), tmp_path)
    assert vision["provider"] == "qnn" and vision["skipped"] == []
    assert vision["session_providers"] == ["QNNExecutionProvider", "CPUExecutionProvider"]
    assert vision["options"]["backend_type"] == "htp"
    total = vision["total_nodes"]
    assert vision["nodes"] == {"cpu": total} and total > 0
    assert vision["warnings"] == [f'session "vision": qnn took none of its {total} nodes; they run on cpu']

    decoder = probe(qnn, session_request(snapdragon, "decoder"), tmp_path)
    assert (decoder["provider"], decoder["shares"], decoder["warnings"]) == ("cpu", {"cpu": 1.0}, [])


def test_a_session_the_plugin_cannot_open_falls_back(qnn: Path, snapdragon: Path, tmp_path: Path) -> None:
    request = session_request(snapdragon, "vision")
    request["session"]["provider_options"] = {}  # no backend_type: none is the default for this device
    answer = probe(qnn, request, tmp_path)
    assert answer["provider"] == "cpu"
    reason = "it failed to create the session: Could not determine default backend path for device"
    assert answer["skipped"] == [{"provider": "qnn", "reason": reason}]


def test_load_with_the_profile_registers_the_plugin_and_gives_the_all_cpu_tokens(
        qnn: Path, snapdragon: Path, tmp_path: Path) -> None:
    """`ortpipe.load(folder, profile="snapdragon-npu")`: the vision session opens on the plugin, whose HTP
    takes none of its nodes here (x64: ahead of time only), so the CPU runs them and the tokens are the
    all-CPU reference's."""
    r = pg.BUILDERS["phi3v"][1](0)
    cpu = snapdragon.parent / "cpu"
    np.savez(tmp_path / "inputs.npz", **r.inputs)
    request = {"generate": str(cpu), "prompt_ids": r.prompt_ids, "inputs": str(tmp_path / "inputs.npz"),
               "new": 12, "profile": "snapdragon-npu"}
    answer = probe(qnn, request, tmp_path)
    assert answer["tokens"] == reference_tokens(cpu, r.prompt_ids, r.inputs, 12)
    placed = {n: (a["provider"], a["requested"]) for n, a in answer["assignments"].items()}
    assert placed == {"vision": ("qnn", ["qnn", "cpu"]), "embedding": ("qnn", ["qnn", "cpu"]),
                      "decoder": ("cpu", ["cpu"])}
    vision, embedding = answer["warnings"]  # the plugin stays in the vision session, not in the embedding's
    total = answer["assignments"]["vision"]["total_nodes"]
    assert vision == f'session "vision": qnn took none of its {total} nodes; they run on cpu'
    assert embedding.startswith('session "embedding": onnxruntime created the session without qnn '
                                "(it claimed none of the nodes")
