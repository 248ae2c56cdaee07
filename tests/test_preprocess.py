"""Preprocessing kernels and configs against transformers' processors on the same inputs.

Image processors run their PIL path (the one transformers takes without torchvision); the resize
kernels reproduce Pillow's uint8 output exactly, so pixel_values agree to float32 rounding.
"""

from __future__ import annotations

import json
import math
import wave
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from build.kernels import IR_VERSION, OPSET
from build.preprocess import PREPROCESS_KERNELS
from onnx import TensorProto, helper

from ortpipe.errors import ConfigError, GenerationError
from ortpipe.execute.work import Run
from ortpipe.folder import LocalFolder
from ortpipe.preprocess import (
    Features,
    audio_config,
    audio_features,
    image_config,
    image_features,
    load_audio_config,
    load_image_config,
    sizes,
    target_size,
)
from ortpipe.preprocess.config import Size
from ortpipe.targets.cpython import CpuBackend, Driver
from ortpipe.targets.cpython.media import decode_image, read_wav, resample

transformers = pytest.importorskip("transformers")
Image = pytest.importorskip("PIL.Image")

TOLERANCE = 1e-4
TYPES = {"uint8": TensorProto.UINT8, "float32": TensorProto.FLOAT, "float16": TensorProto.FLOAT16}


