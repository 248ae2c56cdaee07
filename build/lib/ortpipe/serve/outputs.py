"""The endpoints of folders whose requests make named outputs rather than text (pipeline.output):

    /v1/embeddings             outputs of kind "embedding" (a sentence-transformers folder, single_pass)
    /v1/audio/speech           an "audio" output (VITS, a decoder with a final vocoder, stages ending in a
                               vocoder)
    /v1/images/generations     an "image" output (a denoising folder)
    /v1/images/edits           the same from an uploaded image (image-to-image: a folder with a VAE encoder)

A server serves one folder, so it answers the endpoint of the folder's outputs (`served`) and refuses the
others naming the one it answers. Parameters follow the OpenAI API reference for each endpoint; what the
model cannot honour is a 400 naming the parameter, as for completions (protocol.py):

- embeddings: `input` a string or an array of strings (token arrays are refused: OpenAI's token ids are
  not this model's), `encoding_format` float or base64 (the `openai` package asks for base64 unless told),
  `dimensions` only the model's own;
- speech: `input`, `voice` "default" (these folders have one voice), `response_format` wav (the default
  here: no MP3 encoder ships with the standard library) or pcm (OpenAI's raw format: 16-bit little-endian
  mono at 24 kHz, resampled), `speed` 1 only, no `instructions`, `stream_format` audio only;
- images: `prompt`, `n` (1 to 10; with a seed, image i draws from seed + i), `size` auto or the model's
  own, `response_format` b64_json (there are no files to give URLs of), `output_format` png; beside them,
  as vLLM and diffusers servers take them through `extra_body`: `seed`, `num_inference_steps`,
  `guidance_scale`, `guidance_rescale`, `negative_prompt` and `eta` (a DDIM or TCD scheduler's);
- edits: OpenAI's multipart form (forms.py): one `image` file, `prompt`, `n`, `size` auto or the image's;
  the extras above and `strength` (diffusers' name); `mask`, OpenAI's (a PNG whose fully transparent
  pixels are the region to edit), makes it inpainting (strength 1 unless given, 0.9999 on an XL
  folder, 0.6 on an SD3 folder). `input_fidelity` is refused.

`OutputRow` runs a checked query on the engine thread, one advance of the core's request per engine step
(a batch of texts, a denoising step), so a long image does not hold back the other clients.
"""

from __future__ import annotations

import base64
import math
import re
import time
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Any

from ..errors import ConfigError, GenerationError
from ..loops.denoising import config_beside
from .forms import Form, Upload
from .protocol import IGNORED, InvalidRequest, _check_names, _decimal, _integer, _type_error, _unsupported

PCM_RATE = 24000  # OpenAI's `pcm`: 24 kHz, 16-bit signed little-endian, mono
MAX_INPUTS = 2048  # OpenAI: an embeddings input array holds at most 2048 items
MAX_SPEECH_CHARS = 4096  # OpenAI: the most characters of speech input
MAX_IMAGES = 10  # OpenAI: n of 1 to 10
MAX_EDIT_SIDE = 4096  # the largest side of an image to edit, in pixels (checked before it is decoded)
EMBED_BATCH = 32  # texts in one run of the model

ENDPOINTS = {
    "completions": "POST /v1/chat/completions and POST /v1/completions",
    "embeddings": "POST /v1/embeddings",
    "speech": "POST /v1/audio/speech",
    "images": "POST /v1/images/generations and POST /v1/images/edits",
}
OUTPUT_KINDS = {"embedding": "embeddings", "audio": "speech", "image": "images"}
KINDS = {
    "completions": "a text",
    "embeddings": "an embedding",
    "speech": "a text-to-speech",
    "images": "an image",
}


def served(pipe: Any) -> str:
    """What a loaded folder answers: "completions", "embeddings", "speech" or "images"; a ConfigError for a
    folder no OpenAI endpoint fits."""
    config = pipe.config
    outputs = config.pipeline.outputs
    if outputs:
        kinds = [o.kind for o in outputs]
        if all(k == "embedding" for k in kinds) and config.generation.loop == "single_pass":
            return "embeddings"
        for kind in ("audio", "image"):
            spec = next((o for o in outputs if o.kind == kind), None)
            if spec is None:
                continue
            if kind == "audio" and spec.sampling_rate is None:
                raise ConfigError(
                    f"ortpipe serve sends audio at its sampling rate: give pipeline.output "
                    f'"{spec.name}" a sampling_rate'
                )
            return OUTPUT_KINDS[kind]
        raise ConfigError(
            f"ortpipe serve answers text, embeddings, speech and images; this folder's outputs "
            f"are {', '.join(sorted(set(kinds)))}: run it with ortpipe run --out"
        )
    loop = config.generation.loop
    if loop != "autoregressive":
        raise ConfigError(
            f'ortpipe serve answers completions; this folder\'s generation.loop is "{loop}", '
            "which makes no tokens, and its pipeline.output names nothing to send: run it "
            "with ortpipe run or the API"
        )
    if config.pipeline.stages:
        raise ConfigError(
            "ortpipe serve answers completions of one model; this folder is a pipeline of "
            "stages (pipeline.stages) that names no output: run it with ortpipe run or the API"
        )
    return "completions"


