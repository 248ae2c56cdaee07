"""The denoising loop: the init phase (the text encoder, on the negative and the positive prompt as one
batch), then one run of the step session (the UNet) per timestep of the schedule (`num_steps`; PNDM's one
more) with a scheduler's arithmetic between them as a kernel, then the final phase (the VAE decoder) on the
latents divided by the VAE's scaling factor.

As diffusers' StableDiffusionPipeline does: guidance above 1 runs the UNet on [unconditional, conditional]
rows in one batch and mixes them by guidance_scale (then rescales them by guidance_rescale); the initial
latents are standard normal noise (or the request's `latents`) times the scheduler's initial sigma. The
noise comes from the core's random.Random(seed) through the `normal` kernel (Noise), so a seeded image is
the same on every target.

Where things come from: the scheduler from the folder's scheduler/scheduler_config.json and
generation.scheduler; the latents' default size from the UNet graph's fixed dims or its config.json
(sample_size, in_channels); the VAE's scaling factor from the config.json beside the final session's graph
(diffusers' AutoencoderKL default, 0.18215, without one). The wire from the UNet's output to the final
session carries the final latents (docs/pipelines.md).
"""

from __future__ import annotations

import math
import posixpath
import time
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError, GenerationError
from ..execute.flow import FlowRun
from ..execute.work import Backend, Handle, Run, Work, kernel
from ..folder import Folder
from ..jsonfile import optional_json
from ..outputs import OutputRequest, Progress, finish_outputs
from ..plan import FROM_OUTPUT, FROM_REQUEST, JOINED, LOOP, Plan
from ..preprocess import sizes
from ..preprocess.request import Image
from ..sampling.sampler import generator
from .schedulers import Schedule, f32, scheduler_config
from .text import TextSetup, text_inputs

SCHEDULER_FILE = "scheduler/scheduler_config.json"
DEFAULT_SCALING = 0.18215  # diffusers' AutoencoderKL scaling_factor
LATENT_RANK = 4
TIME_IDS = 6  # Stable Diffusion XL's size conditioning: original height, width, crop top, left, target h, w
LATENT_PARAMETERS = "latent_parameters"  # an image-to-image encoder's output role (sessions.NAME.outputs)


@dataclass(frozen=True)
class ImageEncoder:
    """An init session that turns the request's image into a latent distribution (a VAE encoder): image-to-
    image starts from a draw of it."""

    session: str
    input: str  # its pixels input, float [1, 3, height, width] in [-1, 1]
    dtype: str
    output: str  # its latent distribution [1, 2 * channels, h, w]: mean, then log variance
    output_dtype: str
    scaling_factor: float
    shift_factor: float
    scale: int  # image pixels per latent


@dataclass(frozen=True)
class DenoisingSetup:
    """What the denoising loop learns from the folder at load."""

    scheduler: dict[str, Any]  # scheduler_config() of the folder's scheduler
    session: str  # the step session (the UNet)
    sample: str  # its input of the latents, and the input's element type
    sample_dtype: str
    timestep: str
    timestep_dtype: str
    timestep_shape: tuple[Any, ...]
    noise_pred: str  # its output
    latent_shape: tuple[int | None, int | None, int | None]  # channels, height, width (None: not known)
    scaling_factor: float
    batch_fixed: bool  # the UNet's batch dim is fixed to 1: no guidance
    vae_dtype: str = "float32"  # the element type of the final step's latents input (the VAE's)
    time_ids_dtype: str | None = None  # the UNet takes time_ids (Stable Diffusion XL), of this type
    vae_scale: int = 8  # image pixels per latent (2 ** (the VAE's blocks - 1)), for time_ids
    shift_factor: float = 0.0  # added to the final latents after the division (Stable Diffusion 3's VAE)
    # the UNet takes its guidance as an embedding (timestep_cond: a latent consistency model's), of this
    # type and width; such a UNet runs one row, without classifier-free guidance
    guidance_embedding: tuple[str, int] | None = None
    encoder: ImageEncoder | None = None  # image-to-image's, when the flow has one
    # the latents' sides the step session takes are multiples of this: a UNet's 2 ** (its down blocks - 1)
    # (its upsampled features are joined to the skipped ones), a transformer's patch_size
    latent_multiple: int = 1
    # the step session is an inpainting UNet: it also takes the mask and the masked image's latents
    masked_input: bool = False


