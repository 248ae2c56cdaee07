"""The CPython target: the core driven by onnxruntime, tensors as numpy arrays.

`load(folder)` gives a `Pipeline` with the Python API (generate, stream, the step-wise generator,
chat). What is the same on every target (loading, requests, chats) is the core's `Model`; this
package adds the platform (numpy tensors, Hugging Face tokenizers, jinja2) and the driver.
"""

from __future__ import annotations

from .flavours import warn_if_mixed

warn_if_mixed()  # before onnxruntime is imported: two flavours in one environment overwrite each other

import os
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ...chat import Chat
from ...config.profiles import Profile
from ...errors import ConfigError, GenerationError
from ...execute.work import Work
from ...folder import LocalFolder
from ...loops.autoregressive import TokenGenerator
from ...model import Model, load_model
from ...plan import Plan
from ...request import Chunk, Request, Result
from ...trace import Trace
from . import providers
from .driver import Driver
from .media import Audio, audio_of, decode_image, read_wav, unheard
from .text import HFTokenizer, compile_template


class CpuBackend:
    """Tensors as numpy arrays."""

    fused_layouts = frozenset({"shared", "concat"})  # the cache layouts whose Decode the driver carries out
    decode_burst = 64  # steps per Decode at most; the driver also stops a burst after BURST_SECONDS
    fused_sampling = True  # the driver selects by a Decode's pick (sampling.py)
    fused_speculation = True  # and runs speculative rounds of such requests (speculate.py)
    row_views = True  # narrowing the first axis of a contiguous array gives a view (the driver's narrow)

    def __init__(self) -> None:
        self.speculation_costs: dict = {}  # loops/speculative.py: what runs cost here, kept across requests

    def tensor(self, values: list[int], shape: tuple[int, ...], dtype: str) -> np.ndarray:
        return np.array(values, dtype=dtype).reshape(shape)

    def full(self, shape: tuple[int, ...], value: float, dtype: str) -> np.ndarray:
        if value == 0:  # calloc'd: a KV buffer's pages are only touched when a position is written
            return np.zeros(shape, dtype=dtype)
        return np.full(shape, value, dtype=dtype)

    def shape(self, handle: np.ndarray) -> tuple[int, ...]:
        return handle.shape

    def dtype(self, handle: np.ndarray) -> str:
        return str(handle.dtype)

    def to_list(self, handle: np.ndarray) -> list[int]:
        return handle.ravel().tolist()


class CpuPlatform:
    name = "cpython"
    compile_template = staticmethod(compile_template)

    def __init__(self) -> None:
        self.backend = CpuBackend()

    def tokenizer(self, tokenizer_json: str, tokenizer_config: str | None) -> HFTokenizer:
        return HFTokenizer.from_text(tokenizer_json)

    def folder(self, location: str) -> LocalFolder:
        if not os.path.isdir(location):
            raise GenerationError(f"model folder {location} does not exist or is not a directory")
        return LocalFolder(location)


class StepGenerator:
    """The step-wise API: append tokens, ask for the next one, check whether it is done."""

    def __init__(self, core: TokenGenerator, driver: Driver):
        self.core, self.driver = core, driver

    @property
    def tokens(self) -> list[int]:
        return self.core.tokens

    @property
    def done(self) -> bool:
        return self.core.done

    def append_tokens(self, ids: list[int]) -> None:
        self.core.append_tokens(list(ids))

    def next_token(self) -> int:
        return self.driver.drive(self.core.next_tokens(1))[0]

    def interrupt(self) -> None:
        self.core.interrupted = True


