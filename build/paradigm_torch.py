"""The torch side of build/paradigms.py: makes the tiny models and computes the torch references.

It runs only inside the build's own virtualenvs, never the project's (see build/paradigms.py):
    <venv>/bin/python -m build.paradigm_torch COMMAND SPEC.json
`make-*` commands run in the export environment (transformers 4.57, diffusers 0.39), so every
checkpoint is written in the format older and newer versions both read; `*-refs` and `make-st` run in
the reference environment (transformers 5, diffusers 0.42, sentence-transformers). Every load across
environments fails on a missing or unexpected weight (PITFALLS: transformers 5 renames CLIP's keys).
"""

from __future__ import annotations

import contextlib
import json
import shutil
import sys
from pathlib import Path

from build.hfmodels import _redraw

SEED = 0


def _spec(path: str) -> dict:
    return json.loads(Path(path).read_text())


def _write_json(path: Path, value) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(value, indent=2) + "\n")


def _strict(loaded) -> object:
    """A from_pretrained(..., output_loading_info=True) result, or an error naming the bad keys."""
    model, info = loaded
    bad = {k: v for k, v in info.items() if k in ("missing_keys", "unexpected_keys", "mismatched_keys") and v}
    if bad:
        raise RuntimeError(f"{type(model).__name__} did not load exactly: {bad}")
    return model.eval()


def _noisy_vectors(module, seed: int, scale: float = 0.1) -> None:
    """Noise on every 1-D parameter (norm weights, biases): diffusers and transformers start them constant."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, param in sorted(module.named_parameters()):
            if param.ndim == 1:
                param.add_(scale * torch.randn(param.shape, generator=gen))


# --- sentence embeddings -------------------------------------------------------------------------

def make_bert(spec: dict) -> None:
    """A tiny BertModel (matrices redrawn, norms and biases noisy) with the WordPiece tokenizer."""
    import torch
    import transformers

    out = Path(spec["out"])
    tokenizer = transformers.BertTokenizerFast(vocab_file=spec["vocab"], do_lower_case=True,
                                               model_max_length=spec["max_length"])
    config = transformers.BertConfig(vocab_size=len(tokenizer), **spec["config"])
    torch.manual_seed(SEED)
    model = transformers.BertModel(config)  # with its pooler, as MiniLM checkpoints are (unused by pooling)
    _redraw(model, SEED)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)


def make_st(spec: dict) -> None:
    """A sentence-transformers folder around a transformers model: Transformer, Pooling, [Normalize]."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer import modules

    transformer = modules.Transformer(spec["transformer"], max_seq_length=spec["max_length"])
    _strict_weights(transformer.auto_model, Path(spec["transformer"]))
    stack = [transformer, modules.Pooling(transformer.get_embedding_dimension(), spec["pooling"])]
    if spec["normalize"]:
        stack.append(modules.Normalize())
    SentenceTransformer(modules=stack, device="cpu").save(spec["out"])
    if spec["legacy"]:
        _legacy_layout(Path(spec["out"]), transformer.get_embedding_dimension(), spec["pooling"],
                       spec["max_length"])


LEGACY_POOLING_MODES = ("cls_token", "mean_tokens", "max_tokens", "mean_sqrt_len_tokens",
                        "weightedmean_tokens", "lasttoken")


def _legacy_layout(folder: Path, dimension: int, pooling: str, max_length: int) -> None:
    """Rewrite a sentence-transformers 6 folder in the layout of the 2.x-3.x folders most published models
    have: modules under sentence_transformers.models, one boolean per pooling mode, no Normalize config."""
    modules = json.loads((folder / "modules.json").read_text())
    for module in modules:
        module["type"] = "sentence_transformers.models." + module["type"].rsplit(".", 1)[1]
    _write_json(folder / "modules.json", modules)
    wanted = {"cls": "cls_token", "mean": "mean_tokens"}[pooling]
    _write_json(folder / "1_Pooling" / "config.json", {
        "word_embedding_dimension": dimension,
        **{f"pooling_mode_{mode}": mode == wanted for mode in LEGACY_POOLING_MODES}, "include_prompt": True})
    _write_json(folder / "sentence_bert_config.json", {"max_seq_length": max_length, "do_lower_case": False})
    shutil.rmtree(folder / "2_Normalize", ignore_errors=True)


def _strict_weights(model, folder: Path) -> None:
    """Every tensor of folder/model.safetensors is in the model, equal, and the model has no other."""
    import torch
    from safetensors.torch import load_file

    saved = load_file(folder / "model.safetensors")
    state = model.state_dict()
    if set(saved) != set(state):
        raise RuntimeError(f"weights differ in name: missing {set(saved) - set(state)}, "
                           f"unexpected {set(state) - set(saved)}")
    different = [k for k in saved if not torch.equal(saved[k], state[k])]
    if different:
        raise RuntimeError(f"weights differ in value: {different}")


