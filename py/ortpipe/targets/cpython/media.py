"""Media files in CPython: images read with Pillow, WAV audio read with the standard library; WAV and PNG
written with the standard library (what `--out` writes).

The arrays read are what the core's preprocessing takes: uint8 [h, w, 3] RGB images and float32 mono
waveforms.
"""

from __future__ import annotations

import base64
import io
import math
import os
import struct
import warnings
import wave
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ...errors import GenerationError

WHISPER_RATE = 16000


def decode_image(path: str | os.PathLike[str], what: str = "image") -> np.ndarray:
    """An image file as uint8 [h, w, 3] RGB, turned upright by its EXIF orientation (`what` it is, for
    errors: "image", inpainting's "mask").

    Transparent pixels are laid over white, as transformers' convert_to_rgb does.
    """
    file = _existing(path, what)
    return _decoded(file, str(file))


def decode_image_bytes(data: bytes, name: str, max_side: int | None = None) -> np.ndarray:
    """An image file's bytes (an upload named `name`) as uint8 [h, w, 3] RGB, as decode_image reads; an
    image with a side over `max_side` pixels is refused from its header, before its pixels are decoded."""
    return _decoded(io.BytesIO(data), name, max_side)


def mask_from_alpha(data: bytes, name: str, max_side: int | None = None) -> np.ndarray:
    """An OpenAI image-edit mask (an image with an alpha channel whose fully transparent pixels are the
    region to edit) as an inpainting mask: uint8 RGB, white (255) where alpha is 0, black elsewhere."""

    def alpha(opened: Any) -> np.ndarray | None:
        if "A" not in opened.getbands() and "transparency" not in opened.info:
            return None
        return np.asarray(opened.convert("RGBA"))[..., 3]

    channel = _opened(io.BytesIO(data), name, max_side, alpha)
    if channel is None:
        raise GenerationError(
            f"{name} has no alpha channel: the region to edit is its fully transparent pixels"
        )
    return np.repeat(((channel == 0) * 255).astype(np.uint8)[..., None], 3, axis=2)


def _decoded(source: Any, name: str, max_side: int | None = None) -> np.ndarray:
    from PIL import Image, ImageOps  # _opened said so when Pillow is missing

    def upright(opened: Any) -> Any:
        image = ImageOps.exif_transpose(opened)
        image.load()
        return image

    image = _opened(source, name, max_side, upright)
    if "A" in image.getbands() or "transparency" in image.info:
        rgba = image.convert("RGBA")
        image = Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba)
    return np.asarray(image.convert("RGB"), dtype=np.uint8)


def _opened(source: Any, name: str, max_side: int | None, read: Any) -> Any:
    """read(image) of the image file `source` opened with Pillow; a GenerationError for a file Pillow
    cannot decode, or one with a side over `max_side` pixels (seen in its header, before its pixels are
    decoded)."""
    try:
        from PIL import Image
    except ImportError as e:
        raise GenerationError("decoding images needs Pillow: pip install Pillow") from e
    size = None
    try:
        with Image.open(source) as opened:
            if max_side is not None and max(opened.size) > max_side:
                size = opened.size
            else:
                return read(opened)
    except (OSError, ValueError, Image.DecompressionBombError) as e:
        raise GenerationError(f"{name} is not an image Pillow can decode: {e}") from e
    raise GenerationError(f"{name} is {size[0]}x{size[1]} pixels: images of up to {max_side} pixels a side "
                          "are taken")


RATES = (1000, 1_000_000)  # the sampling rates a WAV file may say it has, in Hz


def read_wav(path: str | os.PathLike[str], rate: int = WHISPER_RATE,
             seconds: float | None = None) -> np.ndarray:
    """A PCM WAV file as float32 mono samples in [-1, 1] at `rate` Hz: channels averaged, resampled
    when the file has another rate; with `seconds`, only its first `seconds` (what a feature extractor that
    cuts clips to that length reads; the file's frames after them are not read)."""
    file = _existing(path, "audio")
    return _wav(str(file), str(file), file.name, rate, seconds)


def wav_samples(data: bytes, name: str, rate: int = WHISPER_RATE, seconds: float | None = None) -> np.ndarray:
    """A PCM WAV file's bytes (`name`: the file's name, for errors) as read_wav reads the file; an error
    naming the setting "file" (a server's upload) when they are no such file."""
    return _wav(io.BytesIO(data), repr(name), name, rate, seconds, "file")


