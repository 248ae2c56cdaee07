"""Requests of the loops that make no tokens, for every target: what `Model` hands over to single_pass.py and
denoising.py. `loop_setup` reads at load what a loop needs from the folder; `output_request` and
`embed_request` check what a caller asks before any model runs."""

from __future__ import annotations

import dataclasses
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from ..config.schema import POOLING_MODES
from ..config.settings import BY_NAME, CODEBOOK_SAMPLING, SearchSettings
from ..errors import ONE_PROMPT, ConfigError, GenerationError
from ..execute.work import Handle
from ..folder import Folder
from ..jsonfile import quote
from ..plan import Plan
from ..preprocess.request import Image
from ..sampling.settings import check_setting, settings_for
from ..tokenizer import Tokenizer
from .codebooks import CodebookRequest
from .denoising import DenoisingRequest, DenoisingSetup, denoising_setup
from .schedulers import FLOW, make_schedule
from .single_pass import DEFAULT_BATCH, SinglePassRequest
from .text import TextSetup, encode_texts, reads_text, text_setup


@dataclass(frozen=True)
class LoopSetup:
    text: TextSetup
    denoising: DenoisingSetup | None = None
    # the sessions with their own tokenizer (sessions.NAME.tokenizer): that tokenizer and its TextSetup
    own: dict[str, tuple[Tokenizer, TextSetup]] = dataclasses.field(default_factory=dict)


def loop_setup(plan: Plan, folder: Folder, tokenizer: Tokenizer | None,
               own: dict[str, Tokenizer | None] | None = None) -> LoopSetup | None:
    """What the folder's loop needs besides the plan (None for the autoregressive loop); `own`: the tokenizers
    of the sessions that name theirs."""
    loop = plan.config.generation.loop
    if loop == "autoregressive" and plan.config.generation.codebooks is None:
        return None
    text = plan.config.pipeline.preprocessing.get("text", {})
    length = text.get("max_length")
    setup = text_setup(folder, text.get("tokenizer", ""), tokenizer, length)
    sessions = {}
    for name, found in (own or {}).items():
        where = plan.config.pipeline.sessions[name].tokenizer
        if found is None:
            raise ConfigError(f'sessions.{name}.tokenizer: {folder.describe(where)} holds no tokenizer '
                              "(tokenizer.json, or a CLIP or VITS tokenizer's vocab.json)")
        own_text = text_setup(folder, where, found, length)
        fixed = plan.config.pipeline.sessions[name].max_length
        if fixed is not None:  # diffusers' max_sequence_length: padded and truncated to exactly this
            own_text = dataclasses.replace(own_text, max_length=fixed, pad_to_max=True)
        sessions[name] = (found, own_text)
    return LoopSetup(setup, denoising_setup(plan, folder) if loop == "denoising" else None, sessions)


def _settings(plan: Plan, given: dict[str, Any]) -> dict[str, Any]:
    """The config's defaults with the request's settings over them, each checked and of this loop."""
    loop = plan.config.generation.loop
    values = {}
    for name, value in given.items():
        if value is None and name in BY_NAME:
            continue  # not given: the default holds
        checked = check_setting(name, value)
        if loop not in BY_NAME[name].loops:
            raise GenerationError(
                f"{name} is a setting of the {' and '.join(BY_NAME[name].loops)} loop; this "
                f'folder\'s loop is "{loop}"'
            )
        values[name] = checked
    defaults = plan.config.generation.settings
    return {
        s.name: values[s.name] if values.get(s.name) is not None else getattr(defaults, s.name, s.default)
        for s in BY_NAME.values()
        if loop in s.loops
    }


