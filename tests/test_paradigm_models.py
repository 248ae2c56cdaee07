"""The folders of build/paradigms.py are faithful exports, so issue 16's loops can be tested against them.

The plain onnxruntime loops of tests/paradigm_refs.py over each folder's ONNX graphs give what
sentence-transformers, transformers' VitsModel and diffusers' StableDiffusionPipeline (and its
StableDiffusionImg2ImgPipeline) computed in torch from the same weights (the references saved in each
folder's references/), within the issue's tolerances.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from build import paradigms

from tests import paradigm_refs as refs

EMBEDDING_TOLERANCE, WAVEFORM_TOLERANCE, IMAGE_TOLERANCE = 1e-5, 1e-4, 1e-3


def _json(path: Path) -> dict:
    return json.loads(path.read_text())


def _embedding_inputs(folder: Path) -> dict[str, np.ndarray]:
    inputs = _json(folder / "references" / "inputs.json")
    names = ("input_ids", "attention_mask", "token_type_ids")
    return {name: np.array(inputs[name], dtype=np.int64) for name in names}


# --- sentence embeddings -------------------------------------------------------------------------

@pytest.mark.slow  # builds models (parametrized fixtures escape conftest's automatic mark)
@pytest.mark.parametrize(("fixture", "pooling", "normalized"), [
    ("st_minilm", "mean", True), ("st_minilm_cls", "cls", True), ("st_minilm_nonorm", "mean", False)])
def test_embeddings_match_sentence_transformers(fixture: str, pooling: str, normalized: bool,
                                                request: pytest.FixtureRequest) -> None:
    folder = request.getfixturevalue(fixture)
    assert (refs.pooling_mode(folder), refs.normalizes(folder)) == (pooling, normalized)
    expected = np.load(folder / "references" / "embeddings.npy")
    actual = refs.embed(folder, _embedding_inputs(folder))
    assert actual.shape == expected.shape == (len(paradigms.EMBED_TEXTS), paradigms.BERT["hidden_size"])
    difference = float(np.abs(actual - expected).max())
    print(f"{fixture}: max |onnxruntime - sentence-transformers| = {difference:.2e}")
    assert difference <= EMBEDDING_TOLERANCE


def test_embedding_tokenizer_json_gives_the_reference_ids(st_minilm: Path) -> None:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(st_minilm / "tokenizer.json"))
    tokenizer.enable_padding(pad_id=0, pad_token="[PAD]")
    encodings = tokenizer.encode_batch(list(paradigms.EMBED_TEXTS))
    inputs = _json(st_minilm / "references" / "inputs.json")
    assert [e.ids for e in encodings] == inputs["input_ids"]
    assert [e.attention_mask for e in encodings] == inputs["attention_mask"]
    assert [e.type_ids for e in encodings] == inputs["token_type_ids"]


def test_embeddings_do_not_depend_on_padding(st_minilm: Path) -> None:
    """Each text alone (no padding) embeds as it does in the padded batch."""
    batch = _embedding_inputs(st_minilm)
    expected = np.load(st_minilm / "references" / "embeddings.npy")
    for row, length in enumerate(batch["attention_mask"].sum(axis=1)):
        alone = {name: value[row:row + 1, :length] for name, value in batch.items()}
        assert np.abs(refs.embed(st_minilm, alone) - expected[row]).max() <= EMBEDDING_TOLERANCE


# --- VITS ----------------------------------------------------------------------------------------

def test_vits_matches_transformers(vits_tiny: Path) -> None:
    inputs = _json(vits_tiny / "references" / "inputs.json")
    assert inputs["sampling_rate"] == _json(vits_tiny / "config.json")["sampling_rate"]
    for case in inputs["cases"]:
        assert refs.vits_ids(vits_tiny, case["text"]) == case["input_ids"]
        expected = np.load(vits_tiny / "references" / case["waveform"])
        actual = refs.speak(vits_tiny, case["input_ids"])
        assert actual.shape == expected.shape == (1, case["samples"])
        difference = float(np.abs(actual - expected).max())
        print(f"{case['text']!r}: {case['samples']} samples, "
              f"max |onnxruntime - transformers| = {difference:.2e}")
        assert difference <= WAVEFORM_TOLERANCE


# --- Stable Diffusion ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def sd_cases(sd_tiny: Path) -> dict[str, dict]:
    return {case["name"]: case for case in _json(sd_tiny / "references" / "cases.json")["cases"]}


def _generate(folder: Path, case: dict, noise: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    references = folder / "references"
    if noise is None and case["noise"]:
        noise = np.load(references / case["noise"])
    return refs.generate_image(folder, case["scheduler"], case["num_inference_steps"],
                               np.load(references / case["latents"]), prompt_ids=case["prompt_ids"],
                               negative_prompt_ids=case["negative_prompt_ids"],
                               guidance_scale=case["guidance_scale"],
                               guidance_rescale=case["guidance_rescale"], noise=noise, eta=case["eta"])


def _against_references(folder: Path, name: str, case: dict, image: np.ndarray, latents: np.ndarray
                        ) -> tuple[float, float]:
    """(max |image - diffusers' image|, the final latents' largest difference relative to their largest)."""
    expected = np.load(folder / "references" / case["image"])
    expected_latents = np.load(folder / "references" / case["final_latents"])
    assert image.shape == expected.shape == (1, 32, 32, 3)
    difference = float(np.abs(image - expected).max())
    drift = float(np.abs(latents - expected_latents).max() / np.abs(expected_latents).max())
    print(f"{name}: max |image difference| = {difference:.2e}, final latents relative {drift:.1e}")
    return difference, drift


@pytest.mark.slow
@pytest.mark.parametrize("name", [case[0] for case in paradigms.SD_CASES])
def test_image_matches_diffusers(name: str, sd_tiny: Path, sd_cases: dict[str, dict]) -> None:
    case = sd_cases[name]
    scheduler = refs.make_scheduler(case["scheduler"], case["num_inference_steps"], eta=case["eta"])
    assert np.allclose(scheduler.timesteps, case["timesteps"], rtol=0, atol=1e-3)
    assert len(scheduler.noise_steps) == case["noise_draws"]
    difference, drift = _against_references(sd_tiny, name, case, *_generate(sd_tiny, case))
    assert difference <= IMAGE_TOLERANCE
    # Euler with zero terminal SNR starts from latents 4096 times the noise (sigma of alpha 2**-24), and
    # diffusers computes that schedule in float32 (its rescaled alpha products differ from float64's by up
    # to 3.8e-5 near the end): there its latents drift up to 5.3e-5 from the float64 port's.
    scheduler = case["scheduler"]
    zero_snr_euler = scheduler.get("rescale_betas_zero_snr") and "Euler" in scheduler["_class_name"]
    assert drift <= (1e-4 if zero_snr_euler else 1e-5)


def test_a_folder_with_another_scheduler(sd_tiny: Path, sd_cases: dict[str, dict], tmp_path: Path) -> None:
    """with_scheduler puts a case's scheduler into a copy of the folder; read back, it gives its image."""
    case = sd_cases["dpm-v-trailing"]
    folder = refs.with_scheduler(sd_tiny, case["scheduler"], tmp_path / "sd")
    config = _json(folder / "scheduler" / "scheduler_config.json")
    assert config["_class_name"] == "DPMSolverMultistepScheduler"
    references = sd_tiny / "references"
    latents = np.load(references / case["latents"])
    image, _ = refs.generate_image(folder, config, case["num_inference_steps"], latents,
                                   prompt_ids=case["prompt_ids"])
    assert np.abs(image - np.load(references / case["image"])).max() <= IMAGE_TOLERANCE


