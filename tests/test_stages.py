"""pipeline.stages and accumulated step outputs: a thinker -> talker -> code2wav pipeline
(build/stage_graphs.py) against its hand-written onnxruntime loop (tests/stage_refs.py), the order in which
streamed stages run, the trace, and the config's refusals."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import pytest
from build import stage_graphs as sg

import ortpipe
from ortpipe.errors import ConfigError
from ortpipe.trace import Trace
from tests.stage_refs import omni_reference

PROMPT = [5, 9, 17, 33]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return sg.omni_style(tmp_path_factory.mktemp("omni"))


def _with_config(folder: Path, tmp_path: Path, config: dict) -> Path:
    out = tmp_path / "copy"
    out.mkdir()
    for name in sg.FILES.values():
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_bytes((folder / name).read_bytes())
    (out / "genai_config.json").write_text(json.dumps(config))
    return out


@pytest.mark.parametrize(("thinker_max", "talker_max"), [(20, 6), (12, 25)])
def test_stages_equal_the_hand_written_loop(folder: Path, tmp_path: Path, thinker_max: int,
                                            talker_max: int) -> None:
    """(20, 6): the talker is done while the thinker still generates; (12, 25): the talker outlasts the
    thinker's rows and gets zero rows past them."""
    config = sg.omni_config(thinker_max, talker_max)
    think, talk, wave = omni_reference(folder, PROMPT, thinker_max, talker_max)
    result = ortpipe.load(_with_config(folder, tmp_path, config)).generate(prompt_ids=PROMPT)
    assert result.tokens == think and len(think) == thinker_max - len(PROMPT)
    assert result.stages["talker"].tokens == talk and len(talk) == talker_max - 1
    assert result.audio.shape == (1, len(talk) * sg.SAMPLES_PER_CODE)
    np.testing.assert_allclose(result.audio, wave, rtol=1e-5, atol=1e-6)
    assert result.kinds["waveform"] == {"kind": "audio", "sampling_rate": sg.SAMPLING_RATE}


def test_the_talker_reads_the_thinker_rows(folder: Path) -> None:
    """The test graphs notice the hand-off: the talker's ids change when its rows do (zeros, or each row
    one position late)."""
    import onnxruntime as ort

    from tests.stage_refs import greedy, session

    _, talk, _ = omni_reference(folder, PROMPT, 20, 25)
    talker: ort.InferenceSession = session(folder, sg.FILES["talker"])
    zeros, _ = greedy(talker, [sg.DECODER_START], 25, [sg.EOS],
                      lambda past, n: {"thinker_states": np.zeros((1, n, 32), np.float32)})
    assert zeros != talk


def test_streamed_stages_interleave(folder: Path) -> None:
    """The talker's first token and the audio come while the thinker still generates."""
    pipe = ortpipe.load(folder)
    order = [c.stage for c in pipe.stream(prompt_ids=PROMPT)]
    last_thinker = len(order) - 1 - order[::-1].index("thinker")
    assert order[0] == "thinker"  # the prefill makes the rows the talker starts on
    assert order.index("talker") < last_thinker
    assert order.index("code2wav") < last_thinker
    assert order.count("thinker") == 16 and order.count("talker") == 5 and order.count("code2wav") == 1


def test_unstreamed_stages_wait_for_the_thinker(folder: Path, tmp_path: Path) -> None:
    config = sg.omni_config(20, 6, stream=False)
    pipe = ortpipe.load(_with_config(folder, tmp_path, config))
    chunks = list(pipe.stream(prompt_ids=PROMPT))
    order = [c.stage for c in chunks]
    assert order == ["thinker"] * 16 + ["talker"] * 5 + ["code2wav"]
    streamed = ortpipe.load(folder).generate(prompt_ids=PROMPT)
    assert [c.token for c in chunks if c.stage == "talker"] == streamed.stages["talker"].tokens


