"""Latent consistency models (issue 16): a UNet that takes the guidance scale embedded (timestep_cond), run
by LCMScheduler with no unconditional row, as diffusers' LatentConsistencyModelPipeline runs it; detected
from optimum's export of a tiny random one (build/paradigms.py, lcm-tiny).

The one-step case draws no noise: its image equals diffusers'. The others add noise at each step but the
last: ortpipe's image equals the plain onnxruntime loop of tests/paradigm_refs.py given ortpipe's noise, and
that loop given diffusers' noise equals diffusers' image; all within the issue's 1e-3.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from build import paradigms

import ortpipe
from ortpipe.errors import GenerationError
from ortpipe.loops.denoising import guidance_embedding
from tests import diffusers_folders as folders
from tests import paradigm_refs as refs

IMAGE_TOLERANCE = 1e-3
CASES = [case[0] for case in paradigms.LCM_CASES]


@pytest.fixture(scope="module")
def cases(lcm_tiny: Path) -> dict[str, dict]:
    return folders.cases(lcm_tiny)


@pytest.fixture
def folder(lcm_tiny: Path, tmp_path: Path) -> Path:
    return folders.copy(lcm_tiny, tmp_path / "lcm")


@pytest.mark.parametrize("name", CASES)
def test_images_equal_diffusers_and_the_plain_loop(name: str, lcm_tiny: Path, folder: Path,
                                                   cases: dict[str, dict]) -> None:
    case = cases[name]
    pipe = ortpipe.load(folder, threads=1)
    latents = np.load(lcm_tiny / "references" / case["latents"])
    result = pipe.generate(case["prompt"], latents=latents, num_steps=case["num_inference_steps"],
                           guidance_scale=case["guidance_scale"], seed=5)
    assert result.finish_reason == "done" and result.timings.steps == len(case["timesteps"])
    expected = np.load(lcm_tiny / "references" / case["image"])
    embedding = refs.guidance_embedding(case["guidance_scale"], 32)
    _, noise = folders.ortpipe_noise(pipe, case, 5, latents=True)
    plain, _ = refs.generate_image(folder, case["scheduler"], case["num_inference_steps"], latents,
                                   prompt_ids=case["prompt_ids"], noise=noise, timestep_cond=embedding)
    to_plain = float(np.abs(result.image - plain).max())
    assert to_plain <= IMAGE_TOLERANCE
    assert case["noise_draws"] == case["num_inference_steps"] - 1
    if case["noise"]:  # the plain loop with diffusers' noise is diffusers' image
        theirs = np.load(lcm_tiny / "references" / case["noise"])
        plain, _ = refs.generate_image(folder, case["scheduler"], case["num_inference_steps"], latents,
                                       prompt_ids=case["prompt_ids"], noise=theirs, timestep_cond=embedding)
        print(f"{name}: |ortpipe - plain loop, ortpipe's noise| = {to_plain:.1e}, |plain loop, diffusers' "
              f"noise - diffusers| = {np.abs(plain - expected).max():.1e}")
        assert np.abs(plain - expected).max() <= IMAGE_TOLERANCE
    else:
        print(f"{name}: max |ortpipe - diffusers| = {np.abs(result.image - expected).max():.2e}")
        assert np.abs(result.image - expected).max() <= IMAGE_TOLERANCE


@pytest.mark.parametrize("name", [case[0] for case in paradigms.LCM_IMG2IMG_CASES])
def test_image_to_image_equals_diffusers_and_the_plain_loop(name: str, lcm_tiny: Path, folder: Path) -> None:
    """LatentConsistencyModelImg2ImgPipeline: LCMScheduler picks its steps from the first
    int(original_inference_steps * strength) of its original timesteps and runs them all, from the image's
    latents noised to the first. The plain loop given diffusers' draws equals diffusers; ortpipe, from its
    seed, equals the plain loop given ortpipe's draws."""
    import json

    from PIL import Image

    from tests.test_image_to_image import ortpipe_draws

    index = json.loads((lcm_tiny / "references" / "img2img.json").read_text())
    case = {c["name"]: c for c in index["cases"]}[name]
    references = lcm_tiny / "references"
    init = references / case["init_image"]
    with Image.open(init) as opened:
        pixels = np.asarray(opened.convert("RGB"))
    steps, strength = case["num_inference_steps"], case["strength"]
    scheduler = refs.make_scheduler(case["scheduler"], steps, strength)
    assert list(scheduler.timesteps) == case["timesteps"] and case["begin_index"] == 0
    assert case["noise_draws"] == steps - 1
    embedding = refs.guidance_embedding(case["guidance_scale"], 32)
    given = {"prompt_ids": case["prompt_ids"], "timestep_cond": embedding}
    plain, _ = refs.image_to_image(lcm_tiny, case["scheduler"], steps, strength, pixels, **given,
                                   encode_noise=np.load(references / case["encode_noise"]),
                                   add_noise=np.load(references / case["add_noise"]),
                                   noise=np.load(references / case["noise"]))
    to_diffusers = float(np.abs(plain - np.load(references / case["image"])).max())

    pipe = ortpipe.load(folder, threads=1)
    result = pipe.generate(case["prompt"], images=[init], seed=9, num_steps=steps, strength=strength,
                           guidance_scale=case["guidance_scale"])
    assert result.timings.steps == steps
    sample, added, noise = ortpipe_draws(pipe, case, 9)
    mine, _ = refs.image_to_image(folder, case["scheduler"], steps, strength, pixels, **given,
                                  encode_noise=sample, add_noise=added, noise=noise[: steps - 1])
    to_plain = float(np.abs(result.image - mine).max())
    print(f"{name}: max |plain loop - diffusers| = {to_diffusers:.2e}, "
          f"|ortpipe - plain loop with ortpipe's draws| = {to_plain:.2e}")
    assert to_diffusers <= IMAGE_TOLERANCE and to_plain <= IMAGE_TOLERANCE