def denoising_setup(plan: Plan, folder: Folder) -> DenoisingSetup:
    """The denoising loop's setup; a ConfigError for what it cannot run."""
    config = plan.config
    (step,) = plan.step_phase  # config/parse.py checked that there is one
    spec, sig = config.pipeline.sessions[step.session], plan.signatures[step.session]
    feeds = {f.source: f for f in step.feeds if f.kind == LOOP}
    sample, timestep = feeds["sample"], feeds["timestep"]
    problems = []
    if sample.dtype not in ("float32", "float16"):
        problems.append(
            f'session "{step.session}" input "{sample.input}" is {sample.dtype}: the denoising loop '
            "runs float32 and float16 UNets (its scheduler kernels compute in float32 between them)"
        )
    info = sig.input(sample.input)
    if info.rank != LATENT_RANK:
        problems.append(
            f'session "{step.session}" input "{sample.input}" has shape {list(info.shape)}: the '
            "denoising loop runs latents [batch, channels, height, width]"
        )
    outputs = sig.output_names
    noise_pred = spec.outputs.get("noise_pred") or (outputs[0] if len(outputs) == 1 else None)
    if noise_pred not in outputs:
        problems.append(
            f'session "{step.session}" has outputs {", ".join(outputs)}: name the noise prediction in '
            f"sessions.{step.session}.outputs.noise_pred"
        )
    elif sig.output(noise_pred).dtype != sample.dtype:
        problems.append(
            f'session "{step.session}" takes {sample.dtype} "{sample.input}" but gives '
            f'{sig.output(noise_pred).dtype} "{noise_pred}": the denoising loop runs UNets whose noise '
            "prediction has the type of their sample"
        )
    if problems:
        raise ConfigError(problems)
    raw = optional_json(folder, SCHEDULER_FILE)
    where = folder.describe(SCHEDULER_FILE) if folder.exists(SCHEDULER_FILE) else "generation.scheduler"
    if not raw and config.generation.scheduler is None:
        raise ConfigError(
            f"the denoising loop needs a scheduler: {folder.describe(SCHEDULER_FILE)} does not "
            'exist and generation.scheduler names none (e.g. "EulerDiscreteScheduler")'
        )
    unet = config_beside(folder, spec.file)
    dims = [d if isinstance(d, int) else None for d in info.shape[1:]]
    size = unet.get("sample_size")
    size = (size, size) if isinstance(size, int) else tuple(size) if isinstance(size, list) else (None, None)
    channels = dims[0] if dims[0] is not None else unet.get("in_channels")
    final = next((s for s in plan.final_phase if any(f.kind == LOOP for f in s.feeds)), None)
    vae = config_beside(folder, config.pipeline.sessions[final.session].file) if final else {}
    latent = vae.get("latent_channels")
    # an inpainting UNet (stable-diffusion-inpainting's): its input is the latents, the mask and the masked
    # image's latents along the channels, 2 * latent_channels + 1 of them
    masked_input = isinstance(latent, int) and isinstance(channels, int) and channels == 2 * latent + 1
    if masked_input:
        channels = latent
    shape = (channels, dims[1] or size[0], dims[2] or size[1])
    latents_feed = next((f for f in final.feeds if f.kind == LOOP), None) if final else None
    vae_dtype = latents_feed.dtype if latents_feed is not None else "float32"
    if vae_dtype not in ("float32", "float16"):
        raise ConfigError(
            f'session "{final.session}" input "{latents_feed.input}" is {vae_dtype}: the denoising '
            "loop hands float32 or float16 latents to its final steps"
        )
    scaling, shift = _vae_factors(vae)
    embedding = feeds.get("timestep_cond")
    embedded = _guidance_embedding(step.session, sig.input(embedding.input), embedding.dtype,
                                   unet) if embedding else None
    time_ids = feeds.get("time_ids")
    vae_scale = 8
    if time_ids is not None:
        vae_scale = _time_ids_scale(step.session, sig.input(time_ids.input), time_ids.dtype, vae)
    t_info = sig.input(timestep.input)
    return DenoisingSetup(
        scheduler_config(raw, config.generation.scheduler, where),
        step.session,
        sample.input,
        sample.dtype,
        timestep.input,
        timestep.dtype,
        t_info.shape,
        noise_pred,
        shape,
        float(scaling),
        info.shape[0] == 1,
        vae_dtype,
        time_ids.dtype if time_ids is not None else None,
        vae_scale,
        float(shift),
        embedded,
        _encoder_of(plan, folder, shape[0], masked_input, step.session),
        _latent_multiple(unet),
        masked_input,
    )