def image_size(pipe: Any) -> tuple[int, int] | None:
    """(width, height) of the folder's images: its latents' size times the VAE's upscaling (2 per block
    after the first of diffusers' block_out_channels); None when either is not known before a run."""
    setup = pipe.model.loop.denoising if pipe.model.loop is not None else None
    final = pipe.plan.final_phase
    if setup is None or not final or None in setup.latent_shape[1:]:
        return None
    vae = config_beside(pipe.model.folder, pipe.config.pipeline.sessions[final[-1].session].file)
    blocks = vae.get("block_out_channels")
    if not isinstance(blocks, list) or not blocks:
        return None
    scale = 2 ** (len(blocks) - 1)
    return setup.latent_shape[2] * scale, setup.latent_shape[1] * scale


# --- requests --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class OutputQuery:
    """A checked request of one of the output endpoints."""

    endpoint: str  # "embeddings", "speech" or "images" (an edit too: its image in `images`)
    model: str
    texts: tuple[str, ...]  # the inputs to embed, or the one text to speak or draw
    encoding: str = "float"  # embeddings: float or base64
    dimensions: int | None = None  # embeddings: the size asked for (None: the model's)
    audio_format: str = "wav"  # speech: wav or pcm
    count: int = 1  # images: n
    size: tuple[int, int] | None = None  # images: (width, height) asked for (None: auto)
    settings: dict[str, Any] = field(default_factory=dict)  # images: seed, num_steps, guidance_scale, ...
    images: tuple[Any, ...] = ()  # edits: the image to start from, uint8 [h, w, 3]
    mask: Any = None  # edits: inpainting's mask, uint8 [h, w, 3], white where it repaints


def _text(value: Any, name: str, limit: int | None = None) -> str:
    if not isinstance(value, str):
        raise _type_error(name, "a string", value)
    if not value:
        raise InvalidRequest(
            f"Invalid '{name}': empty string. Expected a string with minimum length 1.", name, "empty_string"
        )
    if limit is not None and len(value) > limit:
        raise InvalidRequest(
            f"Invalid '{name}': string too long. Expected a string with maximum length "
            f"{limit}, but got a string with length {len(value)} instead.",
            name,
            "string_above_max_length",
        )
    return value


def _choice(body: dict[str, Any], name: str, served: tuple[str, ...], known: tuple[str, ...] = ()) -> str:
    """A string parameter that takes one of `served` (the first is the default); values OpenAI knows but this
    server cannot make (`known`) are refused as unsupported, others as invalid."""
    value = body.get(name)
    if value is None:
        return served[0]
    if not isinstance(value, str):
        raise _type_error(name, "a string", value)
    if value in served:
        return value
    listed = ", ".join(repr(v) for v in served)
    if value in known:
        raise _unsupported(name, f"{value!r} is not made by this server (it makes {listed})")
    raise InvalidRequest(
        f"Invalid value for '{name}': {value!r}. Supported values are: {listed}.", name, "invalid_value"
    )


def parse_embeddings(body: Any) -> OutputQuery:
    body = _check_names(body, {"model", "input", "encoding_format", "dimensions"} | IGNORED)
    if "input" not in body:
        raise InvalidRequest("Missing required parameter: 'input'.", "input", "missing_required_parameter")
    value = body["input"]
    texts = [value] if isinstance(value, str) else value
    if not isinstance(texts, list):
        raise _type_error("input", "a string or an array of strings", value)
    if not texts:
        raise InvalidRequest(
            "Invalid 'input': empty array. Expected an array with minimum length 1.", "input", "empty_array"
        )
    if len(texts) > MAX_INPUTS:
        raise InvalidRequest(
            f"Invalid 'input': array too long. Expected an array with maximum length "
            f"{MAX_INPUTS}, but got an array with length {len(texts)} instead.",
            "input",
            "array_above_max_length",
        )
    if all(type(t) is int for t in texts) or all(isinstance(t, list) for t in texts):
        raise _unsupported(
            "input",
            "as token ids is not served: the ids OpenAI's tokenizers give are not this "
            "model's; send the text",
        )
    for i, text in enumerate(texts):
        _text(text, f"input[{i}]" if isinstance(value, list) else "input")
    dimensions = body.get("dimensions")
    return OutputQuery(
        "embeddings",
        body["model"],
        tuple(texts),
        encoding=_choice(body, "encoding_format", ("float", "base64")),
        dimensions=None if dimensions is None else _integer(dimensions, "dimensions", low=1),
    )


