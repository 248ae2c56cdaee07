"""Processor configs -> validated ImageConfig / AudioConfig.

Reads what transformers saves beside a model (preprocessor_config.json, or processor_config.json
with an `image_processor` / `feature_extractor` section) and the seed's image_processor.json /
audio_processor.json, which use the same keys. Keys a config leaves out take the defaults of the
transformers class it names. onnxruntime-genai's model builder writes a Whisper folder's
audio_processor_config.json instead, an onnxruntime-extensions operation sequence (AudioDecoder,
STFTNorm, LogMelSpectrum): its attributes are read as the same Whisper features. Every problem is
collected and raised as one ConfigError.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..config.parse import Section
from ..errors import ConfigError, Problems, did_you_mean, one_of
from ..folder import Folder
from ..jsonfile import read_json

IMAGE_FILES = ("image_processor.json", "preprocessor_config.json", "processor_config.json")
AUDIO_FILES = ("audio_processor.json", "preprocessor_config.json", "processor_config.json",
               "audio_processor_config.json")  # the last: onnxruntime-genai's builder (EXTENSIONS_AUDIO)

# PIL's resampling enum, as transformers configs store it
RESAMPLE_CODES = {2: "bilinear", 3: "bicubic"}
UNSUPPORTED_RESAMPLE = {0: "nearest", 1: "lanczos", 4: "box", 5: "hamming"}

_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
_HALF = (0.5, 0.5, 0.5)

# transformers' class defaults for the image processors ortpipe reproduces
IMAGE_PROCESSORS: dict[str, dict[str, Any]] = {
    "Qwen2VLImageProcessor": {
        "resample": 3, "size": {"shortest_edge": 56 * 56, "longest_edge": 28 * 28 * 1280},
        "image_mean": _CLIP_MEAN, "image_std": _CLIP_STD, "patch_size": 14, "temporal_patch_size": 2,
        "merge_size": 2},
    "CLIPImageProcessor": {
        "resample": 3, "size": {"shortest_edge": 224}, "do_center_crop": True,
        "crop_size": {"height": 224, "width": 224}, "image_mean": _CLIP_MEAN, "image_std": _CLIP_STD},
    "SiglipImageProcessor": {"resample": 3, "size": {"height": 224, "width": 224}, "image_mean": _HALF,
                             "image_std": _HALF},
    "Gemma3ImageProcessor": {"resample": 2, "size": {"height": 224, "width": 224}, "image_mean": _HALF,
                             "image_std": _HALF},
    # a vision encoder-decoder's (image captioning, TrOCR)
    "ViTImageProcessor": {"resample": 2, "size": {"height": 224, "width": 224}, "image_mean": _HALF,
                          "image_std": _HALF},
}
PATCH_PROCESSORS = frozenset({"Qwen2VLImageProcessor"})
# an int size means h = w
SQUARE_BY_DEFAULT = frozenset({"SiglipImageProcessor", "Gemma3ImageProcessor", "ViTImageProcessor"})
AUDIO_PROCESSORS = ("WhisperFeatureExtractor",)
# what an audio feature extractor config may say: audio rates, a window of up to an hour
AUDIO_LIMITS = {"sampling_rate": (1000, 1_000_000, "Hz"), "chunk_length": (1, 3600, "seconds"),
                "feature_size": (1, 4096, "mel bins"), "n_fft": (1, 65536, "samples"),
                "hop_length": (1, 65536, "samples")}


@dataclass(frozen=True)
class Size:
    """One resize rule: height and width; a shortest edge, optionally capped by a longest edge; or
    (Qwen2-VL) a pixel budget with sides that are multiples of patch_size * merge_size."""

    height: int | None = None
    width: int | None = None
    shortest_edge: int | None = None
    longest_edge: int | None = None
    min_pixels: int | None = None
    max_pixels: int | None = None


@dataclass(frozen=True)
class Patches:
    """Qwen2-VL's flattened patch layout of pixel_values."""

    patch_size: int
    temporal_patch_size: int
    merge_size: int


@dataclass(frozen=True)
class ImageConfig:
    source: str
    processor_type: str
    size: Size | None  # None: no resize
    resample: str  # "bicubic" or "bilinear"
    crop_size: tuple[int, int] | None  # None: no centre crop
    rescale_factor: float  # 1.0 when do_rescale is off
    image_mean: tuple[float, ...]  # zeros and ones when do_normalize is off
    image_std: tuple[float, ...]
    patches: Patches | None  # None: pixel_values is [1, c, h, w]


@dataclass(frozen=True)
class AudioConfig:
    source: str
    feature_size: int = 80
    sampling_rate: int = 16000
    hop_length: int = 160
    chunk_length: int = 30
    n_fft: int = 400

    @property
    def samples(self) -> int:
        """Every waveform is padded with silence or cut to this many samples."""
        return self.chunk_length * self.sampling_rate

    @property
    def frames(self) -> int:
        return self.samples // self.hop_length


