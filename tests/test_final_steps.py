"""`when: final` steps of the plain autoregressive loop (issue 21): a vocoder graph run once on the whole
generated sequence ("generated.ids"), its output returned by name. Checked against the hand-written greedy
loop (tests/handloop.py) and the vocoder run by hand with onnxruntime."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from build import graphs
from onnx import TensorProto, helper

import ortpipe
from ortpipe.errors import ConfigError, GenerationError
from tests.handloop import _step_feeds, empty_pasts, hand_greedy

RATE, SAMPLES_PER_TOKEN = 16000, 3


def _vocoder(path: Path, ids_type: int = TensorProto.INT64) -> None:
    """ids [batch, length] -> waveform [batch, length * 3]: a random table row per id, flattened."""
    table = np.random.default_rng(5).standard_normal((graphs.VOCAB, SAMPLES_PER_TOKEN)).astype(np.float32)
    nodes = [helper.make_node("Cast", ["ids"], ["ids64"], to=TensorProto.INT64),
             helper.make_node("Gather", ["table", "ids64"], ["rows"]),
             helper.make_node("Flatten", ["rows"], ["waveform"], axis=1)]
    graph = helper.make_graph(nodes, "vocoder", [helper.make_tensor_value_info("ids", ids_type, ["b", "n"])],
                              [helper.make_tensor_value_info("waveform", TensorProto.FLOAT, ["b", "s"])],
                              [onnx.numpy_helper.from_array(table, "table")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))


def _config(output: bool = True, wire_to: str = "vocoder.ids") -> dict:
    config = {
        "version": 2,
        "pipeline": {
            "sessions": {"decoder": {"file": "model.onnx"}, "vocoder": {"file": "vocoder.onnx"}},
            "flow": [{"run": "decoder", "when": "step"}, {"run": "vocoder", "when": "final"}],
            "dataflow": [{"from": "generated.ids", "to": wire_to}],
        },
        "tokens": {"eos": [], "bos": graphs.BOS, "pad": graphs.PAD},
        "generation": {"max_length": 64},
    }
    if output:
        config["pipeline"]["output"] = {"session": "vocoder", "name": "waveform", "as": "audio",
                                        "sampling_rate": RATE}
    return config


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    out = graphs.build_separate(tmp_path / "tts")
    _vocoder(out / "vocoder.onnx")
    (out / "genai_config.json").write_text(json.dumps(_config()))
    return out


def test_final_step_runs_on_the_generated_sequence(folder: Path) -> None:
    prompt = [graphs.BOS, 5, 9, 14]
    result = ortpipe.load(folder).generate(prompt_ids=prompt, max_new_tokens=7)
    tokens = hand_greedy(folder, prompt, 7, layout="separate")
    assert result.tokens == tokens
    vocoder = ort.InferenceSession(str(folder / "vocoder.onnx"))
    (expected,) = vocoder.run(None, {"ids": np.array([tokens], np.int64)})
    assert expected.shape == (1, 7 * SAMPLES_PER_TOKEN)
    np.testing.assert_array_equal(result.outputs["waveform"], expected)
    assert result.kinds["waveform"] == {"kind": "audio", "sampling_rate": RATE}


def test_generated_ids_take_the_input_type(tmp_path: Path, folder: Path) -> None:
    _vocoder(folder / "vocoder.onnx", TensorProto.INT32)
    result = ortpipe.load(folder).generate(prompt_ids=[graphs.BOS, 3], max_new_tokens=4)
    vocoder = ort.InferenceSession(str(folder / "vocoder.onnx"))
    (expected,) = vocoder.run(None, {"ids": np.array([result.tokens], np.int32)})
    np.testing.assert_array_equal(result.outputs["waveform"], expected)


@pytest.mark.parametrize(("config", "match"), [
    (_config(output=False), "name them in pipeline.output"),
    (_config(wire_to="decoder.input_ids"), 'feeds "when": "final" steps only'),
    ({**_config(), "pipeline": {**_config()["pipeline"],
                                "dataflow": [{"from": "generated.tokens", "to": "vocoder.ids"}]}},
     'the generated tokens are "generated.ids"'),
])
def test_bad_final_configs_are_refused(folder: Path, config: dict, match: str) -> None:
    (folder / "genai_config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=match):
        ortpipe.load(folder)


def test_token_by_token_loops_are_refused(folder: Path) -> None:
    pipe = ortpipe.load(folder)
    with pytest.raises(GenerationError, match="use generate"):
        pipe.chat()
    with pytest.raises(GenerationError, match="num_beams to 1"):
        pipe.generate(prompt_ids=[graphs.BOS, 3], max_new_tokens=4, num_beams=2)


def test_cli_writes_the_final_output(folder: Path, tmp_path: Path) -> None:
    import subprocess
    import sys
    import wave

    out = tmp_path / "speech.wav"
    proc = subprocess.run([sys.executable, "-m", "ortpipe.cli", "run", str(folder), "--prompt-ids", "0,5,9",
                           "--max-new-tokens", "5", "--out", str(out)], capture_output=True, text=True,
                          check=False)
    assert proc.returncode == 0, proc.stderr
    assert f"waveform: audio float32 [1, {5 * SAMPLES_PER_TOKEN}] -> {out}" in proc.stderr
    with wave.open(str(out)) as w:
        assert (w.getframerate(), w.getnframes()) == (RATE, 5 * SAMPLES_PER_TOKEN)
    bad = subprocess.run([sys.executable, "-m", "ortpipe.cli", "run", str(folder), "--prompt-ids", "0,5",
                          "--out", str(tmp_path / "x.png")], capture_output=True, text=True, check=False)
    assert bad.returncode != 0 and "x.png" in bad.stderr


def test_a_final_step_reads_an_accumulated_output(folder: Path) -> None:
    """A step that accumulates its logits, and a final graph over them (their mean per position): the
    final step gets the whole loop's rows, the logits of a run over prompt and generated tokens but
    the last, with no cache (onnxruntime by hand)."""
    nodes = [helper.make_node("ReduceMean", ["rows"], ["means"], axes=[2], keepdims=0)]
    graph = helper.make_graph(nodes, "mean", [helper.make_tensor_value_info("rows", TensorProto.FLOAT,
                                                                           ["b", "n", graphs.VOCAB])],
                              [helper.make_tensor_value_info("means", TensorProto.FLOAT, ["b", "n"])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(folder / "mean.onnx"))
    config = _config()
    config["pipeline"]["sessions"]["mean"] = {"file": "mean.onnx"}
    config["pipeline"]["flow"] = [{"run": "decoder", "when": "step", "accumulate": ["logits"]},
                                  {"run": "vocoder", "when": "final"}, {"run": "mean", "when": "final"}]
    config["pipeline"]["dataflow"].append({"from": "decoder.logits", "to": "mean.rows"})
    means = {"session": "mean", "name": "means", "as": "audio", "sampling_rate": RATE}
    config["pipeline"]["output"] = [config["pipeline"]["output"], means]
    (folder / "genai_config.json").write_text(json.dumps(config))
    prompt = [graphs.BOS, 5, 9, 14]
    result = ortpipe.load(folder).generate(prompt_ids=prompt, max_new_tokens=6)
    assert result.tokens == hand_greedy(folder, prompt, 6, layout="separate")
    session = ort.InferenceSession(str(folder / "model.onnx"))
    ids = prompt + result.tokens[:-1]
    (logits,) = session.run(["logits"], _step_feeds(session, ids, len(ids)) | empty_pasts(session))
    assert result.outputs["means"].shape == (1, len(ids))
    np.testing.assert_allclose(result.outputs["means"], logits.mean(axis=2), atol=1e-5)
    assert result.outputs["waveform"].shape == (1, 6 * SAMPLES_PER_TOKEN)