def parse_speech(body: Any) -> OutputQuery:
    body = _check_names(
        body,
        {"model", "input", "voice", "instructions", "response_format", "speed", "stream_format"} | IGNORED,
    )
    if "input" not in body:
        raise InvalidRequest("Missing required parameter: 'input'.", "input", "missing_required_parameter")
    text = _text(body["input"], "input", MAX_SPEECH_CHARS)
    voice = body.get("voice")
    if isinstance(voice, dict):  # OpenAI's custom voices: {"id": ...}
        voice = voice.get("id")
    if voice is not None and voice != "default":
        raise InvalidRequest(
            f"Invalid value for 'voice': {voice!r}. This model has one voice: 'default'.",
            "voice",
            "invalid_value",
        )
    if body.get("instructions"):
        raise _unsupported("instructions", "cannot steer this model's voice")
    if body.get("speed") is not None and _decimal(body["speed"], "speed", 0.25, 4.0) != 1.0:
        raise _unsupported("speed", "must be 1 for this model (its graph sets the pace)")
    _choice(body, "stream_format", ("audio",), ("sse",))
    audio_format = _choice(body, "response_format", ("wav", "pcm"), ("mp3", "opus", "aac", "flac"))
    return OutputQuery("speech", body["model"], (text,), audio_format=audio_format)


IMAGE_EXTRAS = {"seed", "num_inference_steps", "guidance_scale", "guidance_rescale", "negative_prompt", "eta"}
IMAGE_NAMES = {"model", "prompt", "n", "size", "response_format", "quality", "background", "output_format",
               "output_compression", "partial_images", "stream"}


def parse_images(body: Any) -> OutputQuery:
    return _image_query(_check_names(body, IMAGE_NAMES | {"style"} | IMAGE_EXTRAS | IGNORED))


# the edit form's text fields that are numbers and booleans (a form sends every value as text)
FORM_INTEGERS = {"n", "seed", "num_inference_steps", "output_compression", "partial_images"}
FORM_DECIMALS = {"guidance_scale", "guidance_rescale", "strength", "eta"}


def parse_image_edit(form: Form) -> OutputQuery:
    """POST /v1/images/edits: OpenAI's multipart form (`image` or `image[]` files, `prompt`, `mask`, ...)
    as an image-to-image or inpainting query; `strength` (diffusers' name) rides beside the extras."""
    body, uploads = _form_fields(form)
    edit = _check_names(
        body, IMAGE_NAMES | {"mask", "input_fidelity", "strength"} | IMAGE_EXTRAS | IGNORED
    )
    if body.get("input_fidelity") is not None:
        raise _unsupported("input_fidelity", "is not served: send 'strength' (0 to 1, how much of the "
                                             "image is redrawn) instead")
    image = _upload_image(uploads)
    height, width = image.shape[:2]
    mask = None if body.get("mask") is None else _upload_mask(body["mask"], (height, width))
    size = body.get("size")
    if size not in (None, "auto") and size != f"{width}x{height}":
        raise InvalidRequest(
            f"Invalid value for 'size': {size!r}. An edit keeps the image's size, {width}x{height}: send "
            f"'{width}x{height}' or 'auto'.",
            "size",
            "invalid_value",
        )
    query = _image_query({**edit, "size": None})
    settings = dict(query.settings)
    if body.get("strength") is not None:
        settings["strength"] = _decimal(body["strength"], "strength", 0.0, 1.0)
        if settings["strength"] == 0:
            raise InvalidRequest(
                "Invalid 'strength': 0 redraws nothing. Expected a value in (0, 1].", "strength",
                "invalid_value",
            )
    return replace(query, size=(width, height), settings=settings, images=(image,), mask=mask)


def _upload_mask(upload: Any, size: tuple[int, int]) -> Any:
    """OpenAI's mask (a PNG of the image's size whose fully transparent pixels are the region to edit) as
    the core's: uint8 RGB, white where it repaints, black where it keeps."""
    from ..targets.cpython.media import mask_from_alpha  # the server runs the CPython target

    if not isinstance(upload, Upload):
        raise _type_error("mask", "a file", upload)
    try:
        mask = mask_from_alpha(upload.data, upload.filename or "mask", MAX_EDIT_SIDE)
    except GenerationError as e:
        raise InvalidRequest(f"Invalid 'mask': {e}.", "mask", "invalid_image") from None
    if mask.shape[:2] != size:
        raise InvalidRequest(
            f"Invalid 'mask': it is {mask.shape[1]}x{mask.shape[0]} pixels, the image {size[1]}x{size[0]}: "
            "send a mask of the image's size.",
            "mask",
            "invalid_value",
        )
    return mask