def st_refs(spec: dict) -> None:
    """The folder's embeddings of spec["texts"] as one padded batch, and the tokenizer's inputs."""
    import numpy as np
    import torch
    from sentence_transformers import SentenceTransformer

    folder = Path(spec["folder"])
    model = SentenceTransformer(str(folder), device="cpu", backend="torch")
    _strict_weights(model[0].auto_model, folder)
    texts = spec["texts"]
    features = model.tokenize(texts)
    with torch.no_grad():
        embeddings = model.encode(texts, batch_size=len(texts), convert_to_numpy=True)
    refs = folder / "references"
    refs.mkdir(parents=True, exist_ok=True)
    np.save(refs / "embeddings.npy", embeddings.astype(np.float32))
    inputs = {name: features[name].tolist() for name in ("input_ids", "attention_mask", "token_type_ids")}
    _write_json(refs / "inputs.json", {"texts": texts, **inputs})


# --- VITS ----------------------------------------------------------------------------------------

def make_vits(spec: dict) -> None:
    """A tiny VitsModel with deterministic inference (noise scales 0) and a character tokenizer."""
    import torch
    import transformers

    out = Path(spec["out"])
    out.mkdir(parents=True, exist_ok=True)
    _write_json(out / "vocab.json", spec["vocab"])
    tokenizer = transformers.VitsTokenizer(vocab_file=str(out / "vocab.json"), language="eng", add_blank=True,
                                           normalize=True, phonemize=False)
    config = transformers.VitsConfig(vocab_size=len(spec["vocab"]), **spec["config"])
    torch.manual_seed(SEED)
    model = transformers.VitsModel(config)
    _noisy_vectors(model, SEED, spec["vector_noise"])
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)


def vits_refs(spec: dict) -> None:
    """transformers' waveform for each text alone (batch 1), with the ids it was given."""
    import numpy as np
    import torch
    import transformers

    hf = spec["hf"]
    model = _strict(transformers.VitsModel.from_pretrained(hf, output_loading_info=True))
    tokenizer = transformers.VitsTokenizer.from_pretrained(hf)
    refs = Path(spec["out"]) / "references"
    refs.mkdir(parents=True, exist_ok=True)
    cases = []
    for i, text in enumerate(spec["texts"]):
        encoded = tokenizer(text, return_tensors="pt")
        with torch.no_grad():
            waveform = model(**encoded).waveform
        np.save(refs / f"waveform_{i}.npy", waveform.numpy().astype(np.float32))
        cases.append({"text": text, "input_ids": encoded["input_ids"][0].tolist(),
                      "waveform": f"waveform_{i}.npy", "samples": int(waveform.shape[1])})
    _write_json(refs / "inputs.json", {"sampling_rate": model.config.sampling_rate, "cases": cases})


# --- Stable Diffusion ----------------------------------------------------------------------------

def make_sd(spec: dict) -> None:
    """A StableDiffusionPipeline of tiny random parts (no safety checker), saved with save_pretrained."""
    import diffusers
    import torch
    import transformers

    torch.manual_seed(SEED)
    text_encoder = transformers.CLIPTextModel(transformers.CLIPTextConfig(**spec["text_encoder"]))
    unet = diffusers.UNet2DConditionModel(**spec["unet"])
    vae = diffusers.AutoencoderKL(**spec["vae"])
    for seed, part in enumerate((text_encoder, unet, vae)):
        _noisy_vectors(part, SEED + seed, spec["vector_noise"])
    with torch.no_grad():  # keep the decoded image inside [-1, 1] mostly: see docs/paradigm-models.md
        vae.decoder.conv_out.weight.mul_(spec["vae_out_gain"])
        vae.decoder.conv_out.bias.mul_(spec["vae_out_gain"])
    tokenizer = transformers.CLIPTokenizer.from_pretrained(spec["tokenizer"])
    cls = spec["scheduler"].get("_class_name", "EulerDiscreteScheduler")
    scheduler = getattr(diffusers, cls).from_config(spec["scheduler"])
    pipeline = getattr(diffusers, spec.get("pipeline", "StableDiffusionPipeline"))
    pipe = pipeline(vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, unet=unet, scheduler=scheduler,
                    safety_checker=None, feature_extractor=None, requires_safety_checker=False)
    pipe.save_pretrained(spec["out"], safe_serialization=True)
    print(json.dumps({"parameters": {name: sum(p.numel() for p in part.parameters())
                                     for name, part in (("text_encoder", text_encoder), ("unet", unet),
                                                        ("vae", vae))}}))