def _rows(
    plan: Plan, tokenizer: Tokenizer | None, text: TextSetup, prompt: Any, prompt_ids: Any,
    own: Collection[str] = (),
) -> list[list[int]] | None:
    """The request's token rows: its text or its ids; None when no session reads text (`own`: sessions that
    read their own tokenizer's, not these)."""
    if own and (prompt is None or prompt_ids is not None):
        raise GenerationError(
            f"session{'s' if len(own) > 1 else ''} {', '.join(own)} read{'' if len(own) > 1 else 's'} "
            "the ids of another tokenizer (sessions.NAME.tokenizer): pass the prompt as text, not prompt_ids"
        )
    if not reads_text(plan, own):
        if own:
            return None
        if prompt is not None or prompt_ids is not None:
            raise GenerationError(
                "no session of this folder reads text: pass its inputs (inputs={name: array})"
            )
        return None
    if (prompt is None) == (prompt_ids is None):
        raise GenerationError(ONE_PROMPT)
    if prompt_ids is not None:
        if (
            not isinstance(prompt_ids, (list, tuple))
            or not prompt_ids
            or not all(type(i) is int and i >= 0 for i in prompt_ids)
        ):
            raise GenerationError(
                f"prompt_ids must be a non-empty list of token ids, found {quote(prompt_ids)}"
            )
        return [list(prompt_ids)]
    return encode_texts(tokenizer, [prompt], text.max_length)


def output_request(
    plan: Plan,
    backend: Any,
    setup: LoopSetup,
    tokenizer: Tokenizer | None,
    prompt: Any = None,
    prompt_ids: Any = None,
    inputs: dict[str, Handle] | None = None,
    images: list[Image] | None = None,
    mask: Image | None = None,
    **given: Any,
) -> Any:
    """A request of the folder's single_pass or denoising loop (`images`: image-to-image's one image, with
    `mask` inpainting's; Model refuses them for the other loops)."""
    if plan.config.generation.codebooks is not None:
        return _codebook_request(plan, backend, setup, tokenizer, prompt, prompt_ids, inputs, given)
    inputs = dict(inputs or {})
    latents = given.pop("latents", None)
    if "latents" in inputs:
        if latents is not None:
            raise GenerationError("give latents once: as latents= or as inputs['latents']")
        latents = inputs.pop("latents")
    settings = _settings(plan, given)
    if setup.denoising is None:
        if latents is not None:
            raise GenerationError(
                'latents are an input of the "denoising" loop; this folder\'s loop is "single_pass"'
            )
        rows = _rows(plan, tokenizer, setup.text, prompt, prompt_ids)
        return SinglePassRequest(plan, backend, rows, setup.text, inputs)
    rows = _rows(plan, tokenizer, setup.text, prompt, prompt_ids, setup.own)
    guided = _guided(setup.denoising, settings, given)
    image = _image(setup.denoising, images or [], latents, inputs, given)
    if mask is not None:
        _check_mask(setup.denoising, image, mask, backend)
    elif setup.denoising.masked_input:
        raise GenerationError(
            f'session "{setup.denoising.session}" is an inpainting UNet (it takes the latents, a mask and '
            "the masked image's latents): give an image and a mask (white repaints, black keeps)"
        )
    # diffusers' StableDiffusionXLPipeline: no negative prompt and force_zeros_for_empty_prompt make the
    # unconditional row's text states zeros; else its text is the negative prompt, or ""
    zeros = guided and settings["negative_prompt"] is None and settings["force_zeros_for_empty_prompt"]
    unconditional = [settings["negative_prompt"] or ""] if guided and not zeros else []
    if unconditional and rows is not None:
        rows = encode_texts(tokenizer, unconditional, setup.text.max_length) + rows
    own = {name: (encode_texts(own_tokenizer, [*unconditional, prompt], own_text.max_length), own_text)
           for name, (own_tokenizer, own_text) in setup.own.items()}
    strength = settings["strength"] if image is not None else None
    if mask is not None:  # the inpainting pipelines' default strength: 1 (from noise alone), XL's 0.9999;
        # Stable Diffusion 3's (flow matching) its image-to-image strength, the config's (0.6 detected)
        default = INPAINT_STRENGTH_XL if setup.denoising.time_ids_dtype is not None else 1.0
        if setup.denoising.scheduler["_class_name"] in FLOW:
            default = settings["strength"]
        strength = given["strength"] if given.get("strength") is not None else default
        strength = None if strength == 1.0 else strength
    schedule = make_schedule(setup.denoising.scheduler, settings["num_steps"], strength, settings["eta"])
    return DenoisingRequest(
        plan,
        backend,
        setup.denoising,
        schedule,
        (settings["guidance_scale"], settings["guidance_rescale"]),
        rows or [],
        setup.text,
        latents,
        settings["seed"],
        inputs,
        own,
        zeros,
        image,
        mask,
    )


