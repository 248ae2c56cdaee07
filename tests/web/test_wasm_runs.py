"""onnxruntime-web's wasm build can fail two runs in flight at once: the init phase of a Stable Diffusion XL
folder (two text encoders in one level, a `RunAll`) ran them so and got "Cannot read properties of null"
from inside onnxruntime-web (1.30; asked for one output each instead of all five, the same two runs
succeeded). web/bridge.js's runEach runs a RunAll's runs one after another; this shows the failure it
prevents, through onnxruntime-web's own sessions, and that the runs made one after another give each
encoder's outputs."""

from __future__ import annotations

from typing import Any

# Runs in the page: both text encoders of the folder on the same ids, each asked for all its outputs, at once
# (each run's error, or null) or one after another through runEach (each run's first output's first values).
RUN = """async ({base, together}) => {
  const ort = await import('./ort/ort.wasm.min.mjs');
  ort.env.wasm.wasmPaths = new URL('./ort/', location.href).href;
  ort.env.wasm.numThreads = 1;
  const {Bridge} = await import('./bridge.js');
  const bridge = new Bridge(ort, null, null, () => {});
  const sessions = [];
  for (const encoder of ['text_encoder', 'text_encoder_2']) {
    const bytes = new Uint8Array(await (await fetch(`${base}${encoder}/model.onnx`)).arrayBuffer());
    sessions.push(await ort.InferenceSession.create(bytes, {executionProviders: ['wasm']}));
  }
  const ids = () => new ort.Tensor('int64', BigInt64Array.from({length: 77}, (_, i) => BigInt(i % 50)),
                                    [1, 77]);
  const call = (s) => [s, null, null, 'wasm', ['input_ids'], [ids()], s.outputNames];
  const shown = (out) => Array.from(out[0].data.slice(0, 4));
  if (together) {
    const settled = await Promise.allSettled(sessions.map((s) => s.run({input_ids: ids()}, s.outputNames)));
    return settled.map((s) => (s.status === 'rejected' ? String(s.reason?.message ?? s.reason) : null));
  }
  return (await bridge.runEach(sessions.map(call))).map(shown);
}"""


def _run(page: Any, base: str, together: bool) -> list[Any]:
    page.goto("/")
    return page.evaluate(RUN, {"base": base, "together": together})


def test_two_runs_in_flight_fail_and_one_after_another_do_not(page: Any, serve_model: Any) -> None:
    import numpy as np
    import onnxruntime as ort
    from build import paradigms

    folder = paradigms.get("sdxl-tiny")
    base = serve_model("sdxl-tiny-runs", folder)
    errors = [r for r in _run(page, base, together=True) if isinstance(r, str)]
    assert errors, "two runs in flight at once succeeded: web/bridge.js's runEach may no longer be needed"
    ids = np.array([[i % 50 for i in range(77)]], np.int64)
    sessions = [ort.InferenceSession(str(folder / e / "model.onnx"))
                for e in ("text_encoder", "text_encoder_2")]
    expected = [s.run(None, {"input_ids": ids})[0].ravel()[:4] for s in sessions]
    got = _run(page, base, together=False)
    for values, reference in zip(got, expected, strict=True):
        assert np.abs(np.array(values, np.float32) - reference).max() <= 1e-5
