"""`ortpipe serve` on folders whose requests make outputs rather than text, driven by the official `openai`
client: /v1/embeddings (a sentence-transformers folder) against sentence-transformers' embeddings,
/v1/audio/speech (VITS) against transformers' waveforms, /v1/images/generations (Stable Diffusion) against
the same request run through `pipe.generate` (itself checked against diffusers in test_loops.py)."""

from __future__ import annotations

import base64
import io
import json
import shutil
import subprocess
import sys
import wave
from pathlib import Path
from typing import Any

import numpy as np
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")

import ortpipe  # noqa: E402
from ortpipe.serve.engine import Engine  # noqa: E402
from ortpipe.targets.cpython.media import resample  # noqa: E402

from .test_serve import raw, served, until  # noqa: E402

EMBEDDING_TOLERANCE = 1e-5


def _json(path: Path) -> Any:
    return json.loads(path.read_text())


def post(url: str, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    status, text = raw(url, "POST", path, json.dumps(body).encode(), {"content-type": "application/json"})
    return status, json.loads(text)


def refused(url: str, path: str, body: dict[str, Any], status: int, param: str | None, words: str) -> None:
    got, answer = post(url, path, body)
    assert got == status, answer
    error = answer["error"]
    assert error["param"] == param and words in error["message"], error


# --- embeddings ----------------------------------------------------------------------------------------


def test_embeddings_equal_sentence_transformers(st_minilm: Path) -> None:
    inputs = _json(st_minilm / "references" / "inputs.json")
    expected = np.load(st_minilm / "references" / "embeddings.npy")
    tokens = int(np.sum(inputs["attention_mask"]))  # the reference tokenizer's ids, padding excluded
    with served(st_minilm, max_batch=2) as server:
        client = server.client()
        got = client.embeddings.create(model="st-minilm", input=inputs["texts"])  # the client asks for base64
        assert [d.index for d in got.data] == list(range(len(inputs["texts"])))
        vectors = np.array([d.embedding for d in got.data], dtype=np.float32)
        worst = float(np.abs(vectors - expected).max())
        print(f"/v1/embeddings: max |served - sentence-transformers| = {worst:.2e}")
        assert vectors.shape == expected.shape and worst <= EMBEDDING_TOLERANCE
        assert got.usage.prompt_tokens == got.usage.total_tokens == tokens
        assert got.model == "st-minilm"

        status, body = post(server.url, "/v1/embeddings",
                            {"model": "m", "input": inputs["texts"][2], "encoding_format": "float"})
        assert status == 200 and body["object"] == "list" and body["data"][0]["object"] == "embedding"
        assert np.abs(np.array(body["data"][0]["embedding"]) - expected[2]).max() <= EMBEDDING_TOLERANCE
        status, body = post(server.url, "/v1/embeddings",
                            {"model": "m", "input": ["A"], "encoding_format": "base64", "dimensions": 32})
        packed = np.frombuffer(base64.b64decode(body["data"][0]["embedding"]), "<f4")
        assert status == 200 and np.abs(packed - expected[1]).max() <= EMBEDDING_TOLERANCE

        url = server.url
        refused(url, "/v1/embeddings", {"model": "m", "input": ["a"], "dimensions": 8}, 400, "dimensions",
                "makes 32-dimensional embeddings")
        refused(url, "/v1/embeddings", {"model": "m", "input": [[1, 2]]}, 400, "input", "token ids")
        refused(url, "/v1/embeddings", {"model": "m", "input": []}, 400, "input", "empty array")
        refused(url, "/v1/embeddings", {"model": "m", "input": ["a", ""]}, 400, "input[1]", "empty string")
        refused(url, "/v1/embeddings", {"model": "m", "input": "a", "encoding_format": "int8"}, 400,
                "encoding_format", "Supported values are: 'float', 'base64'")
        refused(url, "/v1/embeddings", {"model": "m", "input": "a", "pooling": "max"}, 400, "pooling",
                "Unrecognized request argument")
        refused(url, "/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "hi"}]},
                404, None, "is an embedding model: it answers POST /v1/embeddings only")
        with pytest.raises(openai.NotFoundError, match="POST /v1/embeddings only"):
            client.completions.create(model="m", prompt="hi")
        metrics = server.metrics()
        assert metrics['ortpipe_requests_total{finish_reason="done"}'] == 3


# --- speech --------------------------------------------------------------------------------------------


def test_speech_equals_transformers_as_wav_and_24k_pcm(vits_tiny: Path) -> None:
    cases = _json(vits_tiny / "references" / "inputs.json")
    rate = _json(vits_tiny / "config.json")["sampling_rate"]
    with served(vits_tiny) as server:
        client = server.client()
        for case in cases["cases"]:
            expected = np.load(vits_tiny / "references" / case["waveform"])[0]  # transformers' VitsModel
            answer = client.audio.speech.create(model="vits", voice="default", input=case["text"],
                                                response_format="wav")
            with wave.open(io.BytesIO(answer.content)) as w:
                assert (w.getframerate(), w.getnchannels(), w.getsampwidth()) == (rate, 1, 2)
                samples = np.frombuffer(w.readframes(w.getnframes()), "<i2") / 32767
            clipped = np.clip(expected, -1, 1)
            worst = float(np.abs(samples - clipped).max())
            print(f"{case['text']!r}: {len(samples)} samples, max |served wav - transformers| = {worst:.2e}")
            assert len(samples) == case["samples"] and worst <= 1e-4 + 0.5 / 32767
        # pcm: OpenAI's raw 16-bit mono at 24 kHz, the waveform through the resampler wav files are read with
        text = cases["cases"][0]["text"]
        pcm = client.audio.speech.create(model="vits", voice="default", input=text, response_format="pcm")
        samples = np.frombuffer(pcm.content, "<i2") / 32767
        expected = resample(np.load(vits_tiny / "references" / cases["cases"][0]["waveform"])[0], rate, 24000)
        assert len(samples) == len(expected) == cases["cases"][0]["samples"] * 24000 // rate
        assert np.abs(samples - np.clip(expected, -1, 1)).max() <= 1e-4 + 0.5 / 32767
        default = client.audio.speech.create(model="vits", voice="default", input=text)
        assert default.content[:4] == b"RIFF", "without response_format: wav"

        speech = {"model": "m", "input": "hi"}
        for body, status, param, words in [
            ({**speech, "voice": "alloy"}, 400, "voice", "one voice: 'default'"),
            ({**speech, "response_format": "mp3"}, 400, "response_format", "it makes 'wav', 'pcm'"),
            ({**speech, "speed": 2.0}, 400, "speed", "must be 1"),
            ({**speech, "instructions": "whisper"}, 400, "instructions", "cannot steer"),
            ({**speech, "input": ""}, 400, "input", "empty string"),
            ({**speech, "input": "x" * 4097}, 400, "input", "maximum length 4096"),
        ]:
            refused(server.url, "/v1/audio/speech", body, status, param, words)
        refused(server.url, "/v1/images/generations", {"model": "m", "prompt": "a cat"}, 404, None,
                "is a text-to-speech model: it answers POST /v1/audio/speech only")


# --- images ----------------------------------------------------------------------------------------------


def test_images_equal_the_pipelines_and_a_seed_per_image(sd_tiny: Path) -> None:
    pipe = ortpipe.load(sd_tiny, threads=1)
    settings = {"num_steps": 3, "guidance_scale": 2.0, "negative_prompt": "blurry", "guidance_rescale": 0.5}

    def expected(seed: int) -> np.ndarray:
        image = pipe.generate("a red cube", seed=seed, **settings).image[0]
        return np.round(image * 255).astype(np.uint8)  # diffusers' numpy_to_pil

    def pixels(b64: str) -> np.ndarray:
        from PIL import Image

        with Image.open(io.BytesIO(base64.b64decode(b64))) as image:
            assert image.format == "PNG" and image.mode == "RGB"
            return np.asarray(image)

    extra = {"seed": 5, "num_inference_steps": 3, "guidance_scale": 2.0, "negative_prompt": "blurry",
             "guidance_rescale": 0.5}
    with served(sd_tiny, max_batch=2) as server:
        client = server.client()
        got = client.images.generate(model="sd", prompt="a red cube", n=2, size="32x32", extra_body=extra)
        assert len(got.data) == 2 and got.size == "32x32" and got.output_format == "png"
        assert np.array_equal(pixels(got.data[0].b64_json), expected(5))
        assert np.array_equal(pixels(got.data[1].b64_json), expected(6)), "image i draws from seed + i"
        again = client.images.generate(model="sd", prompt="a red cube", extra_body=extra)
        assert again.data[0].b64_json == got.data[0].b64_json

        image = {"model": "m", "prompt": "a"}
        for body, param, words in [
            ({**image, "size": "64x64"}, "size", "makes 32x32 images"),
            ({**image, "size": "big"}, "size", "WIDTHxHEIGHT"),
            ({**image, "response_format": "url"}, "response_format", "it makes 'b64_json'"),
            ({**image, "n": 11}, "n", "maximum value"),
            ({**image, "num_inference_steps": 0}, "num_inference_steps", "minimum value"),
            ({**image, "guidance_scale": 1.0, "negative_prompt": "x"}, None, "is used by guidance"),
            ({**image, "guidance_rescale": 2}, "guidance_rescale", "maximum value"),
            ({**image, "eta": 2}, "eta", "maximum value"),
            ({**image, "eta": 0.5}, None, "eta is DDIMScheduler's"),  # this folder's scheduler is Euler's
        ]:
            refused(server.url, "/v1/images/generations", body, 400, param, words)
        refused(server.url, "/v1/embeddings", {"model": "m", "input": "a"}, 404, None, "is an image model")


def test_eta_reaches_a_ddim_folders_pipeline(sd_tiny: Path, tmp_path: Path) -> None:
    folder = Path(shutil.copytree(sd_tiny, tmp_path / "sd", ignore=shutil.ignore_patterns("references")))
    config = folder / "scheduler" / "scheduler_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "_class_name": "DDIMScheduler"}))
    pipe = ortpipe.load(folder, threads=1)
    noisy = np.round(pipe.generate("a red cube", seed=3, num_steps=3, eta=0.7).image[0] * 255)
    plain = np.round(pipe.generate("a red cube", seed=3, num_steps=3).image[0] * 255)
    noisy, plain = noisy.astype(np.uint8), plain.astype(np.uint8)
    assert np.abs(noisy.astype(int) - plain).max() > 10  # eta's noise changes the image
    with served(folder) as server:
        got = server.client().images.generate(model="sd", prompt="a red cube",
                                               extra_body={"seed": 3, "num_inference_steps": 3, "eta": 0.7})
        assert np.array_equal(png_pixels(got.data[0].b64_json), noisy)


def form(fields: list[tuple[str, str | tuple[str, bytes]]]) -> tuple[bytes, str]:
    """A multipart/form-data body of text fields and (filename, bytes) files, and its content type."""
    boundary = "ortpipe-test-boundary"
    parts = []
    for name, value in fields:
        if isinstance(value, tuple):
            head = f'Content-Disposition: form-data; name="{name}"; filename="{value[0]}"\r\n' \
                   "Content-Type: image/png"
            parts.append(head.encode() + b"\r\n\r\n" + value[1])
        else:
            parts.append(f'Content-Disposition: form-data; name="{name}"\r\n\r\n{value}'.encode())
    body = b"".join(b"--" + boundary.encode() + b"\r\n" + p + b"\r\n" for p in parts)
    return body + b"--" + boundary.encode() + b"--\r\n", f"multipart/form-data; boundary={boundary}"


def png_pixels(b64: str) -> np.ndarray:
    from PIL import Image

    with Image.open(io.BytesIO(base64.b64decode(b64))) as image:
        assert image.format == "PNG" and image.mode == "RGB"
        return np.asarray(image)


def test_image_edits_equal_the_pipelines_image_to_image(sd_tiny: Path, tmp_path: Path) -> None:
    """POST /v1/images/edits through the `openai` client's images.edit (multipart: the PNG as a file,
    numbers as form text, diffusers' strength through extra_body) gives the images `pipe.generate` makes from
    the same file (itself checked against diffusers' img2img pipeline in test_image_to_image.py)."""
    from PIL import Image

    init = sd_tiny / "references" / "init.png"
    pipe = ortpipe.load(sd_tiny, threads=1)
    settings = {"num_steps": 4, "guidance_scale": 2.0, "negative_prompt": "blurry", "strength": 0.6}

    def expected(seed: int, **changed: Any) -> np.ndarray:
        image = pipe.generate("a red cube", images=[init], seed=seed, **{**settings, **changed}).image[0]
        return np.round(image * 255).astype(np.uint8)

    extra = {"seed": 5, "num_inference_steps": 4, "guidance_scale": 2.0, "negative_prompt": "blurry",
             "strength": 0.6}
    odd, huge, opaque_half = io.BytesIO(), io.BytesIO(), io.BytesIO()
    Image.new("RGBA", (16, 32), (0, 0, 0, 255)).save(opaque_half, "PNG")
    Image.new("RGB", (36, 32), (10, 200, 30)).save(odd, "PNG")
    Image.new("1", (4100, 8)).save(huge, "PNG")  # 4100 pixels wide in a few hundred bytes
    with served(sd_tiny, max_batch=2) as server:
        client = server.client()
        with init.open("rb") as file:
            got = client.images.edit(model="sd", image=file, prompt="a red cube", n=2, size="32x32",
                                     extra_body=extra)
        assert len(got.data) == 2 and got.size == "32x32" and got.output_format == "png"
        first = png_pixels(got.data[0].b64_json)
        assert np.array_equal(first, expected(5))
        assert np.array_equal(png_pixels(got.data[1].b64_json), expected(6)), "image i draws from seed + i"
        weaker = client.images.edit(model="sd", image=("init.png", init.read_bytes(), "image/png"),
                                    prompt="a red cube", extra_body={**extra, "strength": 0.3})
        assert np.array_equal(png_pixels(weaker.data[0].b64_json), expected(5, strength=0.3))
        assert not np.array_equal(png_pixels(weaker.data[0].b64_json), first), "strength reaches the loop"

        png = ("init.png", init.read_bytes())
        base = [("model", "m"), ("prompt", "a"), ("image", png)]
        for fields, status, param, words in [
            ([("model", "m"), ("prompt", "a")], 400, "image", "Missing required parameter"),
            ([*base, ("image[]", png)], 400, "image", "2 images were sent"),
            ([*base, ("mask", png)], 400, "mask", "has no alpha channel: the region to edit is its fully"),
            ([*base, ("mask", ("m.png", opaque_half.getvalue()))], 400, "mask",
             "it is 16x32 pixels, the image"),
            ([*base, ("mask", "m")], 400, "mask", "expected a file"),
            ([*base, ("input_fidelity", "high")], 400, "input_fidelity", "send 'strength'"),
            ([*base, ("size", "64x64")], 400, "size", "keeps the image's size, 32x32"),
            ([*base, ("strength", "0")], 400, "strength", "redraws nothing"),
            ([*base, ("strength", "1.5")], 400, "strength", "maximum value"),
            ([*base, ("strength", "much")], 400, "strength", "expected a decimal"),
            ([*base, ("n", "two")], 400, "n", "expected an integer"),
            ([*base, ("n", "1"), ("n", "2")], 400, "n", "given 2 times"),
            ([("model", "m"), ("prompt", ("p.txt", b"a")), ("image", png)], 400, "prompt", "not a file"),
            ([*base, ("colour", "red")], 400, "colour", "Unrecognized request argument"),
            ([*base, ("response_format", "url")], 400, "response_format", "it makes 'b64_json'"),
            ([("model", "m"), ("prompt", "a"), ("image", ("x.png", b"not a png"))], 400, "image",
             "is not an image Pillow can decode"),
            ([("model", "m"), ("prompt", "a"), ("image", ("huge.png", huge.getvalue()))], 400, "image",
             "huge.png is 4100x8 pixels: images of up to 4096 pixels a side are taken"),
            ([("model", "m"), ("prompt", "a"), ("image", ("odd.png", odd.getvalue()))], 400, None,
             "multiples of 8 (4 pixels per latent times 2"),
        ]:
            body, kind = form(fields)
            status_got, text = raw(server.url, "POST", "/v1/images/edits", body, {"content-type": kind})
            error = json.loads(text)["error"]
            assert status_got == status and error["param"] == param and words in error["message"], error
        refused(server.url, "/v1/images/edits", {"model": "m", "prompt": "a"}, 400, None,
                "takes multipart/form-data")
        body, kind = form(base)
        status_got, text = raw(server.url, "POST", "/v1/images/edits", body[:-12], {"content-type": kind})
        assert status_got == 400 and "does not end with its boundary" in json.loads(text)["error"]["message"]


def test_an_edit_with_a_mask_is_inpainting(sd_tiny: Path) -> None:
    """OpenAI's mask (fully transparent pixels: the region to edit) through the client's images.edit: the
    image pipe.generate inpaints with the same region as its mask (white repaints), at strength 1 (the
    default with a mask) and at 0.6."""
    from PIL import Image

    references = sd_tiny / "references"
    init, drawn = references / "init.png", references / "mask.png"
    with Image.open(drawn) as opened:
        repaint = np.asarray(opened.convert("L")) >= 128
    alpha = np.where(repaint, 0, 255).astype(np.uint8)
    mask = io.BytesIO()
    Image.fromarray(np.dstack([np.full((32, 32, 3), 90, np.uint8), alpha]), "RGBA").save(mask, "PNG")
    pipe = ortpipe.load(sd_tiny, threads=1)
    with served(sd_tiny) as server:
        client = server.client()
        for strength in (None, 0.6):
            extra = {"seed": 3, "num_inference_steps": 4, **({"strength": strength} if strength else {})}
            got = client.images.edit(model="sd", image=("init.png", init.read_bytes(), "image/png"),
                                     mask=("mask.png", mask.getvalue(), "image/png"), prompt="a red cube",
                                     extra_body=extra)
            expected = pipe.generate("a red cube", images=[init], mask=drawn, seed=3, num_steps=4,
                                     strength=strength)
            assert np.array_equal(png_pixels(got.data[0].b64_json),
                                  np.round(expected.image[0] * 255).astype(np.uint8)), strength
            plain = pipe.generate("a red cube", images=[init], seed=3, num_steps=4, strength=strength or 1.0)
            assert np.abs(plain.image - expected.image).max() > 1e-2  # the mask made another image


def test_an_edit_on_a_folder_without_an_image_encoder_says_so(sd_tiny: Path, tmp_path: Path) -> None:
    folder = Path(shutil.copytree(sd_tiny, tmp_path / "sd", ignore=shutil.ignore_patterns("vae_encoder")))
    body, kind = form([("model", "m"), ("prompt", "a"),
                       ("image", ("init.png", (sd_tiny / "references" / "init.png").read_bytes()))])
    with served(folder) as server:
        status, text = raw(server.url, "POST", "/v1/images/edits", body, {"content-type": kind})
    assert status == 400 and "has no image encoder" in json.loads(text)["error"]["message"]


def test_a_client_that_leaves_mid_image_frees_its_row(sd_tiny: Path) -> None:
    """An image of 1000 slowed steps is left by its client (a timeout): its row is freed at the next step and
    the next request is answered at once."""
    with served(sd_tiny, max_batch=1, delay=0.02) as server:
        client = server.client(max_retries=0)
        long = {"seed": 1, "num_inference_steps": 1000}
        with pytest.raises(openai.APITimeoutError):
            # 3 s: started well before its client leaves, on a loaded machine too (1000 steps take 20 s)
            client.with_options(timeout=3.0).images.generate(model="sd", prompt="a", extra_body=long)
        until(lambda: server.metrics()["ortpipe_batch_rows"] == 0, timeout=5)
        got = client.images.generate(model="sd", prompt="a", extra_body={"seed": 1, "num_inference_steps": 2})
        assert len(got.data) == 1
        metrics = server.metrics()
    assert metrics['ortpipe_requests_total{finish_reason="interrupt"}'] == 1
    assert metrics['ortpipe_requests_total{finish_reason="done"}'] == 1


# --- what no endpoint fits -------------------------------------------------------------------------------


def test_a_folder_whose_outputs_no_endpoint_sends_ends_the_server_at_load(
    vits_tiny: Path, tmp_path: Path
) -> None:
    """Tensor outputs (the VITS folder's waveform declared a plain tensor) are refused when the folder loads,
    naming what to run instead; so is the CLI's serve."""
    folder = Path(shutil.copytree(vits_tiny, tmp_path / "vits", ignore=shutil.ignore_patterns("references")))
    report = subprocess.run(
        [sys.executable, "-m", "ortpipe.cli", "inspect", str(folder), "--json"],
        capture_output=True,
        text=True,
        check=True,
    )
    config = json.loads(report.stdout)["config"]
    config["pipeline"]["output"] = [{"session": "model", "name": "waveform", "as": "tensor"}]
    (folder / "genai_config.json").write_text(json.dumps(config))
    engine = Engine(lambda: ortpipe.load(folder, threads=1))
    engine.start()
    engine.stop(30)
    assert isinstance(engine.error, ortpipe.ConfigError)
    assert "this folder's outputs are tensor: run it with ortpipe run --out" in str(engine.error)
