"""An optimum encoder-decoder folder (T5 in transformers.js's layout, no genai_config.json) in Chromium: the
core detects it in Pyodide, the prompt's text goes to the encoder through tokenizers.js, and the browser's
tokens are CPython's (which tests/test_seq2seq.py checks against transformers' generate), greedy and seeded
sampled, on wasm and WebGPU."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import ortpipe

PROMPTS = ["def bisect(a, x):", "import os, sys"]
SAMPLED = {"doSample": True, "temperature": 0.9, "seed": 11}

RUN = """async ({model, device, prompts, sampled}) => {
  const {load} = await import('./ortpipe.js');
  const pipe = await load(model, {device});
  try {
    const runs = [];
    for (const prompt of prompts) {
      const result = await pipe.generate({prompt, maxNewTokens: 16});
      runs.push({tokens: result.tokens, text: result.text, fused: result.timings.fusedSteps});
    }
    const result = await pipe.generate({prompt: prompts[0], maxNewTokens: 16, ...sampled});
    runs.push({tokens: result.tokens, text: result.text});
    return {info: pipe.info, runs};
  } finally {
    pipe.dispose();
  }
}"""


@pytest.mark.parametrize("target", ["wasm", "webgpu"])
def test_t5_folder_in_the_browser_equals_cpython(target: str, page: Any, serve_model: Any) -> None:
    from build import seq2seq

    folder = seq2seq.get("t5-optimum")
    pipe = ortpipe.load(folder, threads=1)
    expected = [pipe.generate(p, max_new_tokens=16) for p in PROMPTS]
    expected.append(pipe.generate(PROMPTS[0], max_new_tokens=16, do_sample=True, temperature=0.9, seed=11))
    assert expected[0].tokens != expected[1].tokens and expected[0].tokens != expected[2].tokens
    model = serve_model("t5-optimum", folder)
    page.goto("/")
    got = page.evaluate(RUN, {"model": model, "device": target, "prompts": PROMPTS, "sampled": SAMPLED})
    assert got["info"]["device"] == target and got["info"]["text_encoder"] == "encoder"
    runs = got["runs"]
    assert [r["tokens"] for r in runs] == [e.tokens for e in expected]
    assert [r["text"] for r in runs] == [e.text for e in expected]
    assert [r.get("fused") for r in runs[:2]] == [15, 15]  # the JS Decoder runs every step after the first


def test_image_captioner_in_the_browser_equals_cpython(page: Any, serve_model: Any, tmp_path: Path) -> None:
    """The vision encoder-decoder export (ViT, GPT-2) on wasm: the page decodes the PNG, the core's ViT
    preprocessing kernels make its pixels, and the caption is CPython's (transformers': test_seq2seq.py)."""
    import shutil

    import numpy as np
    from build import seq2seq
    from PIL import Image

    folder = Path(shutil.copytree(seq2seq.get("captioner-optimum"), tmp_path / "captioner"))
    Image.fromarray((np.random.default_rng(8).random((40, 56, 3)) * 255).astype(np.uint8)).save(
        folder / "picture.png")
    picture = str(folder / "picture.png")
    expected = ortpipe.load(folder, threads=1).generate(images=[picture], max_new_tokens=12)
    model = serve_model("captioner", folder)
    page.goto("/")
    tokens = page.evaluate("""async ({model}) => {
      const {load} = await import('./ortpipe.js');
      const pipe = await load(model, {device: 'wasm'});
      try {
        return (await pipe.generate({images: [`${model}picture.png`], maxNewTokens: 12})).tokens;
      } finally {
        pipe.dispose();
      }
    }""", {"model": model})
    assert tokens == expected.tokens


def test_demo_page_shows_the_answer_below_the_prompt(page: Any, serve_model: Any) -> None:
    """The demo page on the T5 folder: the prompt, then CPython's answer on a line of its own (an encoder-
    decoder answers the prompt, it does not continue it)."""
    from build import seq2seq

    folder = seq2seq.get("t5-optimum")
    expected = ortpipe.load(folder, threads=1).generate(PROMPTS[1], max_new_tokens=8)
    model = serve_model("t5-optimum", folder)
    page.goto("/")
    page.fill("#model-url", model)
    page.select_option("#device", "wasm")
    page.fill("#prompt", PROMPTS[1])
    page.fill("#max-new-tokens", "8")
    page.click("#generate")
    page.wait_for_selector("#output[data-finish-reason], #error:not(:empty)", state="attached",
                           timeout=120_000)
    assert page.text_content("#error") == ""
    assert page.text_content("#output .prompt") == PROMPTS[1] + "\n"
    assert page.text_content("#output") == PROMPTS[1] + "\n" + expected.text


def test_whisper_language_and_task_in_the_browser_equal_cpython(page: Any, serve_model: Any,
                                                                tmp_path: Path) -> None:
    """A multilingual Whisper folder (optimum's export with lang_to_id and task_to_id) on wasm: the decoder's
    start ids take the request's language and task, or the language the model chooses (one decoder run and
    the core's argmax_among kernel), as on CPython (transformers' tokens: test_seq2seq.py)."""
    import json
    import shutil

    from build import seq2seq
    from tests.test_seq2seq import MULTILINGUAL
    from tests.test_whisper import features

    folder = Path(shutil.copytree(seq2seq.get("whisper-optimum"), tmp_path / "whisper"))
    gen = json.loads((folder / "generation_config.json").read_text())
    (folder / "generation_config.json").write_text(json.dumps({**gen, **MULTILINGUAL}))
    feats = features(3)
    pipe = ortpipe.load(folder, threads=1)
    cases = [{}, {"language": "de"}, {"task": "translate"}]
    expected = [pipe.generate(max_new_tokens=8, inputs={"input_features": feats}, **c) for c in cases]
    assert len({tuple(r.tokens) for r in expected}) == 3
    model = serve_model("whisper-multilingual", folder)
    page.goto("/")
    got = page.evaluate("""async ({model, data, dims, cases}) => {
      const {load} = await import('./ortpipe.js');
      const pipe = await load(model, {device: 'wasm'});
      try {
        const inputs = {input_features: {data: new Float32Array(data), dims}};
        const runs = [];
        for (const c of cases) {
          const r = await pipe.generate({inputs, maxNewTokens: 8, ...c});
          runs.push({tokens: r.tokens, language: r.language});
        }
        return runs;
      } finally {
        pipe.dispose();
      }
    }""", {"model": model, "data": feats.ravel().tolist(), "dims": list(feats.shape), "cases": cases})
    assert [r["tokens"] for r in got] == [e.tokens for e in expected]
    assert [r["language"] for r in got] == [e.language for e in expected]


def test_bart_summarizer_in_the_browser_equals_cpython(page: Any, serve_model: Any) -> None:
    """The BART export with a summarizer's generation_config.json on wasm: its beams, n-gram bans, minimum
    length and forced bos and eos tokens are the core's, so the browser's tokens are CPython's (which
    test_seq2seq.py checks against transformers' generate), searched and greedy."""
    from build import seq2seq

    folder = seq2seq.get("bart-optimum")
    pipe = ortpipe.load(folder, threads=1)
    expected = [pipe.generate(PROMPTS[0]).tokens, pipe.generate(PROMPTS[1], num_beams=1).tokens]
    assert expected[0][0] == 1 and expected[0][-1] == 2
    model = serve_model("bart", folder)
    page.goto("/")
    got = page.evaluate("""async ({model, prompts}) => {
      const {load} = await import('./ortpipe.js');
      const pipe = await load(model, {device: 'wasm'});
      try {
        return [(await pipe.generate({prompt: prompts[0]})).tokens,
                (await pipe.generate({prompt: prompts[1], numBeams: 1})).tokens];
      } finally {
        pipe.dispose();
      }
    }""", {"model": model, "prompts": PROMPTS})
    assert got == expected