def make_sdxl(spec: dict) -> None:
    """A StableDiffusionXLPipeline of tiny random parts, saved with save_pretrained: the second tokenizer pads
    with "!" as Stable Diffusion XL's does."""
    import diffusers
    import torch
    import transformers

    torch.manual_seed(SEED)
    text_encoder = transformers.CLIPTextModel(transformers.CLIPTextConfig(**spec["text_encoder"]))
    text_encoder_2 = transformers.CLIPTextModelWithProjection(
        transformers.CLIPTextConfig(**spec["text_encoder_2"]))
    unet = diffusers.UNet2DConditionModel(**spec["unet"])
    vae = diffusers.AutoencoderKL(**spec["vae"])
    for seed, part in enumerate((text_encoder, text_encoder_2, unet, vae)):
        _noisy_vectors(part, SEED + seed, spec["vector_noise"])
    tokenizer = transformers.CLIPTokenizer.from_pretrained(spec["tokenizer"])
    tokenizer_2 = transformers.CLIPTokenizer.from_pretrained(spec["tokenizer"], pad_token="!")
    scheduler = diffusers.EulerDiscreteScheduler.from_config(spec["scheduler"])
    parts = {"text_encoder": text_encoder, "text_encoder_2": text_encoder_2, "unet": unet, "vae": vae}
    if spec.get("refiner"):  # stable-diffusion-xl-refiner's layout: the second encoder only, the aesthetic
        # score in the size conditioning, the empty negative prompt encoded
        del parts["text_encoder"]
        pipe = diffusers.StableDiffusionXLImg2ImgPipeline(
            vae=vae, text_encoder=None, text_encoder_2=text_encoder_2, tokenizer=None,
            tokenizer_2=tokenizer_2, unet=unet, scheduler=scheduler, requires_aesthetics_score=True,
            force_zeros_for_empty_prompt=False, add_watermarker=False)
    else:
        pipe = diffusers.StableDiffusionXLPipeline(vae=vae, text_encoder=text_encoder,
                                                   text_encoder_2=text_encoder_2,
                                                   tokenizer=tokenizer, tokenizer_2=tokenizer_2, unet=unet,
                                                   scheduler=scheduler, add_watermarker=False)
    pipe.save_pretrained(spec["out"], safe_serialization=True)
    print(json.dumps({"parameters": {name: sum(p.numel() for p in part.parameters())
                                     for name, part in parts.items()}}))


def _load_sdxl(hf: str, pipeline: str = "StableDiffusionXLPipeline"):
    import diffusers
    import transformers

    refiner = not (Path(hf) / "text_encoder").exists()  # stable-diffusion-xl-refiner's layout
    parts = {
        "text_encoder": None if refiner else _strict(transformers.CLIPTextModel.from_pretrained(
            hf, subfolder="text_encoder", output_loading_info=True)),
        "text_encoder_2": _strict(transformers.CLIPTextModelWithProjection.from_pretrained(
            hf, subfolder="text_encoder_2", output_loading_info=True)),
        "unet": _strict(diffusers.UNet2DConditionModel.from_pretrained(hf, subfolder="unet",
                                                                       output_loading_info=True)),
        "vae": _strict(diffusers.AutoencoderKL.from_pretrained(hf, subfolder="vae",
                                                               output_loading_info=True)),
    }
    tokenizers = {name: None if refiner and name == "tokenizer" else
                  transformers.CLIPTokenizer.from_pretrained(hf, subfolder=name)
                  for name in ("tokenizer", "tokenizer_2")}
    scheduler = diffusers.EulerDiscreteScheduler.from_pretrained(hf, subfolder="scheduler")
    extra = {"requires_aesthetics_score": True, "force_zeros_for_empty_prompt": False} if refiner else {}
    return getattr(diffusers, pipeline)(**parts, **tokenizers, scheduler=scheduler, add_watermarker=False,
                                        **extra)


def _referenced(pipe, case: dict, refs: Path) -> dict:
    """Run one case through `pipe`, save its image and final latents in `refs`; its entry of cases.json."""
    import numpy as np

    result = _run_case(pipe, case, refs)
    name = case["name"]
    np.save(refs / f"{name}.image.npy", result["image"])
    np.save(refs / f"{name}.final_latents.npy", result["final_latents"])
    return {**case, "scheduler": result["scheduler"], "image": f"{name}.image.npy",
            "final_latents": f"{name}.final_latents.npy", "noise_draws": result["noise_draws"],
            "timesteps": result["timesteps"]}