@pytest.mark.slow
@pytest.mark.parametrize("name", ["euler_a-eps-leading", "lcm-eps-4", "kdpm2_a-eps-linspace",
                                  "ddim-eta-eps-leading-cfg", "tcd-eps-cfg"])
def test_noisy_schedulers_use_the_given_noise(name: str, sd_tiny: Path, sd_cases: dict[str, dict]) -> None:
    """Without the case's noise the image is far off: the references really depend on the injected noise."""
    case = sd_cases[name]
    silent = np.zeros_like(np.load(sd_tiny / "references" / case["noise"]))
    image, _ = _generate(sd_tiny, case, noise=silent)
    assert np.abs(image - np.load(sd_tiny / "references" / case["image"])).max() > 100 * IMAGE_TOLERANCE


# --- Stable Diffusion, image to image -----------------------------------------------------------

@pytest.fixture(scope="module")
def img2img_cases(sd_tiny: Path) -> dict[str, dict]:
    return {case["name"]: case for case in _json(sd_tiny / "references" / "img2img.json")["cases"]}


def _pixels(path: Path) -> np.ndarray:
    from PIL import Image

    with Image.open(path) as image:
        return np.asarray(image.convert("RGB"))


def _image_to_image(folder: Path, case: dict, **changed) -> tuple[np.ndarray, np.ndarray]:
    """The plain loop on a case with diffusers' noises and init image, any of them `changed`."""
    references = folder / "references"
    inputs = {"strength": case["strength"], "image": _pixels(references / case["init_image"]),
              "encode_noise": np.load(references / case["encode_noise"]),
              "add_noise": np.load(references / case["add_noise"]),
              "noise": np.load(references / case["noise"]) if case["noise"] else None, **changed}
    return refs.image_to_image(folder, case["scheduler"], case["num_inference_steps"], inputs.pop("strength"),
                               inputs.pop("image"), prompt_ids=case["prompt_ids"],
                               negative_prompt_ids=case["negative_prompt_ids"],
                               guidance_scale=case["guidance_scale"], **inputs)


