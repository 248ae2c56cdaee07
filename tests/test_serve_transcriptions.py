"""POST /v1/audio/transcriptions on onnxruntime-genai's builder export of a tiny Whisper, driven by the
official `openai` client: the text equals what `pipe.generate` makes of the same WAV file (whose tokens equal
transformers' on WhisperFeatureExtractor's features: test_whisper.py), and what the server does not do is
refused naming the parameter."""

from __future__ import annotations

import json
import shutil
import wave
from pathlib import Path

import numpy as np
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")

from build.hfmodels import WHISPER_START_ID  # noqa: E402

import ortpipe  # noqa: E402

from .test_serve import raw, served  # noqa: E402
from .test_serve_outputs import form  # noqa: E402

PATH = "/v1/audio/transcriptions"


def started(whisper_builder: Path, tmp_path: Path) -> Path:
    """The builder's folder with the decoder start token its config leaves out (genai's users pass it)."""
    folder = Path(shutil.copytree(whisper_builder, tmp_path / "whisper"))
    config = json.loads((folder / "genai_config.json").read_text())
    config["model"]["decoder_start_token_id"] = WHISPER_START_ID
    (folder / "genai_config.json").write_text(json.dumps(config))
    return folder


def clip(path: Path, seconds: float, seed: int, rate: int = 16000) -> Path:
    samples = 0.2 * np.random.default_rng(seed).standard_normal(int(rate * seconds))
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1), w.setsampwidth(2), w.setframerate(rate)
        w.writeframes((samples * 32767).astype(np.int16).tobytes())
    return path


def posted(url: str, fields: list[tuple[str, str | tuple[str, bytes]]]) -> tuple[int, dict]:
    body, kind = form(fields)
    status, text = raw(url, "POST", PATH, body, {"content-type": kind})
    return status, json.loads(text)


def test_transcriptions_equal_the_pipelines_text(whisper_builder: Path, tmp_path: Path) -> None:
    folder = started(whisper_builder, tmp_path)
    clips = [clip(tmp_path / "a.wav", 1.5, 0), clip(tmp_path / "b.wav", 3.0, 1, rate=8000)]  # b: resampled
    pipe = ortpipe.load(folder, threads=1)
    expected = [pipe.generate(prompt_ids=[WHISPER_START_ID], audios=[str(c)]) for c in clips]
    assert expected[0].text != expected[1].text  # the audio decides the text
    with served(folder) as server:
        client = server.client()
        for path, result in zip(clips, expected, strict=True):
            with path.open("rb") as f:
                got = client.audio.transcriptions.create(model="whisper", file=f)
            assert got.text == result.text
            assert (got.usage.type, got.usage.input_tokens, got.usage.output_tokens) == (
                "tokens", 1, len(result.tokens))
        with clips[0].open("rb") as f:
            assert client.audio.transcriptions.create(model="whisper", file=f, response_format="text") == \
                expected[0].text
        with clips[0].open("rb") as f:  # temperature 0 is greedy, as without it
            assert client.audio.transcriptions.create(model="whisper", file=f, temperature=0).text == \
                expected[0].text

        wav = ("a.wav", clips[0].read_bytes())
        slow = ("slow.wav", clip(tmp_path / "slow.wav", 9.0, 2, rate=10).read_bytes())  # 90 samples at 10 Hz
        long = ("long.wav", clip(tmp_path / "long.wav", 31.0, 3, rate=8000).read_bytes())
        for fields, status, param, words in [
            ([("model", "m")], 400, "file", "Missing required parameter: 'file'"),
            ([("file", wav)], 400, "model", "Missing required parameter: 'model'"),
            ([("model", "m"), ("file", ("a.mp3", b"ID3\x03\x00garbage"))], 400, "file",
             "'a.mp3' is not a PCM WAV file"),
            ([("model", "m"), ("file", slow)], 400, "file", "at 10 Hz, which is no audio rate"),
            ([("model", "m"), ("file", long)], 400, "file", "is 31.0 s of audio, and this model hears its "
             "first 30 s (the feature extractor's chunk_length): the rest would not be heard. Cut the clip"),
            ([("model", "m"), ("file", wav), ("language", "en")], 400, "language", "names no languages"),
            ([("model", "m"), ("file", wav), ("prompt", "earlier")], 400, "prompt", "previous text"),
            ([("model", "m"), ("file", wav), ("response_format", "srt")], 400, "response_format",
             "makes no timestamps"),
            ([("model", "m"), ("file", wav), ("response_format", "xml")], 400, "response_format",
             "Supported values are"),
            ([("model", "m"), ("file", wav), ("stream", "true")], 400, "stream", "send false"),
            ([("model", "m"), ("file", wav), ("temperature", "1.5")], 400, "temperature", "maximum value"),
            ([("model", "m"), ("file", wav), ("temperature", "warm")], 400, "temperature", "a decimal"),
            ([("model", "m"), ("file", wav), ("temperature", "nan")], 400, "temperature", "a decimal"),
            ([("model", "m"), ("file", wav), ("beam_size", "5")], 400, "beam_size",
             "Unrecognized request argument supplied: beam_size"),
            ([("model", "m"), ("file", wav), ("file", wav)], 400, "file", "given 2 times"),
        ]:
            got_status, answer = posted(server.url, fields)
            assert got_status == status and answer["error"]["param"] == param, answer
            assert words in answer["error"]["message"], answer
        with pytest.raises(openai.BadRequestError, match="send the audio to POST /v1/audio/transcriptions"):
            client.completions.create(model="whisper", prompt="hello", max_tokens=4)