def load_image_config(folder: Folder, name: str | None = None) -> ImageConfig:
    """The folder's image processor config: `name` (from the pipeline's preprocessing section) or the
    first of IMAGE_FILES that describes an image processor."""
    raw, source = _find(folder, name, IMAGE_FILES, _image_section, "an image processor")
    return image_config(raw, source)


def load_audio_config(folder: Folder, name: str | None = None) -> AudioConfig:
    raw, source = _find(folder, name, AUDIO_FILES, _audio_section, "an audio feature extractor")
    return audio_config(raw, source)


def _image_section(data: dict[str, Any]) -> dict[str, Any] | None:
    if isinstance(data.get("image_processor"), dict):
        return data["image_processor"]
    return data if "image_processor_type" in data else None


def _audio_section(data: dict[str, Any]) -> dict[str, Any] | None:
    if "feature_extraction" in data:  # onnxruntime-extensions' sequence: read by audio_config
        return data
    for key in ("feature_extractor", "audio_processor"):
        if isinstance(data.get(key), dict):
            return data[key]
    return data if {"feature_extractor_type", "audio_processor_type"} & data.keys() else None


Picker = Callable[[dict[str, Any]], "dict[str, Any] | None"]


def _find(folder: Folder, name: str | None, names: tuple[str, ...], pick: Picker,
          what: str) -> tuple[dict[str, Any], str]:
    for candidate in (name,) if name else names:
        if not folder.exists(candidate):
            if name:
                raise ConfigError(f"the preprocessing config {folder.describe(candidate)} does not exist")
            continue
        source = folder.describe(candidate)
        data = read_json(folder, candidate)
        section = pick(data)
        if section is not None:
            return section, source
        if name:
            raise ConfigError(f"{source} does not describe {what}{_hint(data)}")
    raise ConfigError(f"{folder.describe()} has no config for {what}: expected one of {one_of(names)}")


def _hint(data: dict[str, Any]) -> str:
    if isinstance(data.get("processor"), dict) and "transforms" in data["processor"]:
        return (" in a form ortpipe reads: it is an onnxruntime-extensions transform list; give the "
                "transformers processor config instead (image_processor_type, size, image_mean, ...)")
    return ""


def _processor_type(sec: Section, key: str, known: tuple[str, ...]) -> str:
    """The transformers class a config names, without the Fast / Pil backend suffix."""
    name = sec.get(key, str)
    if name is None:
        sec.problems.add(f"{sec.path} has no {key}; ortpipe reproduces {one_of(known)}")
        return ""
    for suffix in ("Fast", "Pil"):
        name = name.removesuffix(suffix)
    if name not in known:
        same_letters = {k.lower(): k for k in known}.get(name.lower())
        hint = f' Did you mean "{same_letters}"?' if same_letters else did_you_mean(name, known)
        sec.problems.add(f'{sec.path}.{key} "{name}" is not supported; supported: {one_of(known)}.{hint}')
    return name


def image_config(raw: dict[str, Any], source: str) -> ImageConfig:
    problems = Problems()
    sec = Section(raw, source, problems)
    kind = _processor_type(sec, "image_processor_type", tuple(IMAGE_PROCESSORS))
    problems.raise_if_any()  # the rest falls back on that class's defaults
    defaults = IMAGE_PROCESSORS[kind]

    def get(key: str, type_: type, fallback: Any = None) -> Any:
        return sec.get(key, type_, defaults.get(key, fallback))

    if get("do_pan_and_scan", bool, False):
        problems.add(f"{source}.do_pan_and_scan is not supported; set it to false")
    patches = None
    if kind in PATCH_PROCESSORS:
        patches = Patches(*(_positive(sec, k, get(k, int)) for k in ("patch_size", "temporal_patch_size",
                                                                        "merge_size")))
    size = None
    if get("do_resize", bool, True):
        size = _pixel_budget(sec, defaults) if patches else _size(sec, get("size", object), kind)
    crop = _crop_size(sec, get("crop_size", object)) if get("do_center_crop", bool, False) else None
    scale = get("rescale_factor", float, 1 / 255) if get("do_rescale", bool, True) else 1.0
    if not (isinstance(scale, (int, float)) and math.isfinite(scale) and scale > 0):
        problems.add(f"{source}.rescale_factor must be a finite number above 0, found {scale!r}")
    mean, std = (0.0,) * 3, (1.0,) * 3
    if get("do_normalize", bool, True):
        mean, std = _channels(sec, "image_mean", get("image_mean", object)), _channels(
            sec, "image_std", get("image_std", object))
    resample = _resample(sec, get("resample", object))
    problems.raise_if_any()
    return ImageConfig(source, kind, size, resample, crop, scale, mean, std, patches)


