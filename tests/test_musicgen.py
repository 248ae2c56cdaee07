"""MusicGen (issue 21): optimum's export run as it is (detected) and from a written-out v2 config gives
transformers' greedy generate: the same codes, audio within 1e-4, with and without guidance."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from build import musicgen

import ortpipe
from ortpipe.errors import ConfigError, GenerationError

AUDIO_TOLERANCE = 1e-4


@pytest.fixture(scope="session")
def musicgen_tiny() -> Path:
    return musicgen.get()


def _cases(folder: Path) -> list[dict]:
    return json.loads((folder / "references" / "cases.json").read_text())["cases"]


def _check(pipe: ortpipe.Pipeline, folder: Path) -> None:
    for case in _cases(folder):
        result = pipe.generate(case["prompt"], max_new_tokens=case["max_new_tokens"],
                               guidance_scale=case["guidance_scale"])
        assert result.outputs["codes"].tolist() == case["codes"], case
        reference = np.load(folder / "references" / case["audio"])
        difference = float(np.abs(result.outputs["audio_values"] - reference).max())
        print(f"guidance {case['guidance_scale']}: max |ortpipe - transformers| audio = {difference:.2e}")
        assert difference < AUDIO_TOLERANCE


@pytest.mark.slow
def test_detected_musicgen_matches_transformers(musicgen_tiny: Path) -> None:
    cases = _cases(musicgen_tiny)
    assert cases[0]["codes"] != cases[1]["codes"]  # guidance changes the codes: the test can fail
    _check(ortpipe.load(musicgen_tiny), musicgen_tiny)


@pytest.mark.slow
def test_written_v2_config_matches_transformers(musicgen_tiny: Path, tmp_path: Path) -> None:
    folder = Path(shutil.copytree(musicgen_tiny, tmp_path / "musicgen"))
    config = {
        "version": 2,
        "pipeline": {
            "sessions": {"text_encoder": {"file": "text_encoder.onnx"},
                         "decoder": {"file": "decoder_model_merged.onnx"},
                         "audio_decoder": {"file": "encodec_decode.onnx"}},
            "flow": [{"run": "text_encoder", "when": "init"}, {"run": "decoder", "when": "step"},
                     {"run": "audio_decoder", "when": "final"}],
            "dataflow": [{"from": "text_encoder.last_hidden_state", "to": "decoder.encoder_hidden_states"},
                         {"from": "generated.ids", "to": "audio_decoder.audio_codes"}],
            "output": {"session": "audio_decoder", "name": "audio_values", "as": "audio",
                       "sampling_rate": 800},
        },
        "tokens": {"pad": musicgen.PAD},
        "generation": {"max_length": 24,
                       "codebooks": {"count": 4, "delay": [0, 1, 2, 3], "guidance_scale": 3.0}},
    }
    (folder / "genai_config.json").write_text(json.dumps(config))
    _check(ortpipe.load(folder), folder)


@pytest.mark.slow
def test_cli_writes_the_audio(musicgen_tiny: Path, tmp_path: Path) -> None:
    out = tmp_path / "audio.wav"
    proc = subprocess.run([sys.executable, "-m", "ortpipe.cli", "run", str(musicgen_tiny), "--prompt",
                           "happy rock song", "--max-new-tokens", "12", "--guidance-scale", "3",
                           "--out", str(out)],
                          capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr
    assert out.stat().st_size > 44


def _config_error(tmp_path: Path, folder: Path, generation: dict, match: str) -> None:
    copy = Path(shutil.copytree(folder, tmp_path / "bad", dirs_exist_ok=True))
    raw = {"version": 2,
           "pipeline": {"sessions": {"text_encoder": {"file": "text_encoder.onnx"},
                                     "decoder": {"file": "decoder_model_merged.onnx"},
                                     "audio_decoder": {"file": "encodec_decode.onnx"}},
                        "flow": [{"run": "text_encoder", "when": "init"}, {"run": "decoder", "when": "step"},
                                 {"run": "audio_decoder", "when": "final"}],
                        "dataflow": [{"from": "text_encoder.last_hidden_state",
                                      "to": "decoder.encoder_hidden_states"},
                                     {"from": "generated.ids", "to": "audio_decoder.audio_codes"}],
                        "output": {"session": "audio_decoder", "name": "audio_values"}},
           "tokens": {"pad": musicgen.PAD}, "generation": generation}
    (copy / "genai_config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match=match):
        ortpipe.load(copy)


@pytest.mark.slow
@pytest.mark.parametrize(("generation", "match"), [
    ({}, "encoder_attention_mask"),  # without codebooks: a plain token loop cannot feed the decoder
    ({"codebooks": {"count": 4, "delay": [0, 1]}}, "must list 4 delays"),
    ({"codebooks": {"count": 4, "bogus": 1}}, "bogus"),
    ({"codebooks": {"delay": [0]}}, "count"),
    ({"codebooks": {"count": 4}, "sampling": {"repetition_penalty": 1.2}}, "drop repetition_penalty"),
    ({"codebooks": {"count": 4}, "speculative": {"ngram_size": 3}}, "drop ngram_size"),
    ({"loop": "single_pass", "codebooks": {"count": 4}}, 'for the "autoregressive" loop'),
])
def test_bad_codebook_configs_are_refused(musicgen_tiny: Path, tmp_path: Path, generation: dict,
                                         match: str) -> None:
    _config_error(tmp_path, musicgen_tiny, generation, match)


@pytest.mark.slow
def test_bad_requests_are_refused(musicgen_tiny: Path) -> None:
    pipe = ortpipe.load(musicgen_tiny)
    with pytest.raises(GenerationError, match="at least 6"):
        pipe.generate("rock", max_new_tokens=3)
    with pytest.raises(GenerationError, match="drop repetition_penalty"):
        pipe.generate("rock", max_new_tokens=12, repetition_penalty=1.2)
    with pytest.warns(UserWarning, match="temperature only applies when sampling"):
        pipe.generate("rock", max_new_tokens=12, temperature=0.5)
    with pytest.raises(GenerationError, match="top_k"):
        pipe.generate("rock", max_new_tokens=12, do_sample=True, top_k=-1)


@pytest.mark.slow
def test_sampled_codes(musicgen_tiny: Path) -> None:
    """Sampling picks each codebook's token from its own row: with top_k 1 it gives transformers' greedy
    codes and audio (a codebook sampled from another's row would not); seeded, the codes repeat; another
    seed gives others."""
    pipe = ortpipe.load(musicgen_tiny)
    for case in _cases(musicgen_tiny):
        run = {"max_new_tokens": case["max_new_tokens"], "guidance_scale": case["guidance_scale"]}
        top1 = pipe.generate(case["prompt"], **run, do_sample=True, top_k=1, temperature=1.5)
        assert top1.outputs["codes"].tolist() == case["codes"]
        reference = np.load(musicgen_tiny / "references" / case["audio"])
        assert float(np.abs(top1.outputs["audio_values"] - reference).max()) < AUDIO_TOLERANCE
        sampled = [pipe.generate(case["prompt"], **run, do_sample=True, seed=seed).outputs["codes"].tolist()
                   for seed in (1, 1, 2)]
        assert sampled[0] == sampled[1] != sampled[2]
        assert sampled[0] != case["codes"]
        codes = np.array(sampled[0])
        assert codes.shape == np.array(case["codes"]).shape and codes.min() >= 0


@pytest.mark.slow
def test_generation_config_sampling_is_the_default(musicgen_tiny: Path, tmp_path: Path) -> None:
    """A folder whose generation_config.json samples (MusicGen's real ones say do_sample true, top_k 250)
    samples by default, as transformers' generate does: with top_k 1 there, transformers' greedy codes;
    without a top_k, transformers' default 50; with top_k 3, the codes a request asking for it explicitly gets
    (not the unrestricted ones: the test model's codebooks have 64 entries); a request still turns it off."""
    folder = Path(shutil.copytree(musicgen_tiny, tmp_path / "musicgen"))
    gen = json.loads((folder / "generation_config.json").read_text())
    case = _cases(musicgen_tiny)[0]
    run = {"max_new_tokens": case["max_new_tokens"], "guidance_scale": case["guidance_scale"]}
    (folder / "generation_config.json").write_text(json.dumps({**gen, "do_sample": True, "top_k": 1}))
    assert ortpipe.load(folder).generate(case["prompt"], **run).outputs["codes"].tolist() == case["codes"]
    (folder / "generation_config.json").write_text(json.dumps({**gen, "do_sample": True}))
    settings = ortpipe.load(folder).model.config.generation.settings
    assert (settings.do_sample, settings.top_k, settings.temperature) == (True, 50, 1.0)
    (folder / "generation_config.json").write_text(json.dumps({**gen, "do_sample": True, "top_k": 3}))
    pipe, plain = ortpipe.load(folder), ortpipe.load(musicgen_tiny)
    sampled = pipe.generate(case["prompt"], **run, seed=4).outputs["codes"].tolist()
    explicit = plain.generate(case["prompt"], **run, do_sample=True, top_k=3, seed=4)
    assert sampled == explicit.outputs["codes"].tolist()
    assert sampled != case["codes"]
    unrestricted = plain.generate(case["prompt"], **run, do_sample=True, top_k=0, seed=4)
    assert sampled != unrestricted.outputs["codes"].tolist()
    assert pipe.generate(case["prompt"], **run, do_sample=False).outputs["codes"].tolist() == case["codes"]
    (folder / "generation_config.json").write_text(json.dumps({**gen, "do_sample": True, "temperature": -1}))
    with pytest.raises(ConfigError, match="generation_config.json: temperature"):
        ortpipe.load(folder)


@pytest.mark.slow
def test_expanded_config_runs_the_same(musicgen_tiny: Path, tmp_path: Path) -> None:
    """What `inspect` writes for the detected folder, saved as its genai_config.json, loads and runs alike."""
    from ortpipe.config.expand import as_v2

    folder = Path(shutil.copytree(musicgen_tiny, tmp_path / "musicgen"))
    expanded = as_v2(ortpipe.load(folder).model.config)
    assert expanded["generation"]["codebooks"] == {"count": 4, "delay": [0, 1, 2, 3], "guidance_scale": 3.0}
    (folder / "genai_config.json").write_text(json.dumps(expanded))
    _check(ortpipe.load(folder), folder)