class Pipeline:
    """A loaded model: `generate`, `stream`, `chat` and the step-wise `generator`.

    Generation settings (see config/settings.py: do_sample, temperature, top_k, top_p, min_p,
    repetition_penalty, seed, stop, num_beams, ...) default to the config's and can be given per call.
    """

    def __init__(self, model: Model, driver: Driver, folder: Path):
        self.model, self.driver, self.folder = model, driver, folder
        self.plan: Plan = model.plan
        self.config = model.config
        self.tokenizer = model.tokenizer

    @property
    def load_ms(self) -> float:
        return self.model.load_ms

    @property
    def assignments(self) -> dict[str, providers.Assignment]:
        """Per session: the provider it was opened with and the nodes onnxruntime placed on each
        provider (`providers.report(pipe.assignments.values())` is `ortpipe inspect`'s text)."""
        return self.driver.assignments

    def generator(self, prompt_len: int = 0, max_new_tokens: int | None = None, max_length: int | None = None,
                  inputs: dict[str, Any] | None = None, **settings: Any) -> StepGenerator:
        self.driver.drive(self.model.prepare(settings))  # a draft model it names
        return StepGenerator(self.model.generator(prompt_len, max_new_tokens, max_length, inputs, **settings),
                             self.driver)

    def request(
        self,
        prompt: str | None = None,
        *,
        images: list[Any] | None = None,
        audios: list[Any] | None = None,
        inputs: dict[str, Any] | None = None,
        mask: Any = None,
        **options: Any,
    ) -> Request:
        """A request to drive (`drive`): `prompt`, `prompt_ids` or `messages`; `images`: paths or uint8
        [h, w, 3] arrays; `audios`: .wav paths or float32 mono arrays at the feature extractor's rate;
        `inputs`: arrays for named session inputs; `mask`: inpainting's, a path or uint8 [h, w, 3] array of
        the image's size (white repaints, black keeps)."""
        given, heard = _listed(images, "images"), _listed(audios, "audios")
        self.model.check_media(bool(given), bool(heard), mask is not None)  # before a path is opened
        decoded = [_image(i) for i in given]
        masked = None if mask is None else _image(mask, "mask")
        if "latents" in options and options["latents"] is None:  # no latents, as diffusers' latents=None
            del options["latents"]
        latents = options.get("latents")
        if latents is not None and not isinstance(latents, np.ndarray):
            raise GenerationError(
                f"latents must be a numpy array (float32 [1, channels, height, width]), found "
                f"{type(latents).__name__}"
            )
        waves = [_waveform(a, self.model) for a in heard]
        if inputs is not None and (
            not isinstance(inputs, dict)
            or not all(isinstance(k, str) and isinstance(v, np.ndarray) for k, v in inputs.items())
        ):
            raise GenerationError(
                f"inputs must map input names to numpy arrays, found {type(inputs).__name__}"
            )
        return self.driver.drive(
            self.model.request(
                prompt,
                images=[(d, d.shape[0], d.shape[1]) for d in decoded],
                audios=waves,
                inputs=inputs,
                mask=None if masked is None else (masked, masked.shape[0], masked.shape[1]),
                **options,
            )
        )

    def drive(self, request: Request, trace: Trace | None = None) -> Iterator[Chunk]:
        """The chunks of a request, as its tokens are generated; `trace` collects its runs.

        A pipeline may be used from several threads: each step of a request holds the pipeline for
        itself, so requests of different threads take turns step by step, each with its own cache.
        """
        while not request.done:
            yield from self.driver.drive(request.advance(), trace)

    def stream(
        self, prompt: str | None = None, *, trace: str | None = None, **options: Any
    ) -> Iterator[Chunk]:
        """Chunks as they are generated; `trace` names a Chrome trace file to write at the end."""
        collected = Trace() if trace else None
        yield from self.drive(self.request(prompt, **options), collected)
        if collected:
            collected.write(trace)

    def generate(self, prompt: str | None = None, *, trace: str | None = None, **options: Any) -> Result:
        request = self.request(prompt, **options)
        collected = Trace() if trace else None
        for _ in self.drive(request, collected):
            pass
        if collected:
            collected.write(trace)
        return request.result()

    def embed(self, texts: str | list[str], *, batch_size: int = 32, pooling: str | None = None,
              normalize: bool | None = None) -> np.ndarray:
        """Embeddings of a sentence-transformers (or any embedding) folder: float32 [len(texts), dim], or
        [dim] for one string; texts run in batches of `batch_size`, padded. `pooling` ("mean", "cls",
        "max", "lasttoken") and `normalize` override the folder's."""
        request = self.model.embed(texts, batch_size, pooling, normalize)
        for _ in self.drive(request):
            pass
        embeddings = request.result().output_of("embedding")
        return embeddings[0] if isinstance(texts, str) else embeddings

    def speak(self, text: str, **settings: Any) -> Audio:
        """Speech for `text` from a text-to-speech folder (an "audio" output): mono samples and their rate."""
        if not any(o.kind == "audio" for o in self.config.pipeline.outputs):
            raise GenerationError("speak needs a folder whose pipeline.output is audio")
        return audio_of(self.generate(text, **settings))

    def chat(self, max_length: int | None = None, **settings: Any) -> PipelineChat:
        """A multi-turn chat over one KV cache, with the folder's chat template."""
        self.driver.drive(self.model.prepare(settings))
        return PipelineChat(self.model.chat(max_length, **settings), self)

    def run(self, work: Work) -> Any:
        """Drive any core work (a chat's rewind, preprocessing) to its result."""
        return self.driver.drive(work)


class PipelineChat:
    """`say` streams a reply; `rewind` drops the last turn."""

    def __init__(self, core: Chat, pipe: Pipeline):
        self.core, self.pipe = core, pipe
        self.last: Request | None = None

    def say(self, content: str, max_new_tokens: int | None = None) -> Iterator[Chunk]:
        self.last = self.core.say(content, max_new_tokens)
        yield from self.pipe.drive(self.last)

    def rewind(self) -> None:
        self.pipe.driver.drive(self.core.rewind())

    @property
    def tokens(self) -> list[int]:
        return self.core.tokens


def _listed(items: Any, name: str) -> list[Any]:
    if items is None:
        return []
    if not isinstance(items, (list, tuple)):
        raise GenerationError(f"{name} must be a list, found {type(items).__name__}")
    return list(items)


