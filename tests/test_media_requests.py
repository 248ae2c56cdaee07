"""Images and audio through whole pipelines: ortpipe preprocesses them with its kernels, and the
tokens equal the hand-written reference fed transformers' own preprocessing of the same media."""

from __future__ import annotations

import json
import wave
from pathlib import Path

import numpy as np
import pytest
from build import pipeline_graphs as pg

import ortpipe
from tests.pipeline_refs import reference_tokens

transformers = pytest.importorskip("transformers")
PIL = pytest.importorskip("PIL.Image")

CLIP = {"image_processor_type": "CLIPImageProcessor", "do_resize": True, "size": {"shortest_edge": 8},
        "resample": 3, "do_center_crop": True, "crop_size": {"height": 8, "width": 8}, "do_rescale": True,
        "rescale_factor": 1 / 255, "do_normalize": True, "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711]}


def test_images_are_preprocessed_like_transformers(tmp_path: Path) -> None:
    folder = pg.phi3v_style(tmp_path / "vlm", seed=0)
    (folder / "image_processor.json").write_text(json.dumps(CLIP))
    rng = np.random.default_rng(0)
    images = [
        rng.integers(0, 256, (30, 41, 3), dtype=np.uint8),
        rng.integers(0, 256, (64, 20, 3), dtype=np.uint8),
    ]
    png = tmp_path / "second.png"
    PIL.fromarray(images[1]).save(png)
    prompt = pg.phi3v_inputs(0).prompt_ids
    pipe = ortpipe.load(folder, threads=1)
    ours = pipe.generate(prompt_ids=prompt, max_new_tokens=12, images=[images[0], str(png)]).tokens
    processor = transformers.CLIPImageProcessor(
        **{k: v for k, v in CLIP.items() if k != "image_processor_type"}
    )
    pixels = processor([PIL.fromarray(i) for i in images], return_tensors="np")["pixel_values"].astype(
        np.float32
    )
    assert ours == reference_tokens(folder, prompt, {"pixel_values": pixels}, 12)


def test_audio_is_preprocessed_like_transformers(tmp_path: Path) -> None:
    folder = pg.speech_language_style(tmp_path / "speech", seed=0)
    request = pg.speech_language_inputs(0)
    mels = request.inputs["input_features"].shape[1]  # frames are free: one second makes 100
    extractor = transformers.WhisperFeatureExtractor(
        feature_size=mels, sampling_rate=16000, hop_length=160, chunk_length=1, n_fft=400
    )
    (folder / "preprocessor_config.json").write_text(extractor.to_json_string())
    rng = np.random.default_rng(1)
    clips = [
        (0.3 * rng.standard_normal(2000)).astype(np.float32),
        (0.5 * np.sin(np.arange(1200) / 7)).astype(np.float32),
    ]
    wav = tmp_path / "clip.wav"
    with wave.open(str(wav), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(16000)
        w.writeframes((clips[1] * 32767).astype("<i2").tobytes())
    clips[1] = np.frombuffer((clips[1] * 32767).astype("<i2").tobytes(), "<i2").astype(np.float32) / 32768
    ours = (
        ortpipe.load(folder, threads=1)
        .generate(prompt_ids=request.prompt_ids, max_new_tokens=12, audios=[clips[0], str(wav)])
        .tokens
    )
    feats = extractor(clips, sampling_rate=16000, return_tensors="np")["input_features"].astype(np.float32)
    assert ours == reference_tokens(folder, request.prompt_ids, {"input_features": feats}, 12)
