"""The single_pass and denoising loops (issue 16) on the folders of build/paradigms.py, against the torch
references saved with them (sentence-transformers, transformers' VitsModel, diffusers'
StableDiffusionPipeline) and against the plain onnxruntime loops of tests/paradigm_refs.py.

The tolerances are the issue's: embeddings 1e-5, waveforms 1e-4, images 1e-3 (float, before uint8).
EulerAncestral and LCM add noise at each step, which ortpipe draws from its own seeded generator: those
cases are compared with the plain loop given the same noise (the plain loop is shown equal to diffusers with
injected noise in test_paradigm_models.py), and the deterministic ones with diffusers' images as well.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from build import paradigms

import ortpipe
from ortpipe.errors import ConfigError, GenerationError
from tests import diffusers_folders as folders
from tests import paradigm_refs as refs

EMBEDDING_TOLERANCE, WAVEFORM_TOLERANCE, IMAGE_TOLERANCE = 1e-5, 1e-4, 1e-3
SD_CASES = [case[0] for case in paradigms.SD_CASES]


def _json(path: Path) -> dict:
    return json.loads(path.read_text())


# --- sentence embeddings -------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("fixture", ["st_minilm", "st_minilm_cls", "st_minilm_nonorm"])
def test_embeddings_equal_sentence_transformers_and_the_plain_loop(fixture: str,
                                                                   request: pytest.FixtureRequest) -> None:
    folder = request.getfixturevalue(fixture)
    inputs = _json(folder / "references" / "inputs.json")
    expected = np.load(folder / "references" / "embeddings.npy")
    plain = refs.embed(folder, {k: np.array(inputs[k], dtype=np.int64)
                                for k in ("input_ids", "attention_mask", "token_type_ids")})
    pipe = ortpipe.load(folder, threads=1)
    got = pipe.embed(inputs["texts"])
    assert got.shape == expected.shape == (5, 32) and got.dtype == np.float32
    worst = float(np.abs(got - expected).max())
    print(f"{fixture}: max |ortpipe - sentence-transformers| = {worst:.2e}, "
          f"|ortpipe - plain loop| = {np.abs(got - plain).max():.2e}")
    assert worst <= EMBEDDING_TOLERANCE
    assert np.abs(got - plain).max() <= EMBEDDING_TOLERANCE
    # batches of two, longest first, put back in order; one text alone; the single-pass request API
    assert np.abs(pipe.embed(inputs["texts"], batch_size=2) - expected).max() <= EMBEDDING_TOLERANCE
    assert np.abs(pipe.embed(inputs["texts"][3]) - expected[3]).max() <= EMBEDDING_TOLERANCE
    result = pipe.generate(inputs["texts"][2])
    assert result.kinds == {"last_hidden_state": {"kind": "embedding"}}
    assert np.abs(result.outputs["last_hidden_state"][0] - expected[2]).max() <= EMBEDDING_TOLERANCE


def test_feature_extraction_folder_embeds_as_sentence_transformers(st_tjs: Path, st_minilm_nonorm: Path,
                                                                   st_minilm: Path, st_minilm_cls: Path,
                                                                   llama_concat: Path) -> None:
    """A folder with an encoder graph and no modules.json (transformers.js's and optimum's
    feature-extraction exports) is detected from its graph (last_hidden_state, no logits): mean pooling,
    not normalised, which is what sentence-transformers makes of a plain transformers model
    (st-minilm-nonorm's references). A decoder folder without genai_config.json stays a decoder."""
    pipe = ortpipe.load(st_tjs, threads=1)
    assert pipe.config.generation.loop == "single_pass" and list(pipe.config.pipeline.sessions) == ["encoder"]
    assert "an encoder" in pipe.config.metadata["detected_from"]
    inputs = _json(st_minilm_nonorm / "references" / "inputs.json")
    expected = np.load(st_minilm_nonorm / "references" / "embeddings.npy")
    assert np.abs(pipe.embed(inputs["texts"]) - expected).max() <= EMBEDDING_TOLERANCE
    assert ortpipe.load(llama_concat, threads=1).config.generation.loop == "autoregressive"
    # a request's pooling and normalize, as transformers.js's pipeline takes them: the same graph's other
    # sentence-transformers folders (mean + Normalize; CLS + Normalize) are the references
    cases = ((st_minilm, {"normalize": True}), (st_minilm_cls, {"pooling": "cls", "normalize": True}))
    for folder, options in cases:
        reference = np.load(folder / "references" / "embeddings.npy")
        assert np.abs(pipe.embed(inputs["texts"], **options) - reference).max() <= EMBEDDING_TOLERANCE
    normalised = ortpipe.load(st_minilm, threads=1)
    assert np.abs(normalised.embed(inputs["texts"], normalize=False) - expected).max() <= EMBEDDING_TOLERANCE
    with pytest.raises(GenerationError, match="pooling must be one of mean, cls, max, lasttoken"):
        pipe.embed("x", pooling="sum")
    with pytest.raises(GenerationError, match="normalize must be true or false"):
        pipe.embed("x", normalize="yes")
    done = subprocess.run([sys.executable, "-m", "ortpipe.cli", "embed", str(st_tjs), *inputs["texts"],
                           "--pooling", "cls", "--normalize", "--json"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    cls = np.load(st_minilm_cls / "references" / "embeddings.npy")
    assert np.abs(np.array(json.loads(done.stdout)["embeddings"]) - cls).max() <= EMBEDDING_TOLERANCE


def test_embedding_ids_and_truncation_follow_the_tokenizer(st_minilm: Path) -> None:
    """The rows ortpipe feeds are sentence-transformers' (padding to the longest), and a text longer than the
    folder's 128 tokens is cut as the tokenizer's own truncation cuts it (special tokens kept)."""
    from tokenizers import Tokenizer

    from ortpipe.folder import LocalFolder
    from ortpipe.loops.text import encode_texts, text_inputs

    pipe = ortpipe.load(st_minilm, threads=1)
    inputs = _json(st_minilm / "references" / "inputs.json")
    rows = encode_texts(pipe.tokenizer, inputs["texts"], pipe.model.loop.text.max_length)
    feeds, mask = text_inputs(pipe.plan, pipe.model.backend, rows, pipe.model.loop.text)
    assert feeds["input_ids"].tolist() == inputs["input_ids"]
    assert mask.tolist() == feeds["attention_mask"].tolist() == inputs["attention_mask"]
    assert feeds["token_type_ids"].tolist() == inputs["token_type_ids"]
    long = " ".join(["the parser keeps every field it reads"] * 40)
    reference = Tokenizer.from_file(str(st_minilm / "tokenizer.json"))
    reference.enable_truncation(128)
    assert encode_texts(pipe.tokenizer, [long], 128)[0] == reference.encode(long).ids
    assert LocalFolder(st_minilm).exists("tokenizer.json")
    assert pipe.embed(long).shape == (32,)


# --- text to speech ------------------------------------------------------------------------------

def test_speech_equals_transformers_and_the_plain_loop(vits_tiny: Path) -> None:
    pipe = ortpipe.load(vits_tiny, threads=1)
    for case in _json(vits_tiny / "references" / "inputs.json")["cases"]:
        expected = np.load(vits_tiny / "references" / case["waveform"])
        ids = pipe.tokenizer.encode(case["text"])
        assert ids == refs.vits_ids(vits_tiny, case["text"]) == case["input_ids"]
        audio = pipe.speak(case["text"])
        assert audio.sampling_rate == 16000 and audio.samples.shape == (case["samples"],)
        worst = float(np.abs(audio.samples - expected[0]).max())
        print(f"{case['text']!r}: max |ortpipe - transformers| = {worst:.2e}")
        assert worst <= WAVEFORM_TOLERANCE
        assert np.abs(audio.samples - refs.speak(vits_tiny, case["input_ids"])[0]).max() <= WAVEFORM_TOLERANCE
    ids = refs.vits_ids(vits_tiny, "Hi")
    assert np.array_equal(pipe.generate(prompt_ids=ids).audio, refs.speak(vits_tiny, ids))


def test_transformers_js_vits_folder_speaks_as_transformers(vits_tiny: Path, vits_tjs: Path,
                                                           tmp_path: Path) -> None:
    """transformers.js's converted VITS folder: a tokenizer.json whose model is a bare vocabulary (the Rust
    tokenizers cannot read it) and no vocab.json. The core's VITS tokenizer reads that vocabulary."""
    from tokenizers import Tokenizer

    assert not (vits_tjs / "vocab.json").exists()
    with pytest.raises(Exception, match="ModelUntagged"):
        Tokenizer.from_file(str(vits_tjs / "tokenizer.json"))
    pipe = ortpipe.load(vits_tjs, threads=1)
    for case in _json(vits_tiny / "references" / "inputs.json")["cases"]:
        assert pipe.tokenizer.encode(case["text"]) == case["input_ids"]
        expected = np.load(vits_tiny / "references" / case["waveform"])[0]
        assert np.abs(pipe.speak(case["text"]).samples - expected).max() <= WAVEFORM_TOLERANCE
    broken = Path(shutil.copytree(vits_tjs, tmp_path / "broken"))
    tokenizer = _json(broken / "tokenizer.json")
    (broken / "tokenizer.json").write_text(json.dumps({**tokenizer, "model": {"vocab": [["a", 0.0]]}}))
    with pytest.raises(ConfigError, match=r"tokenizer.json's model.vocab must map tokens to ids"):
        ortpipe.load(broken)
    (broken / "tokenizer.json").write_text(json.dumps({**tokenizer, "model": {"vocab": {"a": 0, "b": 1}}}))
    shutil.copy2(vits_tiny / "vocab.json", broken / "vocab.json")
    with pytest.raises(ConfigError, match="vocab.json and .*model.vocab map tokens to different ids"):
        ortpipe.load(broken)
    (broken / "tokenizer.json").unlink()
    (broken / "vocab.json").unlink()
    with pytest.raises(ConfigError, match="names VitsTokenizer, and neither vocab.json nor tokenizer.json"):
        ortpipe.load(broken)


def test_vits_tokenizer_follows_transformers(vits_tiny: Path) -> None:
    from transformers import VitsTokenizer

    reference = VitsTokenizer.from_pretrained(str(vits_tiny))
    pipe = ortpipe.load(vits_tiny, threads=1)
    for text in ["Hello, World!", "  it's a TEST-case  ", "ünïcode 42 <pad> x", ""]:
        assert pipe.tokenizer.encode(text) == reference(text).input_ids, text


# --- images --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def sd_cases(sd_tiny: Path) -> dict[str, dict]:
    return {case["name"]: case for case in _json(sd_tiny / "references" / "cases.json")["cases"]}


@pytest.fixture(scope="module")
def sd_copy(sd_tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """sd-tiny without its references: a folder whose scheduler config a test may rewrite."""
    return Path(shutil.copytree(sd_tiny, tmp_path_factory.mktemp("sd") / "sd-tiny",
                                ignore=shutil.ignore_patterns("references")))


def _with_scheduler(folder: Path, scheduler: dict) -> Path:
    (folder / "scheduler" / "scheduler_config.json").write_text(json.dumps(scheduler))
    return folder


def _case_request(case: dict) -> dict:
    guided = case["guidance_scale"] > 1
    return {"num_steps": case["num_inference_steps"], "guidance_scale": case["guidance_scale"],
            "negative_prompt": case["negative_prompt"] if guided else None,
            "guidance_rescale": case["guidance_rescale"], **({"eta": case["eta"]} if case["eta"] else {})}


@pytest.mark.slow
@pytest.mark.parametrize("name", SD_CASES)
def test_images_equal_diffusers_and_the_plain_loop(name: str, sd_tiny: Path, sd_copy: Path,
                                                   sd_cases: dict[str, dict]) -> None:
    case = sd_cases[name]
    pipe = ortpipe.load(_with_scheduler(sd_copy, case["scheduler"]), threads=1)
    latents = np.load(sd_tiny / "references" / case["latents"])
    result = pipe.generate(case["prompt"], latents=latents, seed=7, **_case_request(case))
    # one UNet run a timestep of diffusers' schedule (PNDM's PLMS runs its second timestep twice)
    assert result.finish_reason == "done" and result.timings.steps == len(case["timesteps"])
    _, noise = folders.ortpipe_noise(pipe, case, 7, latents=True)
    plain, _ = refs.generate_image(sd_copy, case["scheduler"], case["num_inference_steps"], latents,
                                   prompt_ids=case["prompt_ids"],
                                   negative_prompt_ids=case["negative_prompt_ids"],
                                   guidance_scale=case["guidance_scale"],
                                   guidance_rescale=case["guidance_rescale"], noise=noise, eta=case["eta"])
    to_plain = float(np.abs(result.image - plain).max())
    assert result.image.shape == (1, 32, 32, 3)
    assert to_plain <= IMAGE_TOLERANCE
    if case["noise_draws"] == 0:  # diffusers drew no noise: its image is the reference itself
        to_diffusers = float(np.abs(result.image - np.load(sd_tiny / "references" / case["image"])).max())
        print(f"{name}: max |ortpipe - diffusers| = {to_diffusers:.2e}, |ortpipe - plain loop| = "
              f"{to_plain:.2e}")
        assert to_diffusers <= IMAGE_TOLERANCE
    else:
        print(f"{name}: max |ortpipe - plain loop with ortpipe's noise| = {to_plain:.2e}")


def test_guidance_rescale_is_what_makes_its_image(sd_tiny: Path, sd_copy: Path,
                                                  sd_cases: dict[str, dict]) -> None:
    """The rescaled case's image is diffusers' only with its guidance_rescale: without it, far off."""
    case = sd_cases["ddim-v-trailing-zsnr-cfg-rescale"]
    assert case["guidance_rescale"] == 0.7
    pipe = ortpipe.load(_with_scheduler(sd_copy, case["scheduler"]), threads=1)
    latents = np.load(sd_tiny / "references" / case["latents"])
    expected = np.load(sd_tiny / "references" / case["image"])
    plain = pipe.generate(case["prompt"], latents=latents, **{**_case_request(case), "guidance_rescale": 0.0})
    rescaled = pipe.generate(case["prompt"], latents=latents, **_case_request(case))
    assert np.abs(rescaled.image - expected).max() <= IMAGE_TOLERANCE
    assert np.abs(plain.image - expected).max() > 100 * IMAGE_TOLERANCE


def test_a_seed_makes_the_latents_and_the_noise(sd_copy: Path, sd_cases: dict[str, dict]) -> None:
    """Without latents the seed draws them, then each noisy step's noise: the plain loop given those draws
    gives the same image; the same seed gives the same image again, another seed another image."""
    case = sd_cases["euler_a-eps-leading"]
    pipe = ortpipe.load(_with_scheduler(sd_copy, case["scheduler"]), threads=1)
    result = pipe.generate(case["prompt"], seed=11, **_case_request(case))
    first, noise = folders.ortpipe_noise(pipe, case, 11, latents=False)
    plain, _ = refs.generate_image(sd_copy, case["scheduler"], case["num_inference_steps"], first,
                                   prompt_ids=case["prompt_ids"], noise=noise)
    assert np.abs(result.image - plain).max() <= IMAGE_TOLERANCE
    assert np.array_equal(pipe.generate(case["prompt"], seed=11, **_case_request(case)).image, result.image)
    other = pipe.generate(case["prompt"], seed=12, **_case_request(case)).image
    assert np.abs(other - result.image).max() > 0.1


FP16_IMAGE_TOLERANCE = 5e-3  # float16 graphs against diffusers' float32 image (fp16 rounding)


@pytest.fixture(scope="module")
def sd_fp16(sd_tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """sd-tiny with every graph in float16 inputs, weights and outputs (onnxruntime's float16 converter, as
    fp16 exports for WebGPU are made; Resize kept in float32 as the converter's users do)."""
    import onnx
    from onnxruntime.transformers.float16 import DEFAULT_OP_BLOCK_LIST, convert_float_to_float16

    folder = Path(shutil.copytree(sd_tiny, tmp_path_factory.mktemp("sd16") / "sd-fp16",
                                  ignore=shutil.ignore_patterns("references")))
    for part in ("text_encoder", "unet", "vae_decoder", "vae_encoder"):
        path = folder / part / "model.onnx"
        half = convert_float_to_float16(onnx.load(path), keep_io_types=False,
                                        op_block_list=[*DEFAULT_OP_BLOCK_LIST, "Resize"])
        onnx.save(half, path)
    return folder


@pytest.mark.parametrize("name", ["ddim-eps-leading-cfg", "dpm-v-trailing"])
def test_float16_graphs_give_diffusers_image(name: str, sd_fp16: Path, sd_tiny: Path,
                                             sd_cases: dict[str, dict]) -> None:
    """A float16 UNet, text encoder and VAE: the scheduler still runs in float32 between the UNet's runs (the
    kernels cast its sample in and its prediction out), so the image is diffusers' float32 one up to float16
    rounding, and the float32 folder's up to the same."""
    import onnx

    unet = onnx.load(sd_fp16 / "unet" / "model.onnx", load_external_data=False)
    types = {i.name: i.type.tensor_type.elem_type for i in unet.graph.input}
    assert types["sample"] == onnx.TensorProto.FLOAT16
    case = sd_cases[name]
    folder = _with_scheduler(sd_fp16, case["scheduler"])
    latents = np.load(sd_tiny / "references" / case["latents"])
    half = ortpipe.load(folder, threads=1).generate(case["prompt"], latents=latents, **_case_request(case))
    expected = np.load(sd_tiny / "references" / case["image"])
    to_diffusers = float(np.abs(half.image - expected).max())
    print(f"{name}: float16 graphs, max |ortpipe - diffusers float32| = {to_diffusers:.2e}")
    assert half.image.dtype == np.float32 and half.image.shape == expected.shape
    assert to_diffusers <= FP16_IMAGE_TOLERANCE
    assert to_diffusers > 0, "float16 graphs ran: the image is not bit-equal to float32's"


def test_the_seeds_config_with_real_tensor_names(sd_tiny: Path, sd_copy: Path, sd_cases: dict[str, dict],
                                                 tmp_path: Path) -> None:
    """The design's section 12.3 diffusion config, with optimum's tensor names and a scheduler named by the
    seed's snake-case name, runs the folder as detection does."""
    case = sd_cases["ddim-eps-linspace"]
    folder = Path(shutil.copytree(_with_scheduler(sd_copy, case["scheduler"]), tmp_path / "sd"))
    config = {"version": 2,
              "pipeline": {"sessions": {"text_encoder": {"file": "text_encoder/model.onnx"},
                                        "unet": {"file": "unet/model.onnx"},
                                        "vae_decoder": {"file": "vae_decoder/model.onnx"}},
                           "flow": [{"run": "text_encoder", "when": "init"}, {"run": "unet", "when": "step"},
                                    {"run": "vae_decoder", "when": "final"}],
                           "dataflow": [{"from": "text_encoder.last_hidden_state",
                                         "to": "unet.encoder_hidden_states"},
                                        {"from": "unet.out_sample", "to": "vae_decoder.latent_sample"}],
                           "output": {"session": "vae_decoder", "name": "sample", "as": "image"},
                           "preprocessing": {"text": {"tokenizer": "tokenizer"}}},
              "generation": {"loop": "denoising", "num_steps": 5, "scheduler": "ddim", "guidance_scale": 1.0}}
    (folder / "genai_config.json").write_text(json.dumps(config))
    (folder / "scheduler" / "scheduler_config.json").unlink()  # DDIM's defaults, as diffusers has them
    pipe = ortpipe.load(folder, threads=1)
    assert pipe.config.source == "v2" and pipe.model.loop.denoising.scheduler["clip_sample"] is True
    latents = np.load(sd_tiny / "references" / case["latents"])
    defaults = dict(pipe.model.loop.denoising.scheduler)  # DDIM's defaults: linear betas, clip_sample
    plain, _ = refs.generate_image(folder, defaults, 5, latents, prompt_ids=case["prompt_ids"])
    assert np.abs(pipe.generate(case["prompt"], latents=latents).image - plain).max() <= IMAGE_TOLERANCE


def test_image_cli_writes_png_npy_and_json(sd_copy: Path, sd_cases: dict[str, dict], sd_tiny: Path,
                                           tmp_path: Path) -> None:
    case = sd_cases["euler-eps-linspace"]
    _with_scheduler(sd_copy, case["scheduler"])
    np.save(tmp_path / "latents.npy", np.load(sd_tiny / "references" / case["latents"]))
    command = [sys.executable, "-m", "ortpipe.cli", "run", str(sd_copy), "--prompt", case["prompt"],
               "--num-steps", "4", "--guidance-scale", "1", "--input", f"latents={tmp_path / 'latents.npy'}",
               "--out", str(tmp_path / "image.png"), "--out", f"sample={tmp_path / 'image.npy'}", "--json"]
    done = subprocess.run(command, capture_output=True, text=True, env={**os.environ})
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["outputs"]["sample"] == {"kind": "image", "dtype": "float32", "shape": [1, 32, 32, 3],
                                           "files": [str(tmp_path / "image.png"),
                                                     str(tmp_path / "image.npy")]}
    assert report["timings"]["steps"] == 4 and report["finish_reason"] == "done"
    expected = np.load(sd_tiny / "references" / case["image"])
    assert np.abs(np.load(tmp_path / "image.npy") - expected).max() <= IMAGE_TOLERANCE
    from PIL import Image

    png = np.asarray(Image.open(tmp_path / "image.png"))
    assert png.shape == (32, 32, 3) and np.abs(png.astype(int) - np.round(expected[0] * 255)).max() <= 1


def test_speech_and_embedding_cli(vits_tiny: Path, st_minilm: Path, tmp_path: Path) -> None:
    import wave

    wav = tmp_path / "speech.wav"
    done = subprocess.run([sys.executable, "-m", "ortpipe.cli", "run", str(vits_tiny), "--prompt",
                           "Hello world.", "--out", str(wav)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    with wave.open(str(wav)) as w:
        assert (w.getframerate(), w.getnchannels(), w.getnframes()) == (16000, 1, 464)
        pcm = np.frombuffer(w.readframes(464), "<i2") / 32767
    expected = np.load(vits_tiny / "references" / "waveform_0.npy")[0]
    assert np.abs(pcm - np.clip(expected, -1, 1)).max() <= 1 / 32767
    done = subprocess.run([sys.executable, "-m", "ortpipe.cli", "embed", str(st_minilm), "Hello world.", "A",
                           "--json"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    got = np.array(json.loads(done.stdout)["embeddings"], dtype=np.float32)
    assert np.abs(got - np.load(st_minilm / "references" / "embeddings.npy")[:2]).max() <= EMBEDDING_TOLERANCE
    saved = wav.with_name("embeddings.npy")
    done = subprocess.run([sys.executable, "-m", "ortpipe.cli", "embed", str(st_minilm), "Hello world.", "A",
                           "--out", str(saved)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    np.testing.assert_array_equal(np.load(saved), got)


def test_files_the_cli_cannot_write_are_refused_naming_them(vits_tiny: Path, st_minilm: Path,
                                                            tmp_path: Path) -> None:
    """A missing folder is refused before any model runs (nothing made to be lost); a file the file system
    refuses at write time is a GenerationError naming it (both were 'a bug in ortpipe' before)."""
    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "ortpipe.cli", *args], capture_output=True, text=True)

    missing = tmp_path / "no-folder" / "speech.wav"
    done = cli("run", str(vits_tiny), "--prompt", "Hello.", "--out", str(missing))
    assert done.returncode != 0 and "init" not in done.stderr  # no model ran
    assert done.stderr.strip() == (f"ortpipe: --out {missing}: the folder {missing.parent} does not exist; "
                                   "create it first")
    done = cli("embed", str(st_minilm), "Hello.", "--out", str(tmp_path / "no-folder" / "e.npy"))
    assert "the folder" in done.stderr and "does not exist" in done.stderr
    (tmp_path / "taken.npy").mkdir()
    done = cli("embed", str(st_minilm), "Hello.", "--out", str(tmp_path / "taken.npy"))
    taken = tmp_path / "taken.npy"
    assert done.stderr.strip() == f"ortpipe: --out {taken}: that is a folder; give a file's path"
    blocked = tmp_path / "file"
    blocked.write_text("a file, not a folder")
    done = cli("run", str(vits_tiny), "--prompt", "Hello.", "--out", str(blocked / "speech.wav"))
    assert "does not exist" in done.stderr  # its folder is a file
    trace = tmp_path / "no-folder" / "trace.json"
    done = cli("run", str(vits_tiny), "--prompt", "Hello.", "--trace", str(trace))
    assert done.stderr.strip() == (f"ortpipe: --trace {trace}: the folder {trace.parent} does not exist; "
                                   "create it first")
    if sys.platform == "linux":  # /proc takes no new files, whoever runs this (root too)
        done = cli("run", str(vits_tiny), "--prompt", "Hello.", "--out", "/proc/speech.wav")
        assert done.returncode != 0 and "ortpipe: --out /proc/speech.wav: cannot write it (" in done.stderr
        assert "bug in ortpipe" not in done.stderr


# --- what is refused -----------------------------------------------------------------------------

@pytest.mark.parametrize(("field", "value", "message"), [
    ("_class_name", "DPMSolverSDEScheduler",
     "scheduler \"DPMSolverSDEScheduler\" is not run by ortpipe; it runs Euler"),
    ("_class_name", "PNDMScheduler", "PNDMScheduler with skip_prk_steps False is not run by ortpipe (it runs "
                                     "True)"),  # the Runge-Kutta warm-up; Stable Diffusion's folders skip it
    ("interpolation_type", "log_linear",
     "EulerDiscreteScheduler with interpolation_type \"log_linear\" is not run"),

    ("sigma_max", -1, "sigma_max must be a positive number or null, found -1"),
    ("prediction_type", "sample", "prediction_type \"sample\" is not run by ortpipe (it runs \"epsilon\", "
                                  "\"v_prediction\")"),
    ("timestep_spacing", "karras", "timestep_spacing \"karras\" is not run"),
])
def test_schedulers_ortpipe_does_not_run_are_refused_at_load(sd_copy: Path, sd_cases: dict[str, dict],
                                                              field: str, value: object, message: str,
                                                              tmp_path: Path) -> None:
    folder = Path(shutil.copytree(sd_copy, tmp_path / "sd"))
    _with_scheduler(folder, {**sd_cases["euler-eps-linspace"]["scheduler"], field: value})
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ortpipe.load(folder)


def _v2(folder: Path, edit) -> Path:
    """A genai_config.json written from what detection makes of the folder, changed by `edit`."""
    from ortpipe.detect import detect_config
    from ortpipe.folder import LocalFolder

    config = detect_config(LocalFolder(folder))
    edit(config)
    (folder / "genai_config.json").write_text(json.dumps(config))
    return folder


def test_graphs_that_do_not_fit_the_loop_are_refused(sd_copy: Path, vits_tiny: Path, tmp_path: Path) -> None:
    sd = Path(shutil.copytree(sd_copy, tmp_path / "sd"))
    _v2(sd, lambda c: c["pipeline"]["sessions"]["unet"].update(inputs={"timestep": "t"}))
    with pytest.raises(ConfigError, match='session "unet" has no input "t" for the loop\'s timestep '
                                          r"\(inputs: sample, timestep, encoder_hidden_states\)"):
        ortpipe.load(sd)
    vits = Path(shutil.copytree(vits_tiny, tmp_path / "vits"))
    _v2(vits, lambda c: c["pipeline"]["output"].update(name="audio"))
    with pytest.raises(ConfigError, match='pipeline.output names "audio", but session "model" has no such '
                                          r"output \(outputs: waveform, spectrogram\)"):
        ortpipe.load(vits)
    _v2(vits, lambda c: c["pipeline"].update(output={"session": "model", "name": "waveform", "as": "image"}))
    with pytest.raises(ConfigError, match="needs rank 4"):
        ortpipe.load(vits)
    _v2(vits, lambda c: c["pipeline"].pop("output"))
    with pytest.raises(ConfigError, match='generation.loop "single_pass" makes no tokens: name what a '
                                          'request '
                                          "returns in pipeline.output"):
        ortpipe.load(vits)


def test_requests_a_loop_does_not_take_are_refused(vits_tiny: Path, sd_copy: Path, st_minilm: Path) -> None:
    speech, image = ortpipe.load(vits_tiny, threads=1), ortpipe.load(sd_copy, threads=1)
    for pipe, options, message in [
        (speech, {"num_steps": 3}, "num_steps is a setting of the denoising loop; this folder's loop is"),
        (image, {"temperature": 0.5}, "temperature is a setting of the autoregressive loop"),
        (image, {"max_new_tokens": 4}, "max_new_tokens is a setting of the autoregressive loop"),
        (image, {"num_steps": 0}, "num_steps 0 is out of range"),
        (image, {"guidance_scale": 1.0, "negative_prompt": "x"}, "negative_prompt is used by guidance"),
        (image, {"guidance_scale": 1.0, "guidance_rescale": 0.7}, "guidance_rescale rescales guidance: raise "
                                                                  "guidance_scale above 1"),
        (image, {"guidance_scale": 5.0, "guidance_rescale": 1.5}, "guidance_rescale"),
        (image, {"eta": 1.5}, "eta 1.5 is out of range"),
        (image, {"latents": np.zeros((1, 3, 8, 8), np.float32)}, r"latents must be float32 \[1, 4, height"),
        (speech, {"latents": np.zeros((1, 4, 8, 8), np.float32)}, 'latents are an input of the "denoising"'),
    ]:
        with pytest.raises(GenerationError, match=message):
            pipe.generate("a cube", **options)
    euler = ortpipe.load(_with_scheduler(sd_copy, {"_class_name": "EulerDiscreteScheduler",
                                                   **paradigms.FOLDER_SCHEDULER}), threads=1)
    refusal = ("eta is DDIMScheduler's and TCDScheduler's .*; this folder's scheduler is "
               "EulerDiscreteScheduler: drop eta, or use one of those")
    with pytest.raises(GenerationError, match=refusal):
        euler.generate("a cube", num_steps=2, eta=0.5)
    with pytest.raises(GenerationError, match="chat makes tokens"):
        speech.chat()
    with pytest.raises(GenerationError, match="embed needs a folder whose outputs are embeddings"):
        speech.embed(["x"])
    with pytest.raises(GenerationError, match="texts must be a list of 1 to"):
        ortpipe.load(st_minilm).embed([])


def test_a_final_step_of_the_autoregressive_loop_needs_named_outputs(tmp_path: Path) -> None:
    from ortpipe.config import load_config
    from ortpipe.folder import LocalFolder

    (tmp_path / "model.onnx").write_bytes(b"")
    (tmp_path / "vocoder.onnx").write_bytes(b"")
    config = {"version": 2, "pipeline": {"sessions": {"decoder": {"file": "model.onnx"},
                                                      "vocoder": {"file": "vocoder.onnx"}},
                                         "flow": [{"run": "decoder", "when": "step"},
                                                  {"run": "vocoder", "when": "final"}]}}
    (tmp_path / "genai_config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=r'"when": "final" \(vocoder\) run after the autoregressive loop to '
                                          r"make named outputs: name them in pipeline.output"):
        load_config(LocalFolder(tmp_path))


# --- kernels and detection -----------------------------------------------------------------------

def _kernel(name: str):  # noqa: ANN202 (onnxruntime's session)
    import onnxruntime as ort

    from ortpipe.kernels import kernel_file

    return ort.InferenceSession(str(kernel_file(f"kernel:{name}")), providers=["CPUExecutionProvider"])


def test_pooling_kernels_follow_sentence_transformers() -> None:
    """sentence-transformers' Pooling (its pooling_mode_* in sentence_transformers/models/Pooling.py) and
    Normalize (torch's normalize) written out in numpy, on padded rows and an empty one."""
    rng = np.random.default_rng(1)
    states = rng.standard_normal((3, 6, 5)).astype(np.float32)
    mask = np.array([[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0]], np.int64)
    kept = mask[:, :, None].astype(np.float32)
    expected = {
        "mean": (states * kept).sum(1) / np.maximum(kept.sum(1), 1e-9),
        "max": np.where(kept > 0, states, -1e9).max(1),
        "cls": states[:, 0],
        "lasttoken": states[np.arange(3), [2, 5, 0]],
    }
    for mode, want in expected.items():
        feeds = {"states": states} if mode == "cls" else {"states": states, "mask": mask}
        got = _kernel(f"pool_{mode}_float32").run(None, feeds)[0]
        assert np.abs(got - want).max() <= 1e-6, mode
    normed = _kernel("l2_normalize_float32").run(None, {"x": expected["mean"]})[0]
    norms = np.maximum(np.linalg.norm(expected["mean"], axis=1, keepdims=True), 1e-12)
    assert np.abs(normed - expected["mean"] / norms).max() < 1e-6


def test_image_kernels_follow_diffusers() -> None:
    rng = np.random.default_rng(2)
    sample = (rng.standard_normal((1, 3, 4, 5)) * 1.5).astype(np.float32)
    image = _kernel("vae_image_float32").run(None, {"sample": sample})[0]
    assert np.array_equal(image, np.clip(sample / 2 + 0.5, 0, 1).transpose(0, 2, 3, 1))
    rgba = _kernel("rgba8_uint8").run(None, {"image": image})[0]
    assert np.array_equal(rgba[..., :3], np.round(image * 255).astype(np.uint8))
    assert (rgba[..., 3] == 255).all()


@pytest.mark.parametrize(("files", "message"), [
    ({"model_index.json": {"_class_name": "FluxPipeline",
                           "transformer": ["diffusers", "FluxTransformer2DModel"]}},
     "is FluxPipeline, with transformer: ortpipe detects StableDiffusionPipeline-style"),
    ({"model_index.json": {"_class_name": "StableDiffusionXLImg2ImgPipeline", "text_encoder": [None, None],
                           "text_encoder_2": ["transformers", "CLIPTextModelWithProjection"]}},
     r"with text_encoder_2 without text_encoder \(a refiner\)"),
    ({"model_index.json": {"_class_name": "StableDiffusionPipeline"}},
     r"has model_index.json \(StableDiffusionPipeline\) but not text_encoder/model.onnx, unet/model.onnx, "
     "vae_decoder/model.onnx"),
    ({"modules.json": [{"type": "sentence_transformers.models.Transformer", "path": ""},
                       {"type": "sentence_transformers.models.Pooling", "path": "1_Pooling"},
                       {"type": "sentence_transformers.models.Dense", "path": "2_Dense"}]},
     r"has the modules Transformer, Pooling, Dense: ortpipe runs Transformer, Pooling, Normalize"),
    ({"modules.json": [{"type": "sentence_transformers.models.Pooling", "path": "1_Pooling"}],
      "1_Pooling/config.json": {"pooling_mode_mean_sqrt_len_tokens": True}, "onnx/model.onnx": b""},
     "pools by mean_sqrt_len_tokens: ortpipe pools by one of mean, cls, max, lasttoken"),
    ({"modules.json": [{"type": "sentence_transformers.models.Pooling", "path": "1_Pooling"}]},
     r"a sentence-transformers folder without an ONNX graph \(looked for onnx/model.onnx, model.onnx\)"),
])
def test_folders_detection_cannot_run_are_named(files: dict, message: str, tmp_path: Path) -> None:
    from ortpipe.detect import detect_config
    from ortpipe.folder import LocalFolder

    for name, content in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(content if isinstance(content, bytes) else json.dumps(content).encode())
    with pytest.raises(ConfigError, match=message):
        detect_config(LocalFolder(tmp_path))


@pytest.mark.slow
@pytest.mark.parametrize("fixture", ["st_minilm", "vits_tiny", "sd_tiny"])
def test_the_expanded_config_of_a_detected_folder_loads_the_same(fixture: str, tmp_path: Path,
                                                                  request: pytest.FixtureRequest) -> None:
    """`ortpipe inspect` shows a detected folder's config as v2; as a genai_config.json it is the same."""
    from ortpipe.config.expand import as_v2

    folder = Path(shutil.copytree(request.getfixturevalue(fixture), tmp_path / "folder",
                                  ignore=shutil.ignore_patterns("references")))
    detected = ortpipe.load(folder).config
    (folder / "genai_config.json").write_text(json.dumps(as_v2(detected)))
    written = ortpipe.load(folder).config
    assert written.source == "v2" and detected.source == "detected"
    assert (written.pipeline.outputs, written.generation) == (detected.pipeline.outputs, detected.generation)
    assert written.pipeline.preprocessing == detected.pipeline.preprocessing