def _form_fields(form: Form) -> tuple[dict[str, Any], list[Upload]]:
    """A form's fields as a JSON body would hold them, and its image files."""
    body: dict[str, Any] = {}
    uploads: list[Upload] = []
    for name, values in form.fields.items():
        if name in ("image", "image[]"):
            for value in values:
                if not isinstance(value, Upload):
                    raise _type_error("image", "a file", value)
                uploads.append(value)
            continue
        if len(values) > 1:
            raise InvalidRequest(f"The form field '{name}' is given {len(values)} times: send it once.", name)
        value = values[0]
        if isinstance(value, Upload) and name != "mask":
            raise _type_error(name, "a form field (text), not a file", value)
        body[name] = _form_value(name, value)
    return body, uploads


def _upload_image(uploads: list[Upload]) -> Any:
    """The one uploaded image, decoded to uint8 [h, w, 3]."""
    if not uploads:
        raise InvalidRequest("Missing required parameter: 'image'.", "image", "missing_required_parameter")
    if len(uploads) > 1:
        raise InvalidRequest(
            f"Invalid 'image': {len(uploads)} images were sent; this model edits one image at a time.",
            "image",
            "invalid_value",
        )
    from ..targets.cpython.media import decode_image_bytes  # the server runs the CPython target

    try:
        return decode_image_bytes(uploads[0].data, uploads[0].filename or "image", MAX_EDIT_SIDE)
    except GenerationError as e:
        raise InvalidRequest(f"Invalid 'image': {e}.", "image", "invalid_image") from None


def _form_value(name: str, value: Any) -> Any:
    """A form field as the JSON value its parameter takes (text that is not one stays text, so the
    parameter's check names the type)."""
    if not isinstance(value, str):
        return value
    if name in FORM_INTEGERS and re.fullmatch(r"[+-]?[0-9]{1,18}", value.strip()):
        return int(value)
    if name in FORM_DECIMALS:
        try:
            number = float(value)
        except ValueError:
            return value
        return number if math.isfinite(number) else value
    if name == "stream" and value in ("true", "false"):
        return value == "true"
    return value


def _image_query(body: dict[str, Any]) -> OutputQuery:
    """The parameters images and edits share, checked."""
    if "prompt" not in body:
        raise InvalidRequest("Missing required parameter: 'prompt'.", "prompt", "missing_required_parameter")
    prompt = _text(body["prompt"], "prompt", 32000)
    count = 1 if body.get("n") is None else _integer(body["n"], "n", 1, MAX_IMAGES)
    size = body.get("size")
    if size is not None and not isinstance(size, str):
        raise _type_error("size", "a string", size)
    match = re.fullmatch(r"([1-9][0-9]{0,4})x([1-9][0-9]{0,4})", size or "auto")
    if size not in (None, "auto") and match is None:
        raise InvalidRequest(
            f"Invalid value for 'size': {size!r}. Expected 'auto' or 'WIDTHxHEIGHT'.", "size", "invalid_value"
        )
    _choice(body, "response_format", ("b64_json",), ("url",))
    _choice(body, "output_format", ("png",), ("jpeg", "webp"))
    _choice(body, "quality", ("auto", "standard"), ("hd", "low", "medium", "high"))
    _choice(body, "background", ("auto", "opaque"), ("transparent",))
    for name, neutral in (
        ("style", None),
        ("output_compression", 100),
        ("partial_images", 0),
        ("stream", False),
    ):
        if body.get(name) is not None and body[name] != neutral:
            raise _unsupported(name)
    settings: dict[str, Any] = {}
    if body.get("seed") is not None:
        settings["seed"] = _integer(body["seed"], "seed", low=0)
    if body.get("num_inference_steps") is not None:
        settings["num_steps"] = _integer(body["num_inference_steps"], "num_inference_steps", 1, 1000)
    if body.get("guidance_scale") is not None:
        settings["guidance_scale"] = _decimal(body["guidance_scale"], "guidance_scale", 0.0, 100.0)
    if body.get("guidance_rescale") is not None:
        settings["guidance_rescale"] = _decimal(body["guidance_rescale"], "guidance_rescale", 0.0, 1.0)
    if body.get("negative_prompt") is not None:
        settings["negative_prompt"] = _text(body["negative_prompt"], "negative_prompt", 32000)
    if body.get("eta") is not None:
        settings["eta"] = _decimal(body["eta"], "eta", 0.0, 1.0)
    return OutputQuery(
        "images",
        body["model"],
        (prompt,),
        count=count,
        size=(int(match[1]), int(match[2])) if match else None,
        settings=settings,
    )