def _encoder_of(plan: Plan, folder: Folder, channels: int | None, masked_input: bool,
                session: str) -> ImageEncoder | None:
    """_image_encoder's; a ConfigError for an inpainting UNet without one (it reads the masked image's
    latents)."""
    encoder = _image_encoder(plan, folder, channels)
    if masked_input and encoder is None:
        raise ConfigError(
            f'session "{session}" is an inpainting UNet (2 * latent_channels + 1 input channels), which '
            "reads the masked image's latents: the folder needs its VAE encoder (vae_encoder/model.onnx, "
            "or a session whose outputs name latent_parameters)"
        )
    return encoder


def _latent_multiple(unet: dict[str, Any]) -> int:
    """What the step session's latent sides are multiples of, from its config.json (1 when it says
    nothing): 2 ** (down blocks - 1) for a UNet, patch_size for a transformer."""
    blocks, patch = unet.get("down_block_types"), unet.get("patch_size")
    if isinstance(blocks, list) and blocks:
        return 2 ** (len(blocks) - 1)
    if isinstance(patch, int) and not isinstance(patch, bool) and patch > 0:
        return patch
    return 1


def _vae_factors(vae: dict[str, Any]) -> tuple[float, float]:
    """A VAE config.json's (scaling_factor, shift_factor); a ConfigError for values ortpipe does not apply."""
    scaling = vae.get("scaling_factor", DEFAULT_SCALING)
    if not isinstance(scaling, (int, float)) or isinstance(scaling, bool) or scaling <= 0:
        raise ConfigError(f"the VAE's scaling_factor must be a positive number, found {scaling!r}")
    shifted = [key for key in ("latents_mean", "latents_std") if vae.get(key) is not None]
    if shifted:
        raise ConfigError(
            f"the VAE's config.json sets {', '.join(shifted)}: ortpipe divides the final latents by "
            "scaling_factor and adds shift_factor (Stable Diffusion 1.x, 2.x, XL and 3's VAEs); per-channel "
            "statistics are not applied"
        )
    shift = vae.get("shift_factor") or 0.0
    if not isinstance(shift, (int, float)) or isinstance(shift, bool) or not math.isfinite(shift):
        raise ConfigError(f"the VAE's shift_factor must be a number or null, found {shift!r}")
    return float(scaling), float(shift)


def _image_encoder(plan: Plan, folder: Folder, channels: int | None) -> ImageEncoder | None:
    """The init session whose outputs name the role latent_parameters (image-to-image's encoder), or None;
    a ConfigError for one the loop cannot use (`channels`: the UNet's latent channels, when known)."""
    sessions = plan.config.pipeline.sessions
    found = [s for s in plan.init_steps if LATENT_PARAMETERS in sessions[s.session].outputs]
    if not found:
        return None
    if len(found) > 1:
        raise ConfigError(
            f"sessions {', '.join(s.session for s in found)} each name a {LATENT_PARAMETERS} output: "
            "image-to-image starts from one encoder's"
        )
    (step,) = found
    spec, sig = sessions[step.session], plan.signatures[step.session]
    output = spec.outputs[LATENT_PARAMETERS]
    requested = [f.input for f in step.feeds if f.kind == FROM_REQUEST]
    name = spec.inputs.get("image") or (requested[0] if len(requested) == 1 else None)
    info, out = sig.input(name) if name else None, sig.output(output)
    problems = []
    fits = info is not None and info.rank == LATENT_RANK and info.dtype.startswith("float")
    if not fits or (isinstance(info.shape[1], int) and info.shape[1] != 3):
        problems.append(
            f'session "{step.session}" takes {_described(sig.inputs)}: an image-to-image encoder takes one '
            "request input, float pixels [1, 3, height, width] (name it in "
            f"sessions.{step.session}.inputs.image)"
        )
    wide = out is not None and isinstance(out.shape[1], int) and channels and out.shape[1] != 2 * channels
    if out is None or out.rank != LATENT_RANK or not out.dtype.startswith("float") or wide:
        problems.append(
            f'sessions.{step.session}.outputs.{LATENT_PARAMETERS} is "{output}", but session '
            f'"{step.session}" gives {_described(sig.outputs)}: it names the latent distribution, float '
            f"[1, 2 * channels, height, width] (mean, then log variance; the UNet's {channels or 'latent'} "
            "channels)"
        )
    if problems:
        raise ConfigError(problems)
    vae = config_beside(folder, spec.file)
    scaling, shift = _vae_factors(vae)
    blocks = vae.get("block_out_channels")
    scale = 2 ** (len(blocks) - 1) if isinstance(blocks, list) and blocks else 8
    return ImageEncoder(step.session, info.name, info.dtype, output, out.dtype, scaling, shift, scale)