@pytest.mark.slow
@pytest.mark.parametrize("name", [case[0] for case in paradigms.IMG2IMG_CASES])
def test_image_to_image_matches_diffusers(name: str, sd_tiny: Path, img2img_cases: dict[str, dict]) -> None:
    case = img2img_cases[name]
    scheduler = refs.make_scheduler(case["scheduler"], case["num_inference_steps"])
    start = refs.strength_start(scheduler, case["num_inference_steps"], case["strength"])
    assert start == case["begin_index"]
    assert np.allclose(scheduler.timesteps[start:], case["timesteps"], rtol=0, atol=1e-3)
    assert len([i for i in scheduler.noise_steps if i >= start]) == case["noise_draws"]
    difference, drift = _against_references(sd_tiny, name, case, *_image_to_image(sd_tiny, case))
    assert difference <= IMAGE_TOLERANCE
    assert drift <= 1e-5


def test_image_to_image_references_depend_on_their_inputs(sd_tiny: Path,
                                                          img2img_cases: dict[str, dict]) -> None:
    """The encoder's noise, the added noise, the strength and the init image each move the image far off
    diffusers' (so the references test each of them)."""
    case = img2img_cases["i2i-pndm-eps-leading-cfg"]
    expected = np.load(sd_tiny / "references" / case["image"])
    zeros = np.zeros((1, 4, 8, 8), np.float32)
    init = _pixels(sd_tiny / "references" / case["init_image"])
    changes = {"no encoder noise": {"encode_noise": zeros}, "no added noise": {"add_noise": zeros},
               "strength 0.4": {"strength": 0.4}, "the image upside down": {"image": init[::-1].copy()}}
    for what, changed in changes.items():
        difference = float(np.abs(_image_to_image(sd_tiny, case, **changed)[0] - expected).max())
        print(f"{what}: max |image difference| = {difference:.2e}")
        assert difference > 10 * IMAGE_TOLERANCE, what


def test_image_to_image_init_is_a_fixed_png(sd_tiny: Path, tmp_path: Path) -> None:
    """init.png: 32 x 32 RGB, the bytes build/paradigms.py writes (the same each build)."""
    references = sd_tiny / "references"
    index = _json(references / "img2img.json")
    assert {case["init_image"] for case in index["cases"]} == {index["init_image"], paradigms.IMG2IMG_INIT}
    assert _pixels(references / index["init_image"]).shape == (32, 32, 3)
    expected = paradigms.init_image(tmp_path / "init.png").read_bytes()
    assert (references / index["init_image"]).read_bytes() == expected


def test_clip_tokenizer_gives_the_reference_ids(sd_tiny: Path, sd_cases: dict[str, dict],
                                                img2img_cases: dict[str, dict]) -> None:
    from transformers import CLIPTokenizer

    tokenizer = CLIPTokenizer.from_pretrained(str(sd_tiny / "tokenizer"))
    for case in [*sd_cases.values(), *img2img_cases.values()]:
        negative = case["negative_prompt"] or ""  # diffusers' unconditional text when none is given
        for text, ids in ((case["prompt"], case["prompt_ids"]), (negative, case["negative_prompt_ids"])):
            if ids is not None:
                assert tokenizer(text, padding="max_length", max_length=77, truncation=True).input_ids == ids


def test_image_to_image_cases_cover_the_starts() -> None:
    """Image-to-image cases that start part-way (a multistep solver's warm-up, PNDM's counter, a two-run
    scheduler's start), from the top (strength 1), with step noise, guided and not."""
    cases = {case["name"]: case for case in paradigms.img2img_cases()}
    starts = {}
    for name, case in cases.items():
        scheduler = refs.make_scheduler(case["scheduler"], case["num_inference_steps"])
        starts[name] = refs.strength_start(scheduler, case["num_inference_steps"], case["strength"])
        assert starts[name] < len(scheduler.timesteps), name
    classes = {case["scheduler"]["_class_name"] for name, case in cases.items() if starts[name] > 0}
    assert {"PNDMScheduler", "DPMSolverMultistepScheduler", "HeunDiscreteScheduler",
            "KDPM2DiscreteScheduler", "EulerAncestralDiscreteScheduler", "DDIMScheduler"} <= classes
    assert 0 in starts.values()
    assert {case["guidance_scale"] > 1 for case in cases.values()} == {False, True}
    assert any(case["noisy"] for case in cases.values())


def test_cases_cover_the_issue() -> None:
    """Every scheduler with both prediction types and every spacing, guidance off and on (negative prompt)."""
    schedulers = {cls for _, cls, *_ in paradigms.SD_CASES}
    assert schedulers == set(refs.SCHEDULERS)
    for cls in schedulers:
        rows = [case for case in paradigms.SD_CASES if case[1] == cls]
        assert {row[2] for row in rows} == {"epsilon", "v_prediction"}, cls
        assert {row[5] > 1 for row in rows} == {False, True}, cls
        assert any(row[5] > 1 and row[6] for row in rows), cls
        if cls not in ("LCMScheduler", "TCDScheduler", "EDMEulerScheduler"):  # they have no timestep spacing
            assert {row[3] for row in rows} == {"linspace", "leading", "trailing"}, cls