INPAINT_STRENGTH_XL = 0.9999  # StableDiffusionXLInpaintPipeline's default strength


def _check_mask(setup: DenoisingSetup, image: Image | None, mask: Image, backend: Any) -> None:
    """A GenerationError for a mask inpainting cannot take."""
    if image is None:
        raise GenerationError("a mask says which part of an image to repaint: pass the image (images=[...])")
    if (mask[1], mask[2]) != (image[1], image[2]):
        raise GenerationError(
            f"the mask is {mask[1]}x{mask[2]} pixels and the image {image[1]}x{image[2]} (height x width): "
            "give a mask of the image's size"
        )
    if backend.shape(mask[0])[-1] != 3:
        raise GenerationError("the mask must be an RGB image (white repaints, black keeps)")
    name = setup.scheduler["_class_name"]
    if name == "LCMScheduler":
        raise GenerationError(
            f"inpainting with {name} is not built (diffusers' StableDiffusionInpaintPipeline runs the "
            "other schedulers): use another scheduler or drop the mask"
        )


def _image(setup: DenoisingSetup, images: list[Image], latents: Any, inputs: dict[str, Handle],
           given: dict[str, Any]) -> Image | None:
    """Image-to-image's image, or None; a GenerationError for what does not go with it."""
    encoder = setup.encoder
    names = (encoder.input, f"{encoder.session}.{encoder.input}") if encoder is not None else ()
    if any(k in names for k in inputs):
        raise GenerationError(
            f'session "{encoder.session}" encodes image-to-image\'s image: pass the image (images=[...]), '
            f'not inputs["{encoder.input}"]'
        )
    if not images:
        if given.get("strength") is not None:
            raise GenerationError("strength is image-to-image's: pass an image, or drop strength")
        return None
    if len(images) > 1:
        raise GenerationError(f"image-to-image starts from one image; {len(images)} were given")
    if latents is not None:
        raise GenerationError("give an image (image-to-image) or latents (text-to-image), not both")
    return images[0]


def _guided(setup: DenoisingSetup, settings: dict[str, Any], given: dict[str, Any]) -> bool:
    """Whether the request runs classifier-free guidance (an unconditional row); a GenerationError for what
    only guidance reads, given without it."""
    if setup.guidance_embedding is not None:
        unread = [k for k in ("negative_prompt", "guidance_rescale", "force_zeros_for_empty_prompt")
                  if given.get(k) not in (None, 0, False)]  # "" is a negative prompt
        if unread:
            raise GenerationError(
                f'session "{setup.session}" takes guidance_scale as an embedding (timestep_cond, a latent '
                f"consistency model's) and runs no unconditional row: drop {', '.join(unread)}"
            )
    guided = settings["guidance_scale"] > 1 and setup.guidance_embedding is None
    if guided and setup.batch_fixed:
        raise GenerationError(
            f'session "{setup.session}" runs one row at a time: guidance needs two; '
            "set guidance_scale to 1 or less"
        )
    if settings["negative_prompt"] is not None and not guided:
        raise GenerationError("negative_prompt is used by guidance: raise guidance_scale above 1, or drop it")
    if settings["guidance_rescale"] > 0 and not guided:
        raise GenerationError("guidance_rescale rescales guidance: raise guidance_scale above 1, or drop it")
    if given.get("force_zeros_for_empty_prompt") and not guided:  # false zeroes nothing either way
        raise GenerationError("force_zeros_for_empty_prompt sets the unconditional row of guidance: raise "
                              "guidance_scale above 1, or drop it")
    return guided