def _wav(source: Any, shown: str, name: str, rate: int, seconds: float | None,
         setting: str | None = None) -> np.ndarray:
    try:
        with wave.open(source, "rb") as w:
            width, channels, source_rate = w.getsampwidth(), w.getnchannels(), w.getframerate()
            if not RATES[0] <= source_rate <= RATES[1]:
                raise GenerationError(f"{shown} says its samples come at {source_rate} Hz, which is no audio "
                                      f"rate ({RATES[0]} to {RATES[1]} Hz): give a WAV file of audio",
                                      setting)
            frames = w.getnframes()
            if seconds is not None:
                unheard(frames / source_rate, seconds, shown, setting)
                frames = min(frames, source_frames(seconds, source_rate, rate))
            data = w.readframes(frames)
    except (wave.Error, EOFError) as e:
        raise GenerationError(f"{shown} is not a PCM WAV file the wave module reads ({e}); convert it, e.g. "
                              f"ffmpeg -i {name} -ac 1 -ar {rate} -c:a pcm_s16le out.wav", setting) from e
    frame = width * channels
    data = data[:len(data) - len(data) % frame] if frame > 0 else b""  # a file cut inside a frame
    if not data or width not in (1, 2, 3, 4):
        raise GenerationError(f"{shown} holds no samples (or {width}-byte ones): give a WAV file of audio",
                              setting)
    samples = _pcm_to_float(data, width).reshape(-1, channels).mean(axis=1, dtype=np.float32)
    return resample(samples, source_rate, rate) if source_rate != rate else samples


def _existing(path: str | os.PathLike[str], what: str) -> Path:
    file = Path(path)
    try:
        found = file.is_file()
    except (OSError, ValueError) as e:  # a name too long for the file system, a NUL byte
        text = str(file)
        shown = text if len(text) <= 80 else f"{text[:60]}... ({len(text)} characters)"
        reason = getattr(e, "strerror", None) or e
        raise GenerationError(f"the {what} path {shown} cannot be a file here ({reason}); give the path of "
                              "an existing file") from e
    if not found:
        if file.is_dir():
            raise GenerationError(f"the {what} path {file} is a folder; give the path of a file")
        raise GenerationError(f"the {what} file {file} does not exist")
    return file


def _pcm_to_float(data: bytes, width: int) -> np.ndarray:
    """Little-endian PCM (8-bit unsigned, 16/24/32-bit signed) as float32 in [-1, 1]."""
    if width == 1:
        return (np.frombuffer(data, np.uint8).astype(np.float32) - 128.0) / 128.0
    if width == 3:  # no numpy type: widen each sample to 4 bytes, the sign byte on top
        raw = np.frombuffer(data, np.uint8).reshape(-1, 3)
        wide = np.zeros((len(raw), 4), np.uint8)
        wide[:, 1:] = raw
        return wide.view("<i4").ravel().astype(np.float32) / 2.0**31
    if width in (2, 4):
        return np.frombuffer(data, f"<i{width}").astype(np.float32) / float(2 ** (8 * width - 1))
    raise GenerationError(f"{width * 8}-bit PCM WAV is not supported")


def unheard(length: float, seconds: float, shown: str, setting: str | None) -> None:
    """A clip longer than the `seconds` a model hears (its feature extractor's chunk_length, which cuts it):
    a server's upload (`setting` "file") is refused, as its transcript would leave the rest out without a
    word; a caller of the library is warned."""
    if length <= seconds:
        return
    message = (f"{shown} is {length:.1f} s of audio, and this model hears its first {seconds:g} s (the "
               f"feature extractor's chunk_length): the rest would not be heard. Cut the clip into parts of "
               f"at most {seconds:g} s")
    if setting == "file":
        raise GenerationError(message, setting)
    warnings.warn(message, UserWarning, stacklevel=4)


def source_frames(seconds: float, source_rate: int, rate: int, zeros: int = 16) -> int:
    """The frames at `source_rate` that `resample` to `rate` reads for its first `seconds` of output."""
    if source_rate == rate:
        return math.ceil(seconds * rate)
    return math.floor(seconds * source_rate) + math.ceil(zeros / min(1.0, rate / source_rate)) + 1