MOST_SIDE = 16384  # pixels: the longest side (or edge, or crop) a processor config may resize to
MOST_PIXELS = MOST_SIDE * MOST_SIDE


def _positive(sec: Section, key: str, value: Any, most: int = MOST_SIDE) -> int:
    """A positive integer up to `most` (larger ones would allocate without bound)."""
    if not isinstance(value, int) or isinstance(value, bool) or not 0 < value <= most:
        sec.problems.add(f"{sec.path}.{key} must be an integer from 1 to {most}, found {value!r}")
        return 1
    return value


def _pixel_budget(sec: Section, defaults: dict[str, Any]) -> Size:
    """Qwen2-VL's min / max pixels: top-level keys win over `size` (as its __init__ does)."""
    size = sec.get("size", dict) or {}

    def first(key: str, size_key: str) -> Any:
        return sec.raw.get(key) or size.get(key) or size.get(size_key) or defaults["size"][size_key]

    low, high = first("min_pixels", "shortest_edge"), first("max_pixels", "longest_edge")
    return Size(min_pixels=_positive(sec, "min_pixels", low, MOST_PIXELS),
                max_pixels=_positive(sec, "max_pixels", high, MOST_PIXELS))


_SIZE_FORMS = ({"height", "width"}, {"shortest_edge"}, {"shortest_edge", "longest_edge"})


def _size(sec: Section, value: Any, kind: str) -> Size | None:
    if isinstance(value, int) and not isinstance(value, bool):
        square = kind in SQUARE_BY_DEFAULT
        value = {"height": value, "width": value} if square else {"shortest_edge": value}
    elif isinstance(value, list) and len(value) == 2:
        value = {"height": value[0], "width": value[1]}
    keys = {k for k, v in value.items() if v is not None} if isinstance(value, dict) else None
    if keys not in _SIZE_FORMS:
        sec.problems.add(f"{sec.path}.size must be an integer or an object with one of the key sets "
                         f"{'; '.join(', '.join(sorted(f)) for f in _SIZE_FORMS)}, found {value!r}")
        return None
    return Size(**{k: _positive(sec, f"size.{k}", value[k]) for k in keys})


def _crop_size(sec: Section, value: Any) -> tuple[int, int] | None:
    if isinstance(value, int) and not isinstance(value, bool):
        value = {"height": value, "width": value}
    if not isinstance(value, dict) or {"height", "width"} - value.keys():
        sec.problems.add(f"{sec.path}.crop_size must be an integer or {{height, width}}, found {value!r}")
        return None
    return tuple(_positive(sec, f"crop_size.{k}", value[k]) for k in ("height", "width"))


def _channels(sec: Section, key: str, value: Any) -> tuple[float, ...]:
    """image_mean or image_std: one finite number, or one per channel (a std above 1e-6: pixels are divided
    by it)."""
    values = [value] * 3 if isinstance(value, (int, float)) else value
    low = 1e-6 if key == "image_std" else -math.inf
    if (isinstance(values, (list, tuple)) and values
            and all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= low
                    for v in values)):
        return tuple(float(v) for v in values)
    which = "finite numbers above 1e-6" if key == "image_std" else "finite numbers"
    sec.problems.add(f"{sec.path}.{key} must be a number or a list of numbers per channel, {which}, found "
                     f"{value!r}")
    return (1.0,) * 3


def _resample(sec: Section, value: Any) -> str:
    names = {name: name for name in RESAMPLE_CODES.values()}
    if isinstance(value, str) and value.lower() in names:
        return value.lower()
    if isinstance(value, int) and not isinstance(value, bool) and value in RESAMPLE_CODES:
        return RESAMPLE_CODES[value]
    found = UNSUPPORTED_RESAMPLE.get(value, value) if isinstance(value, int) else value
    sec.problems.add(f"{sec.path}.resample {found!r} is not supported; supported: bilinear (2), bicubic (3)")
    return "bicubic"


# onnxruntime-extensions' operations of Whisper's features, in order, and the attributes ortpipe reads of each
# (keys from "_", such as "_comment", are comments); missing ones take WhisperFeatureExtractor's defaults
EXTENSIONS_AUDIO = {"AudioDecoder": ("target_sample_rate", "stereo_to_mono"),
                    "STFTNorm": ("n_fft", "frame_length", "hop_length"),
                    "LogMelSpectrum": ("chunk_size", "hop_length", "n_fft", "n_mel")}