def _described(tensors: Any) -> str:
    return ", ".join(f'"{t.name}" {t.dtype} {list(t.shape)}' for t in tensors) or "nothing"


def _guidance_embedding(session: str, info: Any, dtype: str, unet: dict[str, Any]) -> tuple[str, int]:
    """The type and width of a UNet's timestep_cond input: its graph's last dim, else its config.json's
    time_cond_proj_dim; a ConfigError when neither tells it."""
    fixed = info.rank == 2 and isinstance(info.shape[-1], int)
    width = info.shape[-1] if fixed else unet.get("time_cond_proj_dim")
    if info.rank != 2 or not dtype.startswith("float") or not isinstance(width, int) or width < 4:
        raise ConfigError(
            f'session "{session}" input "{info.name}" is {dtype} {list(info.shape)}: the denoising loop '
            "makes a latent consistency model's guidance embedding, float [batch, width] (width 4 or more), "
            "its width the graph's last dim or time_cond_proj_dim of the config.json beside the graph"
        )
    return dtype, width


def guidance_embedding(scale: float, width: int) -> list[float]:
    """diffusers' get_guidance_scale_embedding of w = scale - 1 (sinusoids of w * 1000 at `width` // 2
    frequencies, sines then cosines, a 0 after them for an odd width), each operation rounded to float32 as
    torch computes it there."""
    half = width // 2
    w = f32(f32(scale - 1) * 1000.0)
    step = f32(f32(math.log(10000.0)) / (half - 1))  # width 4 or more: half - 1 is not 0
    angles = [f32(w * f32(math.exp(f32(k * -step)))) for k in range(half)]
    return [f32(math.sin(a)) for a in angles] + [f32(math.cos(a)) for a in angles] + [0.0] * (width % 2)


def _time_ids_scale(session: str, info: Any, dtype: str, vae: dict[str, Any]) -> int:
    """The pixels per latent of a UNet that takes time_ids; a ConfigError for time_ids the loop cannot
    make."""
    width = info.shape[-1] if info.rank == 2 else None
    if info.rank != 2 or (isinstance(width, int) and width != TIME_IDS) or not dtype.startswith("float"):
        raise ConfigError(
            f'session "{session}" input "{info.name}" is {dtype} {list(info.shape)}: the denoising loop '
            f"makes Stable Diffusion XL's float [batch, {TIME_IDS}] size conditioning (original size, crop "
            "corner, target size); a refiner's aesthetic score is not made"
        )
    blocks = vae.get("block_out_channels")
    if not isinstance(blocks, list) or not blocks:
        raise ConfigError(
            f'session "{session}" takes "{info.name}" (the image size in pixels), but the VAE\'s config.json '
            "has no block_out_channels to tell pixels per latent (2 ** (blocks - 1))"
        )
    return 2 ** (len(blocks) - 1)


def config_beside(folder: Folder, graph: str) -> dict[str, Any]:
    """The config.json beside a graph file (diffusers writes one per model), or {}."""
    return optional_json(folder, posixpath.join(posixpath.dirname(graph), "config.json"))


class Noise:
    """Standard normal noise from random.Random(seed): float64 uniforms in (0, 1] drawn here, turned into
    normal values by the `normal` kernel (Box-Muller)."""

    def __init__(self, backend: Backend, seed: int | None):
        self.backend = backend
        self.rng = generator(seed)

    def draw(self, shape: tuple[int, ...], label: str = "") -> Work:
        count = math.prod(shape)
        pairs = (count + 1) // 2
        b = self.backend
        uniforms = [1.0 - self.rng.random() for _ in range(2 * pairs)]
        out = yield Run(
            kernel("normal", "float32"),
            {
                "u": b.tensor(uniforms, (2, pairs), "float64"),
                "count": b.tensor([count], (1,), "int64"),
                "shape": b.tensor(list(shape), (len(shape),), "int64"),
            },
            ("noise",),
            None,
            label,
        )
        return out["noise"]