def sdxl_refs(spec: dict) -> None:
    """Each case through diffusers' StableDiffusionXLPipeline: image and final latents, both tokenizers' ids
    (the negative's None where the pipeline zeroes the unconditional states)."""

    pipe = _load_sdxl(spec["hf"])
    pipe.set_progress_bar_config(disable=True)
    refs = Path(spec["out"]) / "references"
    index = []
    seen: list = []  # the size conditioning the pipeline hands its UNet, each call

    def keep(_module, _args, kwargs):
        seen.append(kwargs["added_cond_kwargs"]["time_ids"].numpy().tolist())

    pipe.unet.register_forward_pre_hook(keep, with_kwargs=True)
    for case in spec["cases"]:
        seen.clear()
        entry = _referenced(pipe, case, refs)
        negative = case.get("negative_prompt")
        zeros = negative is None and case["guidance_scale"] > 1 and pipe.config.force_zeros_for_empty_prompt
        index.append({**entry, "zero_negative": bool(zeros), "time_ids": seen[0],
                      "prompt_ids": [_ids(pipe.tokenizer, case["prompt"]),
                                     _ids(pipe.tokenizer_2, case["prompt"])],
                      "negative_prompt_ids": [_ids(pipe.tokenizer, negative),
                                              _ids(pipe.tokenizer_2, negative)]})
    _write_json(refs / "cases.json", {"vae_scaling_factor": pipe.vae.config.scaling_factor, "cases": index})


def make_sd3(spec: dict) -> None:
    """A StableDiffusion3Pipeline of tiny random parts (two CLIP encoders with projections, a T5 encoder, an
    SD3 transformer, a VAE with a shift factor), saved with save_pretrained."""
    import diffusers
    import torch
    import transformers

    torch.manual_seed(SEED)
    clip = [transformers.CLIPTextModelWithProjection(transformers.CLIPTextConfig(**spec[name]))
            for name in ("text_encoder", "text_encoder_2")]
    t5 = transformers.T5EncoderModel(transformers.T5Config(**spec["text_encoder_3"]))
    transformer = diffusers.SD3Transformer2DModel(**spec["transformer"])
    vae = diffusers.AutoencoderKL(**spec["vae"])
    for seed, part in enumerate((*clip, t5, transformer, vae)):
        _noisy_vectors(part, SEED + seed, spec["vector_noise"])
    tokenizer = transformers.CLIPTokenizer.from_pretrained(spec["tokenizer"])
    tokenizer_2 = transformers.CLIPTokenizer.from_pretrained(spec["tokenizer"], pad_token="!")
    tokenizer_3 = transformers.T5TokenizerFast.from_pretrained(spec["tokenizer_3"])
    scheduler = diffusers.FlowMatchEulerDiscreteScheduler(**spec["flow_scheduler"])
    pipe = diffusers.StableDiffusion3Pipeline(transformer=transformer, scheduler=scheduler, vae=vae,
                                              text_encoder=clip[0], tokenizer=tokenizer,
                                              text_encoder_2=clip[1], tokenizer_2=tokenizer_2,
                                              text_encoder_3=t5, tokenizer_3=tokenizer_3)
    pipe.save_pretrained(spec["out"], safe_serialization=True)
    parts = {"text_encoder": clip[0], "text_encoder_2": clip[1], "text_encoder_3": t5,
             "transformer": transformer,
             "vae": vae}
    print(json.dumps({"parameters": {k: sum(p.numel() for p in v.parameters()) for k, v in parts.items()}}))


def sd3_refs(spec: dict) -> None:
    """Each case through diffusers' StableDiffusion3Pipeline (loaded with from_pretrained: every part's
    load is checked by diffusers' own strict loading): image and final latents, the three tokenizers' ids
    (T5's padded to the pipeline's max_sequence_length, 256)."""
    import diffusers

    # without_t5: loaded as diffusers' docs show to drop T5 (text_encoder_3=None, tokenizer_3=None): the
    # pipeline puts zeros in place of T5's states
    dropped = {"text_encoder_3": None, "tokenizer_3": None} if spec.get("without_t5") else {}
    pipe = diffusers.StableDiffusion3Pipeline.from_pretrained(spec["hf"], **dropped)
    pipe.set_progress_bar_config(disable=True)
    refs = Path(spec["out"]) / "references"
    index = []
    tokenizers = (pipe.tokenizer, pipe.tokenizer_2, pipe.tokenizer_3)[: 2 if dropped else 3]
    lengths = (pipe.tokenizer_max_length, pipe.tokenizer_max_length, 256)[: len(tokenizers)]
    for case in spec["cases"]:
        entry = _referenced(pipe, case, refs)
        negative = case.get("negative_prompt")
        if negative is None and case["guidance_scale"] > 1:
            negative = ""  # what the pipeline encodes for the unconditional row when none is given
        index.append({**entry,
                      "prompt_ids": [_ids(t, case["prompt"], n)
                                     for t, n in zip(tokenizers, lengths, strict=True)],
                      "negative_prompt_ids": [_ids(t, negative, n)
                                              for t, n in zip(tokenizers, lengths, strict=True)]})
    _write_json(refs / spec.get("index", "cases.json"),
                {"vae_scaling_factor": pipe.vae.config.scaling_factor,
                 "vae_shift_factor": pipe.vae.config.shift_factor, "cases": index})


