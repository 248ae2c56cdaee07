"""Inpainting (diffusers' StableDiffusionInpaintPipeline) with a UNet of the latents' channels: an image
and a mask (white repaints, black keeps); at strength 1 the first latents are noise alone, below it the
image's latents noised as image-to-image's; after each step the kept region is set back to the image's
latents noised to the next step's level (clean after the last).

sd-tiny's references hold diffusers' images for six schedulers (build/paradigms.py, inpaint.json); the
plain onnxruntime loop of tests/paradigm_refs.py given diffusers' draws equals them, and ortpipe from its
seed equals that loop given ortpipe's draws, within the issue's 1e-3.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from build import paradigms

import ortpipe
from ortpipe.errors import GenerationError
from tests import diffusers_folders as folders
from tests import paradigm_refs as refs
from tests.test_image_to_image import ortpipe_draws

IMAGE_TOLERANCE = 1e-3


@pytest.fixture(scope="module")
def cases(sd_tiny: Path) -> dict[str, dict]:
    index = json.loads((sd_tiny / "references" / "inpaint.json").read_text())
    return {case["name"]: case for case in index["cases"]}


@pytest.fixture
def folder(sd_tiny: Path, tmp_path: Path) -> Path:
    return folders.copy(sd_tiny, tmp_path / "sd")


def _pixels(path: Path) -> np.ndarray:
    from PIL import Image

    with Image.open(path) as image:
        return np.asarray(image.convert("RGB"))


def _plain(folder: Path, case: dict, references: Path, **draws: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return refs.inpaint(folder, case["scheduler"], case["num_inference_steps"], case["strength"],
                        _pixels(references / case["init_image"]), _pixels(references / case["mask_image"]),
                        prompt_ids=case["prompt_ids"], negative_prompt_ids=case["negative_prompt_ids"],
                        guidance_scale=case["guidance_scale"], **draws)


@pytest.mark.parametrize("name", [case[0] for case in paradigms.INPAINT_CASES])
def test_inpainting_equals_diffusers_and_the_plain_loop(name: str, sd_tiny: Path, folder: Path,
                                                        cases: dict[str, dict]) -> None:
    case = cases[name]
    references = sd_tiny / "references"
    given = {"encode_noise": np.load(references / case["encode_noise"]),
             "add_noise": np.load(references / case["add_noise"]),
             "noise": np.load(references / case["noise"]) if case["noise"] else None}
    plain, latents = _plain(sd_tiny, case, references, **given)
    expected = np.load(references / case["image"])
    final = np.load(references / case["final_latents"])
    to_diffusers = float(np.abs(plain - expected).max())
    drift = float(np.abs(latents - final).max() / np.abs(final).max())

    pipe = ortpipe.load(folders.scheduled(folder, case), threads=1)
    guided = case["guidance_scale"] > 1
    strength = {} if case["strength"] == 1.0 else {"strength": case["strength"]}  # the default: 1
    result = pipe.generate(case["prompt"], images=[references / case["init_image"]],
                           mask=references / case["mask_image"], seed=4,
                           num_steps=case["num_inference_steps"], guidance_scale=case["guidance_scale"],
                           negative_prompt=case["negative_prompt"] if guided else None, **strength)
    assert result.timings.steps == len(case["timesteps"])
    sample, added, noise = ortpipe_draws(pipe, case, 4)
    mine, _ = _plain(folder, case, references, encode_noise=sample, add_noise=added,
                     noise=noise if case["noise"] else None)
    to_plain = float(np.abs(result.image - mine).max())
    print(f"{name}: max |plain loop - diffusers| = {to_diffusers:.2e} (final latents relative {drift:.1e}), "
          f"|ortpipe - plain loop with ortpipe's draws| = {to_plain:.2e}")
    assert expected.shape == result.image.shape == (1, 32, 32, 3)
    assert to_diffusers <= IMAGE_TOLERANCE and drift <= 1e-5 and to_plain <= IMAGE_TOLERANCE


@pytest.fixture(scope="module")
def sd_inpaint_tiny() -> Path:
    return paradigms.get("sd-inpaint-tiny")


@pytest.mark.parametrize("name", [case[0] for case in paradigms.INPAINT9_CASES])
def test_an_inpainting_unet_equals_diffusers_and_the_plain_loop(name: str, sd_inpaint_tiny: Path,
                                                                tmp_path: Path) -> None:
    """An inpainting UNet (9 input channels, optimum's inpainting export of stable-diffusion-inpainting's
    layout): the latents, the mask and the masked image's latents along the channels at every run, no
    blend. Detected from its channels (2 * the VAE's latent_channels + 1)."""
    index = json.loads((sd_inpaint_tiny / "references" / "inpaint.json").read_text())
    case = {c["name"]: c for c in index["cases"]}[name]
    references = sd_inpaint_tiny / "references"
    folder = folders.copy(sd_inpaint_tiny, tmp_path / "sd")
    given = {"encode_noise": np.load(references / case["encode_noise"]),
             "add_noise": np.load(references / case["add_noise"]),
             "masked_noise": np.load(references / case["masked_noise"]),
             "noise": np.load(references / case["noise"]) if case["noise"] else None}
    plain, latents = _plain(sd_inpaint_tiny, case, references, **given)
    expected, final = np.load(references / case["image"]), np.load(references / case["final_latents"])
    to_diffusers = float(np.abs(plain - expected).max())
    drift = float(np.abs(latents - final).max() / np.abs(final).max())

    pipe = ortpipe.load(folders.scheduled(folder, case), threads=1)
    assert pipe.model.loop.denoising.masked_input and pipe.model.loop.denoising.latent_shape == (4, 8, 8)
    guided = case["guidance_scale"] > 1
    result = pipe.generate(case["prompt"], images=[references / case["init_image"]],
                           mask=references / case["mask_image"], seed=6, strength=case["strength"],
                           num_steps=case["num_inference_steps"], guidance_scale=case["guidance_scale"],
                           negative_prompt=case["negative_prompt"] if guided else None)
    assert result.timings.steps == len(case["timesteps"])
    sample, added, masked, noise = _draws(pipe, case, 6)
    mine, _ = _plain(folder, case, references, encode_noise=sample, add_noise=added, masked_noise=masked,
                     noise=noise if case["noise"] else None)
    to_plain = float(np.abs(result.image - mine).max())
    print(f"{name}: max |plain loop - diffusers| = {to_diffusers:.2e} (final latents relative {drift:.1e}), "
          f"|ortpipe - plain loop with ortpipe's draws| = {to_plain:.2e}")
    assert to_diffusers <= IMAGE_TOLERANCE and drift <= 1e-5 and to_plain <= IMAGE_TOLERANCE
    wrong, _ = _plain(folder, case, references, encode_noise=sample, add_noise=added,
                      masked_noise=np.zeros_like(masked), noise=noise if case["noise"] else None)
    assert np.abs(wrong - mine).max() > 10 * IMAGE_TOLERANCE  # the masked image's latents reach the UNet


def _draws(pipe: ortpipe.Pipeline, case: dict, seed: int) -> tuple[np.ndarray, ...]:
    """What ortpipe draws from `seed` for an inpainting UNet's request, in its order: the image's sample,
    the added noise, the masked image's sample, then each noisy step's, in order."""
    from ortpipe.loops.denoising import Noise
    from ortpipe.loops.schedulers import make_schedule

    shape = (1, 4, 8, 8)
    strength = None if case["strength"] == 1.0 else case["strength"]
    schedule = make_schedule(pipe.model.loop.denoising.scheduler, case["num_inference_steps"], strength)
    noise = Noise(pipe.model.backend, seed)
    first = [np.asarray(pipe.run(noise.draw(shape))) for _ in range(3)]
    steps = [pipe.run(noise.draw(shape)) for step in schedule.steps if step.noise]
    return (*first, np.array(steps, np.float32).reshape(len(steps), *shape))


def test_an_inpainting_unet_needs_a_mask_and_its_encoder(sd_inpaint_tiny: Path, tmp_path: Path) -> None:
    import shutil

    from ortpipe.errors import ConfigError

    folder = folders.copy(sd_inpaint_tiny, tmp_path / "sd")
    pipe = ortpipe.load(folder, threads=1)
    with pytest.raises(GenerationError, match='session "unet" is an inpainting UNet .*: give an image and'):
        pipe.generate("a red cube", num_steps=2)
    with pytest.raises(GenerationError, match="give an image and a mask"):
        pipe.generate("a red cube", images=[sd_inpaint_tiny / "references" / "init.png"], num_steps=2)
    shutil.rmtree(folder / "vae_encoder")
    with pytest.raises(ConfigError, match="inpainting UNet .* the folder needs its VAE encoder"):
        ortpipe.load(folder, threads=1)


def test_the_mask_kernel_is_pillows_luminance_binarized_and_nearest(folder: Path) -> None:
    """inpaint_mask on random colours (and luminances next to the threshold) equals Pillow's
    convert("L") / 255 >= 0.5 at every 4th pixel, the plain loop's mask (diffusers' mask processor)."""
    from ortpipe.execute.work import Run, kernel

    pipe = ortpipe.load(folder, threads=1)
    backend = pipe.model.backend
    rng = np.random.default_rng(0)
    image = rng.integers(0, 256, (32, 40, 3), dtype=np.uint8)
    image[0, ::4] = [[127, 127, 127], [128, 128, 128], [129, 127, 127], [127, 128, 128], [0, 0, 0],
                     [255, 255, 255], [200, 60, 90], [90, 200, 60], [1, 1, 255], [128, 127, 128]]

    def work():  # noqa: ANN202
        out = yield Run(kernel("inpaint_mask", "uint8"), {
            "mask_image": backend.tensor(image.ravel().tolist(), image.shape, "uint8"),
            "stride": backend.tensor([4], (1,), "int64")}, ("mask",), None, "init")
        return out["mask"]

    made = np.asarray(pipe.run(work()))
    expected = refs.inpaint_mask(image, 4)
    assert made.shape == expected.shape == (1, 1, 8, 10)
    assert np.array_equal(made, expected) and 0 < expected.mean() < 1
    assert list(expected[0, 0, 0, :4]) == [0.0, 1.0, 1.0, 1.0]  # luminance 127, 128, 128.09, 128.2


def test_the_mask_and_the_image_make_the_image(sd_tiny: Path, folder: Path, cases: dict[str, dict]) -> None:
    """The inverted mask, another image or another strength each give another image; an all-black mask
    keeps everything (the final latents are the image's clean latents); the same request the same image."""
    from PIL import Image

    case = cases["inp-ddim-v-linspace"]
    references = sd_tiny / "references"
    init, mask = references / case["init_image"], _pixels(references / case["mask_image"])
    pipe = ortpipe.load(folders.scheduled(folder, case), threads=1)
    request = {"num_steps": 5, "seed": 2, "strength": 0.6}
    first = pipe.generate("a red cube", images=[init], mask=mask, **request).image
    assert np.array_equal(pipe.generate("a red cube", images=[init], mask=mask, **request).image, first)
    inverted = folder / "inverted.png"
    Image.fromarray(255 - _pixels(init)).save(inverted)
    others = {"inverted mask": pipe.generate("a red cube", images=[init], mask=255 - mask, **request).image,
              "another image": pipe.generate("a red cube", images=[inverted], mask=mask, **request).image,
              "strength 1": pipe.generate("a red cube", images=[init], mask=mask,
                                          **{**request, "strength": 1.0}).image}
    for what, other in others.items():
        assert np.abs(other - first).max() > 10 * IMAGE_TOLERANCE, what
    kept = pipe.generate("a red cube", images=[init], mask=np.zeros_like(mask), **request).image
    sample, _, _ = ortpipe_draws(pipe, {**case, "strength": 0.6}, 2)
    clean = refs.encode_image(folder, _pixels(init), sample)
    assert np.abs(kept - refs._decode(folder, clean.astype(np.float64))).max() <= IMAGE_TOLERANCE


def test_requests_inpainting_does_not_take_are_refused(sd_tiny: Path, folder: Path,
                                                       cases: dict[str, dict]) -> None:
    case = cases["inp-ddim-v-linspace"]
    references = sd_tiny / "references"
    init, mask = references / case["init_image"], _pixels(references / case["mask_image"])
    pipe = ortpipe.load(folders.scheduled(folder, case), threads=1)
    for request, message in [
        ({"mask": mask}, r"a mask says which part of an image to repaint: pass the image \(images=\[...\]\)"),
        ({"images": [init], "mask": mask[:, :28]},
         r"the mask is 32x28 pixels and the image 32x32 \(height x width\): give a mask of the image's "),
        ({"images": [init], "mask": mask[..., 0]},
         r"the mask must be a path or a uint8 \[height, width, 3\]"),
        ({"images": [init], "mask": references / "no-mask.png"},
         r"the mask file .*no-mask.png does not exist"),
        ({"images": [init], "mask": references}, r"the mask path .* is a folder; give the path of a file"),
    ]:
        with pytest.raises(GenerationError, match=message):
            pipe.generate("a red cube", num_steps=2, **request)
    (folder / "scheduler" / "scheduler_config.json").write_text(json.dumps(
        {"_class_name": "LCMScheduler", "num_train_timesteps": 1000, "beta_schedule": "scaled_linear",
         "beta_start": 0.00085, "beta_end": 0.012}))
    with pytest.raises(GenerationError, match="inpainting with LCMScheduler is not built"):
        ortpipe.load(folder, threads=1).generate("a red cube", images=[init], mask=mask, num_steps=2)


def test_a_mask_outside_a_denoising_folder_is_refused(st_minilm: Path, sd_tiny: Path) -> None:
    mask = np.zeros((32, 32, 3), np.uint8)
    with pytest.raises(GenerationError, match="a mask is inpainting's: it goes with an image to a denoising"):
        ortpipe.load(st_minilm, threads=1).generate("a red cube", mask=mask)


def test_the_cli_takes_a_mask(sd_tiny: Path, folder: Path, cases: dict[str, dict], tmp_path: Path) -> None:
    from ortpipe.cli import main

    case = cases["inp-ddim-v-linspace"]
    references = sd_tiny / "references"
    folders.scheduled(folder, case)
    out = tmp_path / "image.npy"
    assert main(["run", str(folder), "--prompt", "a red cube", "--image", str(references / "init.png"),
                 "--mask", str(references / "mask.png"), "--num-steps", "3", "--seed", "2",
                 "--out", str(out)]) == 0
    expected = ortpipe.load(folder, threads=1).generate(
        "a red cube", images=[references / "init.png"], mask=references / "mask.png", num_steps=3, seed=2)
    assert np.array_equal(np.load(out), expected.image)


def test_random_image_requests_are_images_or_clear_refusals(sd_tiny: Path) -> None:
    """Random mixes of image, mask, strength, latents, steps and guidance on a folder with an encoder (the
    fuzz tests' rules: a result or a ConfigError/GenerationError of a bounded message, nothing opened
    outside the folder, no hang); afterwards the pipeline still inpaints as before."""
    import random

    from tests.test_fuzz import outcome

    init, drawn = sd_tiny / "references" / "init.png", sd_tiny / "references" / "mask.png"
    rng = random.Random(20261125)
    white = np.full((32, 32, 3), 255, np.uint8)
    choices = {
        "images": [None, [init], [], [init, init], [sd_tiny / "missing.png"], [white[..., :2]], "x", [3]],
        "mask": [None, drawn, white, white[:16], white[..., 0], 0, "x", sd_tiny / "missing.png"],
        "strength": [None, 0.5, 1.0, 0.0, 1.5, -1, float("nan"), "a", True],
        "latents": [None, np.zeros((1, 4, 8, 8), np.float32), np.zeros((1, 4, 8, 9), np.float32),
                    np.zeros((2, 4, 8, 8), np.float32), [1.0]],
        "num_steps": [2, 1, 0, 3.5, 10**6],
        "guidance_scale": [1.0, 3.0, -1.0, float("inf")],
    }
    pipe = ortpipe.load(sd_tiny, threads=1)
    expected = pipe.generate("a red cube", images=[init], mask=drawn, num_steps=2, seed=1).image
    counts: dict[str, int] = {}
    for _ in range(400):
        request = {k: rng.choice(v) for k, v in choices.items() if rng.random() < 0.6}
        request = {k: v for k, v in request.items() if v is not None}
        result = outcome(lambda: pipe.generate("a red cube", seed=1, **request), sd_tiny)  # noqa: B023
        counts[result] = counts.get(result, 0) + 1
    print("random image requests:", counts)
    assert counts.get("ok", 0) > 10 and counts.get("GenerationError", 0) > 50
    again = pipe.generate("a red cube", images=[init], mask=drawn, num_steps=2, seed=1).image
    assert np.array_equal(again, expected)
