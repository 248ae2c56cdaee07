"""onnxruntime-web's WebGPU EP makes one session at a time: a second `InferenceSession.create` while
one is in flight fails ("another WebGPU EP inference session is being created"). The worker makes its
early sessions, the core's and the kernels' concurrently, so web/bridge.js's createInferenceSession
queues them on WebGPU; this shows the failure it prevents and that the queue makes every session."""

from __future__ import annotations

from typing import Any

# Runs in the page: `count` sessions of one graph created at once on WebGPU, by onnxruntime-web
# directly or through bridge.js; what each creation gave (null: a session that runs).
CREATE = """async ({model, count, queued}) => {
  const ort = await import('./ort/ort.webgpu.min.mjs');
  ort.env.wasm.wasmPaths = new URL('./ort/', location.href).href;
  ort.env.wasm.numThreads = 1;
  ort.env.logLevel = 'error';
  const {createInferenceSession, sessionOptions} = await import('./bridge.js');
  const bytes = new Uint8Array(await (await fetch(model)).arrayBuffer());
  const make = () => (queued ? createInferenceSession(ort, bytes, sessionOptions('webgpu', [], false))
                             : ort.InferenceSession.create(bytes, sessionOptions('webgpu', [], false)));
  const settled = await Promise.allSettled(Array.from({length: count}, make));
  return Promise.all(settled.map(async (s) => {
    if (s.status === 'rejected') return String(s.reason?.message ?? s.reason);
    await s.value.release();
    return null;
  }));
}"""


def _create(page: Any, queued: bool) -> list[str | None]:
    page.goto("/")
    return page.evaluate(CREATE, {"model": "models/v2/model.onnx", "count": 3, "queued": queued})


def test_concurrent_webgpu_sessions_fail_without_the_queue(page: Any) -> None:
    errors = [e for e in _create(page, queued=False) if e]
    assert errors and all("another WebGPU EP inference session is being created" in e for e in errors), errors


def test_the_queue_makes_every_webgpu_session(page: Any) -> None:
    assert _create(page, queued=True) == [None, None, None]
