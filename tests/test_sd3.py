"""Stable Diffusion 3 folders (issue 16): three text encoders with their own tokenizers (T5's rows 256 ids,
padded), the CLIP encoders' penultimate states side by side, zero-padded to T5's width and joined with T5's
along the sequence (a wire of grouped sources), their pooled projections side by side, an SD3 transformer
stepped by flow matching's Euler scheduler, a VAE whose latents are unscaled and shifted; detected from
optimum's export of a tiny random StableDiffusion3Pipeline (build/paradigms.py, sd3-tiny).

Each case's image equals diffusers' StableDiffusion3Pipeline given the same initial latents, and the plain
onnxruntime loop of tests/paradigm_refs.py, within the issue's 1e-3.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from build import paradigms

import ortpipe
from ortpipe.errors import ConfigError
from ortpipe.loops.schedulers import make_schedule
from ortpipe.loops.text import encode_texts
from tests import diffusers_folders as folders
from tests import paradigm_refs as refs

IMAGE_TOLERANCE = 1e-3
CASES = [case[0] for case in paradigms.SD3_CASES]


@pytest.fixture(scope="module")
def cases(sd3_tiny: Path) -> dict[str, dict]:
    return folders.cases(sd3_tiny)


@pytest.fixture
def folder(sd3_tiny: Path, tmp_path: Path) -> Path:
    """sd3-tiny without its references: a folder a test may change."""
    return folders.copy(sd3_tiny, tmp_path / "sd3")


@pytest.mark.slow
@pytest.mark.parametrize("name", CASES)
def test_images_equal_diffusers_and_the_plain_loop(name: str, sd3_tiny: Path, folder: Path,
                                                   cases: dict[str, dict]) -> None:
    case = cases[name]
    pipe = ortpipe.load(folders.scheduled(folder, case), threads=1)
    schedule = make_schedule(pipe.model.loop.denoising.scheduler, case["num_inference_steps"])
    assert [s.timestep for s in schedule.steps] == case["timesteps"]  # float32 values, exactly diffusers'
    latents = np.load(sd3_tiny / "references" / case["latents"])
    guided = case["guidance_scale"] > 1
    result = pipe.generate(case["prompt"], latents=latents, num_steps=case["num_inference_steps"],
                           guidance_scale=case["guidance_scale"],
                           negative_prompt=case["negative_prompt"] if guided else None)
    assert result.finish_reason == "done" and result.timings.steps == len(case["timesteps"])
    expected = np.load(sd3_tiny / "references" / case["image"])
    _assert_as_references(name, result.image, expected, folder, case, latents)


def _assert_as_references(name: str, image: np.ndarray, expected: np.ndarray, folder: Path, case: dict,
                          latents: np.ndarray) -> None:
    """`image` equals diffusers' (`expected`) and the plain onnxruntime loop's, which equals diffusers'."""
    plain = refs.generate_image_sd3(folder, case["scheduler"], case["num_inference_steps"], latents,
                                    prompt_ids=case["prompt_ids"],
                                    negative_prompt_ids=case["negative_prompt_ids"],
                                    guidance_scale=case["guidance_scale"])
    to_diffusers = float(np.abs(image - expected).max())
    to_plain = float(np.abs(image - plain).max())
    print(f"{name}: max |ortpipe - diffusers| = {to_diffusers:.2e}, |ortpipe - plain loop| = {to_plain:.2e}")
    assert image.shape == expected.shape == (1, 32, 32, 3)
    assert to_diffusers <= IMAGE_TOLERANCE and to_plain <= IMAGE_TOLERANCE
    assert np.abs(plain - expected).max() <= IMAGE_TOLERANCE  # the plain loop is diffusers' computation


# --- image to image ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def img2img_cases(sd3_tiny: Path) -> dict[str, dict]:
    return {c["name"]: c for c in json.loads((sd3_tiny / "references" / "img2img.json").read_text())["cases"]}


def _pixels(path: Path) -> np.ndarray:
    from PIL import Image

    with Image.open(path) as image:
        return np.asarray(image.convert("RGB"))


