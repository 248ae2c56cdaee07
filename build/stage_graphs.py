"""A tiny thinker -> talker -> code2wav pipeline shaped like Qwen2.5-Omni's, for the stage tests.

- thinker: an LLM decoder with a KV cache that also gives its per-token hidden states:
  `input_ids` i64 [B, S], `attention_mask` i64 [B, T], `position_ids` i64 [B, S],
  `past_key_values.{0,1}.key/.value` f32 [B, 2, P, 8] -> `logits` f32 [B, S, 96],
  `hidden_states` f32 [B, S, 32],
  `present.{0,1}.key/.value`.
- talker: an autoregressive codec decoder conditioned on the thinker: the same inputs plus `thinker_states`
  f32 [B, S, 32], projected and added to its token and position embeddings (one thinker row per talker
  position) -> `logits` f32 [B, S, 96] (codec ids), presents.
- code2wav: single_pass `codes` i64 [1, N] -> `waveform` f32 [1, N * 4] (each code's embedding through a
  small MLP to 4 samples; a 3-tap smoothing across codes, so the order of codes matters).

`omni_style(out, ...)` writes the folder with a pipeline.stages config: the thinker accumulates
`hidden_states` (prefill rows included), streamed to the talker (`stream`), whose generated ids feed
code2wav. tests/stage_refs.py is the hand-written onnxruntime loop it is checked against.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from build.graphs import BATCH, HIDDEN, SEQ, TOTAL, VOCAB, _Graph, _tensor
from build.pipeline_graphs import (
    DECODER_START,
    EOS,
    FLOAT,
    INT64,
    _lm_head,
    _logits_info,
    _model,
    _position_embedding,
    _self_attention_stack,
    _write,
)

SAMPLES_PER_CODE = 4
CODES = "num_codes"
SAMPLING_RATE = 16000


def thinker(seed: int) -> Any:
    g = _Graph(np.random.RandomState(seed))
    tokens = g.op("Gather", g.weight("token_embedding", (VOCAB, HIDDEN), 1.0), "input_ids")
    x = g.op("Add", tokens, _position_embedding(g, "position_ids", 2))
    x, pasts, presents = _self_attention_stack(g, x, "attention_mask", "past_key_values.{layer}.{kind}",
                                               "present.{layer}.{kind}")
    hidden = g.op("Identity", g.norm(x), out="hidden_states")
    _lm_head(g, hidden)
    inputs = [_tensor("input_ids", INT64, [BATCH, SEQ]), _tensor("attention_mask", INT64, [BATCH, TOTAL]),
              _tensor("position_ids", INT64, [BATCH, SEQ]), *pasts]
    outputs = [_logits_info(), _tensor("hidden_states", FLOAT, [BATCH, SEQ, HIDDEN]), *presents]
    return _model(g, "tiny_thinker", inputs, outputs)


def talker(seed: int) -> Any:
    g = _Graph(np.random.RandomState(seed))
    tokens = g.op("Gather", g.weight("codec_embedding", (VOCAB, HIDDEN), 1.0), "input_ids")
    cond = g.linear("thinker_states", "thinker_projection", HIDDEN, HIDDEN, 3.0)
    x = g.op("Add", g.op("Add", tokens, _position_embedding(g, "position_ids", 2)), cond)
    x, pasts, presents = _self_attention_stack(g, x, "attention_mask", "past_key_values.{layer}.{kind}",
                                               "present.{layer}.{kind}")
    _lm_head(g, x)
    inputs = [_tensor("input_ids", INT64, [BATCH, SEQ]), _tensor("attention_mask", INT64, [BATCH, TOTAL]),
              _tensor("position_ids", INT64, [BATCH, SEQ]),
              _tensor("thinker_states", FLOAT, [BATCH, SEQ, HIDDEN]), *pasts]
    return _model(g, "tiny_talker", inputs, [_logits_info(), *presents])


def code2wav(seed: int) -> Any:
    g = _Graph(np.random.RandomState(seed))
    x = g.op("Gather", g.weight("code_embedding", (VOCAB, HIDDEN), 1.0), "codes")  # [1, N, H]
    h = g.op("Tanh", g.linear(x, "up", HIDDEN, HIDDEN, 2.0))
    frames = g.op("Tanh", g.linear(h, "to_samples", HIDDEN, SAMPLES_PER_CODE, 2.0))  # [1, N, 4]
    # each code's frame plus half of its neighbours' (zeros at the ends): [1, 1, N, 4] padded on N
    image = g.op("Unsqueeze", frames, g.const([1]))
    padded = g.op("Pad", image, g.const([0, 0, 1, 0, 0, 0, 1, 0]))
    kernel = np.zeros((1, 1, 3, 1), dtype=np.float32)
    kernel[0, 0, :, 0] = (0.5, 1.0, 0.5)
    smooth = g.op("Conv", padded, g.const(kernel, np.float32))
    g.op("Reshape", smooth, g.const([1, -1]), out="waveform")
    return _model(g, "tiny_code2wav", [_tensor("codes", INT64, [1, CODES])],
                  [_tensor("waveform", FLOAT, [1, "samples"])])


FILES = {"thinker": "thinker/model.onnx", "talker": "talker/model.onnx", "code2wav": "code2wav/model.onnx"}


def omni_config(thinker_max: int, talker_max: int, stream: bool = True) -> dict[str, Any]:
    """Three stages; `thinker_max`, `talker_max`: each decoder's max_length (prompt included)."""
    return {
        "version": 2,
        "pipeline": {
            "sessions": {name: {"file": file} for name, file in FILES.items()},
            "stages": {
                "thinker": {
                    "flow": [{"run": "thinker", "when": "step", "accumulate": ["hidden_states"]}],
                    "generation": {"max_length": thinker_max},
                    "tokens": {"eos": [EOS]},
                },
                "talker": {
                    "flow": [{"run": "talker", "when": "step"}],
                    "generation": {"max_length": talker_max},
                    "tokens": {"eos": [EOS], "decoder_start": DECODER_START},
                },
                "code2wav": {
                    "flow": [{"run": "code2wav", "when": "init"}],
                    "generation": {"loop": "single_pass"},
                },
            },
            "dataflow": [
                {"from": "thinker.hidden_states", "to": "talker.thinker_states", "stream": stream},
                {"from": "talker.tokens", "to": "code2wav.codes"},
            ],
            "output": {"session": "code2wav", "name": "waveform", "as": "audio",
                       "sampling_rate": SAMPLING_RATE},
        },
        "metadata": {"model_type": "tiny-omni", "source": "build/stage_graphs.py"},
    }


def omni_style(out: Path | str, seed: int = 0, thinker_max: int = 20, talker_max: int = 6,
               stream: bool = True) -> Path:
    models = {FILES["thinker"]: thinker(seed + 1), FILES["talker"]: talker(seed + 2),
              FILES["code2wav"]: code2wav(seed + 3)}
    return _write(out, models, omni_config(thinker_max, talker_max, stream))


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description="write the tiny thinker -> talker -> code2wav folder")
    parser.add_argument("out", type=Path)
    parser.add_argument("--no-stream", action="store_true", help="the talker waits for the thinker")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    print(omni_style(args.out, stream=not args.no_stream))


if __name__ == "__main__":
    main()
