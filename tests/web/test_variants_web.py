"""Model variants in the browser: each variant gives the tokens of its own CPython run, the device's
default is the one ortpipe/variants.py's table names, the worker's early downloads (and the session
made from them) are of that variant, and web/variants.js is the table's twin."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
from test_browser import PROMPT

import ortpipe
from ortpipe import variants

ROOT = Path(__file__).resolve().parents[2]

# Runs in the page: load with a dtype (or none), generate greedily, and note the progress events.
LOAD = """async ({model, device, dtype, options}) => {
  const {load} = await import('./ortpipe.js');
  const progress = [];
  const pipe = await load(model, {device, dtype, onProgress: (p) => progress.push(p)});
  try {
    return {info: pipe.info, progress, result: await pipe.generate(options)};
  } finally {
    pipe.dispose();
  }
}"""


def test_the_tables_are_the_cores() -> None:
    script = ("import('./web/variants.js').then((m) => console.log(JSON.stringify("
              "{SUFFIXES: m.SUFFIXES, DEFAULTS: m.DEFAULTS, ROWS: m.ROWS, HALF: m.HALF,"
              " base: m.base('onnx/model_q4f16.onnx')})))")
    out = subprocess.run(["node", "--input-type=module", "-e", script], cwd=ROOT, capture_output=True,
                         text=True, check=True)
    js = json.loads(out.stdout)
    assert js["SUFFIXES"] == variants.SUFFIXES
    assert js["DEFAULTS"] == {row: list(order) for row, order in variants.DEFAULTS.items()}
    assert js["ROWS"] == variants.ROWS
    assert js["HALF"] == list(variants.HALF)
    assert js["base"] == variants.split("onnx/model_q4f16.onnx")[0]


def _load(page: Any, model: str, device: str, dtype: str | None, new_tokens: int = 12) -> dict[str, Any]:
    page.goto("/")
    options = {"promptIds": PROMPT, "maxNewTokens": new_tokens, "doSample": False}
    return page.evaluate(LOAD, {"model": model, "device": device, "dtype": dtype, "options": options})


def test_each_variant_gives_its_cpython_tokens_on_wasm(page: Any, serve_model: Any,
                                                       llama_variants: Path) -> None:
    url = serve_model("llama-variants", llama_variants)
    requests: list[tuple[str, str]] = []
    page.context.on("request", lambda r: requests.append((r.method, r.url)))
    for dtype in ("fp32", "q8", "q4", "fp16", "q4f16", None):
        expected = ortpipe.load(llama_variants, dtype=dtype or "q8", threads=1).generate(
            prompt_ids=PROMPT, max_new_tokens=12, do_sample=False)
        requests.clear()
        got = _load(page, url, "wasm", dtype)
        file = variants.file_of("model", dtype or "q8")  # wasm's default: q8 (the table's first here)
        assert got["info"]["files"] == {"decoder": file}
        assert got["info"]["dtypes"] == {"decoder": dtype or "q8"}
        assert got["result"]["tokens"] == expected.tokens, dtype
        # only the variant run was downloaded, once, and its session made while Python started
        graphs = [u.rsplit("/", 1)[-1] for method, u in requests
                  if method == "GET" and "/models/" in u and u.endswith(".onnx")]
        assert graphs == [file], graphs
        sessions = [p for p in got["progress"] if p["phase"] == "session"]
        assert sessions == [{"phase": "session", "file": file, "early": True}], sessions



def test_a_graph_optimized_ahead_is_opened_as_it_is(page: Any, serve_model: Any, llama_variants: Path,
                                                     optimized_q8: Path) -> None:
    """A q8 graph optimized ahead for CPUs (build/variants.py) gives CPython's tokens on wasm, its session
    (the early one, made while Python starts) created without onnxruntime-web's optimizer, as the core
    asks: the worker reads the graph's metadata as ortpipe/variants.py does."""
    pipe = ortpipe.load(llama_variants, dtype="q8", threads=1)
    expected = pipe.generate(prompt_ids=PROMPT, max_new_tokens=12, do_sample=False).tokens
    for name, folder, optimized in (("llama-variants", llama_variants, []),
                                    ("llama-ahead", optimized_q8, ["decoder"])):
        url = serve_model(name, folder)
        got = _load(page, url, "wasm", "q8")
        assert got["result"]["tokens"] == expected, name
        assert got["info"]["optimized"] == optimized, name
        sessions = [p for p in got["progress"] if p["phase"] == "session"]
        assert sessions == [{"phase": "session", "file": "model_quantized.onnx", "early": True}], sessions
    read = page.evaluate("""async () => {
      const {graphMetadata} = await import('./variants.js');
      const key = 'ortpipe.optimized_for';
      const bytes = async (url) => new Uint8Array(await (await fetch(url)).arrayBuffer());
      const ahead = await bytes('models/llama-ahead/model_quantized.onnx');
      const noise = Uint8Array.from({length: 5000}, (_, i) => (i * 7919) % 256);
      const plain = await bytes('models/llama-variants/model_quantized.onnx');
      const cut = ahead.subarray(0, ahead.length - 10);
      return [ahead, plain, cut, noise, new Uint8Array(0)].map((b) => graphMetadata(b, key));
    }""")
    assert read == ["CPUExecutionProvider", None, None, None, None]


def test_a_missing_dtype_names_the_variants_the_folder_has(page: Any, serve_model: Any,
                                                           llama_variants: Path) -> None:
    url = serve_model("llama-variants", llama_variants)
    page.goto("/")
    error = page.evaluate("""async ({model}) => {
      const {load} = await import('./ortpipe.js');
      try {
        await load(model, {device: 'wasm', dtype: 'bnb4'});
      } catch (e) {
        return {name: e.name, message: e.message};
      }
    }""", {"model": url})
    assert error["name"] == "ConfigError"
    assert "dtype bnb4 needs" in error["message"]
    assert "the variants of this graph in the folder: fp32" in error["message"]


@pytest.mark.parametrize("dtype", ["fp32", "q4", "fp16", "q4f16", None])
def test_webgpu_variants_give_their_cpython_tokens(page: Any, serve_model: Any, llama_variants: Path,
                                                   dtype: str | None) -> None:
    """Correctness only, on this machine's software adapter. The default is fp16, or fp32 on an
    adapter without shader-f16 (this one), which runs no float16 graph: asking for one is an error."""
    url = serve_model("llama-variants", llama_variants)
    page.goto("/")
    f16 = page.evaluate("navigator.gpu.requestAdapter().then((a) => a.features.has('shader-f16'))")
    runs = dtype or ("fp16" if f16 else "fp32")
    if runs in variants.HALF and not f16:
        with pytest.raises(Exception, match=f"dtype {runs} computes in float16, which this webgpu device"):
            _load(page, url, "webgpu", dtype)
        return
    expected = ortpipe.load(llama_variants, dtype=runs).generate(prompt_ids=PROMPT, max_new_tokens=6,
                                                                 do_sample=False)
    got = _load(page, url, "webgpu", dtype, new_tokens=6)
    assert got["info"]["device"] == "webgpu"
    assert got["info"]["dtypes"] == {"decoder": runs}
    assert got["result"]["tokens"] == expected.tokens