def _plain_img2img(folder: Path, case: dict, image: np.ndarray, encode_noise: np.ndarray,
                   add_noise: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return refs.image_to_image_sd3(folder, case["scheduler"], case["num_inference_steps"], case["strength"],
                                   image, encode_noise=encode_noise, add_noise=add_noise,
                                   prompt_ids=case["prompt_ids"],
                                   negative_prompt_ids=case["negative_prompt_ids"],
                                   guidance_scale=case["guidance_scale"])


@pytest.mark.slow
@pytest.mark.parametrize("name", [case[0] for case in paradigms.SD3_IMG2IMG_CASES])
def test_image_to_image_equals_diffusers_and_the_plain_loop(name: str, sd3_tiny: Path, folder: Path,
                                                            img2img_cases: dict[str, dict]) -> None:
    """StableDiffusion3Img2ImgPipeline's rule: the last steps - int(steps - steps * strength) steps (the
    float product: 5 of 6 at 0.75, where Stable Diffusion's pipeline keeps 4), the image's latents shifted,
    scaled and noised by scale_noise. The plain loop given diffusers' two draws equals diffusers; ortpipe,
    from its seed, equals the plain loop given ortpipe's draws."""
    from tests.test_image_to_image import ortpipe_draws

    case = img2img_cases[name]
    references = sd3_tiny / "references"
    init = references / case["init_image"]
    expected = np.load(references / case["image"])
    start = refs.flow_strength_start(case["num_inference_steps"], case["strength"])
    assert start == case["begin_index"]
    plain, latents = _plain_img2img(sd3_tiny, case, _pixels(init), np.load(references / case["encode_noise"]),
                                    np.load(references / case["add_noise"]))
    to_diffusers = float(np.abs(plain - expected).max())
    final = np.load(references / case["final_latents"])
    drift = float(np.abs(latents - final).max() / np.abs(final).max())  # relative to the largest

    pipe = ortpipe.load(folders.scheduled(folder, case), threads=1)
    guided = case["guidance_scale"] > 1
    result = pipe.generate(case["prompt"], images=[init], seed=7, num_steps=case["num_inference_steps"],
                           strength=case["strength"], guidance_scale=case["guidance_scale"],
                           negative_prompt=case["negative_prompt"] if guided else None)
    setup = pipe.model.loop.denoising
    assert setup.latent_multiple == 2  # the transformer's patch_size: an image's sides are multiples of 8
    schedule = make_schedule(setup.scheduler, case["num_inference_steps"], case["strength"])
    assert [s.timestep for s in schedule.steps] == case["timesteps"]  # float32 values, exactly diffusers'
    assert result.timings.steps == len(case["timesteps"])
    sample, added, _ = ortpipe_draws(pipe, case, 7)
    mine, _ = _plain_img2img(folder, case, _pixels(init), sample, added)
    to_plain = float(np.abs(result.image - mine).max())
    print(f"{name}: max |plain loop - diffusers| = {to_diffusers:.2e} (final latents relative {drift:.1e}), "
          f"|ortpipe - plain loop with ortpipe's draws| = {to_plain:.2e}")
    assert expected.shape == result.image.shape == (1, 32, 32, 3)
    assert to_diffusers <= IMAGE_TOLERANCE and drift <= 1e-5 and to_plain <= IMAGE_TOLERANCE
    # the draws matter: each zeroed moves the image far off (at strength 1 the image is all noise)
    changes = {"added noise zeroed": (sample, 0 * added)}
    if case["strength"] < 1:
        changes["encode noise zeroed"] = (np.zeros_like(sample), added)
    for what, (e1, e2) in changes.items():
        other, _ = _plain_img2img(folder, case, _pixels(init), e1, e2)
        assert np.abs(other - result.image).max() > 10 * IMAGE_TOLERANCE, what


@pytest.mark.slow
@pytest.mark.parametrize("name", [case[0] for case in paradigms.SD3_INPAINT_CASES])
def test_inpainting_equals_diffusers_and_the_plain_loop(name: str, sd3_tiny: Path, folder: Path) -> None:
    """StableDiffusion3InpaintPipeline with a transformer of the latents' 16 channels: after each step the
    kept region goes back to the image's latents, noised by flow matching's scale_noise to the next sigma
    (clean after the last). The strength defaults to the pipeline's 0.6 (the detected config's strength).
    The plain loop given diffusers' draws equals diffusers; ortpipe, from its seed, equals the plain loop
    given ortpipe's draws; the mask matters (inverted, the image moves far).

    diffusers 0.42.1's pipeline decodes without the VAE's shift factor (its issue #13611), unlike its other
    SD3 pipelines and its own encoding: the reference is its final latents decoded with the shift, as
    ortpipe decodes every SD3 image; the pipeline's own image is far from it."""
    from tests.test_image_to_image import ortpipe_draws

    index = json.loads((sd3_tiny / "references" / "inpaint.json").read_text())
    case = {c["name"]: c for c in index["cases"]}[name]
    references = sd3_tiny / "references"
    init, mask = _pixels(references / case["init_image"]), _pixels(references / case["mask_image"])

    def plain(where: Path, sample: np.ndarray, added: np.ndarray, repaint: np.ndarray = mask
              ) -> tuple[np.ndarray, np.ndarray]:
        return refs.inpaint_sd3(where, case["scheduler"], case["num_inference_steps"], case["strength"],
                                init, repaint, encode_noise=sample, add_noise=added,
                                prompt_ids=case["prompt_ids"],
                                negative_prompt_ids=case["negative_prompt_ids"],
                                guidance_scale=case["guidance_scale"])

    expected = np.load(references / case["image"])
    final = np.load(references / case["final_latents"])
    image, latents = plain(sd3_tiny, np.load(references / case["encode_noise"]),
                           np.load(references / case["add_noise"]))
    to_diffusers = float(np.abs(image - expected).max())
    drift = float(np.abs(latents - final).max() / np.abs(final).max())
    pipe = ortpipe.load(folders.scheduled(folder, case), threads=1)
    guided = case["guidance_scale"] > 1
    strength = {} if case["strength"] == 0.6 else {"strength": case["strength"]}  # the default: 0.6
    result = pipe.generate(case["prompt"], images=[references / case["init_image"]],
                           mask=references / case["mask_image"], seed=8,
                           num_steps=case["num_inference_steps"],
                           guidance_scale=case["guidance_scale"],
                           negative_prompt=case["negative_prompt"] if guided else None, **strength)
    assert result.timings.steps == len(case["timesteps"])
    sample, added, _ = ortpipe_draws(pipe, case, 8)
    mine, _ = plain(folder, sample, added)
    to_plain = float(np.abs(result.image - mine).max())
    print(f"{name}: max |plain loop - diffusers| = {to_diffusers:.2e} (final latents relative {drift:.1e}), "
          f"|ortpipe - plain loop with ortpipe's draws| = {to_plain:.2e}")
    assert expected.shape == result.image.shape == (1, 32, 32, 3)
    assert to_diffusers <= IMAGE_TOLERANCE and drift <= 1e-5 and to_plain <= IMAGE_TOLERANCE
    assert np.abs(np.load(references / case["unshifted_image"]) - expected).max() > 10 * IMAGE_TOLERANCE
    inverted, _ = plain(folder, sample, added, 255 - mask)
    assert np.abs(inverted - result.image).max() > 10 * IMAGE_TOLERANCE


@pytest.mark.slow
def test_each_encoder_reads_its_own_tokenizers_ids(folder: Path, cases: dict[str, dict]) -> None:
    """The rows ortpipe makes for each text encoder are the ids diffusers' pipeline gave it: CLIP's 77, the
    second CLIP's padded with "!", T5's padded with <pad> to 256."""
    case = cases["sd3-flow-shift3-cfg-neg"]
    pipe = ortpipe.load(folder, threads=1)
    loop = pipe.model.loop
    made = {}
    for name, (tokenizer, text) in loop.own.items():
        (ids,) = encode_texts(tokenizer, [case["prompt"]], text.max_length)
        made[name] = ids + [text.pad_id] * (text.max_length - len(ids))
    (ids,) = encode_texts(pipe.model.tokenizer, [case["prompt"]], loop.text.max_length)
    made["text_encoder"] = ids + [loop.text.pad_id] * (loop.text.max_length - len(ids))
    names = ("text_encoder", "text_encoder_2", "text_encoder_3")
    expected = dict(zip(names, case["prompt_ids"], strict=True))
    assert made == expected
    assert len(expected["text_encoder_3"]) == 256 and expected["text_encoder_2"] != expected["text_encoder"]


@pytest.mark.slow
def test_the_vae_shift_makes_the_image(sd3_tiny: Path, folder: Path, cases: dict[str, dict]) -> None:
    """The VAE's shift factor is applied: without it the image is far from diffusers'."""
    case = cases["sd3-flow-shift1"]
    vae = json.loads((folder / "vae_decoder" / "config.json").read_text())
    assert vae["shift_factor"] == 0.0609
    (folder / "vae_decoder" / "config.json").write_text(json.dumps({**vae, "shift_factor": None}))
    pipe = ortpipe.load(folders.scheduled(folder, case), threads=1)
    latents = np.load(sd3_tiny / "references" / case["latents"])
    unshifted = pipe.generate(case["prompt"], latents=latents, num_steps=case["num_inference_steps"],
                              guidance_scale=1.0).image
    assert np.abs(unshifted - np.load(sd3_tiny / "references" / case["image"])).max() > 10 * IMAGE_TOLERANCE


def test_the_detected_config(sd3_tiny: Path) -> None:
    from ortpipe.detect import detect_config
    from ortpipe.folder import LocalFolder

    config = detect_config(LocalFolder(sd3_tiny))
    sessions = config["pipeline"]["sessions"]
    assert sessions["text_encoder_3"] == {"file": "text_encoder_3/model.onnx", "tokenizer": "tokenizer_3",
                                          "max_length": 256}
    assert sessions["transformer"]["inputs"] == {"sample": "hidden_states"}
    assert config["pipeline"]["dataflow"][:2] == [
        {"from": [["text_encoder.hidden_states.1", "text_encoder_2.hidden_states.2"],
                  "text_encoder_3.last_hidden_state"], "to": "transformer.encoder_hidden_states"},
        {"from": ["text_encoder.text_embeds", "text_encoder_2.text_embeds"],
         "to": "transformer.pooled_projections"}]
    assert config["generation"] == {"loop": "denoising", "num_steps": 28, "guidance_scale": 7.0,
                                    "strength": 0.6}


@pytest.mark.slow
def test_the_expanded_config_loads_the_same(folder: Path) -> None:
    folders.expanded_config_makes_the_same_image(folder, guidance_scale=4.0)


def _scheduler(folder: Path, **fields: object) -> None:
    path = folder / "scheduler" / "scheduler_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **fields}))


@pytest.mark.parametrize(("edit", "message"), [
    (lambda f: folders.with_v2(f, lambda c: c["pipeline"]["dataflow"][0].update(
        {"from": [[], "text_encoder_3.x"]})),
     "or a list of two or more such lists, names and"),
    *((lambda f, bad=bad: folders.with_v2(f, lambda c: c["pipeline"]["dataflow"][0].update({"from": bad})),
       r'\{"zeros": ROWS\} \(each list joined so')
      for bad in ([["text_encoder.text_embeds"], {"zeros": 0}],
                  [["text_encoder.text_embeds"], {"zeros": True}],
                  [["text_encoder.text_embeds"], {"zeros": 3, "width": 8}], [{"zeros": 3}, {"zeros": 4}],
                  [{"zeros": 3}], ["text_encoder.text_embeds", [{"zeros": 3}]])),
    (lambda f: folders.with_v2(f, lambda c: c["pipeline"]["sessions"]["text_encoder"].update(max_length=10)),
     "sessions.text_encoder.max_length pads and truncates the rows of the session's own tokenizer"),
    (lambda f: folders.with_v2(f, lambda c: c["pipeline"]["sessions"]["text_encoder_3"].update(max_length=0)),
     "sessions.text_encoder_3.max_length must be"),
    (lambda f: _scheduler(f, use_dynamic_shifting=True),
     "FlowMatchEulerDiscreteScheduler with use_dynamic_shifting True is not run by ortpipe"),
    (lambda f: _scheduler(f, shift=0), "shift must be a positive number, found 0"),
    (lambda f: (f / "text_encoder_3" / "model.onnx").unlink(),
     r"has model_index.json \(StableDiffusion3Pipeline\) but not text_encoder_3/model.onnx"),
])
def test_what_the_loop_cannot_run_is_refused_at_load(folder: Path, edit, message: str) -> None:  # noqa: ANN001
    edit(folder)
    with pytest.raises(ConfigError, match=message):
        ortpipe.load(folder)


# --- without T5 ------------------------------------------------------------------------------------------


def without_t5(folder: Path) -> Path:
    """`folder` as StableDiffusion3Pipeline.save_pretrained writes a pipeline loaded with text_encoder_3=None
    and tokenizer_3=None: neither part, both listed as [null, null]."""
    for part in ("text_encoder_3", "tokenizer_3"):
        shutil.rmtree(folder / part)
    index = json.loads((folder / "model_index.json").read_text())
    (folder / "model_index.json").write_text(json.dumps({**index, "text_encoder_3": [None, None],
                                                         "tokenizer_3": [None, None]}))
    return folder


@pytest.fixture(scope="module")
def no_t5_cases(sd3_tiny: Path) -> dict[str, dict]:
    index = json.loads((sd3_tiny / "references" / paradigms.SD3_NO_T5_INDEX).read_text())
    return {case["name"]: case for case in index["cases"]}


@pytest.mark.slow
@pytest.mark.parametrize("name", [case[0] for case in paradigms.SD3_NO_T5_CASES])
def test_without_t5_images_equal_diffusers_and_the_plain_loop(name: str, sd3_tiny: Path, folder: Path,
                                                              no_t5_cases: dict[str, dict]) -> None:
    """A folder saved without T5 runs as diffusers' StableDiffusion3Pipeline loaded with text_encoder_3=None:
    256 rows of zeros, as wide as the transformer's joint attention, where T5's states go. The T5 states
    matter: the full folder given the same latents makes another image."""
    case = no_t5_cases[name]
    references = sd3_tiny / "references"
    latents = np.load(references / case["latents"])
    request = {"latents": latents, "num_steps": case["num_inference_steps"],
               "guidance_scale": case["guidance_scale"],
               "negative_prompt": case["negative_prompt"] if case["guidance_scale"] > 1 else None}
    with_t5 = ortpipe.load(folders.scheduled(folder, case), threads=1).generate(case["prompt"], **request)
    pipe = ortpipe.load(without_t5(folder), threads=1)
    assert "text_encoder_3" not in pipe.config.pipeline.sessions
    result = pipe.generate(case["prompt"], **request)
    expected = np.load(references / case["image"])
    assert len(case["prompt_ids"]) == 2  # diffusers tokenized for the two CLIP encoders only
    _assert_as_references(name, result.image, expected, folder, case, latents)
    assert np.abs(with_t5.image - expected).max() > 10 * IMAGE_TOLERANCE


def test_the_detected_config_without_t5(folder: Path) -> None:
    from ortpipe.detect import detect_config
    from ortpipe.folder import LocalFolder

    config = detect_config(LocalFolder(without_t5(folder)))
    assert set(config["pipeline"]["sessions"]) == {"text_encoder", "text_encoder_2", "transformer",
                                                   "vae_decoder", "vae_encoder"}
    assert [step["run"] for step in config["pipeline"]["flow"]][:2] == ["text_encoder", "text_encoder_2"]
    assert config["pipeline"]["dataflow"][0] == {
        "from": [["text_encoder.hidden_states.1", "text_encoder_2.hidden_states.2"], {"zeros": 256}],
        "to": "transformer.encoder_hidden_states"}
    pipe = ortpipe.load(folder)
    (wire,) = [w for w in pipe.config.pipeline.dataflow if w.to_input == "encoder_hidden_states"]
    assert str(wire) == ("text_encoder.hidden_states.1 + text_encoder_2.hidden_states.2 + zeros(256) -> "
                         "transformer.encoder_hidden_states")


@pytest.mark.slow
def test_the_expanded_config_without_t5_loads_the_same(folder: Path) -> None:
    folders.expanded_config_makes_the_same_image(without_t5(folder), guidance_scale=4.0)


@pytest.mark.slow
def test_zero_rows_go_where_the_wire_puts_them(sd3_tiny: Path, folder: Path, cases: dict[str, dict],
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Zeros before, between and after the groups, each as many rows as written, as wide as the input: the
    image of the plain loop given that conditioning by hand."""
    case = cases["sd3-flow-shift1"]
    clip = ["text_encoder.hidden_states.1", "text_encoder_2.hidden_states.2"]
    wire = [{"zeros": 5}, clip, {"zeros": 2}, {"zeros": 1}, "text_encoder_3.last_hidden_state", {"zeros": 3}]
    folders.with_v2(folders.scheduled(folder, case),
                    lambda c: c["pipeline"]["dataflow"][0].update({"from": wire}))
    latents = np.load(sd3_tiny / "references" / case["latents"])
    image = ortpipe.load(folder, threads=1).generate(case["prompt"], latents=latents, guidance_scale=1.0,
                                                     num_steps=case["num_inference_steps"]).image
    encode = refs.encode_prompt_sd3

    def rearranged(where: Path, ids: list) -> tuple[np.ndarray, np.ndarray]:
        states, pooled = encode(where, ids)  # CLIP's 77 rows padded to 96 wide, then T5's 256
        zeros = [np.zeros((1, n, 96), np.float32) for n in (5, 3, 3)]
        return np.concatenate([zeros[0], states[:, :77], zeros[1], states[:, 77:], zeros[2]], axis=1), pooled

    monkeypatch.setattr(refs, "encode_prompt_sd3", rearranged)
    plain = refs.generate_image_sd3(folder, case["scheduler"], case["num_inference_steps"], latents,
                                    prompt_ids=case["prompt_ids"], negative_prompt_ids=None)
    assert np.abs(image - plain).max() <= IMAGE_TOLERANCE
    # the rows moved it off the image without them (attention over more rows; by a little on tiny weights)
    assert np.abs(image - np.load(sd3_tiny / "references" / case["image"])).max() > IMAGE_TOLERANCE


def test_a_flux_like_folder_is_still_refused(folder: Path) -> None:
    """A transformer folder whose transformer is not SD3's and has no text_encoder_3 (FluxPipeline's layout:
    CLIP and T5 as text_encoder and text_encoder_2) is refused, not run as SD3 without T5."""
    without_t5(folder)
    index = json.loads((folder / "model_index.json").read_text())
    (folder / "model_index.json").write_text(json.dumps({
        **index, "_class_name": "FluxPipeline", "transformer": ["diffusers", "FluxTransformer2DModel"]}))
    with pytest.raises(ConfigError, match="is FluxPipeline, with transformer: ortpipe detects"):
        ortpipe.load(folder)


def test_a_group_wider_than_the_input_is_refused(folder: Path) -> None:
    """Groups are padded to the input's static width, never cut: one wider is a GenerationError naming both
    widths (the transformer would fail inside onnxruntime)."""
    from ortpipe.errors import GenerationError

    wide = ["text_encoder.hidden_states.1", "text_encoder_2.hidden_states.2", "text_encoder.hidden_states.0"]
    wire = [wide, {"zeros": 1}]  # 32 + 48 + 32 wide
    folders.with_v2(folder, lambda c: c["pipeline"]["dataflow"][0].update({"from": wire}))
    pipe = ortpipe.load(folder, threads=1)
    with pytest.raises(GenerationError, match="is 112 wide, wider than its input's 96: groups are zero-"):
        pipe.generate("a cube", num_steps=1, guidance_scale=1.0)