def test_the_trace_shows_each_stage(folder: Path) -> None:
    pipe = ortpipe.load(folder)
    trace = Trace()
    for _ in pipe.drive(pipe.request(prompt_ids=PROMPT), trace):
        pass
    stages = {span.label.split(" ")[0] for span in trace.spans}
    assert stages == {"thinker", "talker", "code2wav"}
    talker = [s for s in trace.spans if s.name == "talker"]
    assert [s.label for s in talker] == ["talker step 0", *(f"talker step {i}" for i in range(1, 5))]
    assert talker[0].shapes["thinker_states"] == [1, 1, 32]
    assert any(line.startswith("talker:") for line in trace.summary())


# the config's refusals


def _problems(folder: Path, tmp_path: Path, change) -> str:
    config = copy.deepcopy(sg.omni_config(20, 6))
    change(config)
    with pytest.raises(ConfigError) as e:
        ortpipe.load(_with_config(folder, tmp_path, config))
    return str(e.value)


def _stages(config: dict) -> dict:
    return config["pipeline"]["stages"]


def _wires(config: dict) -> list:
    return config["pipeline"]["dataflow"]


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (lambda c: _stages(c)["thinker"].update(loop="autoregressive"),
         'Unknown key "loop" in pipeline.stages.thinker'),
        (lambda c: c.update(generation={"max_length": 9}),
         "config.generation: with pipeline.stages each stage has its own generation"),
        (lambda c: c["pipeline"].update(flow=[{"run": "thinker"}]), "pipeline.flow: with pipeline.stages"),
        (lambda c: _stages(c)["talker"]["flow"].append({"run": "thinker", "when": "step"}),
         'session "thinker" runs in stages "thinker" and "talker"'),
        (lambda c: _wires(c).append({"from": "code2wav.waveform", "to": "thinker.input_ids"}),
         "Circular dependency between stages"),
        (lambda c: c["pipeline"].update(stages=dict(reversed(list(_stages(c).items())))),
         'feeds stage "talker" from stage "thinker", which runs after it'),
        (lambda c: _stages(c)["thinker"]["flow"][0].pop("accumulate"),
         'add "accumulate": ["hidden_states"] to its flow step'),
        (lambda c: _stages(c)["thinker"]["flow"][0].update(accumulate=["hidden_states", "hiden_states"]),
         'accumulates "hiden_states", which session "thinker" does not output'),
        (lambda c: _wires(c)[1].update(stream=True),
         '"code2wav" of stage "code2wav" is not one: drop "stream"'),
        (lambda c: _wires(c)[0].update({"from": "thinker.logits"}), 'add "accumulate": ["logits"]'),
        (lambda c: _wires(c).append({"from": "thinker.hidden_states", "to": "code2wav.codes"}),
         "code2wav.codes is fed by two wires"),
        (lambda c: _stages(c)["talker"]["tokens"].pop("decoder_start"),
         "pipeline.stages.talker: a later autoregressive stage starts from [tokens.decoder_start]"),
        (lambda c: _wires(c)[0].update(to="talker.thinker_state"),
         'references input "thinker_state" but session "talker" has no such input'),
        (lambda c: _stages(c)["code2wav"]["flow"][0].update(accumulate=["waveform"]),
         'only a "when": "step" step has them'),
        (lambda c: _stages(c)["talker"]["generation"].update(max_length="six"),
         "pipeline.stages.talker: config.generation.max_length"),
    ],
)
def test_bad_stage_configs_are_refused(folder: Path, tmp_path: Path, change, expected: str) -> None:
    assert expected in _problems(folder, tmp_path, change)