def _load_sd(hf: str, pipeline: str = "StableDiffusionPipeline"):
    import diffusers
    import transformers

    parts = {
        "text_encoder": _strict(transformers.CLIPTextModel.from_pretrained(hf, subfolder="text_encoder",
                                                                           output_loading_info=True)),
        "unet": _strict(diffusers.UNet2DConditionModel.from_pretrained(hf, subfolder="unet",
                                                                       output_loading_info=True)),
        "vae": _strict(diffusers.AutoencoderKL.from_pretrained(hf, subfolder="vae",
                                                               output_loading_info=True)),
    }
    tokenizer = transformers.CLIPTokenizer.from_pretrained(hf, subfolder="tokenizer")
    scheduler = diffusers.EulerDiscreteScheduler.from_pretrained(hf, subfolder="scheduler")
    options = {"safety_checker": None, "feature_extractor": None, "requires_safety_checker": False}
    return getattr(diffusers, pipeline)(**parts, tokenizer=tokenizer, scheduler=scheduler, **options)


class _GivenNoise:
    """Stands in for diffusers' randn_tensor inside a scheduler module: hands out noise[0], noise[1], ..."""

    def __init__(self, noise):
        self.noise, self.calls = noise, 0

    def __call__(self, shape, **_):
        import torch

        if self.noise is None or self.calls >= len(self.noise):
            raise RuntimeError(f"the scheduler drew noise #{self.calls}; the case gives "
                               f"{0 if self.noise is None else len(self.noise)}")
        sample = torch.from_numpy(self.noise[self.calls])
        if tuple(sample.shape) != tuple(shape):
            raise RuntimeError(f"noise of shape {tuple(sample.shape)} given, {tuple(shape)} asked")
        self.calls += 1
        return sample


@contextlib.contextmanager
def _noise_in(module_name: str, given: _GivenNoise):
    """`module_name`'s randn_tensor replaced by `given` inside the block (a scheduler's module that never
    draws noise may have none: it has `given` until the block ends)."""
    import importlib

    module = importlib.import_module(module_name)
    original = getattr(module, "randn_tensor", None)
    module.randn_tensor = given
    try:
        yield given
    finally:
        if original is None:
            del module.randn_tensor
        else:
            module.randn_tensor = original


def _run_case(pipe, case: dict, folder: Path) -> dict:
    """One StableDiffusionPipeline call with the case's scheduler, initial latents and per-step noise."""
    import diffusers
    import numpy as np
    import torch

    config = case["scheduler"]
    cls = getattr(diffusers, config["_class_name"])
    pipe.scheduler = cls.from_config(config)
    latents = np.load(folder / case["latents"])
    noise = np.load(folder / case["noise"]) if case.get("noise") else None
    given = _GivenNoise(noise)
    steps: list[np.ndarray] = []

    def keep(_pipe, _step, _t, kwargs):
        steps.append(kwargs["latents"].numpy().copy())
        return kwargs

    rescale = case.get("guidance_rescale", 0.0)  # an argument Stable Diffusion 3's pipeline does not take
    with _noise_in(cls.__module__, given), torch.no_grad():
        # arguments that some pipelines do not take (a latent consistency model's: negative_prompt), given
        # only when set
        optional = {"guidance_rescale": rescale} if rescale else {}
        if case.get("eta"):  # StableDiffusionPipeline hands it to the schedulers whose step takes it (DDIM)
            optional["eta"] = case["eta"]
        if case.get("negative_prompt") is not None:  # "" is a negative prompt, unlike None
            optional["negative_prompt"] = case["negative_prompt"]
        image = pipe(case["prompt"], num_inference_steps=case["num_inference_steps"],
                     guidance_scale=case["guidance_scale"], latents=torch.from_numpy(latents),
                     output_type="np", callback_on_step_end=keep, **optional).images
    return {"image": image.astype(np.float32), "final_latents": steps[-1], "noise_draws": given.calls,
            "timesteps": [float(t) for t in pipe.scheduler.timesteps],
            "scheduler": json.loads(pipe.scheduler.to_json_string())}


