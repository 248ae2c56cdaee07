"""Stable Diffusion XL folders (issue 16): two text encoders, each with its own tokenizer, whose penultimate
states are joined for the UNet (a wire of several sources), the second's pooled projection, the loop's size
conditioning (time_ids) and zeroed unconditional states (force_zeros_for_empty_prompt), detected from
optimum's export of a tiny random StableDiffusionXLPipeline (build/paradigms.py, sdxl-tiny).

Each case's image equals diffusers' StableDiffusionXLPipeline given the same initial latents, and the plain
onnxruntime loop of tests/paradigm_refs.py, within the issue's 1e-3.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from build import paradigms

import ortpipe
from ortpipe.errors import ConfigError, GenerationError
from tests import diffusers_folders as folders
from tests import paradigm_refs as refs

IMAGE_TOLERANCE = 1e-3
CASES = [case[0] for case in paradigms.SDXL_CASES]


@pytest.fixture(scope="module")
def cases(sdxl_tiny: Path) -> dict[str, dict]:
    return folders.cases(sdxl_tiny)


@pytest.fixture
def folder(sdxl_tiny: Path, tmp_path: Path) -> Path:
    """sdxl-tiny without its references: a folder a test may change."""
    return folders.copy(sdxl_tiny, tmp_path / "sdxl")


def _request(case: dict) -> dict:
    guided = case["guidance_scale"] > 1
    return {"num_steps": case["num_inference_steps"], "guidance_scale": case["guidance_scale"],
            "negative_prompt": case["negative_prompt"] if guided else None}


@pytest.mark.slow
@pytest.mark.parametrize("name", CASES)
def test_images_equal_diffusers_and_the_plain_loop(name: str, sdxl_tiny: Path, folder: Path,
                                                   cases: dict[str, dict]) -> None:
    case = cases[name]
    # the second tokenizer pads with "!": the encoders read different ids, so each session's own are used
    assert case["prompt_ids"][0] != case["prompt_ids"][1]
    pipe = ortpipe.load(folders.scheduled(folder, case), threads=1)
    assert pipe.model.plan.config.metadata["model_type"] == "StableDiffusionXLPipeline"
    latents = np.load(sdxl_tiny / "references" / case["latents"])
    result = pipe.generate(case["prompt"], latents=latents, **_request(case))
    assert result.finish_reason == "done" and result.timings.steps == len(case["timesteps"])
    expected = np.load(sdxl_tiny / "references" / case["image"])
    plain = refs.generate_image_xl(folder, case["scheduler"], case["num_inference_steps"], latents,
                                   prompt_ids=case["prompt_ids"],
                                   negative_prompt_ids=case["negative_prompt_ids"],
                                   guidance_scale=case["guidance_scale"], zero_negative=case["zero_negative"])
    to_diffusers = float(np.abs(result.image - expected).max())
    to_plain = float(np.abs(result.image - plain).max())
    print(f"{name}: max |ortpipe - diffusers| = {to_diffusers:.2e}, |ortpipe - plain loop| = {to_plain:.2e}")
    assert result.image.shape == expected.shape == (1, 32, 32, 3)
    assert to_diffusers <= IMAGE_TOLERANCE and to_plain <= IMAGE_TOLERANCE
    assert np.abs(plain - expected).max() <= IMAGE_TOLERANCE  # the plain loop is diffusers' computation


@pytest.fixture(scope="module")
def img2img_cases(sdxl_tiny: Path) -> dict[str, dict]:
    index = json.loads((sdxl_tiny / "references" / "img2img.json").read_text())
    return {c["name"]: c for c in index["cases"]}


@pytest.mark.slow
@pytest.mark.parametrize("name", [case[0] for case in paradigms.SDXL_IMG2IMG_CASES])
def test_image_to_image_equals_diffusers_and_the_plain_loop(name: str, sdxl_tiny: Path, folder: Path,
                                                            img2img_cases: dict[str, dict]) -> None:
    """StableDiffusionXLImg2ImgPipeline (a base model's: no aesthetic score): the plain loop given
    diffusers' draws equals diffusers (its size conditioning the image's size, as the pipeline handed its
    UNet); ortpipe, from its seed, equals the plain loop given ortpipe's draws."""
    from PIL import Image

    from tests.test_image_to_image import ortpipe_draws

    case = img2img_cases[name]
    references = sdxl_tiny / "references"
    init = references / case["init_image"]
    with Image.open(init) as opened:
        pixels = np.asarray(opened.convert("RGB"))
    assert case["time_ids"][-1] == [32, 32, 0, 0, 32, 32]
    given = {"prompt_ids": case["prompt_ids"], "negative_prompt_ids": case["negative_prompt_ids"],
             "guidance_scale": case["guidance_scale"], "zero_negative": case["zero_negative"]}
    steps, strength = case["num_inference_steps"], case["strength"]
    plain, latents = refs.image_to_image_xl(
        sdxl_tiny, case["scheduler"], steps, strength, pixels, **given,
        encode_noise=np.load(references / case["encode_noise"]),
        add_noise=np.load(references / case["add_noise"]),
        noise=np.load(references / case["noise"]) if case["noise"] else None)
    expected = np.load(references / case["image"])
    to_diffusers = float(np.abs(plain - expected).max())
    final = np.load(references / case["final_latents"])
    drift = float(np.abs(latents - final).max() / np.abs(final).max())  # relative to the largest

    pipe = ortpipe.load(folders.scheduled(folder, case), threads=1)
    result = pipe.generate(case["prompt"], images=[init], seed=8, strength=strength, **_request(case))
    assert result.timings.steps == len(case["timesteps"])
    sample, added, noise = ortpipe_draws(pipe, case, 8)
    mine, _ = refs.image_to_image_xl(folder, case["scheduler"], steps, strength, pixels, **given,
                                     encode_noise=sample, add_noise=added, noise=noise)
    to_plain = float(np.abs(result.image - mine).max())
    print(f"{name}: max |plain loop - diffusers| = {to_diffusers:.2e} (final latents relative {drift:.1e}), "
          f"|ortpipe - plain loop with ortpipe's draws| = {to_plain:.2e}")
    assert expected.shape == result.image.shape == (1, 32, 32, 3)
    assert to_diffusers <= IMAGE_TOLERANCE and drift <= 1e-5 and to_plain <= IMAGE_TOLERANCE


