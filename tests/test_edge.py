"""Edge devices without their hardware: device profiles, provider settings, the provider choice on the CPU
onnxruntime of this environment, node placement, the check for two onnxruntime flavours, and the extras'
platform markers. OpenVINO and the QNN plugin run in their own environments (test_openvino.py, test_qnn.py).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import onnx
import onnxruntime as ort
import pytest
import tomllib
from packaging.requirements import Requirement

import ortpipe
from ortpipe.config import load_config
from ortpipe.config.ep import check_session_options, options_for, provider_key
from ortpipe.config.profiles import layer_profile, load_profile, parse_profile, profile_names
from ortpipe.config.schema import SessionSpec
from ortpipe.errors import ConfigError, Problems
from ortpipe.folder import LocalFolder
from ortpipe.targets.cpython import flavours, providers

REPO = Path(__file__).resolve().parent.parent
DEMO_DIR = REPO / "models" / "demo"
DEMO = DEMO_DIR / "onnx" / "model_q4.onnx"
VLM = {"version": 2, "pipeline": {"extends": "vision-language", "sessions": {
    "vision": {"file": "vision.onnx",
               "provider_options": {"OpenVINO": {"num_streams": "2", "device_type": "GPU"}},
               "session_options": {"intra_op_num_threads": 2, "config_entries": {"session.x": "1"}}},
    "embedding": {"file": "embedding.onnx"}, "decoder": {"file": "decoder.onnx"}}}}


def spec(*names: str, **options: dict) -> SessionSpec:
    return SessionSpec(name="decoder", file="model.onnx", providers=names, **options)


# --- profiles ----------------------------------------------------------------------------------


def test_every_built_in_profile_validates() -> None:
    assert profile_names() == ["intel-cpu", "intel-gpu", "intel-npu", "raspberry-pi", "snapdragon-npu",
                               "windows-gpu"]
    first = {name: load_profile(name).session["execution_provider"][0] for name in profile_names()}
    assert first == {"intel-cpu": "openvino", "intel-gpu": "openvino", "intel-npu": "openvino",
                     "raspberry-pi": "cpu", "snapdragon-npu": "qnn", "windows-gpu": "dml"}
    cache = load_profile("intel-npu").session["provider_options"]["openvino"]["cache_dir"]
    assert cache == str(Path.home() / ".cache" / "ortpipe" / "openvino")


def test_a_bad_profile_lists_every_problem() -> None:
    with pytest.raises(ConfigError) as info:
        parse_profile({"sesion": {}, "session": {
            "execution_provider": ["openvno"],
            "provider_options": {"openvino": {"device_type": "TPU", "enable_qdq_optimizer": True}},
            "session_options": {"intra_op_threads": 2}}}, "bad")
    problems = info.value.problems
    assert len(problems) == 5
    assert 'Unknown key "sesion" in profile bad. Did you mean "session"?' in problems[0]
    assert 'Unknown execution provider "openvno" in profile bad.session.execution_provider' in problems[1]
    assert 'Did you mean "openvino"?' in problems[1]
    assert "enable_qdq_optimizer must be a string or a number" in problems[2]
    assert 'device_type "TPU" is not an OpenVINO device' in problems[3]
    assert 'Unknown key "intra_op_threads"' in problems[4]
    assert 'Did you mean "intra_op_num_threads"?' in problems[4]


def test_an_unknown_profile_suggests_the_closest_and_a_file_works(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match='Unknown profile "raspberry". .* Did you mean "raspberry-pi"?'):
        load_profile("raspberry")
    path = tmp_path / "mine.json"
    path.write_text(json.dumps({"session": {"execution_provider": "cpu"}}))
    assert load_profile(str(path)).session == {"execution_provider": ["cpu"]}
    path.write_text("{")
    with pytest.raises(ConfigError, match="is not valid JSON"):
        load_profile(str(path))


def test_a_profile_layers_over_every_session_then_over_named_ones() -> None:
    layered = layer_profile(VLM, load_profile("intel-npu"))
    sessions = layered["pipeline"]["sessions"]
    cache = str(Path.home() / ".cache" / "ortpipe" / "openvino")
    assert sessions["vision"]["execution_provider"] == ["openvino", "cpu"]
    assert sessions["vision"]["provider_options"] == {  # the model's "OpenVINO" options, merged
        "openvino": {"num_streams": "2", "device_type": "NPU", "cache_dir": cache}}
    assert sessions["vision"]["session_options"] == VLM["pipeline"]["sessions"]["vision"]["session_options"]
    assert sessions["decoder"]["provider_options"] == {"openvino": {"device_type": "CPU", "cache_dir": cache}}
    assert VLM["pipeline"]["sessions"]["vision"]["provider_options"]["OpenVINO"]["device_type"] == "GPU"

    pi = layer_profile(VLM, load_profile("raspberry-pi"))["pipeline"]["sessions"]["vision"]["session_options"]
    assert pi["intra_op_num_threads"] == 4 and pi["enable_cpu_mem_arena"] is False
    assert pi["config_entries"] == {"session.x": "1", "session.intra_op.allow_spinning": "0",
                                    "session.inter_op.allow_spinning": "0",
                                    "session.use_device_allocator_for_initializers": "1"}


def test_a_profile_over_a_preset_writes_out_the_presets_sessions() -> None:
    layered = layer_profile({"version": 2, "pipeline": {"extends": "autoregressive-decoder"}},
                            load_profile("raspberry-pi"))
    decoder = layered["pipeline"]["sessions"]["decoder"]
    assert decoder["file"] == "model.onnx" and decoder["execution_provider"] == ["cpu"]


@pytest.mark.parametrize(("profile", "vision", "decoder"), [
    ("snapdragon-npu", ("qnn", "cpu"), ("cpu",)), ("windows-gpu", ("dml", "cpu"), ("dml", "cpu"))])
def test_qnn_and_directml_configs_validate_here(profile: str, vision: tuple, decoder: tuple,
                                                tmp_path: Path) -> None:
    for name in ("vision.onnx", "embedding.onnx", "decoder.onnx"):
        (tmp_path / name).write_bytes(b"")
    (tmp_path / "genai_config.json").write_text(json.dumps(layer_profile(VLM, load_profile(profile))))
    sessions = load_config(LocalFolder(tmp_path)).pipeline.sessions
    assert (sessions["vision"].providers, sessions["decoder"].providers) == (vision, decoder)
    request = providers.request_for(sessions["vision"])
    assert request.providers == vision and request.provider_options[vision[0]]


# --- provider settings -------------------------------------------------------------------------


def test_providers_are_named_by_key_alias_or_onnxruntime_name() -> None:
    assert [provider_key(n) for n in ("OpenVINOExecutionProvider", "DirectML", "QNN", "cpu", "npu")] == [
        "openvino", "dml", "qnn", "cpu", None]


def test_session_options_apply_per_provider() -> None:
    problems = Problems()
    options = check_session_options({"intra_op_num_threads": 4, "config_entries": {"a": "1"},
                                     "OpenVINO": {"intra_op_num_threads": 1, "config_entries": {"b": "2"}}},
                                    "session_options", problems)
    assert not problems
    assert options_for(options, "openvino") == {"intra_op_num_threads": 1,
                                                "config_entries": {"a": "1", "b": "2"}}
    assert options_for(options, "cpu") == {"intra_op_num_threads": 4, "config_entries": {"a": "1"}}


def test_session_options_reach_onnxruntime() -> None:
    options = providers.session_options({
        "intra_op_num_threads": 3, "enable_cpu_mem_arena": False,
        "graph_optimization_level": "ORT_ENABLE_BASIC", "execution_mode": "ORT_PARALLEL",
        "disable_cpu_ep_fallback": True, "log_id": "vision",
        "config_entries": {"session.intra_op.allow_spinning": "0"}})
    assert (options.intra_op_num_threads, options.enable_cpu_mem_arena, options.logid) == (3, False, "vision")
    assert options.graph_optimization_level == ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    assert options.execution_mode == ort.ExecutionMode.ORT_PARALLEL
    assert options.get_session_config_entry("session.disable_cpu_ep_fallback") == "1"
    assert options.get_session_config_entry("session.intra_op.allow_spinning") == "0"
    assert options.get_session_config_entry(providers.RECORD_ASSIGNMENT) == "1"


# --- providers on this environment's onnxruntime (CPU) -----------------------------------------


@pytest.mark.parametrize(("name", "extra"), [("qnn", "qnn"), ("dml", "directml"), ("openvino", "openvino"),
                                             ("cuda", "cuda")])
def test_a_provider_that_is_not_installed_names_its_extra(name: str, extra: str) -> None:
    with pytest.raises(ConfigError) as info:
        providers.open_session(DEMO, spec(name))
    message = str(info.value)
    assert f'session "decoder" (model.onnx) asks for {name}, and none could run it.' in message
    assert f'it is not installed here: pip install "ortpipe[{extra}]" installs it' in message
    assert "Installed here: cpu." in message


def test_a_fallback_list_passes_over_what_is_missing_with_a_warning() -> None:
    with pytest.warns(providers.ProviderWarning, match="qnn was passed over: it is not installed here"):
        _, assignment = providers.open_session(DEMO, spec("qnn", "cpu"))
    assert assignment.provider == "cpu"
    assert [s.provider for s in assignment.skipped] == ["qnn"]


def test_the_override_replaces_the_sessions_list() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _, assignment = providers.open_session(DEMO, spec("qnn"), "cpu")
    assert (assignment.requested, assignment.provider) == (("cpu",), "cpu")


def test_placement_counts_the_nodes_onnxruntime_partitioned(tmp_path: Path) -> None:
    """Nodes are assigned after the basic optimizations: as many as the basic-optimized model holds."""
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    options.optimized_model_filepath = str(tmp_path / "basic.onnx")
    options.add_session_config_entry("session.optimized_model_external_initializers_file_name", "basic.data")
    ort.InferenceSession(str(DEMO), options, providers=["CPUExecutionProvider"])
    expected = len(onnx.load(tmp_path / "basic.onnx", load_external_data=False).graph.node)

    session, assignment = providers.open_session(DEMO, spec("cpu"))
    assert assignment.nodes == {"cpu": expected} and assignment.share("cpu") == 1.0
    assert "GroupQueryAttention" in assignment.op_types["cpu"]
    assert assignment.describe() == f"decoder: cpu, {expected} of {expected} nodes (100%) on cpu"
    assert session.get_providers() == ["CPUExecutionProvider"]


def test_placement_is_not_recorded_when_not_asked() -> None:
    _, assignment = providers.open_session(DEMO, spec("cpu"), record=False)
    assert assignment.nodes == {} and "not recorded" in assignment.describe()


def test_a_profile_reaches_the_session() -> None:
    config = layer_profile({"version": 2, "pipeline": {"extends": "autoregressive-decoder"}},
                           load_profile("raspberry-pi"))
    raw = config["pipeline"]["sessions"]["decoder"]
    session, _ = providers.open_session(DEMO, spec(*raw["execution_provider"],
                                                   session_options=raw["session_options"]))
    options = session.get_session_options()
    assert options.intra_op_num_threads == 4 and options.inter_op_num_threads == 1
    assert options.enable_cpu_mem_arena is False
    assert options.get_session_config_entry("session.intra_op.allow_spinning") == "0"


def test_ep_overrides_per_session_and_for_all() -> None:
    overrides = providers.parse_overrides(["openvino", "vision=OpenVINO,cpu"])
    assert overrides == {None: ("openvino",), "vision": ("openvino", "cpu")}
    assert providers.override_for(overrides, "vision") == ("openvino", "cpu")
    assert providers.override_for(overrides, "decoder") == ("openvino",)
    assert providers.override_for({}, "decoder") is None
    with pytest.raises(ConfigError, match='Unknown execution provider "qnm" in --ep vision=qnm. .*"qnn"'):
        providers.parse_overrides(["vision=qnm"])


# --- ortpipe.load and the command line ---------------------------------------------------------


def cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO / "py")}
    command = [sys.executable, "-m", "ortpipe.cli", *args]
    return subprocess.run(command, capture_output=True, text=True, env=env, check=False)


def test_load_takes_a_profile_and_keeps_each_sessions_assignment() -> None:
    pipe = ortpipe.load(DEMO_DIR, profile="raspberry-pi")
    options = pipe.driver.sessions["decoder"].get_session_options()
    assert (options.intra_op_num_threads, options.inter_op_num_threads) == (4, 1)
    assert options.enable_cpu_mem_arena is False
    placed = pipe.assignments["decoder"]
    assert (placed.requested, placed.provider, placed.warnings) == (("cpu",), "cpu", ())
    assert placed.nodes == {"cpu": placed.total} and placed.total > 0
    assert ortpipe.load(DEMO_DIR, threads=1).assignments["decoder"].nodes == placed.nodes


@pytest.mark.parametrize(("profile", "provider", "extra"), [("snapdragon-npu", "qnn", "qnn"),
                                                            ("windows-gpu", "dml", "directml")])
def test_qnn_and_directml_through_load_name_their_extra(profile: str, provider: str, extra: str) -> None:
    hint = f'it is not installed here: pip install "ortpipe[{extra}]" installs it'
    with pytest.raises(ConfigError, match=re.escape(hint)):
        ortpipe.load(DEMO_DIR, provider=provider)
    with pytest.warns(providers.ProviderWarning, match=re.escape(f"{provider} was passed over: {hint}")):
        pipe = ortpipe.load(DEMO_DIR, provider={"decoder": [provider, "cpu"]}, profile=profile)
    placed = pipe.assignments["decoder"]
    assert placed.provider == "cpu" and [s.provider for s in placed.skipped] == [provider]


def test_load_refuses_an_override_for_a_session_the_pipeline_lacks() -> None:
    with pytest.raises(ConfigError, match='names session "decodr", .* Its sessions: decoder. Did you mean'):
        ortpipe.load(DEMO_DIR, provider={"decodr": "cpu"})
    with pytest.raises(ConfigError, match='Unknown execution provider "cpuu" in provider'):
        ortpipe.load(DEMO_DIR, provider="cpuu")


def test_the_cli_takes_ep_and_profile_and_inspect_reports_the_placement() -> None:
    demo = str(DEMO_DIR)
    out = cli("inspect", demo, "--ep", "qnn")
    assert out.returncode == 2 and 'pip install "ortpipe[qnn]" installs it' in out.stderr
    assert "Traceback" not in out.stderr

    out = cli("inspect", demo, "--ep", "decoder=dml,cpu", "--json")
    assert out.returncode == 0, out.stderr
    placement = json.loads(out.stdout)["sessions"]["decoder"]["placement"]
    assert (placement["provider"], placement["requested"]) == ("cpu", ["dml", "cpu"])
    assert placement["shares"] == {"cpu": 1.0} and placement["total_nodes"] > 0
    assert placement["skipped"][0]["provider"] == "dml" and "ortpipe[directml]" in placement["warnings"][0]
    assert out.stderr == ""  # the report holds the warning

    out = cli("inspect", demo)
    total = placement["total_nodes"]
    assert f"providers:\n  decoder: cpu, {total} of {total} nodes (100%) on cpu\n" in out.stdout

    out = cli("validate", demo, "--profile", "windows-gpu")
    assert out.returncode == 0 and "ok (v1 config" in out.stdout
    assert out.stderr.startswith('ortpipe: warning: session "decoder": dml was passed over: it is not '
                                 'installed here: pip install "ortpipe[directml]"')

    runs = [cli("run", demo, "--prompt-ids", "5,17,42,8,23", "--max-new-tokens", "6", "--temperature", "0",
                "--json", *extra) for extra in ((), ("--profile", "raspberry-pi", "--ep", "cpu"))]
    assert [r.returncode for r in runs] == [0, 0], runs[1].stderr
    assert json.loads(runs[0].stdout)["tokens"] == json.loads(runs[1].stdout)["tokens"]


# --- two flavours in one environment -----------------------------------------------------------


def dist_info(site: Path, name: str, version: str, top_level: str | None = None, record: str = "") -> None:
    info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    (info / "RECORD").write_text(record)
    if top_level is not None:
        (info / "top_level.txt").write_text(top_level + "\n")


def test_two_flavours_in_one_environment_say_what_to_uninstall(tmp_path: Path) -> None:
    dist_info(tmp_path, "onnxruntime", "1.31.1", top_level="onnxruntime")
    dist_info(tmp_path, "onnxruntime-openvino", "1.24.1", record="onnxruntime/__init__.py,,\n")
    dist_info(tmp_path, "onnxruntime-qnn", "2.7.0", top_level="onnxruntime_qnn")  # a plugin, beside a flavour
    (tmp_path / "onnxruntime" / "capi").mkdir(parents=True)
    (tmp_path / "onnxruntime" / "capi" / "build_and_package_info.py").write_text(
        "package_name = 'onnxruntime-openvino'\n__version__ = '1.24.1'\n")
    found = flavours.installed(tmp_path)
    assert found == [flavours.Flavour("onnxruntime", "1.31.1"),
                     flavours.Flavour("onnxruntime-openvino", "1.24.1")]
    assert flavours.live(tmp_path / "onnxruntime") == "onnxruntime-openvino"
    assert flavours.mixed_message(found, "onnxruntime-openvino") == (
        "onnxruntime 1.31.1 and onnxruntime-openvino 1.24.1 are installed in one environment: they install "
        "the same `onnxruntime` module and overwrite each other's files (the files there now are "
        "onnxruntime-openvino's). Keep one flavour: pip uninstall -y onnxruntime onnxruntime-openvino, "
        'then pip install "ortpipe[cpu]" or "ortpipe[openvino]".')
    assert flavours.mixed_message(found[:1], "onnxruntime") is None


def test_this_environment_has_one_flavour() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert flavours.warn_if_mixed() is None
    assert [f.name for f in flavours.installed()] == ["onnxruntime"]


# --- the extras' platforms ---------------------------------------------------------------------

PLATFORMS = {  # where PyPI had wheels, checked in November 2026 (the README's edge section)
    "linux-x86_64": {"sys_platform": "linux", "platform_machine": "x86_64"},
    "linux-aarch64": {"sys_platform": "linux", "platform_machine": "aarch64"},
    "linux-armv7l": {"sys_platform": "linux", "platform_machine": "armv7l"},
    "win-amd64": {"sys_platform": "win32", "platform_machine": "AMD64"},
    "win-arm64": {"sys_platform": "win32", "platform_machine": "ARM64"},
    "macos-arm64": {"sys_platform": "darwin", "platform_machine": "arm64"},
}


def test_each_extra_resolves_only_where_pypi_has_its_wheels() -> None:
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert not any("onnxruntime" in r for r in extras.pop("serve"))  # pure Python, beside a flavour
    where = {}
    for extra, requirements in extras.items():
        runtime = Requirement(requirements[0])
        where[extra] = (runtime.name, sorted(p for p, env in PLATFORMS.items()
                                             if runtime.marker.evaluate({**env, "python_version": "3.12"})))
    assert where == {
        "cpu": ("onnxruntime", ["linux-aarch64", "linux-x86_64", "macos-arm64", "win-amd64", "win-arm64"]),
        "openvino": ("onnxruntime-openvino", ["linux-x86_64", "win-amd64"]),
        "qnn": ("onnxruntime-qnn", ["linux-aarch64", "linux-x86_64", "win-amd64", "win-arm64"]),
        "directml": ("onnxruntime-directml", ["win-amd64"]),
        "cuda": ("onnxruntime-gpu", ["linux-aarch64", "linux-x86_64", "win-amd64"]),
    }