def resample(samples: np.ndarray, source_rate: int, rate: int, zeros: int = 16) -> np.ndarray:
    """Band-limited resampling: a Hann-windowed sinc low-pass at the lower Nyquist frequency, `zeros`
    zero crossings on each side."""
    cutoff = min(1.0, rate / source_rate)  # in units of the source's Nyquist frequency
    count = math.floor(len(samples) * rate / source_rate)
    reach = math.ceil(zeros / cutoff)
    out = np.empty(count, np.float32)
    step = 4096  # outputs per block: bounds the [outputs, taps] matrix
    for begin in range(0, count, step):
        centers = np.arange(begin, min(begin + step, count)) * (source_rate / rate)
        taps = np.floor(centers)[:, None].astype(np.int64) + np.arange(-reach + 1, reach + 1)
        offset = (taps - centers[:, None]) * cutoff
        window = np.where(np.abs(offset) < zeros, 0.5 + 0.5 * np.cos(np.pi * offset / zeros), 0.0)
        weights = cutoff * np.sinc(offset) * window
        inside = (taps >= 0) & (taps < len(samples))
        values = np.where(inside, samples[np.clip(taps, 0, len(samples) - 1)], 0.0)
        out[begin:begin + len(centers)] = (values * weights).sum(axis=1)
    return out


@dataclass(frozen=True)
class Audio:
    """Mono samples (float32, nominally in [-1, 1]) and their rate."""

    samples: np.ndarray
    sampling_rate: int

    @property
    def seconds(self) -> float:
        return self.samples.shape[-1] / self.sampling_rate

    def write(self, path: str | os.PathLike[str]) -> None:
        write_wav(path, self.samples, self.sampling_rate)


def audio_of(result: Any) -> Audio:
    """The first audio output of a request's result, mono samples when it has one row."""
    name = next((n for n, k in result.kinds.items() if k["kind"] == "audio"), None)
    if name is None:
        raise GenerationError("this folder's pipeline.output names no audio")
    samples = result.outputs[name]
    return Audio(samples.reshape(-1) if samples.ndim == 1 or samples.shape[0] == 1 else samples,
                 result.kinds[name]["sampling_rate"])


def float32_rows(values: Any, encoding: str) -> list[Any]:
    """The rows of a [rows, dim] array as OpenAI sends embeddings: lists of floats, or ("base64") each row's
    little-endian float32 bytes in base64."""
    rows = np.asarray(values, dtype="<f4")
    if encoding == "base64":
        return [base64.b64encode(row.tobytes()).decode("ascii") for row in rows]
    return [row.tolist() for row in rows]


def pcm16(samples: np.ndarray) -> np.ndarray:
    """Float samples [samples] or [channels, samples], clipped to [-1, 1], as 16-bit frames [frames, channels]
    (channels interleaved)."""
    data = np.asarray(samples, dtype=np.float32)
    data = data.reshape(1, -1) if data.ndim == 1 else data
    return np.round(np.clip(data, -1.0, 1.0) * 32767).astype("<i2").T


def wav_bytes(samples: np.ndarray, rate: int) -> bytes:
    """A 16-bit PCM WAV file of float samples [samples] or [channels, samples]."""
    pcm = pcm16(samples)
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(pcm.shape[1])
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(pcm.tobytes())
    return out.getvalue()


def write_wav(path: str | os.PathLike[str], samples: np.ndarray, rate: int) -> None:
    """16-bit PCM WAV of float samples [samples] or [channels, samples], clipped to [-1, 1]."""
    Path(path).write_bytes(wav_bytes(samples, rate))


def image_bytes(image: np.ndarray) -> np.ndarray:
    """A float image [height, width, 3] in [0, 1] as uint8, round(x * 255) (diffusers' numpy_to_pil)."""
    return np.round(np.asarray(image, dtype=np.float32) * 255).astype(np.uint8)


def write_png(path: str | os.PathLike[str], image: np.ndarray) -> None:
    """An 8-bit RGB PNG of a float image [height, width, 3] in [0, 1] (or uint8)."""
    Path(path).write_bytes(png_bytes(image))


def png_bytes(image: np.ndarray) -> bytes:
    """An 8-bit RGB PNG file of a float image [height, width, 3] in [0, 1] (or uint8)."""
    pixels = image if image.dtype == np.uint8 else image_bytes(image)
    height, width = pixels.shape[:2]
    rows = b"".join(b"\x00" + pixels[y].tobytes() for y in range(height))  # filter 0 on each row

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    body = chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(rows, 9)) + chunk(b"IEND", b"")
    return b"\x89PNG\r\n\x1a\n" + body