def test_a_folder_that_cannot_transcribe_says_why(whisper_builder: Path, vits_tiny: Path,
                                                   tmp_path: Path) -> None:
    wav = ("a.wav", clip(tmp_path / "a.wav", 1.0, 0).read_bytes())
    demo = Path(__file__).resolve().parent.parent / "models" / "demo"
    with served(demo) as server:  # a text model: no session reads audio
        status, answer = posted(server.url, [("model", "m"), ("file", wav)])
        assert status == 400 and answer["error"]["param"] == "file", answer
        assert "audio" in answer["error"]["message"], answer
    with served(whisper_builder) as server:  # the builder's own config: no start token
        status, answer = posted(server.url, [("model", "m"), ("file", wav)])
        assert status == 500 and "sets no decoder start token" in answer["error"]["message"], answer
    with served(vits_tiny) as server:  # a folder that makes speech answers its own endpoint only
        status, answer = posted(server.url, [("model", "m"), ("file", wav)])
        assert status == 404 and "POST /v1/audio/speech only" in answer["error"]["message"], answer


def test_a_clip_longer_than_the_model_hears_is_warned_of(whisper_builder: Path, tmp_path: Path) -> None:
    """The library reads the seconds the feature extractor keeps and warns of the rest (a server refuses the
    upload: above); a clip within them is read without a word."""
    import warnings

    pipe = ortpipe.load(started(whisper_builder, tmp_path), threads=1)
    long, short = clip(tmp_path / "long.wav", 31.5, 3, rate=8000), clip(tmp_path / "short.wav", 2.0, 3)
    with pytest.warns(UserWarning, match=r"long.wav is 31.5 s of audio, and this model hears its first 30 s"):
        pipe.generate(prompt_ids=[WHISPER_START_ID], audios=[str(long)], max_new_tokens=2)
    with pytest.warns(UserWarning, match="the audio clip is 40.0 s of audio"):
        silence = np.zeros(16000 * 40, np.float32)
        pipe.generate(prompt_ids=[WHISPER_START_ID], audios=[silence], max_new_tokens=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pipe.generate(prompt_ids=[WHISPER_START_ID], audios=[str(short)], max_new_tokens=2)