@pytest.fixture(scope="module")
def driver() -> Driver:
    """A driver whose kernel sessions are freshly built from build/preprocess.py."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    sessions = {}
    for name, (make, types) in PREPROCESS_KERNELS.items():
        for type_name in types:
            model = helper.make_model(make(TYPES[type_name]), opset_imports=[helper.make_opsetid("", OPSET)])
            model.ir_version = IR_VERSION
            sessions[f"kernel:{name}_{type_name}"] = ort.InferenceSession(
                model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    driver = Driver()
    driver.sessions.update(sessions)
    return driver


def noise(height: int, width: int, seed: int) -> np.ndarray:
    """Random pixels with smooth patches: the hardest case for rounding, plus realistic gradients."""
    rng = np.random.default_rng(seed)
    image = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
    image[: height // 2, : width // 2] = np.linspace(0, 255, width // 2, dtype=np.uint8)[None, :, None]
    return image


def ours(driver: Driver, config_dict: dict, image: np.ndarray, dtype: str = "float32") -> Features:
    config = image_config(config_dict, "image_processor.json")
    work = image_features(CpuBackend(), config, image, image.shape[0], image.shape[1], dtype)
    return driver.drive(work)


def compare(name: str, ours_values: np.ndarray, reference: np.ndarray) -> None:
    """Asserts the tolerance and prints the max difference (shown with pytest -s)."""
    assert ours_values.shape == reference.shape, name
    diff = float(np.abs(ours_values.astype(np.float64) - reference).max())
    print(f"{name}: max |ours - transformers| = {diff:.3g}")
    assert diff <= TOLERANCE, name


IMAGES = [(123, 457), (40, 30), (900, 700), (333, 333)]  # non-square, upscaled, downscaled, square


@pytest.mark.parametrize("height,width", IMAGES)
@pytest.mark.parametrize("settings", [{}, {"max_pixels": 200_000}, {"min_pixels": 300_000}],
                         ids=["defaults", "max-pixels", "min-pixels"])
def test_qwen2_vl_matches_transformers(driver: Driver, height: int, width: int, settings: dict) -> None:
    image = noise(height, width, height + width)
    reference = transformers.Qwen2VLImageProcessorPil(**settings)(Image.fromarray(image), return_tensors="np")
    features = ours(driver, {"image_processor_type": "Qwen2VLImageProcessor", **settings}, image)
    name = f"qwen2-vl {height}x{width} {settings}"
    compare(name, features.tensors["pixel_values"], reference["pixel_values"])
    assert features.tensors["image_grid_thw"].tolist() == reference["image_grid_thw"].tolist()
    grid = reference["image_grid_thw"][0]
    assert features.values["image_grid_thw"] == tuple(grid)
    assert features.values["image_tokens"] == (grid.prod() // 4,)


CLIP_336 = {"image_processor_type": "CLIPImageProcessor", "size": {"shortest_edge": 336},
            "crop_size": {"height": 336, "width": 336}}


@pytest.mark.parametrize("height,width", [(500, 375), (200, 100), (336, 600), (123, 457)])
def test_clip_336_matches_transformers(driver: Driver, height: int, width: int) -> None:
    image = noise(height, width, 7 * height + width)
    processor = transformers.CLIPImageProcessorPil(size={"shortest_edge": 336},
                                                   crop_size={"height": 336, "width": 336})
    reference = processor(Image.fromarray(image), return_tensors="np")["pixel_values"]
    features = ours(driver, CLIP_336, image)
    compare(f"clip-336 {height}x{width}", features.tensors["pixel_values"], reference)
    assert features.values["image_sizes"] == (336, 336)


def test_center_crop_pads_an_image_smaller_than_the_crop(driver: Driver) -> None:
    image = noise(150, 300, 3)
    settings = {"do_resize": False, "crop_size": {"height": 224, "width": 224}}
    reference = transformers.CLIPImageProcessorPil(**settings)(Image.fromarray(image), return_tensors="np")
    features = ours(driver, {"image_processor_type": "CLIPImageProcessor", **settings}, image)
    compare("clip crop 150x300 -> 224 (padded)", features.tensors["pixel_values"], reference["pixel_values"])


@pytest.mark.parametrize("height,width", [(123, 457), (40, 30), (1000, 800)])
@pytest.mark.parametrize("kind,side", [("Siglip", 224), ("Gemma3", 896), ("ViT", 224), ("ViT", 384)])
def test_siglip_gemma3_and_vit_match_transformers(driver: Driver, kind: str, side: int, height: int,
                                              width: int) -> None:
    image = noise(height, width, height * width)
    size = {"height": side, "width": side}
    processor = getattr(transformers, f"{kind}ImageProcessorPil")(size=size)
    reference = processor(Image.fromarray(image), return_tensors="np")["pixel_values"]
    features = ours(driver, {"image_processor_type": f"{kind}ImageProcessor", "size": size}, image)
    compare(f"{kind.lower()}-{side} {height}x{width}", features.tensors["pixel_values"], reference)


def test_float16_pixel_values(driver: Driver) -> None:
    image = noise(64, 48, 5)
    processor = transformers.SiglipImageProcessorPil()
    reference = processor(Image.fromarray(image), return_tensors="np")["pixel_values"]
    features = ours(driver, {"image_processor_type": "SiglipImageProcessor"}, image, "float16")
    assert features.tensors["pixel_values"].dtype == np.float16
    assert np.abs(features.tensors["pixel_values"] - reference).max() <= 2e-3  # half precision near 1


def test_seed_image_processor_json_from_a_folder(driver: Driver, tmp_path: Path) -> None:
    """Section 3.7 of seed 000: its image_processor.json, min/max pixels inside `size`."""
    seed = {"image_processor_type": "Qwen2VLImageProcessor", "resample": "bicubic", "do_resize": True,
            "size": {"min_pixels": 3136, "max_pixels": 12845056}, "do_rescale": True,
            "rescale_factor": 0.00392156862745098, "do_normalize": True,
            "image_mean": [0.48145466, 0.4578275, 0.40821073],
            "image_std": [0.26862954, 0.26130258, 0.27577711],
            "patch_size": 14, "merge_size": 2}
    (tmp_path / "image_processor.json").write_text(json.dumps(seed))
    config = load_image_config(LocalFolder(tmp_path))
    image = noise(300, 200, 11)
    features = driver.drive(image_features(CpuBackend(), config, image, 300, 200))
    processor = transformers.Qwen2VLImageProcessorPil(min_pixels=3136, max_pixels=12845056)
    reference = processor(Image.fromarray(image), return_tensors="np")
    compare("seed image_processor.json 300x200", features.tensors["pixel_values"], reference["pixel_values"])


def test_processor_config_json_sections(tmp_path: Path) -> None:
    combined = {
        "image_processor": {"image_processor_type": "SiglipImageProcessorFast", "size": 384},
        "feature_extractor": {"feature_extractor_type": "WhisperFeatureExtractor", "feature_size": 128}}
    (tmp_path / "processor_config.json").write_text(json.dumps(combined))
    folder = LocalFolder(tmp_path)
    assert load_image_config(folder).size == Size(height=384, width=384)
    assert load_audio_config(folder).feature_size == 128


def test_config_errors_name_the_problem(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="has no config for an image processor"):
        load_image_config(LocalFolder(tmp_path))
    (tmp_path / "image_processor.json").write_text(json.dumps(
        {"processor": {"name": "image_processing", "transforms": [{"operation": {"type": "DecodeImage"}}]}}))
    with pytest.raises(ConfigError, match="onnxruntime-extensions transform list"):
        load_image_config(LocalFolder(tmp_path), "image_processor.json")
    with pytest.raises(ConfigError, match='Did you mean "CLIPImageProcessor"'):
        image_config({"image_processor_type": "ClipImageProcessor"}, "x.json")
    with pytest.raises(ConfigError) as error:
        image_config({"image_processor_type": "CLIPImageProcessor", "resample": 1, "size": {"width": 3}},
                     "x.json")
    assert "'lanczos' is not supported" in str(error.value) and "x.json.size must be" in str(error.value)
    with pytest.raises(ConfigError, match="dither"):
        audio_config({"feature_extractor_type": "WhisperFeatureExtractor", "dither": 0.1}, "a.json")
    # what a fuzz of a captioner's preprocessor_config.json found: a TypeError, a resize past any memory,
    # and pixels divided by zero or NaN (the model's logits NaN at the first step)
    vit = {"image_processor_type": "ViTImageProcessor"}
    for change, words in (({"resample": [[1]]}, r"resample \[\[1\]\] is not supported"),
                          ({"size": 10**9}, "size.height must be an integer from 1 to 16384"),
                          ({"size": True}, "size must be an integer or an object"),
                          ({"image_std": 0}, "image_std must be .* finite numbers above 1e-6"),
                          ({"image_std": [0.5, float("nan"), 0.5]}, "image_std must be"),
                          ({"image_mean": float("inf")}, "image_mean must be .* finite numbers"),
                          ({"rescale_factor": float("nan")}, "rescale_factor must be a finite number")):
        with pytest.raises(ConfigError, match=words):
            image_config({**vit, **change}, "p.json")
    # a rate or a window that would make a clip of billions of samples (the fuzz found a hang at 2 ** 31 Hz)
    for key, value, words in (("sampling_rate", 2**31, "1000 to 1000000 Hz"), ("sampling_rate", 10, "Hz"),
                              ("chunk_length", 10**6, "1 to 3600 seconds"), ("n_fft", 2**20, "samples")):
        with pytest.raises(ConfigError, match=f"a.json.{key} {value} is out of range: .*{words}"):
            audio_config({"feature_extractor_type": "WhisperFeatureExtractor", key: value}, "a.json")


# Whisper

def waveforms() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    t = np.arange(16000 * 3) / 16000
    return {"noise 7 s": (0.1 * rng.standard_normal(16000 * 7)).astype(np.float32),
            "sine 3 s": (0.5 * np.sin(2 * np.pi * 440 * t)).astype(np.float32),
            "chirp 31 s (cut)": (0.3 * np.sin(2 * np.pi * (100 + 20 * np.arange(16000 * 31) / 16000)
                                              * np.arange(16000 * 31) / 16000)).astype(np.float32)}


@pytest.mark.parametrize("path", ["torch", "numpy"])
@pytest.mark.parametrize("feature_size", [80, 128])
def test_whisper_log_mel_matches_transformers(driver: Driver, feature_size: int, path: str,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Both of transformers' paths: torch.stft in float32 (taken when torch is installed) and numpy's
    float64 STFT. The remaining difference is the float32 FFT's own error in the quietest bins."""
    if path == "numpy":
        from transformers.models.whisper import feature_extraction_whisper

        monkeypatch.setattr(feature_extraction_whisper, "is_torch_available", lambda: False)
    extractor = transformers.WhisperFeatureExtractor(feature_size=feature_size)
    config = audio_config({"feature_extractor_type": "WhisperFeatureExtractor", "feature_size": feature_size},
                          "preprocessor_config.json")
    for name, wave_ in waveforms().items():
        reference = extractor(wave_, sampling_rate=16000, return_tensors="np")["input_features"]
        features = driver.drive(audio_features(CpuBackend(), config, wave_))
        compare(f"whisper-{feature_size} ({path}) {name}", features.tensors["input_features"], reference)