def check_query(pipe: Any, query: OutputQuery) -> None:
    """What the loaded model decides about a query, before it runs."""
    if query.endpoint == "images" and query.size is not None and not query.images:  # an edit's: its image's
        made = image_size(pipe)
        if made is None:
            raise InvalidRequest(
                "This model's image size is known only once it runs: send size 'auto'.",
                "size",
                "invalid_value",
            )
        if made != query.size:
            raise InvalidRequest(
                f"Invalid value for 'size': '{query.size[0]}x{query.size[1]}'. This model makes "
                f"{made[0]}x{made[1]} images: send '{made[0]}x{made[1]}' or 'auto'.",
                "size",
                "invalid_value",
            )


# --- running ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class OutputReply:
    """What an output endpoint sends: a JSON object, or bytes of a media type."""

    body: dict[str, Any] | bytes
    media_type: str = "application/json"
    tokens: int = 0  # the input's tokens (embeddings' usage)


class OutputRow:
    """A query on the engine thread: its core requests made one after another (an image per request), each
    advanced once per `step`."""

    def __init__(self, pipe: Any, query: OutputQuery):
        self.pipe, self.query = pipe, query
        check_query(pipe, query)
        self.todo = deque(range(query.count))
        self.results: list[Any] = []
        self.tokens = 0
        self.current = self._next()

    def _next(self) -> Any:
        i = self.todo.popleft()
        q = self.query
        if q.endpoint == "embeddings":
            request = self.pipe.model.embed(list(q.texts), EMBED_BATCH)
            self.tokens = sum(len(row) for batch in request.batches for row in batch)
            return request
        settings = dict(q.settings)
        if "seed" in settings:
            settings["seed"] += i
        if q.images:
            settings["images"] = list(q.images)
        if q.mask is not None:
            settings["mask"] = q.mask
        return self.pipe.request(q.texts[0], **settings)

    def step(self) -> bool:
        """Advance the query once; True when it is done."""
        self.pipe.driver.drive(self.current.advance())
        if not self.current.done:
            return False
        self.results.append(self.current.result())
        if not self.todo:
            return True
        self.current = self._next()
        return False

    def interrupt(self) -> None:
        self.current.interrupt()

    def reply(self, model: str) -> OutputReply:
        # the server runs the CPython target: its media encoders (numpy), imported where they are used
        from ..targets.cpython.media import audio_of, pcm16, png_bytes, resample, wav_bytes

        q = self.query
        if q.endpoint == "embeddings":
            return self._embeddings(model)
        if q.endpoint == "speech":
            audio = audio_of(self.results[0])
            if q.audio_format == "pcm":
                samples = audio.samples if audio.samples.ndim == 1 else audio.samples.mean(axis=0)
                if audio.sampling_rate != PCM_RATE:
                    samples = resample(samples, audio.sampling_rate, PCM_RATE)
                return OutputReply(pcm16(samples).tobytes(), "audio/pcm")
            return OutputReply(wav_bytes(audio.samples, audio.sampling_rate), "audio/wav")
        images = [r.image[0] for r in self.results]
        height, width = images[0].shape[:2]
        data = [{"b64_json": base64.b64encode(png_bytes(image)).decode("ascii")} for image in images]
        return OutputReply(
            {"created": int(time.time()), "data": data, "output_format": "png", "size": f"{width}x{height}"}
        )

    def _embeddings(self, model: str) -> OutputReply:
        from ..targets.cpython.media import float32_rows

        q = self.query
        vectors = self.results[0].output_of("embedding")
        dim = vectors.shape[1]
        if q.dimensions is not None and q.dimensions != dim:
            raise InvalidRequest(
                f"Invalid value for 'dimensions': {q.dimensions}. This model makes {dim}-dimensional "
                f"embeddings; send {dim} or omit it.",
                "dimensions",
                "invalid_value",
            )
        rows = float32_rows(vectors, q.encoding)
        data = [{"object": "embedding", "index": i, "embedding": row} for i, row in enumerate(rows)]
        usage = {"prompt_tokens": self.tokens, "total_tokens": self.tokens}
        return OutputReply(
            {"object": "list", "data": data, "model": model, "usage": usage}, tokens=self.tokens
        )
