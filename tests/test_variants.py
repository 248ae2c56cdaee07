"""Model variants (ortpipe/variants.py): which file of a folder's exports each device runs, the dtype
option on load, the CLI and the config, and the variants build/variants.py writes."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

import ortpipe
from ortpipe import variants
from ortpipe.errors import ConfigError
from ortpipe.folder import LocalFolder

ALL = {
    "fp32": "onnx/model.onnx", "fp16": "onnx/model_fp16.onnx", "q8": "onnx/model_quantized.onnx",
    "int8": "onnx/model_int8.onnx", "uint8": "onnx/model_uint8.onnx", "q4": "onnx/model_q4.onnx",
    "q4f16": "onnx/model_q4f16.onnx", "bnb4": "onnx/model_bnb4.onnx",
}


class Files:
    """A folder of empty files: what the chooser sees."""

    def __init__(self, *names: str):
        self.names = set(names)

    def exists(self, name: str) -> bool:
        return name in self.names

    def describe(self, name: str = "") -> str:
        return f"demo/{name}"


@pytest.mark.parametrize("name, expected", [
    ("onnx/model.onnx", ("onnx/model", "fp32")),
    ("onnx/model_q4f16.onnx", ("onnx/model", "q4f16")),
    ("model_quantized.onnx", ("model", "q8")),
    ("decoder_model_merged_q4.onnx", ("decoder_model_merged", "q4")),
    ("model_uint8.onnx", ("model", "uint8")),
    ("model_int8.onnx", ("model", "int8")),
    ("onnx/_q4.onnx", ("onnx/_q4", "fp32")),  # a suffix alone is a name, not a variant
])
def test_file_names_say_the_variant(name: str, expected: tuple[str, str]) -> None:
    assert variants.split(name) == expected
    assert variants.file_of(*expected) == name


@pytest.mark.parametrize("device, files, expected", [
    # wasm: q8 before fp32 (as fast, smaller, faster prefill), int4 MatMulNBits last
    ("wasm", ("fp32", "fp16", "q8", "q4", "q4f16"), "q8"),
    ("wasm", ("fp32", "fp16", "q4", "q4f16"), "fp32"),
    ("wasm", ("q4f16", "q4"), "q4"),
    # CPython's CPU provider, by any of its names; OpenVINO and unknown providers read the same row
    ("cpu", ("fp32", "fp16", "q8", "q4", "q4f16"), "q4"),
    ("CPUExecutionProvider", ("fp32", "q8", "q4f16"), "q8"),
    ("openvino", ("fp32", "fp16", "q4f16"), "q4f16"),
    ("someday", ("fp32", "fp16"), "fp32"),
    # GPUs: fp16 first, int8 last
    ("webgpu", ("fp32", "fp16", "q8", "q4", "q4f16"), "fp16"),
    ("cuda", ("fp32", "q8"), "fp32"),
    ("DmlExecutionProvider", ("q8", "q4"), "q4"),
])
def test_the_chooser_picks_what_the_table_says(device: str, files: tuple[str, ...], expected: str) -> None:
    folder = Files(*(ALL[d] for d in files))
    for configured in (ALL[files[0]], "onnx/model.onnx"):  # whichever the config names
        assert variants.choose(folder, configured, device) == ALL[expected]


def test_a_device_without_float16_skips_those_variants() -> None:
    folder = Files(ALL["fp16"], ALL["q4f16"], ALL["q4"])
    assert variants.choose(folder, "onnx/model.onnx", "webgpu") == ALL["fp16"]
    assert variants.choose(folder, "onnx/model.onnx", "webgpu", f16=False) == ALL["q4"]
    with pytest.raises(ConfigError, match=r"dtype q4f16 computes in float16, which this webgpu device "
                                          r"cannot .*choose another: q4$"):
        variants.choose(folder, "onnx/model.onnx", "webgpu", "q4f16", f16=False)


def test_every_row_orders_every_dtype() -> None:
    for row in variants.DEFAULTS.values():
        assert sorted(row) == sorted(variants.SUFFIXES)


def test_a_dtype_asked_for_wins_or_names_what_the_folder_has() -> None:
    folder = Files(ALL["fp32"], ALL["q4"])
    assert variants.choose(folder, "onnx/model.onnx", "wasm", "q4") == ALL["q4"]
    with pytest.raises(ConfigError) as info:
        variants.choose(folder, "onnx/model.onnx", "wasm", "fp16", "decoder")
    assert str(info.value) == (
        'session "decoder": dtype fp16 needs demo/onnx/model_fp16.onnx, which does not exist; the variants '
        "of this graph in the folder: fp32 (onnx/model.onnx), q4 (onnx/model_q4.onnx)"
    )
    with pytest.raises(ConfigError, match='found "fp61". Did you mean "fp16"?'):
        variants.check_dtype("fp61")
    with pytest.raises(ConfigError, match="found 4"):
        variants.check_dtype({"decoder": 4})


# --- loading a folder of variants -------------------------------------------------------------------


def _decoder_file(pipe: ortpipe.Pipeline) -> str:
    return pipe.config.pipeline.sessions["decoder"].file


def test_load_runs_the_variant_asked_for(llama_variants: Path) -> None:
    ids = [5, 17, 42, 8]
    for dtype, file in [("fp32", "model.onnx"), ("q8", "model_quantized.onnx"), ("q4", "model_q4.onnx"),
                        ("fp16", "model_fp16.onnx"), ("q4f16", "model_q4f16.onnx")]:
        pipe = ortpipe.load(llama_variants, dtype=dtype)
        assert _decoder_file(pipe) == file
        # plain onnxruntime on that file, greedy with a growing (concat) cache: the reference
        reference = _greedy(llama_variants / file, ids, 8)
        assert pipe.generate(prompt_ids=ids, max_new_tokens=8).tokens == reference
    assert _decoder_file(ortpipe.load(llama_variants)) == "model_q4.onnx"  # the cpu row's first
    assert _decoder_file(ortpipe.load(llama_variants, dtype={"decoder": "q4"})) == "model_q4.onnx"
    with pytest.raises(ConfigError, match="dtype names sessions this model does not have: vision"):
        ortpipe.load(llama_variants, dtype={"vision": "q4"})
    with pytest.raises(ConfigError, match="the variants of this graph in the folder: fp32"):
        ortpipe.load(llama_variants, dtype="bnb4")


def _greedy(path: Path, ids: list[int], new: int, positions: bool = False) -> list[int]:
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    decoder = json.loads((path.parent / "genai_config.json").read_text())["model"]["decoder"]
    shape = (1, decoder["num_key_value_heads"], 0, decoder["head_size"])
    past_type = np.float16 if "16" in path.name else np.float32
    pasts = {i.name: np.zeros(shape, past_type) for i in session.get_inputs() if i.name.startswith("past_")}
    names = [o.name for o in session.get_outputs()]
    tokens, feed, length = [], ids, 0
    for _ in range(new):
        start, length = length, length + len(feed)
        feeds = {"input_ids": np.array([feed], np.int64), "attention_mask": np.ones((1, length), np.int64),
                 **pasts}
        if positions:  # Optimum's graphs take position ids
            feeds["position_ids"] = np.arange(start, length, dtype=np.int64)[None]
        out = dict(zip(names, session.run(None, feeds), strict=True))
        tokens.append(int(out["logits"][0, -1].astype(np.float32).argmax()))
        pasts = {k: out[k.replace("past_key_values", "present")] for k in pasts}
        feed = tokens[-1:]
    return tokens


def test_the_config_and_config_json_pick_a_variant(llama_variants: Path, tmp_path: Path) -> None:
    v1 = shutil.copytree(llama_variants, tmp_path / "v1")
    config = json.loads((v1 / "genai_config.json").read_text())
    config["model"]["decoder"]["filename"] = "model_q4f16.onnx"  # a variant's name: its siblings count too
    (v1 / "genai_config.json").write_text(json.dumps(config))
    assert _decoder_file(ortpipe.load(v1)) == "model_q4.onnx"
    v2 = {"version": 2, "pipeline": {"extends": "autoregressive-decoder",
                                     "sessions": {"decoder": {"file": "model.onnx", "dtype": "fp16"}}}}
    (v1 / "genai_config.json").write_text(json.dumps(v2))
    assert _decoder_file(ortpipe.load(v1)) == "model_fp16.onnx"
    assert _decoder_file(ortpipe.load(v1, dtype="q4")) == "model_q4.onnx"  # load's dtype comes first
    v2["pipeline"]["sessions"]["decoder"]["dtype"] = "q3"
    (v1 / "genai_config.json").write_text(json.dumps(v2))
    with pytest.raises(ConfigError, match=r'sessions.decoder.dtype must be one of fp32, .*found "q3"'):
        ortpipe.load(v1)
    # no genai_config.json: detection finds a variant alone, and reads transformers.js_config
    detected = tmp_path / "detected"
    (detected / "onnx").mkdir(parents=True)
    for name in ("model_q4.onnx", "model_fp16.onnx"):
        shutil.copy2(llama_variants / name, detected / "onnx" / name)
    shutil.copy2(llama_variants / "tokenizer.json", detected)
    assert _decoder_file(ortpipe.load(detected)) == "onnx/model_q4.onnx"
    transformers_js = {"transformers.js_config": {"dtype": {"model": "fp16"}}}
    (detected / "config.json").write_text(json.dumps(transformers_js))
    assert _decoder_file(ortpipe.load(detected)) == "onnx/model_fp16.onnx"
    assert variants.present(LocalFolder(detected), "onnx/model.onnx") == {
        "fp16": "onnx/model_fp16.onnx", "q4": "onnx/model_q4.onnx"}


def test_the_cli_takes_a_dtype(llama_variants: Path) -> None:
    def run(*extra: str) -> subprocess.CompletedProcess:
        command = [sys.executable, "-m", "ortpipe.cli", "run", str(llama_variants), "--prompt-ids", "5,17,42",
                   "--max-new-tokens", "6", "--no-do-sample", "--json", *extra]
        return subprocess.run(command, capture_output=True, text=True)

    expected = ortpipe.load(llama_variants, dtype="q4").generate(prompt_ids=[5, 17, 42], max_new_tokens=6)
    assert json.loads(run("--dtype", "q4").stdout)["tokens"] == expected.tokens
    refused = run("--dtype", "fp8")
    assert refused.returncode == 2 and "invalid choice: 'fp8'" in refused.stderr


def test_a_variant_that_concatenates_its_cache_runs_beside_a_shared_buffer_graph(
        llama_builder_fp32: Path, llama_concat: Path, tmp_path: Path) -> None:
    """The builder's config says past_present_share_buffer (its GroupQueryAttention graph writes presents into
    its pasts' buffers); a q8 variant exported by Optimum from the same weights concatenates (present =
    Concat(past, new)). Each graph runs with the cache it has; a v2 config that declares a shared buffer
    for the concatenating graph is refused at load."""
    from build.variants import quantize_q8

    folder = shutil.copytree(llama_builder_fp32, tmp_path / "mixed")
    quantize_q8(llama_concat / "model.onnx", folder / "model_quantized.onnx")
    ids = [5, 17, 42, 8]
    shared = ortpipe.load(folder, dtype="fp32")
    assert shared.plan.step_phase[0].kv.share_buffer
    concat = ortpipe.load(folder, dtype="q8")
    assert not concat.plan.step_phase[0].kv.share_buffer
    assert concat.generate(prompt_ids=ids, max_new_tokens=8).tokens == \
        _greedy(folder / "model_quantized.onnx", ids, 8, positions=True)
    v2 = {"version": 2, "pipeline": {"extends": "autoregressive-decoder",
                                     "sessions": {"decoder": {"file": "model_quantized.onnx"}},
                                     "state": {"kv_cache": {"share_buffer": True}}}}
    (folder / "genai_config.json").write_text(json.dumps(v2))
    with pytest.raises(ConfigError, match=r'"share_buffer" is true, but session "decoder" concatenates its '
                                          r'cache: a Concat node joins "past_key_values.0.key"'):
        ortpipe.load(folder)


def test_a_graph_optimized_ahead_runs_unoptimized_with_the_same_logits(
    llama_variants: Path, optimized_q8: Path, tmp_path: Path
) -> None:
    """onnxruntime's extended fusions written into the graph (fewer nodes), marked in its metadata: by
    hand, the graph gives the original's logits; ortpipe creates its CPU session without optimizing it
    again and gives the original's tokens, greedy and sampled; a config that sets the level keeps it."""
    import onnx

    original = onnx.load(llama_variants / "model_quantized.onnx", load_external_data=False)
    ahead = onnx.load(optimized_q8 / "model_quantized.onnx", load_external_data=False)
    assert len(ahead.graph.node) < len(original.graph.node)
    assert {e.key: e.value for e in ahead.metadata_props}[variants.OPTIMIZED_FOR] == "CPUExecutionProvider"
    sessions = [ort.InferenceSession(str(f / "model_quantized.onnx"), providers=["CPUExecutionProvider"])
                for f in (llama_variants, optimized_q8)]
    rng = np.random.default_rng(0)
    feeds = {}
    for i in sessions[0].get_inputs():
        dims = [2 if d == "batch_size" else 7 if isinstance(d, str) else d for d in i.shape]
        if i.name == "input_ids":
            feeds[i.name] = rng.integers(0, 90, dims[:2]).astype(np.int64)
        elif i.type == "tensor(int64)" or i.type == "tensor(int32)":
            feeds[i.name] = np.ones(dims, np.int64 if "64" in i.type else np.int32)
        else:
            feeds[i.name] = rng.standard_normal(dims).astype(np.float32)
    plain, fused = (s.run(["logits"], feeds)[0] for s in sessions)
    assert np.array_equal(plain, fused)
    for settings in ({"do_sample": False}, {"do_sample": True, "seed": 4, "temperature": 0.9}):
        want = ortpipe.load(llama_variants, dtype="q8", threads=1).generate(prompt_ids=[5, 17, 42],
                                                                            max_new_tokens=16, **settings)
        pipe = ortpipe.load(optimized_q8, dtype="q8", threads=1)
        assert pipe.generate(prompt_ids=[5, 17, 42], max_new_tokens=16, **settings).tokens == want.tokens
        assert pipe.assignments["decoder"].optimized_ahead
    assert not ortpipe.load(llama_variants, dtype="q8", threads=1).assignments["decoder"].optimized_ahead
    leveled = shutil.copytree(optimized_q8, tmp_path / "leveled")
    config = json.loads((leveled / "genai_config.json").read_text())
    config["model"]["decoder"]["filename"] = "model_quantized.onnx"
    config["model"]["decoder"]["session_options"] = {"graph_optimization_level": "ORT_ENABLE_BASIC"}
    (leveled / "genai_config.json").write_text(json.dumps(config))
    assert not ortpipe.load(leveled, dtype="q8", threads=1).assignments["decoder"].optimized_ahead