OUT_KINDS = {".wav": "audio", ".png": "image", ".npy": None}  # what each file type takes (None: any)


def plan_files(plan: Any, specs: list[str]) -> dict[str, list[str]]:
    """The CLI's `--out [NAME=]FILE` as {output name: [files]}, checked against the folder's named outputs
    before any model runs: a .wav takes an audio output, a .png an image, a .npy any; without NAME, the
    first output of the file's kind (or the only output, for .npy)."""
    outputs = {o.name: o.kind for o in plan.config.pipeline.outputs}
    files: dict[str, list[str]] = {}
    for spec in specs:
        name, _, file = spec.rpartition("=")
        kind_wanted = OUT_KINDS.get(Path(file).suffix.lower(), "")
        if kind_wanted == "":
            raise GenerationError(f"--out {spec}: write .wav, .png or .npy files")
        if not outputs:
            raise GenerationError("--out: this folder names no outputs (pipeline.output); it makes tokens")
        if not name:
            fitting = [n for n, k in outputs.items() if kind_wanted in (None, k)]
            if not fitting or (kind_wanted is None and len(outputs) > 1):
                raise GenerationError(f"--out {spec}: say which output, NAME={file} (outputs: "
                                      f"{', '.join(f'{n} ({k})' for n, k in outputs.items())})")
            name = fitting[0]
        if name not in outputs:
            raise GenerationError(f"--out {spec}: no output named {name!r} (outputs: {', '.join(outputs)})")
        if kind_wanted not in (None, outputs[name]):
            raise GenerationError(f"--out {spec}: {name} is {outputs[name]}, which a {Path(file).suffix} "
                                  "file does not hold; write .npy")
        check_writable(file)
        files.setdefault(name, []).append(file)
    return files


def check_writable(file: str | os.PathLike[str], flag: str = "--out") -> None:
    """Refuse a file the CLI is to write (`flag`'s) that cannot be written (its folder missing or read-only,
    a folder by that name) before any model runs, so that no result is made to be lost."""
    path = Path(file)
    folder = path.parent
    if path.is_dir():
        raise GenerationError(f"{flag} {file}: that is a folder; give a file's path")
    if not folder.is_dir():
        raise GenerationError(f"{flag} {file}: the folder {folder} does not exist; create it first")
    if not os.access(folder, os.W_OK):
        raise GenerationError(f"{flag} {file}: the folder {folder} is not writable")


@contextmanager
def writing(path: str | os.PathLike[str], flag: str = "--out") -> Iterator[None]:
    """What the file system refuses while `path` is written (a full disk, a file it does not allow) is a
    GenerationError naming the file."""
    try:
        yield
    except OSError as e:
        raise GenerationError(f"{flag} {path}: cannot write it ({e.strerror or e})") from None


def write_npy(path: str | os.PathLike[str], value: Any) -> None:
    """An array as a .npy file (numpy adds the suffix when the path has none)."""
    with writing(path):
        np.save(path, np.asarray(value))


def write_outputs(result: Any, files: dict[str, list[str]]) -> dict[str, list[str]]:
    """Write each named output to its files; a batch of several images or clips to FILE-0, FILE-1, ...
    Returns {name: [the files written]}."""
    written: dict[str, list[str]] = {}
    for name, targets in files.items():
        value, kind = result.outputs.get(name), result.kinds.get(name, {})
        if value is None:
            continue
        for target in targets:
            path = Path(target)
            if path.suffix.lower() == ".npy":
                write_npy(path, value)
                written.setdefault(name, []).append(str(path))
                continue
            if kind["kind"] == "audio" and value.ndim == 3:  # [batch, 1, samples]: mono
                value = value.reshape(value.shape[0], -1)
            items = value if kind["kind"] == "image" or value.ndim == 2 else value[None]
            for i, item in enumerate(items):
                one = path if len(items) == 1 else path.with_name(f"{path.stem}-{i}{path.suffix}")
                with writing(one):
                    if kind["kind"] == "image":
                        write_png(one, item)
                    else:
                        write_wav(one, item, kind["sampling_rate"])
                written.setdefault(name, []).append(str(one))
    return written
