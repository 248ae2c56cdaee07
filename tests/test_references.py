"""The references agree with each other, so conformance tests can trust them.

onnxruntime-genai on the builder exports, and a hand-written onnxruntime loop on the Optimum
exports, generate exactly what transformers generates from the same weights (greedy, fp32).
The test models never predict eos (build/hfmodels.py zeroes its output row), so every run
must produce all NEW_TOKENS.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from build.references import explain_divergence, first_divergence, genai_greedy, hf_greedy, prompt_ids

pytestmark = pytest.mark.slow  # builds models (the parametrized fixtures escape conftest's automatic mark)

NEW_TOKENS = 64
PROMPT_TOKENS = 60


@pytest.mark.parametrize(("hf_name", "onnx_name"), [
    ("llama_hf", "llama_builder_fp32"),
    ("qwen2_hf", "qwen2_builder"),
    ("phi3_hf", "phi3_builder"),
    ("gemma_hf", "gemma_builder"),
])
def test_genai_matches_transformers(hf_name: str, onnx_name: str, request: pytest.FixtureRequest) -> None:
    hf_dir, onnx_dir = request.getfixturevalue(hf_name), request.getfixturevalue(onnx_name)
    prompt = prompt_ids(onnx_dir, PROMPT_TOKENS)
    assert prompt == prompt_ids(hf_dir, PROMPT_TOKENS), "the export's tokenizer differs from the model's"
    expected = hf_greedy(hf_dir, prompt, NEW_TOKENS)
    actual = genai_greedy(onnx_dir, prompt, NEW_TOKENS)
    assert len(expected) == NEW_TOKENS
    assert actual == expected, explain_divergence(hf_dir, prompt, expected, actual)


def test_genai_int4_runs_to_length(llama_hf: Path, llama_builder_int4: Path) -> None:
    """int4 weights change the logits: only the length is checked; the agreement is reported."""
    prompt = prompt_ids(llama_builder_int4, PROMPT_TOKENS)
    actual = genai_greedy(llama_builder_int4, prompt, NEW_TOKENS)
    assert len(actual) == NEW_TOKENS
    expected = hf_greedy(llama_hf, prompt, NEW_TOKENS)
    step = first_divergence(expected, actual)
    print(f"int4 vs fp32 transformers: {NEW_TOKENS if step is None else step} leading tokens equal; "
          f"{explain_divergence(llama_hf, prompt, expected, actual)}")


def ort_greedy(model_dir: Path, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Greedy decoding over a concat-layout graph (present = concat(past, new)), fed by hand."""
    session = ort.InferenceSession(str(model_dir / "model.onnx"), providers=["CPUExecutionProvider"])
    eos = json.loads((model_dir / "generation_config.json").read_text())["eos_token_id"]
    pasts = [i for i in session.get_inputs() if i.name.startswith("past_key_values.")]
    output_names = [o.name for o in session.get_outputs()]
    # Empty past on the first run: [batch, kv_heads, 0, head_size].
    cache = {i.name: np.zeros((1, i.shape[1], 0, i.shape[3]), dtype=np.float32) for i in pasts}
    new = list(prompt)
    generated: list[int] = []
    while len(generated) < max_new_tokens:
        done = len(prompt) + len(generated) - len(new)
        feeds = {
            "input_ids": np.array([new], dtype=np.int64),
            "attention_mask": np.ones((1, done + len(new)), dtype=np.int64),
            "position_ids": np.arange(done, done + len(new), dtype=np.int64)[None],
            **cache,
        }
        outputs = dict(zip(output_names, session.run(None, feeds), strict=True))
        for name in cache:
            present = outputs[name.replace("past_key_values.", "present.")]
            assert present.shape[2] == done + len(new)
            assert np.array_equal(present[:, :, :done], cache[name]), f"{name}: present does not extend past"
            cache[name] = present
        token = int(outputs["logits"][0, -1].argmax())
        generated.append(token)
        if token == eos:
            break
        new = [token]
    return generated


@pytest.mark.parametrize(("hf_name", "onnx_name"), [
    ("llama_hf", "llama_concat"),
    ("gpt2_hf", "gpt2_optimum"),
])
def test_onnxruntime_loop_matches_transformers(hf_name: str, onnx_name: str,
                                               request: pytest.FixtureRequest) -> None:
    hf_dir, onnx_dir = request.getfixturevalue(hf_name), request.getfixturevalue(onnx_name)
    prompt = prompt_ids(onnx_dir, PROMPT_TOKENS)
    expected = hf_greedy(hf_dir, prompt, NEW_TOKENS)
    actual = ort_greedy(onnx_dir, prompt, NEW_TOKENS)
    assert len(expected) == NEW_TOKENS
    assert actual == expected, explain_divergence(hf_dir, prompt, expected, actual)


@pytest.mark.parametrize("name", ["llama_builder_fp32", "llama_builder_int4", "qwen2_builder", "phi3_builder",
                                  "gemma_builder"])
def test_builder_folder_layout(name: str, request: pytest.FixtureRequest) -> None:
    folder = request.getfixturevalue(name)
    files = {p.name for p in folder.iterdir()}
    assert {"genai_config.json", "model.onnx", "tokenizer.json", "tokenizer_config.json"} <= files


@pytest.mark.parametrize("name", ["llama_concat", "gpt2_optimum"])
def test_optimum_folder_layout(name: str, request: pytest.FixtureRequest) -> None:
    folder = request.getfixturevalue(name)
    files = {p.name for p in folder.iterdir()}
    assert {"model.onnx", "config.json", "generation_config.json", "tokenizer.json",
            "tokenizer_config.json"} <= files
    assert "genai_config.json" not in files
    session = ort.InferenceSession(str(folder / "model.onnx"), providers=["CPUExecutionProvider"])
    assert "use_cache_branch" not in {i.name for i in session.get_inputs()}