class DenoisingRequest(OutputRequest):
    """One image: the first advance runs the init phase and makes the first latents, each later one a step,
    the last one also the final phase and the outputs."""

    def __init__(
        self,
        plan: Plan,
        backend: Backend,
        setup: DenoisingSetup,
        schedule: Schedule,
        guidance: tuple[float, float],
        rows: list[list[int]],
        text: TextSetup,
        latents: Handle | None,
        seed: int | None,
        inputs: dict[str, Handle] | None = None,
        own: dict[str, tuple[list[list[int]], TextSetup]] | None = None,
        zeros: bool = False,
        image: Image | None = None,
        mask: Image | None = None,
    ):
        super().__init__(plan)
        self.backend, self.setup, self.schedule = backend, setup, schedule
        self.guidance, self.guidance_rescale = guidance  # guidance_scale, guidance_rescale
        # diffusers: guidance 1 or less runs no unconditional row; a guidance embedding runs none either
        self.guided = self.guidance > 1 and setup.guidance_embedding is None
        self.noise = Noise(backend, seed)
        self.latents = latents
        self.image = image  # image-to-image's (schedule.noised is set then)
        # inpainting's mask (1: repaint) at the latents' size, the image's clean latents and the first
        # latents' noise, which the blend after each step reads
        self.mask, self.inpaint = mask, None
        self.extra: Handle = None  # an inpainting UNet's: the mask and the masked image's latents
        self.shape = _image_shape(setup, image, backend) if image else _latent_shape(setup, latents, backend)
        self.zeros = zeros  # the unconditional row's text states are zeros (force_zeros_for_empty_prompt)
        text_feeds, _ = text_inputs(plan, backend, rows, text, own) if rows or own else ({}, None)
        encoder = setup.encoder
        keep = (f"{encoder.session}.{encoder.output}",) if encoder and image else ()
        self.flow = FlowRun(plan, backend, 1, 0, {**text_feeds, **(inputs or {})}, keep)
        self.x: Handle = None
        self.sample: Handle = None
        self.memory: list[Handle] = []  # the x0 of the last three steps that keep theirs, latest first
        self.step = 0
        self._zero = backend.full((1,), 0.0, "float32")
        self.repeats = backend.tensor([2 if self.guided else 1, 1, 1, 1], (4,), "int64")

    def _advance(self) -> Work:
        start = time.perf_counter()
        if self._interrupted:  # after the step that was running, as the token loop stops
            self.finish_reason = "interrupt"
            return Progress(self.step, len(self.schedule.steps))
        if self.x is None:
            yield from self._start()
            self.timings.prefill_ms = _since(start)
            return Progress(0, len(self.schedule.steps))
        yield from self._step()
        self.step += 1
        self.timings.steps, self.timings.steps_ms = self.step, self.timings.steps_ms + _since(start)
        if self.step == len(self.schedule.steps):
            start = time.perf_counter()
            yield from self._finish()
            self.timings.final_ms = _since(start)
        return Progress(self.step, len(self.schedule.steps))

    def _start(self) -> Work:
        """The init phase (the text encoders; the image's encoder for image-to-image), the first latents and
        the first UNet input."""
        encoder = self.setup.encoder
        if self.image is not None and encoder is not None:
            self.flow.inputs[f"{encoder.session}.{encoder.input}"] = yield from self._pixels(encoder)
        yield from self.flow.run_init([])
        b = self.backend
        if self.zeros:
            yield from self._zero_unconditional()
        if self.setup.time_ids_dtype is not None:
            self.flow.loop_inputs["time_ids"] = self._time_ids()
        if self.setup.guidance_embedding is not None:
            dtype, width = self.setup.guidance_embedding
            values = guidance_embedding(self.guidance, width)
            self.flow.loop_inputs["timestep_cond"] = b.tensor(values, (1, width), dtype)
        latents, sigma = self.latents, self.schedule.init_noise_sigma
        if self.mask is not None and encoder is not None:
            latents, sigma = yield from self._inpaint_start(encoder)
        elif self.image is not None and encoder is not None:
            latents, sigma = (yield from self._image_latents(encoder)), 1.0
        elif latents is None:
            latents = yield from self.noise.draw(self.shape, "init")
        first = self.schedule.steps[0]
        out = yield Run(
            kernel("denoise_init", self.setup.sample_dtype),
            {
                "latents": latents,
                "coefficients": b.tensor([sigma, first.input_scale], (2,), "float32"),
                "repeats": self.repeats,
            },
            ("x", "sample"),
            None,
            "init",
        )
        self.x, self.sample = out["x"], out["sample"]

    def _pixels(self, encoder: ImageEncoder) -> Work:
        """The request's uint8 image [height, width, 3] as the encoder's pixels [1, 3, height, width] in
        [-1, 1] (diffusers' x / 255 * 2 - 1)."""
        b = self.backend
        image, height, width = self.image
        crop = sizes.whole(height, width)
        out = yield Run(kernel("normalize", encoder.dtype), {
            "image": image, "pads": b.tensor(list(crop.pads), (6,), "int64"),
            "starts": b.tensor(list(crop.starts), (2,), "int64"),
            "ends": b.tensor(list(crop.ends), (2,), "int64"),
            "scale": b.tensor([1 / 255], (1,), "float64"), "mean": b.tensor([0.5] * 3, (3,), "float32"),
            "std": b.tensor([0.5] * 3, (3,), "float32")}, ("pixel_values",), None, "init")
        return out["pixel_values"]

    def _image_latents(self, encoder: ImageEncoder, draws: tuple[Handle, Handle] | None = None,
                       noised: tuple[float, float] | None = None, parameters: Handle | None = None) -> Work:
        """A draw of the encoder's latent distribution (its output on the request's image, or
        `parameters`), scaled, noised to the first step's level (or as `noised` says): diffusers' noise
        draws in its order (the distribution's sample, then add_noise's), or the given `draws`."""
        b = self.backend
        if draws is None:
            sample_noise = yield from self.noise.draw(self.shape, "init")
            noise = yield from self.noise.draw(self.shape, "init")
        else:
            sample_noise, noise = draws
        signal, level = noised or self.schedule.noised or (1.0, 0.0)
        out = yield Run(kernel("image_latents", encoder.output_dtype), {
            "parameters": parameters if parameters is not None
            else self.flow.values[f"{encoder.session}.{encoder.output}"],
            "sample_noise": sample_noise, "noise": noise,
            "coefficients": b.tensor([encoder.scaling_factor, encoder.shift_factor, signal, level], (4,),
                                     "float32")}, ("latents",), None, "init")
        return out["latents"]

    def _inpaint_start(self, encoder: ImageEncoder) -> Work:
        """Inpainting's first latents and what its blend reads (diffusers' StableDiffusionInpaintPipeline):
        the image's clean latents z, the noise e, the mask at the latents' size; the first latents are e
        times the initial sigma at strength 1 (schedule.noised None), else z noised to the first step."""
        b = self.backend
        sample_noise = yield from self.noise.draw(self.shape, "init")
        draws = sample_noise, (yield from self.noise.draw(self.shape, "init"))
        mask, height, width = self.mask
        made = yield Run(kernel("inpaint_mask", "uint8"), {
            "mask_image": mask, "stride": b.tensor([height // self.shape[2]], (1,), "int64")},
            ("mask",), None, "init")
        if self.setup.masked_input:  # an inpainting UNet reads the mask and the masked image instead
            self.extra = yield from self._masked_input(encoder, made["mask"])
        else:
            clean = yield from self._image_latents(encoder, draws, (1.0, 0.0))
            self.inpaint = (clean, draws[1], made["mask"])
        if self.schedule.noised is None:
            return draws[1], self.schedule.init_noise_sigma
        return (yield from self._image_latents(encoder, draws)), 1.0

    def _zero_unconditional(self) -> Work:
        """A row of zeros in front of each init output the step reads (the text encoders ran on the prompt
        alone): diffusers' zeroed negative prompt states."""
        b, done = self.backend, set()
        for s in self.plan.step_phase:
            for f in s.feeds:
                init_output = f.kind in (FROM_OUTPUT, JOINED) and f.source in self.flow.values
                if not init_output or f.source in done:
                    continue
                value = self.flow.values[f.source]
                dtype = b.dtype(value)
                zeros = b.full((1, *b.shape(value)[1:]), 0.0, dtype)
                out = yield Run(kernel("concat0", dtype), {"a": zeros, "b": value}, ("y",), None, "init")
                self.flow.values[f.source] = out["y"]
                done.add(f.source)

    def _time_ids(self) -> Handle:
        """Stable Diffusion XL's size conditioning, as diffusers' defaults make it: the image's size in pixels
        as the original and the target size, the crop corner at (0, 0); one row per UNet row."""
        height, width = (n * self.setup.vae_scale for n in self.shape[2:])
        rows = 2 if self.guided else 1
        values = [float(height), float(width), 0.0, 0.0, float(height), float(width)] * rows
        return self.backend.tensor(values, (rows, TIME_IDS), self.setup.time_ids_dtype)

    def _step(self) -> Work:
        b, step = self.backend, self.schedule.steps[self.step]
        self.flow.loop_inputs["sample"] = self.sample
        if self.extra is not None:
            joined = yield Run(kernel("inpaint_input", self.setup.sample_dtype), {
                "sample": self.sample, "extra": self.extra, "repeats": self.repeats}, ("input",), None,
                self.flow.label)
            self.flow.loop_inputs["sample"] = joined["input"]
        self.flow.loop_inputs["timestep"] = _timestep(b, self.setup, step.timestep, 2 if self.guided else 1)
        out = yield from self.flow.run_steps()
        label = self.flow.label
        noise = (yield from self.noise.draw(self.shape, label)) if step.noise else self._zero
        steps = self.schedule.steps
        following = steps[self.step + 1].input_scale if self.step + 1 < len(steps) else 1.0
        coefficients = [
            self.guidance if self.guided else 0.0,
            self.guidance_rescale if self.guided else 0.0,
            *step.coefficients,
            following,
        ]
        made = yield Run(
            kernel("denoise_step", self.setup.sample_dtype),
            {
                "x": self.x,
                "output": out[self.setup.noise_pred],
                **{name: self.memory[k] if k < len(self.memory) else self._zero
                   for k, name in enumerate(("previous_x0", "previous2_x0", "previous3_x0"))},
                "noise": noise,
                "coefficients": b.tensor(coefficients, (len(coefficients),), "float32"),
                "repeats": self.repeats,
            },
            ("x_next", "x0", "sample"),
            None,
            label,
        )
        self.x, self.sample = made["x_next"], made["sample"]
        if step.remember:
            self.memory = [made["x0"], *self.memory[:2]]
        if self.inpaint is not None:
            yield from self._blend(label, following)

    def _masked_input(self, encoder: ImageEncoder, mask: Handle) -> Work:
        """An inpainting UNet's extra input channels, the mask and the masked image's latents [1, 1 + c,
        h, w]: the image with the repainted pixels at 0 (the mask at full size), encoded, a third draw of
        its distribution, scaled."""
        b = self.backend
        image, _, _ = self.mask
        pixels = self.flow.inputs[f"{encoder.session}.{encoder.input}"]
        full = yield Run(kernel("inpaint_mask", "uint8"), {
            "mask_image": image, "stride": b.tensor([1], (1,), "int64")}, ("mask",), None, "init")
        masked = yield Run(kernel("masked_pixels", encoder.dtype), {"pixels": pixels, "mask": full["mask"]},
                           ("masked",), None, "init")
        encoded = yield Run(encoder.session, {encoder.input: masked["masked"]}, (encoder.output,), None,
                            "init")
        draw = yield from self.noise.draw(self.shape, "init")
        latents = yield from self._image_latents(encoder, (draw, draw), (1.0, 0.0), encoded[encoder.output])
        joined = yield Run(kernel("concat1", "float32"), {"a": mask, "b": latents}, ("y",), None, "init")
        return joined["y"]

    def _blend(self, label: str, following: float) -> Work:
        """Inpainting with a UNet of the latents' channels: the region kept goes back to the image's
        latents, noised to the next step's level (its add_noise; clean after the last step)."""
        b, steps = self.backend, self.schedule.steps
        clean, noise, mask = self.inpaint
        ahead = steps[self.step + 1].noised if self.step + 1 < len(steps) else (1.0, 0.0)
        made = yield Run(kernel("inpaint_blend", self.setup.sample_dtype), {
            "x": self.x, "image_latents": clean, "noise": noise, "mask": mask,
            "coefficients": b.tensor([*ahead, following], (3,), "float32"), "repeats": self.repeats},
            ("x_blended", "sample"), None, label)
        self.x, self.sample = made["x_blended"], made["sample"]

    def _finish(self) -> Work:
        """The final latents over the VAE's scaling factor into the final phase; the named outputs."""
        b = self.backend
        scaled = yield Run(
            kernel("divide", self.setup.vae_dtype),
            {"x": self.x, "d": b.tensor([self.setup.scaling_factor], (1,), "float32"),
             "s": b.tensor([self.setup.shift_factor], (1,), "float32")},
            ("y",),
            None,
            "final",
        )
        self.flow.loop_inputs["latents"] = scaled["y"]
        yield from self.flow.run_final()
        replace = {
            f"{self.setup.session}.{self.setup.noise_pred}": self.x
        }  # the UNet's output names the latents
        self.outputs = yield from finish_outputs(self.plan, b, self.flow.values, None, replace)
        self.finish_reason = "done"


def _since(start: float) -> float:
    return (time.perf_counter() - start) * 1000


def _latent_shape(setup: DenoisingSetup, latents: Handle | None, backend: Backend) -> tuple[int, ...]:
    if latents is not None:
        shape, dtype = tuple(backend.shape(latents)), backend.dtype(latents)
        channels = setup.latent_shape[0]
        if (
            len(shape) != LATENT_RANK
            or shape[0] != 1
            or dtype != "float32"
            or (channels and shape[1] != channels)
        ):
            raise GenerationError(
                f"latents must be float32 [1, {channels or 'channels'}, height, width], found "
                f"{dtype} {list(shape)}"
            )
        multiple = setup.latent_multiple
        if shape[2] % multiple or shape[3] % multiple:
            raise GenerationError(
                f'latents of {shape[2]}x{shape[3]} (height x width) do not fit session "{setup.session}": it '
                f"takes sides that are multiples of {multiple} (its config.json's down blocks or patch size)"
            )
        return shape
    if None in setup.latent_shape:
        raise GenerationError(
            f'session "{setup.session}" leaves the latents\' size open and its config.json has no '
            "sample_size and in_channels: pass latents"
        )
    return (1, *setup.latent_shape)


def _image_shape(setup: DenoisingSetup, image: Image, backend: Backend) -> tuple[int, ...]:
    """The latents' shape of image-to-image: the image's size over the VAE's pixels per latent; a
    GenerationError for an image the encoder cannot take."""
    encoder = setup.encoder
    if encoder is None:
        raise GenerationError(
            "this folder has no image encoder, so it does not run image-to-image: drop the image (a "
            f"diffusers folder needs vae_encoder/model.onnx; a config names its output sessions.NAME.outputs."
            f"{LATENT_PARAMETERS})"
        )
    handle, height, width = image
    channels = backend.shape(handle)[-1]
    if channels != 3:
        raise GenerationError(f"image-to-image takes an RGB image; this one has {channels} channels")
    scale = encoder.scale * setup.latent_multiple
    if height < scale or width < scale:
        raise GenerationError(f"the image is {height}x{width} pixels: image-to-image needs at least {scale}")
    if height % scale or width % scale:
        fit = f"{height // scale * scale}x{width // scale * scale}"
        why = f"{encoder.scale} pixels per latent"
        if setup.latent_multiple > 1:
            why += f' times {setup.latent_multiple}: session "{setup.session}" takes latent sides that are ' \
                   f"multiples of {setup.latent_multiple}"
        raise GenerationError(
            f"the image is {height}x{width} pixels, but image-to-image takes sides that are multiples of "
            f"{scale} ({why}): resize or crop it, e.g. to {fit} (height x width)"
        )
    channels = setup.latent_shape[0]
    if channels is None:
        raise GenerationError(
            f'session "{setup.session}" leaves the latents\' channels open and its config.json has no '
            "in_channels: image-to-image cannot tell them"
        )
    return (1, channels, height // encoder.scale, width // encoder.scale)


def _timestep(b: Backend, setup: DenoisingSetup, t: float, rows: int) -> Handle:
    """The UNet's timestep input: a scalar, or one value per row, of its element type."""
    value = t if setup.timestep_dtype.startswith("float") else int(t)
    shape = setup.timestep_shape
    if not shape:
        return b.tensor([value], (), setup.timestep_dtype)
    n = shape[0] if isinstance(shape[0], int) else rows
    return b.tensor([value] * n, (n,), setup.timestep_dtype)
