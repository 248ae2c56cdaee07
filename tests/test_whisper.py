"""Encoder-decoder conformance on a tiny random-weight Whisper exported by onnxruntime-genai's model
builder: ortpipe runs the builder's folder (its v1 genai_config.json untouched) from raw log-mel
features, and its greedy tokens equal transformers' generate on the weights and onnxruntime-genai's."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from build.hfmodels import WHISPER_MELS, WHISPER_SOURCE_POSITIONS, WHISPER_START_ID
from build.references import first_divergence, genai_whisper_greedy, hf_whisper_greedy, hf_whisper_margins

import ortpipe
from ortpipe.plan import FROM_OUTPUT, FROM_REQUEST
from ortpipe.targets.cpython import Pipeline

NEW = 32
LAYERS, KV = (0, 1), ("key", "value")
PROMPTS = {"start": [WHISPER_START_ID], "start+3": [WHISPER_START_ID, 300, 301, 302]}


def features(seed: int) -> np.ndarray:
    """Random log-mel features [1, mels, frames]: the encoder's fixed 30 s window (2 frames per position)."""
    rng = np.random.default_rng(seed)
    return rng.standard_normal((1, WHISPER_MELS, 2 * WHISPER_SOURCE_POSITIONS)).astype(np.float32)


def ortpipe_greedy(pipe: Pipeline, feats: np.ndarray, prompt: list[int]) -> list[int]:
    return pipe.generate(prompt_ids=prompt, max_new_tokens=NEW, inputs={"audio_features": feats}).tokens


def explain(hf_dir: Path, feats: np.ndarray, prompt: list[int], expected: list[int],
            actual: list[int]) -> str:
    """Where ortpipe leaves the HF reference, with the HF logit margin there (a near-tie is no bug)."""
    step = first_divergence(expected, actual)
    if step is None or step >= min(len(expected), len(actual)):
        return f"lengths differ: {len(expected)} vs {len(actual)} tokens"
    margin = hf_whisper_margins(hf_dir, feats, prompt, expected)[step]
    return (f"diverges at step {step}: reference {expected[step]}, got {actual[step]}; "
            f"HF top-2 there {margin.first}/{margin.second}, margin {margin.margin:.6f}")


@pytest.fixture(scope="module")
def pipe(whisper_builder: Path) -> Pipeline:
    return ortpipe.load(whisper_builder, threads=1)


@pytest.mark.parametrize("prompt", PROMPTS.values(), ids=PROMPTS.keys())
def test_whisper_matches_transformers_and_genai(prompt: list[int], pipe: Pipeline, whisper_builder: Path,
                                                whisper_hf: Path) -> None:
    feats = features(0)
    ours = ortpipe_greedy(pipe, feats, prompt)
    assert len(ours) == NEW
    reference = hf_whisper_greedy(whisper_hf, feats, prompt, NEW)
    assert ours == reference, explain(whisper_hf, feats, prompt, reference, ours)
    assert ours == genai_whisper_greedy(whisper_builder, feats, prompt, NEW, threads=1), \
        "ortpipe differs from onnxruntime-genai"


def test_builder_config_runs_the_encoder_once_into_the_cross_cache(pipe: Pipeline,
                                                                   whisper_builder: Path) -> None:
    raw = json.loads((whisper_builder / "genai_config.json").read_text())
    assert "version" not in raw and "encoder" in raw["model"]  # the builder's own v1 config
    plan = pipe.plan
    assert plan.config.source == "v1"
    [[encoder]] = plan.init_levels
    assert encoder.session == "encoder"
    assert [(f.input, f.kind) for f in encoder.feeds] == [("audio_features", FROM_REQUEST)]
    [decoder] = plan.step_phase
    cross = {f.input: f.source for f in decoder.feeds if f.kind == FROM_OUTPUT}
    assert cross == {f"past_{kv}_cross_{i}": f"encoder.present_{kv}_cross_{i}" for kv in KV for i in LAYERS}
    assert {e.past_input for e in decoder.kv.entries} == {f"past_{kv}_self_{i}" for kv in KV for i in LAYERS}


def test_the_audio_decides_the_tokens_and_requests_stay_apart(pipe: Pipeline) -> None:
    prompt = PROMPTS["start"]
    first, other, again = (ortpipe_greedy(pipe, features(seed), prompt) for seed in (0, 1, 0))
    assert first == again  # the frozen cross cache is per request
    assert first != other


def test_beam_search_tiles_the_encoder_outputs_for_every_beam(
    whisper_builder: Path, whisper_hf: Path
) -> None:
    import torch
    import transformers
    from build.references import _hf_whisper, _plain_greedy_config

    feats = features(0)
    ours = ortpipe.load(whisper_builder, threads=1).generate(
        prompt_ids=[1], max_new_tokens=12, num_beams=3, early_stopping=False, inputs={"audio_features": feats}
    )
    model = _hf_whisper(str(whisper_hf))
    config = _plain_greedy_config(model, 12)
    config.num_beams, config.early_stopping = 3, False
    with torch.no_grad():
        out = transformers.GenerationMixin.generate(
            model,
            input_features=torch.as_tensor(feats),
            decoder_input_ids=torch.tensor([[1]]),
            generation_config=config,
        )
    assert ours.tokens == out[0, 1:].tolist()


def test_a_wav_on_the_builders_folder_gives_the_tokens_of_transformers_features(
    pipe: Pipeline, whisper_hf: Path, tmp_path: Path
) -> None:
    """The builder describes the features in audio_processor_config.json (onnxruntime-extensions'
    AudioDecoder, STFTNorm, LogMelSpectrum); ortpipe reads it as WhisperFeatureExtractor's config, so a
    WAV file gives the tokens transformers generates from that extractor's features of the same samples."""
    import wave

    import transformers

    samples = (0.2 * np.random.default_rng(3).standard_normal(16000 * 2)).astype(np.float32)
    pcm = (samples * 32767).astype(np.int16)
    path = tmp_path / "clip.wav"
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1), w.setsampwidth(2), w.setframerate(16000)
        w.writeframes(pcm.tobytes())
    extractor = transformers.WhisperFeatureExtractor(feature_size=WHISPER_MELS)
    read = pcm.astype(np.float32) / 32768  # what a WAV reader gives back of the samples written
    feats = extractor(read, sampling_rate=16000, return_tensors="np")["input_features"]
    prompt = PROMPTS["start"]
    ours = pipe.generate(prompt_ids=prompt, max_new_tokens=NEW, audios=[str(path)]).tokens
    assert ours == hf_whisper_greedy(whisper_hf, feats, prompt, NEW)


def test_bad_request_inputs_are_refused_before_running(whisper_builder: Path) -> None:
    pipe = ortpipe.load(whisper_builder, threads=1)
    with pytest.raises(
        ortpipe.GenerationError,
        match=r"expected float32 \[.batch_size., 80, 3000\], got float32 \[1, 80, 200\]",
    ):
        pipe.generate(prompt_ids=[1], max_new_tokens=4, inputs={"audio_features": features(0)[:, :, :200]})
    with pytest.raises(ortpipe.GenerationError, match='no session reads a request input named "pixels"'):
        pipe.generate(prompt_ids=[1], max_new_tokens=4, inputs={"pixels": features(0)})
    with pytest.raises(ortpipe.GenerationError, match="context_length 128"):
        pipe.generate(prompt_ids=[1], max_length=200, inputs={"audio_features": features(0)})
    with pytest.raises(ortpipe.GenerationError, match="sets no decoder start token"):
        pipe.generate(max_new_tokens=4, inputs={"audio_features": features(0)})
