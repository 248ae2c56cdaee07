"""A pipeline of stages in Chromium (wasm): the thinker -> talker -> code2wav test pipeline gives CPython's
ids, waveform and order of stage chunks (the talker and the audio while the thinker still generates)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from build import stage_graphs as sg

import ortpipe

PROMPT = [5, 9, 17, 33]

# Runs in the page: stream a request, keep each chunk's stage and token, and the result.
RUN = """async ({model, promptIds}) => {
  const {load} = await import('./ortpipe.js');
  const pipe = await load(model, {device: 'wasm'});
  try {
    const chunks = [];
    const stream = pipe.stream({promptIds});
    let next;
    while (!(next = await stream.next()).done) {
      chunks.push({stage: next.value.stage, token: next.value.token});
    }
    const result = next.value;
    return {info: pipe.info, chunks, tokens: result.tokens, stages: result.stages,
            audio: Array.from(result.audio.audio), samplingRate: result.audio.samplingRate};
  } finally {
    pipe.dispose();
  }
}"""


@pytest.fixture(scope="module")
def omni(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return sg.omni_style(tmp_path_factory.mktemp("web-omni"))


def test_wasm_stages_equal_cpython(page: Any, serve_model: Any, omni: Path) -> None:
    pipe = ortpipe.load(omni)
    expected = [(c.stage, c.token) for c in pipe.stream(prompt_ids=PROMPT)]
    result = pipe.generate(prompt_ids=PROMPT)
    url = serve_model("omni", omni)
    page.goto("/")
    got = page.evaluate(RUN, {"model": url, "promptIds": PROMPT})
    assert got["info"]["stages"] == ["thinker", "talker", "code2wav"]
    assert sorted(got["info"]["sessions"]) == ["code2wav", "talker", "thinker"]
    assert [(c["stage"], c["token"]) for c in got["chunks"]] == expected
    order = [stage for stage, _ in expected]
    assert order.index("code2wav") < len(order) - 1 - order[::-1].index("thinker")  # audio before the end
    assert got["tokens"] == result.tokens
    assert got["stages"]["talker"] == {"tokens": result.stages["talker"].tokens, "finishReason": "length"}
    assert got["samplingRate"] == sg.SAMPLING_RATE
    audio = np.array(got["audio"], np.float32)
    assert audio.shape == (result.audio.size,)
    assert np.abs(audio - result.audio.ravel()).max() <= 1e-5
