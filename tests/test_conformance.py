"""Conformance on tiny random-weight Hugging Face models: ortpipe's greedy tokens equal
onnxruntime-genai's on the builder's folder (untouched) and transformers' generate on the weights."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from build.references import explain_divergence, genai_greedy, hf_greedy, prompt_ids

import ortpipe

NEW = 64
BUILDER_CASES = [("llama_builder_fp32", "llama_hf"), ("qwen2_builder", "qwen2_hf"),
                 ("phi3_builder", "phi3_hf"), ("gemma_builder", "gemma_hf")]


def ortpipe_greedy(folder: Path, ids: list[int], **options) -> list[int]:
    return ortpipe.load(folder, threads=1, **options).generate(prompt_ids=ids, max_new_tokens=NEW).tokens


@pytest.mark.parametrize("builder,hf", BUILDER_CASES)
def test_builder_export_matches_genai_and_transformers(
    builder: str, hf: str, request: pytest.FixtureRequest
) -> None:
    folder, hf_dir = request.getfixturevalue(builder), request.getfixturevalue(hf)
    ids = prompt_ids(folder)
    ours = ortpipe_greedy(folder, ids)
    assert len(ids) >= 50 and len(ours) == NEW
    assert ours == genai_greedy(folder, ids, NEW, threads=1), "ortpipe differs from onnxruntime-genai"
    reference = hf_greedy(hf_dir, ids, NEW)
    assert ours == reference, explain_divergence(hf_dir, ids, reference, ours)


def test_builder_config_uses_the_shared_buffer(gemma_builder: Path) -> None:
    plan = ortpipe.load(gemma_builder, threads=1).plan
    kv = plan.step_phase[0].kv
    assert plan.config.source == "v1" and kv.share_buffer
    windows = {e.layer: e.window for e in kv.entries}
    assert windows == {0: 32, 1: None}  # Gemma 2 alternates sliding-window and global layers


def test_int4_export_matches_genai(llama_builder_int4: Path) -> None:
    ids = prompt_ids(llama_builder_int4)
    ours = ortpipe_greedy(llama_builder_int4, ids)
    assert len(ours) == NEW
    assert ours == genai_greedy(llama_builder_int4, ids, NEW, threads=1)


def test_concat_layout_of_the_same_llama_gives_the_same_tokens(
    llama_concat: Path, llama_builder_fp32: Path, llama_hf: Path
) -> None:
    assert not (llama_concat / "genai_config.json").exists()  # Optimum layout: detected
    ids = prompt_ids(llama_concat)
    ours = ortpipe_greedy(llama_concat, ids)
    reference = hf_greedy(llama_hf, ids, NEW)
    assert ours == reference, explain_divergence(llama_hf, ids, reference, ours)
    assert ours == ortpipe_greedy(llama_builder_fp32, ids)


def test_gpt2_runs_from_its_optimum_export(gpt2_optimum: Path, gpt2_hf: Path) -> None:
    pipe = ortpipe.load(gpt2_optimum, threads=1)
    assert pipe.config.source == "detected"
    ids = prompt_ids(gpt2_optimum)
    ours = pipe.generate(prompt_ids=ids, max_new_tokens=NEW).tokens
    reference = hf_greedy(gpt2_hf, ids, NEW)
    assert len(ours) == NEW
    assert ours == reference, explain_divergence(gpt2_hf, ids, reference, ours)


def test_unknown_model_type_runs_like_any_decoder(llama_builder_fp32: Path, tmp_path: Path) -> None:
    copy = tmp_path / "my_finetune"
    shutil.copytree(llama_builder_fp32, copy)
    config = json.loads((copy / "genai_config.json").read_text())
    config["model"]["type"] = "my_finetune"
    (copy / "genai_config.json").write_text(json.dumps(config))
    ids = prompt_ids(copy)
    assert ortpipe_greedy(copy, ids) == ortpipe_greedy(llama_builder_fp32, ids)


def test_text_prompt_round_trips_through_the_tokenizer(llama_builder_fp32: Path) -> None:
    pipe = ortpipe.load(llama_builder_fp32, threads=1)
    result = pipe.generate("def count_words(path):", max_new_tokens=16)
    ids = pipe.tokenizer.encode("def count_words(path):")
    assert result.tokens == pipe.generate(prompt_ids=ids, max_new_tokens=16).tokens
    assert result.text == pipe.tokenizer.decode(result.tokens)


def test_short_request_below_the_sliding_window(gemma_builder: Path, gemma_hf: Path) -> None:
    """The windowed layer's buffer is a ring of the window's size, even when the request is shorter
    (onnxruntime-genai 0.18 refuses this request: it sizes that buffer from max_length)."""
    ids = prompt_ids(gemma_builder)[:5]
    ours = ortpipe.load(gemma_builder, threads=1).generate(prompt_ids=ids, max_new_tokens=8).tokens
    assert ours == hf_greedy(gemma_hf, ids, 8)


# The seed's section 4.1 config, as written there, with the model's own eos id.
SEED_CONFIG = {
    "version": 2,
    "pipeline": {"extends": "autoregressive-decoder", "sessions": {"decoder": {"file": "model.onnx"}}},
    "tokens": {"eos": [151645], "pad": 0},
    "generation": {"max_length": 4096, "sampling": {"temperature": 0.7}},
    "metadata": {"model_type": "qwen2", "source": "mobius"},
}


@pytest.mark.parametrize("builder", ["llama_builder_fp32", "llama_builder_int4", "qwen2_builder",
                                     "phi3_builder", "gemma_builder"])

def test_the_seed_config_runs_every_builder_export(builder: str, request: pytest.FixtureRequest,
                                                   tmp_path: Path) -> None:
    """"Detect, don't declare": the graph gives the head counts and sizes its cache dims leave symbolic
    and the position limit; the seven-line config gives onnxruntime-genai's tokens."""
    folder = request.getfixturevalue(builder)
    seeded = shutil.copytree(folder, tmp_path / "seeded")
    v1 = json.loads((folder / "genai_config.json").read_text())
    config = json.loads(json.dumps(SEED_CONFIG))
    config["tokens"]["eos"] = [v1["model"]["eos_token_id"]]
    (seeded / "genai_config.json").write_text(json.dumps(config))
    ids = prompt_ids(folder)
    pipe = ortpipe.load(seeded, threads=1)
    kv = pipe.plan.step_phase[0].kv
    assert {e.shape[1] for e in kv.entries} == {v1["model"]["decoder"]["num_key_value_heads"]}
    assert {e.shape[3] for e in kv.entries} == {v1["model"]["decoder"]["head_size"]}
    assert pipe.plan.max_positions == v1["model"]["context_length"]
    assert kv.share_buffer  # GroupQueryAttention writes in place, as the builder's own config says
    window = v1["model"]["decoder"].get("sliding_window") or {}
    assert {e.layer: e.window for e in kv.entries} == {
        e.layer: window["window_size"] if e.layer in window.get("layers", ()) else None for e in kv.entries}

    ours = pipe.generate(prompt_ids=ids, max_new_tokens=NEW).tokens
    assert ours == genai_greedy(folder, ids, NEW, threads=1)
    with pytest.raises(ortpipe.GenerationError, match="positions the model's graph can run"):
        pipe.generate(prompt_ids=ids)  # the config's max_length, 4096, is past the graph's 512 positions