def _ids(tokenizer, text: str | None, length: int | None = None) -> list[int] | None:
    if text is None:
        return None
    return tokenizer(text, padding="max_length", max_length=length or tokenizer.model_max_length,
                     truncation=True).input_ids


def sd_refs(spec: dict) -> None:
    """Each case through diffusers' StableDiffusionPipeline (or the spec's pipeline class): image (float,
    before uint8) and final latents; for a UNet that takes its guidance embedded (a latent consistency
    model's), the embedding the pipeline handed it (`guidance_embedding`)."""
    pipe = _load_sd(spec["hf"], spec.get("pipeline", "StableDiffusionPipeline"))
    pipe.set_progress_bar_config(disable=True)
    refs = Path(spec["out"]) / "references"
    embedded = pipe.unet.config.time_cond_proj_dim is not None
    seen: list = []

    def keep(_module, _args, kwargs):
        seen.append(kwargs["timestep_cond"].numpy()[0].tolist())

    if embedded:
        pipe.unet.register_forward_pre_hook(keep, with_kwargs=True)
    index = []
    for case in spec["cases"]:
        seen.clear()
        entry = _referenced(pipe, case, refs)
        negative = case.get("negative_prompt")
        if negative is None and case["guidance_scale"] > 1 and not embedded:
            negative = ""  # what diffusers feeds the unconditional row when no negative prompt is given
        index.append({**entry, **({"guidance_embedding": seen[0]} if embedded else {}),
                      "prompt_ids": _ids(pipe.tokenizer, case["prompt"]),
                      "negative_prompt_ids": _ids(pipe.tokenizer, negative)})
    _write_json(refs / "cases.json", {"vae_scaling_factor": pipe.vae.config.scaling_factor, "cases": index})


