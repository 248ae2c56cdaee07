"""A plugin's loop in the browser (plugins.py): the example RNN transducer's wheel is fetched from the
model folder into Pyodide and gives CPython's tokens; without {allowPlugins: true} the folder is refused."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from build.plugin_models import BLANK_ID, build_rnnt, features

import ortpipe

RUN = """async ({url, feats}) => {
  const {load} = await import('./ortpipe.js');
  const out = {};
  try { await load(url, {device: 'wasm'}); } catch (e) { out.refused = e.name + ': ' + e.message; }
  try { await load(url, {device: 'wasm', allowPlugin: true}); } catch (e) { out.misspelt = e.message; }
  const pipe = await load(url, {device: 'wasm', allowPlugins: true});
  out.results = [];
  for (const [data, dims, promptIds] of feats) {
    const result = await pipe.generate({promptIds, maxNewTokens: 60,
                                        inputs: {features: {data: new Float32Array(data), dims}}});
    out.results.push([result.tokens, result.finishReason]);
  }
  try {
    await pipe.generate({promptIds: [0], inputs: {features: {data: new Int32Array(8), dims: [1, 1, 8]}}});
  } catch (e) { out.badInput = e.name + ': ' + e.message; }
  pipe.dispose();
  return out;
}"""


@pytest.fixture(scope="module")
def rnnt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_rnnt(tmp_path_factory.mktemp("plugin-web") / "rnnt")


def test_the_transducer_plugin_runs_in_the_browser(page: Any, serve_model: Any, rnnt: Path) -> None:
    url = serve_model("rnnt", rnnt)
    cases = [(6, [BLANK_ID]), (9, [3, 5])]
    feats = [(features(n, seed=n).ravel().tolist(), [1, n, 8], prompt) for n, prompt in cases]
    page.goto("/")
    out = page.evaluate(RUN, {"url": url, "feats": feats})
    assert out["refused"].startswith('ConfigError: pipeline.plugin runs code from "ortpipe_rnnt"')
    assert "{allowPlugins: true}" in out["refused"]
    assert out["misspelt"] == "load() takes device, dtype, allowPlugins and onProgress, not allowPlugin"
    pipe = ortpipe.load(rnnt, allow_plugins=True)
    for (n, prompt), (tokens, finish) in zip(cases, out["results"], strict=True):
        expected = pipe.generate(
            prompt_ids=prompt, max_new_tokens=60, inputs={"features": features(n, seed=n)}
        )
        assert tokens == expected.tokens and len(tokens) > 0
        assert finish == expected.finish_reason
    assert out["badInput"].startswith(
        'GenerationError: input "features" of session "encoder": expected float32'
    )