def test_stream_outside_stages_is_refused(tmp_path: Path) -> None:
    from build.pipeline_graphs import talker_repeat

    out = talker_repeat(tmp_path / "talker")
    config = json.loads((out / "genai_config.json").read_text())
    config["pipeline"]["dataflow"][0]["stream"] = True
    (out / "genai_config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match='has "stream", which is for wires between stages'):
        ortpipe.load(out)


def test_the_expanded_config_runs_the_same(folder: Path, tmp_path: Path) -> None:
    from ortpipe.config.expand import as_v2

    pipe = ortpipe.load(folder)
    expanded = as_v2(pipe.config)
    assert expanded["pipeline"]["stages"]["thinker"]["flow"][0]["accumulate"] == ["hidden_states"]
    assert expanded["pipeline"]["dataflow"][0]["stream"] is True
    again = ortpipe.load(_with_config(folder, tmp_path, expanded)).generate(prompt_ids=PROMPT)
    first = pipe.generate(prompt_ids=PROMPT)
    assert again.tokens == first.tokens and again.stages["talker"].tokens == first.stages["talker"].tokens


def test_the_cli_shows_and_runs_the_stages(folder: Path, tmp_path: Path) -> None:
    import subprocess
    import sys

    def cli(*args: str) -> str:
        done = subprocess.run([sys.executable, "-m", "ortpipe.cli", *args], capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        return done.stdout

    shown = cli("inspect", str(folder))
    assert "stage talker (autoregressive): talker" in shown
    assert "reads thinker.hidden_states -> talker.thinker_states (streamed)" in shown
    assert "stage code2wav (single_pass): code2wav" in shown
    wav = tmp_path / "speech.wav"
    result = json.loads(cli("run", str(folder), "--prompt-ids", "5,9,17,33", "--out", str(wav), "--json"))
    _, talk, _ = omni_reference(folder, PROMPT, 20, 6)
    assert result["stages"]["talker"]["tokens"] == talk
    assert result["outputs"]["waveform"]["shape"] == [1, len(talk) * sg.SAMPLES_PER_CODE] and wav.exists()


def _single_decoder(folder: Path, tmp_path: Path, accumulate: bool) -> Path:
    """The thinker alone, returning its hidden states (pipeline.output of an autoregressive loop)."""
    step = {"run": "decoder", "when": "step", **({"accumulate": ["hidden_states"]} if accumulate else {})}
    config = {"version": 2,
              "pipeline": {"sessions": {"decoder": {"file": sg.FILES["thinker"]}}, "flow": [step],
                           "output": {"session": "decoder", "name": "hidden_states"}},
              "tokens": {"eos": [sg.EOS]}, "generation": {"max_length": 12}}
    return _with_config(folder, tmp_path, config)


@pytest.mark.parametrize("accumulate", [True, False])
def test_an_accumulated_output_holds_every_run_s_rows(folder: Path, tmp_path: Path, accumulate: bool) -> None:
    """Accumulated: the prefill's rows and one per later run (P + N - 1); else the last run's row."""
    from tests.stage_refs import greedy, session

    think, states = greedy(session(folder, sg.FILES["thinker"]), PROMPT, 12, [sg.EOS], lambda p, n: {},
                           keep="hidden_states")
    result = ortpipe.load(_single_decoder(folder, tmp_path, accumulate)).generate(prompt_ids=PROMPT)
    assert result.tokens == think
    expected = states if accumulate else states[:, -1:]
    assert result.outputs["hidden_states"].shape == expected.shape
    assert expected.shape[1] == (len(PROMPT) + len(think) - 1 if accumulate else 1)
    np.testing.assert_allclose(result.outputs["hidden_states"], expected, rtol=1e-5, atol=1e-5)
    assert result.kinds["hidden_states"] == {"kind": "tensor"}


def test_beams_and_speculation_are_refused(folder: Path) -> None:
    from ortpipe.errors import GenerationError

    pipe = ortpipe.load(folder)
    with pytest.raises(GenerationError, match="thinker accumulate outputs step by step, which beam search"):
        pipe.generate(prompt_ids=PROMPT, num_beams=2)
    with pytest.raises(GenerationError, match="speculative decoding"):
        pipe.generate(prompt_ids=PROMPT, prompt_lookup_num_tokens=3)


def test_an_interrupt_stops_the_stages_that_started(folder: Path) -> None:
    """Interrupted after the talker's first token: code2wav, not started, never starts."""
    pipe = ortpipe.load(folder)
    request = pipe.request(prompt_ids=PROMPT)
    seen = []
    for chunk in pipe.drive(request):
        seen.append(chunk.stage)
        if chunk.stage == "talker":
            request.interrupt()
    assert seen == ["thinker", "talker"]
    result = request.result()
    assert result.finish_reason == "interrupt" and set(result.stages) == {"thinker", "talker"}
    assert result.audio is None