def test_the_builders_audio_processor_config_gives_genai_features_but_at_the_edges(
    driver: Driver, whisper_builder: Path, tmp_path: Path
) -> None:
    """onnxruntime-genai's processor computes a builder folder's features from the same config. They equal
    ortpipe's (transformers') inside the clip; the frames whose window reaches past an end of it differ, as
    the two pad the clip otherwise: the first two frames and the two at the clip's end (for a clip cut to
    30 s, the last frame)."""
    og = pytest.importorskip("onnxruntime_genai")
    config = load_audio_config(LocalFolder(whisper_builder))
    assert (config.feature_size, config.sampling_rate, config.hop_length, config.chunk_length,
            config.n_fft) == (80, 16000, 160, 30, 400)
    processor = og.Model(str(whisper_builder)).create_multimodal_processor()
    for name, wave_ in waveforms().items():
        path = tmp_path / "clip.wav"
        with wave.open(str(path), "wb") as w:
            w.setnchannels(1), w.setsampwidth(2), w.setframerate(16000)
            w.writeframes((np.clip(wave_, -1, 1) * 32767).astype(np.int16).tobytes())
        reference = processor("<s>", audios=og.Audios.open(str(path)))["audio_features"].as_numpy()
        ours = driver.drive(audio_features(CpuBackend(), config, read_wav(path))).tensors["input_features"]
        end = len(wave_) // config.hop_length
        edges = [0, 1, end, end + 1] if end < config.frames else [0, 1, config.frames - 1]
        inside = np.delete(np.arange(config.frames), edges)
        compare(f"genai {name}", ours[..., inside], reference[..., inside])