def img2img_refs(spec: dict) -> None:
    """Each image-to-image case through diffusers' spec["pipeline"] (StableDiffusionImg2ImgPipeline of
    sd_refs' parts, or StableDiffusion3Img2ImgPipeline) from the init image references/<spec["init_image"]>:
    its noises drawn here from torch.Generator().manual_seed(case seed) and given to diffusers in place of
    its own draws: the encoder's sample (`encode_noise`), the noise
    the pipeline adds at the first retained timestep (`add_noise`), and the scheduler's per-step noise
    (`noise`, one row per retained UNet run of a scheduler that draws, else none); each consumed exactly.
    Writes references/img2img.json: per case its image (float, before uint8), final latents, the
    timesteps the pipeline ran (diffusers' schedule from `begin_index` on) and the tokenizer's ids.
    StableDiffusionInpaintPipeline (spec["mask_image"] beside): the encoder draws twice, the image's sample
    and the masked image's (`masked_noise`), and the file is references/inpaint.json."""
    import diffusers
    import numpy as np
    import torch

    kind = spec["pipeline"]
    pipe, init, masking = _img2img_pipeline(spec)
    refs = Path(spec["out"]) / "references"
    inpaint = kind in INPAINTS
    shape = spec["latent_shape"]
    index = []
    seen: list = []  # Stable Diffusion XL: the size conditioning the pipeline hands its UNet, each call
    if kind in XL:
        def keep_time_ids(_module, _args, kwargs):
            seen.append(kwargs["added_cond_kwargs"]["time_ids"].numpy().tolist())

        pipe.unet.register_forward_pre_hook(keep_time_ids, with_kwargs=True)
    for case in spec["cases"]:
        seen.clear()
        name, steps, strength = case["name"], case["num_inference_steps"], case["strength"]
        cls = getattr(diffusers, case["scheduler"]["_class_name"])
        pipe.scheduler = cls.from_config(case["scheduler"])  # a probe: how many runs the pipeline keeps
        lcm = kind == LCM_IMG2IMG  # its scheduler makes the schedule of the strength, run whole
        pipe.scheduler.set_timesteps(steps, **({"strength": strength} if lcm else {}))
        runs = steps if lcm else len(pipe.get_timesteps(steps, strength, "cpu")[0])
        pipe.scheduler = cls.from_config(case["scheduler"])
        gen = torch.Generator().manual_seed(case["seed"])
        drawn = {"encode_noise": torch.randn(shape, generator=gen).numpy(),
                 "add_noise": torch.randn(shape, generator=gen).numpy()}
        if inpaint:  # the masked image's encoding, which a UNet of the latents' channels does not read
            drawn["masked_noise"] = torch.randn(shape, generator=gen).numpy()
        if case["noisy"]:  # LCM adds none after its last step, KDPM2Ancestral at its second runs only
            second_runs = case["scheduler"]["_class_name"] == "KDPM2AncestralDiscreteScheduler"
            draws = runs - 1 if lcm else runs // 2 if second_runs else runs
            drawn["noise"] = torch.randn([draws, *shape], generator=gen).numpy()
        files = {key: f"{name}.{key}.npy" for key in drawn}
        for key, value in drawn.items():
            np.save(refs / files[key], value)
        # an inpainting UNet (9 input channels) at strength 1 starts from noise alone: no image latents
        denoiser = pipe.transformer if kind in SD3 else pipe.unet
        nine = inpaint and denoiser.config.in_channels == 2 * pipe.vae.config.latent_channels + 1
        encoded = [*([] if nine and strength == 1.0 else [drawn["encode_noise"]]),
                   *([drawn["masked_noise"]] if inpaint else [])]
        givens = {"encode_noise": _GivenNoise(np.stack(encoded)),
                  "add_noise": _GivenNoise(drawn["add_noise"][None]),
                  "noise": _GivenNoise(drawn.get("noise"))}
        ran: list[float] = []
        latents: list[np.ndarray] = []

        def keep(_pipe, _step, t, kwargs, ran=ran, latents=latents):
            ran.append(float(t))
            latents.append(kwargs["latents"].numpy().copy())
            return kwargs

        optional = {} if case["negative_prompt"] is None else {"negative_prompt": case["negative_prompt"]}
        with (_noise_in("diffusers.models.autoencoders.vae", givens["encode_noise"]),
              _noise_in(type(pipe).__module__, givens["add_noise"]),
              _noise_in(cls.__module__, givens["noise"]), torch.no_grad()):
            image = pipe(case["prompt"], image=init, strength=strength, num_inference_steps=steps,
                         guidance_scale=case["guidance_scale"], output_type="np", callback_on_step_end=keep,
                         **optional, **masking).images
        for key, given in givens.items():
            wanted = 0 if given.noise is None else len(given.noise)
            if given.calls != wanted:
                raise RuntimeError(f"{name}: {given.calls} draws of {key}, {wanted} given")
        if len(ran) != runs:
            raise RuntimeError(f"{name}: {len(ran)} UNet runs, {runs} expected")
        image, shipped = _shifted(pipe, kind, name, image, latents[-1], refs)
        np.save(refs / f"{name}.image.npy", image.astype(np.float32))
        np.save(refs / f"{name}.final_latents.npy", latents[-1])
        negative = case["negative_prompt"]
        zeros = negative is None and case["guidance_scale"] > 1 and kind in XL \
            and pipe.config.force_zeros_for_empty_prompt  # the unconditional states zeroed, no text
        if negative is None and case["guidance_scale"] > 1 and not zeros and not lcm:
            negative = ""  # what diffusers feeds the unconditional row when no negative prompt is given
        index.append({**{k: v for k, v in case.items() if k != "noisy"}, "zero_negative": bool(zeros),
                      "scheduler": json.loads(pipe.scheduler.to_json_string()),
                      "init_image": spec["init_image"], **files, "noise": files.get("noise"),
                      **({"mask_image": spec["mask_image"]} if inpaint else {}),
                      "image": f"{name}.image.npy", "final_latents": f"{name}.final_latents.npy", **shipped,
                      "timesteps": ran, "begin_index": len(pipe.scheduler.timesteps) - len(ran),
                      "noise_draws": givens["noise"].calls, "pipeline": spec["pipeline"],
                      **({"time_ids": seen[0]} if seen else {}),
                      **_prompt_ids(pipe, case["prompt"], negative, kind)})
    _write_json(refs / ("inpaint.json" if inpaint else "img2img.json"),
                {"vae_scaling_factor": pipe.vae.config.scaling_factor, "init_image": spec["init_image"],
                 "cases": index})


def _shifted(pipe, kind: str, name: str, image, final, refs: Path) -> tuple:
    """(the reference image, more fields of the case). StableDiffusion3InpaintPipeline of diffusers 0.42.1
    decodes its latents without the VAE's shift (its issue #13611; every other SD3 pipeline adds it): the
    final latents decoded with it are the reference, the pipeline's own image beside (`unshifted_image`)."""
    import numpy as np
    import torch

    if kind != SD3_INPAINT:
        return image, {}
    np.save(refs / f"{name}.unshifted_image.npy", image.astype(np.float32))
    with torch.no_grad():
        latents = torch.from_numpy(final) / pipe.vae.config.scaling_factor + pipe.vae.config.shift_factor
        decoded = pipe.vae.decode(latents, return_dict=False)[0]
    return pipe.image_processor.postprocess(decoded, output_type="np"), {
        "unshifted_image": f"{name}.unshifted_image.npy"}