def test_image_to_image_with_too_little_strength_for_the_steps_is_refused(lcm_tiny: Path,
                                                                         folder: Path) -> None:
    pipe = ortpipe.load(folder, threads=1)
    init = lcm_tiny / "references" / "init.png"
    refusal = "strength 0.05 leaves LCMScheduler 2 of its original_inference_steps 50 timesteps, fewer than"
    with pytest.raises(GenerationError, match=refusal + " num_steps 4"):
        pipe.generate("a red cube", images=[init], num_steps=4, strength=0.05)


def test_the_guidance_embedding_is_what_diffusers_hands_its_unet(cases: dict[str, dict]) -> None:
    for case in cases.values():
        reference = np.array(case["guidance_embedding"], np.float32)
        assert np.abs(np.array(guidance_embedding(case["guidance_scale"], 32)) - reference).max() <= 1e-6
        assert np.abs(refs.guidance_embedding(case["guidance_scale"], 32)[0] - reference).max() <= 1e-6
    assert guidance_embedding(3.0, 5)[-1] == 0.0 and len(guidance_embedding(3.0, 5)) == 5  # odd: a 0 after


def test_guidance_is_embedded_not_batched(lcm_tiny: Path, folder: Path, cases: dict[str, dict]) -> None:
    """The folder's defaults are the pipeline's (8.5, 4 steps); the guidance scale changes the image through
    the embedding alone (one UNet row), and what only classifier-free guidance reads is refused."""
    pipe = ortpipe.load(folder, threads=1)
    settings = pipe.config.generation.settings
    assert (settings.guidance_scale, settings.num_steps) == (8.5, 4)
    case = cases["lcm-embedded-1"]
    latents = np.load(lcm_tiny / "references" / case["latents"])
    other = pipe.generate(case["prompt"], latents=latents, num_steps=1, guidance_scale=2.0).image
    assert np.abs(other - np.load(lcm_tiny / "references" / case["image"])).max() > 10 * IMAGE_TOLERANCE
    for option in ({"negative_prompt": "dark"}, {"guidance_rescale": 0.5}):
        with pytest.raises(GenerationError, match=r"takes guidance_scale as an embedding \(timestep_cond"):
            pipe.generate("a cube", num_steps=1, **option)