def test_an_extensions_sequence_that_computes_other_features_is_refused(tmp_path: Path) -> None:
    step = {"operation": {"type": "STFTNorm", "attrs": {"n_fft": 512, "frame_length": 512, "hop": 1}}}
    sequence = [{"operation": {"type": "AudioDecoder"}}, step, {"operation": {"type": "Phi4AudioEmbed"}}]
    (tmp_path / "audio_processor_config.json").write_text(json.dumps(
        {"feature_extraction": {"sequence": sequence}, "extra": 1}))
    with pytest.raises(ConfigError) as error:
        load_audio_config(LocalFolder(tmp_path))
    said = str(error.value)
    assert "audio_processor_config.json.extra is not read" in said
    assert "sequence[1].operation.attrs.hop is not supported for STFTNorm" in said
    assert "sequence[2].operation.type 'Phi4AudioEmbed' is not supported" in said
    assert "must be the operations AudioDecoder, STFTNorm, LogMelSpectrum" in said
    sequence[2] = {"operation": {"type": "LogMelSpectrum", "attrs": {"n_fft": 400, "n_mel": 128}}}
    step["operation"]["attrs"].pop("hop")
    config = {"feature_extraction": {"sequence": sequence}}
    (tmp_path / "audio_processor_config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="STFTNorm's n_fft 512 is not LogMelSpectrum's n_fft 400"):
        load_audio_config(LocalFolder(tmp_path))


# Size arithmetic against transformers' own functions

def test_fit_pixels_equals_smart_resize() -> None:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    rng = np.random.default_rng(1)
    cases = [(h, w) for h in (1, 14, 27, 28, 29, 55, 56, 57, 100, 999, 1000, 4032)
             for w in (3, 28, 56, 300, 3024)]
    cases += [tuple(int(v) for v in rng.integers(1, 5000, 2)) for _ in range(300)]
    for height, width in cases:
        for factor, low, high in ((28, 3136, 1003520), (32, 4096, 200_000), (28, 300_000, 12845056)):
            try:
                expected = smart_resize(height, width, factor, low, high)
            except ValueError:
                with pytest.raises(GenerationError, match="too elongated"):
                    sizes.fit_pixels(height, width, factor, low, high)
                continue
            assert sizes.fit_pixels(height, width, factor, low, high) == expected, (height, width, factor)


def test_shortest_edge_sizes_equal_transformers() -> None:
    from transformers.image_transforms import get_resize_output_image_size, get_size_with_aspect_ratio

    rng = np.random.default_rng(2)
    for height, width in [(500, 375), (375, 500), (336, 336), (1, 999)] + [
            tuple(int(v) for v in rng.integers(1, 3000, 2)) for _ in range(200)]:
        image = np.zeros((1, height, width))
        for edge in (224, 336, 800):
            expected = get_resize_output_image_size(image, edge, default_to_square=False,
                                                    input_data_format="channels_first")
            assert sizes.shortest_edge(height, width, edge) == tuple(expected)
            assert sizes.shortest_edge_within(height, width, edge, 1333) == get_size_with_aspect_ratio(
                (height, width), edge, 1333)


def test_center_crop_boxes_equal_transformers() -> None:
    from transformers.image_transforms import center_crop

    for height, width, crop_h, crop_w in [(10, 12, 4, 5), (5, 7, 8, 3), (6, 6, 9, 10), (7, 9, 7, 9)]:
        image = np.arange(height * width, dtype=np.float32).reshape(1, height, width) + 1
        expected = center_crop(image, (crop_h, crop_w), input_data_format="channels_first")[0]
        crop = sizes.center_crop(height, width, crop_h, crop_w)
        padded = np.pad(image[0], ((crop.pads[0], crop.pads[3]), (crop.pads[1], crop.pads[4])))
        assert np.array_equal(padded[crop.starts[0]:crop.ends[0], crop.starts[1]:crop.ends[1]], expected)


def test_target_size_follows_the_config() -> None:
    clip = image_config(CLIP_336, "x")
    assert target_size(clip, 500, 375) == (448, 336)
    assert target_size(image_config({"image_processor_type": "Gemma3ImageProcessor", "size": 896}, "x"),
                       10, 20) == (896, 896)
    qwen = image_config({"image_processor_type": "Qwen2VLImageProcessor"}, "x")
    assert target_size(qwen, 40, 30) == (84, 56)


def test_resize_kernels_equal_pillow(driver: Driver) -> None:
    """Both filters over random size pairs (up, down, mixed), uint8 for uint8 with the installed Pillow."""
    pillow_13 = int(Image.__version__.split(".")[0]) >= 13
    rng = np.random.default_rng(3)
    for _ in range(25):
        height, width, out_h, out_w = (int(v) for v in rng.integers(1, 300, 4))
        image = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
        first = pillow_13 and sizes.vertical_first(height, width, out_h, out_w)
        for name, code in (("bicubic", Image.BICUBIC), ("bilinear", Image.BILINEAR)):
            out = driver.run(Run(f"kernel:resize_{name}_uint8", {
                "image": image, "size": np.array([out_h, out_w]), "vertical_first": np.array(first)},
                ("resized",)))["resized"]
            expected = np.asarray(Image.fromarray(image).resize((out_w, out_h), code))
            assert np.array_equal(out, expected), (name, height, width, out_h, out_w)


def test_pillow_pass_order() -> None:
    assert sizes.vertical_first(100, 80, 56, 84)  # height shrinks, width grows
    assert not sizes.vertical_first(100, 80, 56, 40)  # 44 rows against 40 columns: horizontal first
    assert not sizes.vertical_first(50, 80, 100, 40)


# CPython media helpers

def test_decode_image_gives_rgb_and_lays_transparency_over_white(tmp_path: Path) -> None:
    rgba = np.zeros((4, 6, 4), np.uint8)
    rgba[..., 0] = 200
    rgba[:, :3, 3] = 255  # left half opaque red, right half transparent
    Image.fromarray(rgba, "RGBA").save(tmp_path / "a.png")
    image = decode_image(tmp_path / "a.png")
    assert image.dtype == np.uint8 and image.shape == (4, 6, 3)
    assert image[0, 0].tolist() == [200, 0, 0] and image[0, 5].tolist() == [255, 255, 255]
    with pytest.raises(GenerationError, match="does not exist"):
        decode_image(tmp_path / "missing.png")
    (tmp_path / "not.png").write_bytes(b"hello")
    with pytest.raises(GenerationError, match="not an image"):
        decode_image(tmp_path / "not.png")


def write_wav(path: Path, samples: np.ndarray, rate: int, channels: int = 1) -> None:
    with wave.open(str(path), "wb") as w:
        w.setnchannels(channels)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes((samples * 32767).astype("<i2").tobytes())


def test_read_wav_mono_16k_and_resampled(tmp_path: Path) -> None:
    t = np.arange(16000) / 16000
    sine = 0.5 * np.sin(2 * np.pi * 440 * t)
    write_wav(tmp_path / "a.wav", np.repeat(sine, 2), 16000, channels=2)
    samples = read_wav(tmp_path / "a.wav")
    assert samples.dtype == np.float32 and np.abs(samples - sine).max() < 1e-4
    t44 = np.arange(44100) / 44100
    write_wav(tmp_path / "b.wav", 0.5 * np.sin(2 * np.pi * 440 * t44), 44100)
    samples = read_wav(tmp_path / "b.wav")
    assert len(samples) == 16000
    middle = slice(100, -100)  # away from the edges, where the filter sees silence
    assert np.abs(samples[middle] - sine[middle]).max() < 2e-3
    with pytest.raises(GenerationError, match="does not exist"):
        read_wav(tmp_path / "missing.wav")
    (tmp_path / "c.wav").write_bytes(b"RIFF0000WAVEfmt ")
    with pytest.raises(GenerationError, match="not a PCM WAV"):
        read_wav(tmp_path / "c.wav")


@pytest.mark.parametrize("rate", [8000, 16000, 44100])
def test_a_clip_read_for_its_first_seconds_is_the_whole_clip_read_then_cut(tmp_path: Path, rate: int) -> None:
    """read_wav(seconds=) reads only the frames the resampler needs for those seconds: the samples it gives
    are those of reading the whole file, cut (with a warning of the rest); a rate that is no audio rate is
    refused."""
    noise = 0.3 * np.random.default_rng(rate).standard_normal(int(rate * 3.7))
    write_wav(tmp_path / "long.wav", noise, rate)
    whole = read_wav(tmp_path / "long.wav", 16000)
    with pytest.warns(UserWarning, match="long.wav is 3.7 s of audio, and this model hears its first 2 s"):
        first = read_wav(tmp_path / "long.wav", 16000, seconds=2)
    assert len(first) >= 2 * 16000 and np.array_equal(first[:2 * 16000], whole[:2 * 16000])
    write_wav(tmp_path / "slow.wav", noise[:100], 10)
    with pytest.raises(GenerationError, match="at 10 Hz, which is no audio rate"):
        read_wav(tmp_path / "slow.wav")


def test_resample_keeps_a_tone_below_both_nyquists() -> None:
    t = np.arange(48000) / 48000
    out = resample(np.sin(2 * np.pi * 1000 * t).astype(np.float32), 48000, 16000)
    expected = np.sin(2 * np.pi * 1000 * np.arange(16000) / 16000)
    assert math.isclose(len(out), 16000) and np.abs(out[100:-100] - expected[100:-100]).max() < 2e-3