@pytest.mark.parametrize("name", [case[0] for case in paradigms.SDXL_INPAINT_CASES])
def test_inpainting_equals_diffusers_and_the_plain_loop(name: str, sdxl_tiny: Path, folder: Path) -> None:
    """StableDiffusionXLInpaintPipeline with sdxl-tiny's UNet of the latents' channels (its blend), at
    strength 1 and at the pipeline's default 0.9999 (what ortpipe gives a mask on a Stable Diffusion XL
    folder when the request names no strength)."""
    from PIL import Image

    from tests.test_image_to_image import ortpipe_draws

    references = sdxl_tiny / "references"
    index = json.loads((references / "inpaint.json").read_text())
    case = {c["name"]: c for c in index["cases"]}[name]
    init, mask = references / case["init_image"], references / case["mask_image"]
    with Image.open(init) as opened:
        pixels = np.asarray(opened.convert("RGB"))
    with Image.open(mask) as opened:
        masking = np.asarray(opened.convert("RGB"))
    assert case["time_ids"][-1] == [32, 32, 0, 0, 32, 32]
    given = {"prompt_ids": case["prompt_ids"], "negative_prompt_ids": case["negative_prompt_ids"],
             "guidance_scale": case["guidance_scale"], "zero_negative": case["zero_negative"]}
    steps, strength = case["num_inference_steps"], case["strength"]
    plain, latents = refs.inpaint(sdxl_tiny, case["scheduler"], steps, strength, pixels, masking, **given,
                                  encode_noise=np.load(references / case["encode_noise"]),
                                  add_noise=np.load(references / case["add_noise"]))
    expected, final = np.load(references / case["image"]), np.load(references / case["final_latents"])
    to_diffusers = float(np.abs(plain - expected).max())
    drift = float(np.abs(latents - final).max() / np.abs(final).max())

    pipe = ortpipe.load(folders.scheduled(folder, case), threads=1)
    default = {} if strength == 0.9999 else {"strength": strength}
    result = pipe.generate(case["prompt"], images=[init], mask=mask, seed=8, **default, **_request(case))
    assert result.timings.steps == len(case["timesteps"])
    sample, added, _ = ortpipe_draws(pipe, case, 8)
    mine, _ = refs.inpaint(folder, case["scheduler"], steps, strength, pixels, masking, **given,
                           encode_noise=sample, add_noise=added)
    to_plain = float(np.abs(result.image - mine).max())
    print(f"{name}: max |plain loop - diffusers| = {to_diffusers:.2e} (final latents relative {drift:.1e}), "
          f"|ortpipe - plain loop with ortpipe's draws| = {to_plain:.2e}")
    assert to_diffusers <= IMAGE_TOLERANCE and drift <= 1e-5 and to_plain <= IMAGE_TOLERANCE