def _codebook_request(
    plan: Plan, backend: Any, setup: LoopSetup, tokenizer: Tokenizer | None, prompt: Any, prompt_ids: Any,
    inputs: dict[str, Handle] | None, given: dict[str, Any]
) -> CodebookRequest:
    """A request of the autoregressive loop over codebooks: its length, guidance and how each codebook's
    token is picked (greedy, or sampled with the sampling settings); nothing else is read."""
    known = ("max_new_tokens", "max_length", "guidance_scale", *CODEBOOK_SAMPLING)
    unread = sorted(k for k, v in given.items() if k not in known and v is not None)
    if unread or inputs:
        raise GenerationError(
            f"this folder generates codebooks from a text and reads only {', '.join(known)}; "
            f"drop {', '.join(unread) or 'inputs'}"
        )
    # the config's sampling settings (generation.codebooks reads no others), then the request's
    defaults = SearchSettings(**{k: getattr(plan.config.generation.settings, k) for k in CODEBOOK_SAMPLING})
    search = settings_for(defaults, {k: given[k] for k in CODEBOOK_SAMPLING if k in given})
    rows = _rows(plan, tokenizer, setup.text, prompt, prompt_ids)
    if rows is None:
        raise GenerationError("the codebook loop needs an init session that reads the prompt's input_ids")
    new, total = given.get("max_new_tokens"), given.get("max_length")
    if new is not None and total is not None:
        raise GenerationError("give max_new_tokens or max_length, not both")
    for name, value in (("max_new_tokens", new), ("max_length", total)):
        if value is not None and (type(value) is not int or not 1 <= value <= 1_000_000):
            raise GenerationError(f"{name} must be a positive integer, found {quote(value)}")
    length = total or (new + 1 if new else plan.config.generation.max_length)
    if length is None:
        raise GenerationError("give max_new_tokens (this folder's config sets no generation.max_length)")
    scale = given.get("guidance_scale")
    if scale is None:
        scale = plan.config.generation.codebooks.guidance_scale
    scale = check_setting("guidance_scale", scale)
    return CodebookRequest(plan, backend, rows[0], setup.text, length - 1, scale, search)


def embed_request(
    plan: Plan,
    backend: Any,
    setup: LoopSetup | None,
    tokenizer: Tokenizer | None,
    texts: Any,
    batch_size: int = DEFAULT_BATCH,
    pooling: str | None = None,
    normalize: bool | None = None,
) -> SinglePassRequest:
    """Embeddings of many texts, in batches (a single_pass folder whose outputs are embeddings); `pooling`
    and `normalize`, when given, instead of the folder's (as transformers.js's feature-extraction pipeline
    takes them)."""
    outputs = plan.config.pipeline.outputs
    if (
        setup is None
        or setup.denoising is not None
        or not outputs
        or any(o.kind != "embedding" for o in outputs)
    ):
        raise GenerationError(
            "embed needs a folder whose outputs are embeddings (a sentence-transformers folder, "
            'or "as": "embedding" in pipeline.output)'
        )
    if type(batch_size) is not int or not 1 <= batch_size <= 4096:
        raise GenerationError(f"batch_size must be an integer from 1 to 4096, found {quote(batch_size)}")
    if pooling is not None and pooling not in POOLING_MODES:
        raise GenerationError(f"pooling must be one of {', '.join(POOLING_MODES)}, found {quote(pooling)}")
    if normalize is not None and type(normalize) is not bool:
        raise GenerationError(f"normalize must be true or false, found {quote(normalize)}")
    changes = {k: v for k, v in (("pooling", pooling), ("normalize", normalize)) if v is not None}
    specs = [dataclasses.replace(o, **changes) for o in outputs] if changes else None
    rows = encode_texts(tokenizer, [texts] if isinstance(texts, str) else texts, setup.text.max_length)
    return SinglePassRequest(plan, backend, rows, setup.text, None, batch_size, specs)