def _img2img_pipeline(spec: dict):
    """(the pipeline of spec["pipeline"], the init image, the call's mask_image argument: inpainting's)."""
    import diffusers
    from PIL import Image

    kind = spec["pipeline"]
    # Stable Diffusion 3's parts load with diffusers' own strict from_pretrained (as sd3_refs loads them)
    pipe = (getattr(diffusers, kind).from_pretrained(spec["hf"]) if kind in SD3
            else _load_sdxl(spec["hf"], kind) if kind in XL else _load_sd(spec["hf"], kind))
    pipe.set_progress_bar_config(disable=True)
    refs = Path(spec["out"]) / "references"
    with Image.open(refs / spec["init_image"]) as opened:
        init = opened.copy()
    if init.mode != "RGB":
        raise RuntimeError(f"the init image is {init.mode}, not RGB")
    if kind not in INPAINTS:
        return pipe, init, {}
    with Image.open(refs / spec["mask_image"]) as opened:
        return pipe, init, {"mask_image": opened.copy()}


SD3_IMG2IMG = "StableDiffusion3Img2ImgPipeline"
INPAINT = "StableDiffusionInpaintPipeline"
LCM_IMG2IMG = "LatentConsistencyModelImg2ImgPipeline"  # the guidance embedded: no unconditional row
SDXL_IMG2IMG = "StableDiffusionXLImg2ImgPipeline"
XL = (SDXL_IMG2IMG, "StableDiffusionXLInpaintPipeline")  # two tokenizers, size conditioning
SD3_INPAINT = "StableDiffusion3InpaintPipeline"
SD3 = (SD3_IMG2IMG, SD3_INPAINT)  # three tokenizers, a transformer
INPAINTS = (INPAINT, "StableDiffusionXLInpaintPipeline", SD3_INPAINT)


def _prompt_ids(pipe, prompt: str, negative: str | None, kind: str) -> dict:
    """The tokenizers' ids of a case's prompt and negative prompt: Stable Diffusion's one row, Stable
    Diffusion XL's two, or Stable Diffusion 3's three (T5's padded to the pipeline's max_sequence_length,
    256)."""
    if kind not in SD3 and kind not in XL:
        return {"prompt_ids": _ids(pipe.tokenizer, prompt),
                "negative_prompt_ids": _ids(pipe.tokenizer, negative)}
    if kind in XL:  # each tokenizer's own length (77); a refiner's second alone
        tokenizers = tuple(t for t in (pipe.tokenizer, pipe.tokenizer_2) if t is not None)
        lengths = (None,) * len(tokenizers)
    else:
        tokenizers = (pipe.tokenizer, pipe.tokenizer_2, pipe.tokenizer_3)
        lengths = (pipe.tokenizer_max_length, pipe.tokenizer_max_length, 256)
    return {key: None if text is None else [_ids(t, text, n)
                                            for t, n in zip(tokenizers, lengths, strict=True)]
            for key, text in (("prompt_ids", prompt), ("negative_prompt_ids", negative))}


def draw_case_inputs(spec: dict) -> None:
    """Initial latents and per-step noise for each case, from torch.Generator().manual_seed(case seed)."""
    import numpy as np
    import torch

    refs = Path(spec["out"]) / "references"
    refs.mkdir(parents=True, exist_ok=True)
    shape = spec["latent_shape"]
    for case in spec["cases"]:
        gen = torch.Generator().manual_seed(case["seed"])
        np.save(refs / case["latents"], torch.randn(shape, generator=gen).numpy())
        if case.get("noise"):
            noise = torch.randn([case["num_inference_steps"], *shape], generator=gen)
            np.save(refs / case["noise"], noise.numpy())


COMMANDS = {"make-bert": make_bert, "make-st": make_st, "st-refs": st_refs, "make-vits": make_vits,
            "vits-refs": vits_refs, "make-sd": make_sd, "sd-refs": sd_refs, "make-sdxl": make_sdxl,
            "sdxl-refs": sdxl_refs, "make-sd3": make_sd3, "sd3-refs": sd3_refs,
            "img2img-refs": img2img_refs, "draw-case-inputs": draw_case_inputs}

if __name__ == "__main__":
    COMMANDS[sys.argv[1]](_spec(sys.argv[2]))