@pytest.mark.slow
def test_each_part_of_the_conditioning_makes_the_image(
sdxl_tiny: Path, folder: Path,
                                                       cases: dict[str, dict]) -> None:
    """The zeroed unconditional row, the size conditioning and the pooled projection each change the image:
    an image that matched diffusers without one of them would show that the case does not test it."""
    case = cases["sdxl-euler-eps-leading-cfg-zeros"]
    assert case["zero_negative"] and case["time_ids"][0] == [32.0, 32.0, 0.0, 0.0, 32.0, 32.0]
    pipe = ortpipe.load(folders.scheduled(folder, case), threads=1)
    latents = np.load(sdxl_tiny / "references" / case["latents"])
    expected = np.load(sdxl_tiny / "references" / case["image"])
    encoded = pipe.generate(case["prompt"], latents=latents, force_zeros_for_empty_prompt=False,
                            **_request(case)).image
    assert np.abs(encoded - expected).max() > 100 * IMAGE_TOLERANCE  # "" encoded instead of zeros
    # the plain loop without the pooled projection, and with another size conditioning, is far off too
    plain = refs.generate_image_xl(folder, case["scheduler"], case["num_inference_steps"], latents,
                                   prompt_ids=case["prompt_ids"], negative_prompt_ids=None,
                                   guidance_scale=case["guidance_scale"], zero_negative=True)
    assert np.abs(plain - expected).max() <= IMAGE_TOLERANCE
    unet = refs.session(folder / "unet" / "model.onnx")
    feeds = {"sample": latents, "timestep": np.array(500.0, np.float32),
             "encoder_hidden_states": np.zeros((1, 77, 80), np.float32),
             "text_embeds": np.ones((1, 24), np.float32),
             "time_ids": np.array([[32, 32, 0, 0, 32, 32]], np.float32)}
    base = refs.run(unet, feeds)["out_sample"]
    for name, value in (("text_embeds", np.zeros((1, 24), np.float32)),
                        ("time_ids", np.array([[64, 64, 0, 0, 64, 64]], np.float32))):
        assert np.abs(refs.run(unet, {**feeds, name: value})["out_sample"] - base).max() > 1e-3, name


def test_the_detected_config(sdxl_tiny: Path) -> None:
    """What detection makes of the folder: the two encoders' tokenizers, the joined wire of their last layer
    but one (from each config.json's num_hidden_layers), the pooled projection's wire, diffusers' defaults."""
    from ortpipe.detect import detect_config
    from ortpipe.folder import LocalFolder

    config = detect_config(LocalFolder(sdxl_tiny))
    assert config["pipeline"]["sessions"]["text_encoder_2"] == {"file": "text_encoder_2/model.onnx",
                                                                "tokenizer": "tokenizer_2"}
    assert config["pipeline"]["dataflow"][:2] == [
        {"from": ["text_encoder.hidden_states.1", "text_encoder_2.hidden_states.2"],
         "to": "unet.encoder_hidden_states"},
        {"from": "text_encoder_2.text_embeds", "to": "unet.text_embeds"}]
    assert config["generation"] == {"loop": "denoising", "guidance_scale": 5.0,
                                    "force_zeros_for_empty_prompt": True}


@pytest.mark.slow
def test_the_expanded_config_loads_the_same(folder: Path, cases: dict[str, dict]) -> None:
    folders.scheduled(folder, cases["sdxl-euler-eps-leading-cfg-neg"])
    folders.expanded_config_makes_the_same_image(folder, negative_prompt="dark")