def _image(item: Any, what: str = "image") -> np.ndarray:
    """A path decoded, or a uint8 [h, w, 3] RGB array (`what` it is, for errors: an image, the mask)."""
    if isinstance(item, (str, os.PathLike)):
        return decode_image(item, what)
    array = np.asarray(item) if isinstance(item, (np.ndarray, list)) else None
    if array is None or array.dtype != np.uint8 or array.ndim != 3 or array.shape[2] != 3 or 0 in array.shape:
        shape = list(array.shape) if array is not None else type(item).__name__
        named = "an image" if what == "image" else f"the {what}"
        raise GenerationError(
            f"{named} must be a path or a uint8 [height, width, 3] RGB array, found {shape}"
        )
    return array


def _waveform(item: Any, model: Model) -> np.ndarray:
    """A .wav path read at the feature extractor's rate (the seconds of it the extractor reads), or float32
    mono samples."""
    if isinstance(item, (str, os.PathLike)):
        config = model.audio_config()
        return read_wav(item, config.sampling_rate, config.chunk_length)
    array = np.asarray(item) if isinstance(item, (np.ndarray, list)) else None
    if array is None or array.ndim != 1 or array.dtype.kind != "f" or not array.size:
        raise GenerationError("an audio clip must be a .wav path or a 1-D float array of mono samples")
    try:
        config = model.audio_config()
    except ConfigError:  # a folder without a feature extractor config: the core's media_inputs says so
        return array.astype(np.float32, copy=False)
    unheard(array.size / config.sampling_rate, config.chunk_length, "the audio clip", None)
    return array.astype(np.float32, copy=False)


def read_inputs(specs: list[str]) -> dict[str, np.ndarray]:
    """`NAME=FILE.npy` pairs (the CLI's --input) as arrays for named session inputs."""
    inputs = {}
    for spec in specs:
        name, sep, file = spec.partition("=")
        if not sep or not name or not file:
            raise GenerationError(f"--input takes NAME=FILE.npy, found {spec!r}")
        try:
            inputs[name] = np.load(file, allow_pickle=False)
        except (OSError, ValueError) as e:
            raise GenerationError(f"--input {name}: cannot read {file} as a .npy array: {e}") from None
    return inputs


Progress = Callable[[str], None]


def load(
    model_dir: str | os.PathLike[str],
    *,
    provider: str | Sequence[str] | Mapping[str | None, str | Sequence[str]] | None = None,
    profile: str | Profile | None = None,
    threads: int | None = None,
    on_progress: Progress | None = None,
    dtype: str | dict[str, str] | None = None,
    allow_plugins: bool = False,
) -> Pipeline:
    """Load a model folder (genai_config.json v1 or v2, or a detected export) for onnxruntime.

    `provider` overrides the sessions' execution providers: a name or a fallback list for every
    session ("openvino", ["openvino", "cpu"]), or {session name: name or list} for some (the key
    None: every other session). `profile`: a device profile, by name (edge/profiles/) or .json path,
    layered over the config first. Where each session was placed is `Pipeline.assignments`.
    `on_progress` receives a line of text as each session starts and ends loading. `dtype` picks
    the model variant when the folder holds several exports of a graph (fp32, fp16, q8, q4, q4f16,
    ...: transformers.js's names, model_q4.onnx and so on), for every session or per session name;
    by default each session runs the first of its provider's defaults (ortpipe.variants.DEFAULTS).
    `allow_plugins`: run the config's plugin (its code), if it names one (ortpipe/plugins.py).
    """
    if not isinstance(model_dir, (str, os.PathLike)) or model_dir == "":
        found = '""' if model_dir == "" else type(model_dir).__name__
        raise ConfigError(f"load() takes the model folder's path (a str or os.PathLike), not {found}")
    path = Path(model_dir)
    if path.is_file():
        raise ConfigError(f"model folder {path} is a file, not a directory: give the folder that holds the "
                          f"model's files ({path.parent})")
    if not path.is_dir():
        raise ConfigError(f"model folder {path} does not exist or is not a directory")
    if threads is not None and (type(threads) is not int or not 0 <= threads <= 1024):
        raise ConfigError(
            f"threads must be an integer from 0 (onnxruntime's default) to 1024, found {threads!r}"
        )
    overrides = providers.overrides_from(provider)
    start = time.perf_counter()
    driver = Driver(overrides, threads, on_progress)
    devices = {session: names[0] for session, names in overrides.items() if names}
    model, _ = driver.drive(
        load_model(LocalFolder(path), CpuPlatform(), profile, allow_plugins, dtype=dtype, device=devices)
    )

    providers.check_overrides(overrides, model.config.pipeline.sessions)
    model.load_ms = (time.perf_counter() - start) * 1000
    return Pipeline(model, driver, path)


__all__ = ["Audio", "CpuBackend", "CpuPlatform", "Driver", "Pipeline", "load", "read_inputs"]