def _from_extensions(raw: dict[str, Any], source: str) -> dict[str, Any]:
    """An onnxruntime-extensions feature_extraction sequence as the WhisperFeatureExtractor config it
    computes; a ConfigError listing every problem when it computes something else."""
    problems = Problems()
    where = f"{source}.feature_extraction"
    for key in raw:
        if key != "feature_extraction" and not key.startswith("_"):
            problems.add(f"{source}.{key} is not read (ortpipe reads its feature_extraction); remove it")
    decoder, stft, mel = _extensions_ops(raw["feature_extraction"], where, problems)
    n_fft, hop = mel.get("n_fft", AudioConfig.n_fft), mel.get("hop_length", AudioConfig.hop_length)
    if decoder.get("stereo_to_mono", 1) != 1:
        problems.add(f"{where}: AudioDecoder's stereo_to_mono {decoder['stereo_to_mono']} is not supported; "
                     "ortpipe averages the channels (1)")
    for key, value in (("n_fft", n_fft), ("hop_length", hop), ("frame_length", n_fft)):
        if stft.get(key, value) != value:
            problems.add(f"{where}: STFTNorm's {key} {stft[key]} is not LogMelSpectrum's "
                         f"{'n_fft' if key == 'frame_length' else key} {value}; ortpipe's STFT takes "
                         "one n_fft-sample window")
    problems.raise_if_any()
    return {"feature_extractor_type": "WhisperFeatureExtractor", "feature_size": mel.get("n_mel", 80),
            "sampling_rate": decoder.get("target_sample_rate", AudioConfig.sampling_rate), "hop_length": hop,
            "chunk_length": mel.get("chunk_size", AudioConfig.chunk_length), "n_fft": n_fft}


def _extensions_ops(section: Any, where: str, problems: Problems) -> list[dict[str, Any]]:
    """The attributes of each of EXTENSIONS_AUDIO's operations in `section`'s sequence, in that order; the
    problems raised when the sequence is another."""
    sequence = section.get("sequence") if isinstance(section, dict) else None
    if not isinstance(sequence, list):
        raise ConfigError(f"{where}.sequence must be a list of operations, found {sequence!r}")
    attrs: dict[str, dict[str, Any]] = {}
    for i, step in enumerate(sequence):
        op = step.get("operation") if isinstance(step, dict) else None
        at = f"{where}.sequence[{i}].operation"
        kind = op.get("type") if isinstance(op, dict) else op
        if kind not in EXTENSIONS_AUDIO:
            problems.add(f"{at}.type {kind!r} is not supported: ortpipe computes Whisper's log-mel "
                         f"features, the sequence {', '.join(EXTENSIONS_AUDIO)}")
            continue
        given = op.get("attrs", {})
        if not isinstance(given, dict):
            problems.add(f"{at}.attrs must be an object, found {given!r}")
            continue
        known = EXTENSIONS_AUDIO[kind]
        for key, value in given.items():
            if key.startswith("_"):
                continue
            if key not in known:
                problems.add(f"{at}.attrs.{key} is not supported for {kind} (ortpipe reads "
                             f"{one_of(known)}).{did_you_mean(key, known)}")
            elif not isinstance(value, int) or isinstance(value, bool) or value < 0:
                problems.add(f"{at}.attrs.{key} must be a non-negative integer, found {value!r}")
        attrs[kind] = {k: v for k, v in given.items() if k in known and isinstance(v, int)}
    if list(attrs) != list(EXTENSIONS_AUDIO) or len(sequence) != len(EXTENSIONS_AUDIO):
        problems.add(f"{where}.sequence must be the operations {', '.join(EXTENSIONS_AUDIO)}, once each "
                     "and in that order (Whisper's log-mel features)")
    problems.raise_if_any()
    return [attrs[name] for name in EXTENSIONS_AUDIO]


def audio_config(raw: dict[str, Any], source: str) -> AudioConfig:
    if "feature_extraction" in raw:
        raw = _from_extensions(raw, source)
    problems = Problems()
    sec = Section(raw, source, problems)
    key = "feature_extractor_type" if "feature_extractor_type" in raw else "audio_processor_type"
    _processor_type(sec, key, AUDIO_PROCESSORS)
    ints = {k: _positive(sec, k, sec.get(k, int, getattr(AudioConfig, k)), 1 << 31)
            for k in ("feature_size", "sampling_rate", "hop_length", "chunk_length", "n_fft")}
    for key, (low, high, unit) in AUDIO_LIMITS.items():
        if not low <= ints[key] <= high:  # a clip at such a rate or length would take all the memory there is
            problems.add(f"{source}.{key} {ints[key]} is out of range: ortpipe reads {low} to {high} {unit}")
    for name, neutral in (("padding_value", 0.0), ("dither", 0.0), ("do_normalize", False)):
        if raw.get(name, neutral) not in (neutral, None):
            problems.add(f"{source}.{name} {raw[name]!r} is not supported; ortpipe computes Whisper's "
                         f"features with {name} {neutral!r}")
    problems.raise_if_any()
    return AudioConfig(source, **ints)