def _wire(config: dict, index: int, **change: object) -> None:
    config["pipeline"]["dataflow"][index].update(change)


@pytest.mark.parametrize(("edit", "message"), [
    (lambda c: _wire(c, 0, **{"from": ["text_encoder.hidden_states.1"]}),
     r'from must be "session.tensor", a list of two or more of them \(joined along the last axis\)'),
    (lambda c: _wire(c, 0, **{"from": ["text_encoder.hidden_states.1", "text_encoder_2.hidden_states.9"]}),
     'Dataflow wire references output "hidden_states.9" but session "text_encoder_2" has no such output'),
    (lambda c: _wire(c, 0, **{"from": ["text_encoder.hidden_states.1", "unet.out_sample"]}),
     '"unet.out_sample", which is not an init session\'s output: joined wires take outputs of the '
     "init phase"),
    (lambda c: _wire(c, 0, **{"from": ["text_encoder.hidden_states.1", "nowhere.x"]}),
     'names session "nowhere", which is not declared in pipeline.sessions'),
    (lambda c: _wire(c, 0, stream=True), "a wire of joined sources cannot stream: drop stream"),
    (lambda c: c["pipeline"]["sessions"]["unet"].update(tokenizer="tokenizer_2"),
     'session "unet" is not an init session that takes "input_ids" from the request'),
    (lambda c: c["pipeline"]["sessions"]["text_encoder_2"].update(tokenizer="../elsewhere"),
     'sessions.text_encoder_2.tokenizer "../elsewhere" is not a folder inside the model folder'),
    (lambda c: c["pipeline"]["sessions"]["text_encoder_2"].update(tokenizer="vae_decoder"),
     r"sessions.text_encoder_2.tokenizer: .*vae_decoder holds no tokenizer"),
    (lambda c: c["generation"].update(force_zeros_for_empty_prompt="yes"),
     "generation.force_zeros_for_empty_prompt must be true or false"),
])
def test_configs_the_loop_cannot_run_are_refused_at_load(folder: Path, edit, message: str) -> None:  # noqa: ANN001
    with pytest.raises(ConfigError, match=message):
        ortpipe.load(folders.with_v2(folder, edit))


def test_folders_and_requests_sdxl_cannot_take_are_refused(folder: Path) -> None:
    index = json.loads((folder / "model_index.json").read_text())
    (folder / "model_index.json").write_text(json.dumps({**index, "text_encoder": [None, None]}))
    with pytest.raises(ConfigError, match=r"with text_encoder_2 without text_encoder \(a refiner\)"):
        ortpipe.load(folder)
    (folder / "model_index.json").write_text(json.dumps(index))
    layers = json.loads((folder / "text_encoder_2" / "config.json").read_text())
    (folder / "text_encoder_2" / "config.json").write_text(json.dumps({**layers, "num_hidden_layers": None}))
    with pytest.raises(ConfigError,
                       match="gives no num_hidden_layers: the pipeline reads text_encoder_2's last layer"):
        ortpipe.load(folder)
    (folder / "text_encoder_2" / "config.json").write_text(json.dumps(layers))
    vae = json.loads((folder / "vae_decoder" / "config.json").read_text())
    (folder / "vae_decoder" / "config.json").write_text(json.dumps({**vae, "latents_mean": [0.0] * 4}))
    with pytest.raises(ConfigError, match="the VAE's config.json sets latents_mean: ortpipe divides"):
        ortpipe.load(folder)
    (folder / "vae_decoder" / "config.json").write_text(json.dumps({**vae, "block_out_channels": None}))
    with pytest.raises(ConfigError, match='takes "time_ids" .* has no block_out_channels'):
        ortpipe.load(folder)
    (folder / "vae_decoder" / "config.json").write_text(json.dumps(vae))
    pipe = ortpipe.load(folder, threads=1)
    for options, message in [
        ({"prompt_ids": [1, 2, 3]}, "session text_encoder_2 reads the ids of another tokenizer"),
        ({"prompt": "a cube", "guidance_scale": 1.0, "force_zeros_for_empty_prompt": True},
         "force_zeros_for_empty_prompt sets the unconditional row of guidance"),
    ]:
        with pytest.raises(GenerationError, match=message):
            pipe.generate(**{"num_steps": 1, **options})
