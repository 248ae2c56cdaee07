"""A request's images and audio clips -> the named inputs its init sessions read.

Each item is preprocessed on its own (kernels); items of one kind are joined along dim 0
(`pixel_values` [n, c, h, w], or Qwen2-VL's patches [sum of patches, dim]), and their small
integer values become int64 tensors (`image_grid_thw` [n, 3], `image_sizes` [n, 2]).
"""

from __future__ import annotations

from ..errors import GenerationError
from ..execute.work import Backend, Handle, Run, Work, kernel
from ..folder import Folder
from ..plan import FROM_REQUEST, Plan
from .audio import audio_features
from .config import load_audio_config, load_image_config
from .image import image_features

# Names a graph may use for the same preprocessed tensor (the Whisper builder's encoder reads
# "audio_features" where the feature extractor makes "input_features").
ALIASES = {"input_features": ("input_features", "audio_features"), "pixel_values": ("pixel_values",),
           "image_grid_thw": ("image_grid_thw",), "image_sizes": ("image_sizes",)}

Image = tuple[Handle, int, int]  # uint8 [h, w, 3], h, w


def media_inputs(
    plan: Plan, folder: Folder, backend: Backend, images: list[Image], audios: list[Handle]
) -> Work:
    """The request inputs made from images and waveforms, named as the plan's sessions read them."""
    wanted = _wanted(plan)
    _check_media(wanted, bool(images), bool(audios))
    made: dict[str, list[Handle]] = {}
    values: dict[str, list[tuple[int, ...]]] = {}
    prep = plan.config.pipeline.preprocessing
    if images:
        config = load_image_config(folder, _config_name(prep, "image"))
        for image, height, width in images:
            f = yield from image_features(
                backend, config, image, height, width, _dtype(wanted, "pixel_values")
            )
            made.setdefault("pixel_values", []).append(f.tensors["pixel_values"])
            for key, value in f.values.items():
                values.setdefault(key, []).append(value)
    if audios:
        config = load_audio_config(folder, _config_name(prep, "audio"))
        for waveform in audios:
            f = yield from audio_features(backend, config, waveform, _dtype(wanted, "input_features"))
            made.setdefault("input_features", []).append(f.tensors["input_features"])
    inputs: dict[str, Handle] = {}
    for name, parts in made.items():
        inputs[_target(name, wanted)] = yield from _joined(backend, parts, _dtype(wanted, name))
    for name, rows in values.items():
        if name in wanted:
            inputs[name] = backend.tensor(
                [v for row in rows for v in row], (len(rows), len(rows[0])), "int64"
            )
    return inputs


def _config_name(prep: dict, kind: str) -> str | None:
    section = prep.get(kind)
    return section.get("config") if isinstance(section, dict) else None


def check_media(plan: Plan, images: bool, audios: bool) -> None:
    """A GenerationError for images or audio that no session of the plan reads, before any is decoded or
    a processor config is read."""
    _check_media(_wanted(plan), images, audios)


def _check_media(wanted: dict[str, str], images: bool, audios: bool) -> None:
    if images:
        _target("pixel_values", wanted)
    if audios:
        _target("input_features", wanted)


def _wanted(plan: Plan) -> dict[str, str]:
    """The request inputs the plan's init steps read, with their element types."""
    return {f.input: f.dtype for s in plan.init_steps for f in s.feeds if f.kind == FROM_REQUEST}


def _target(name: str, wanted: dict[str, str]) -> str:
    for alias in ALIASES.get(name, (name,)):
        if alias in wanted:
            return alias
    kind = "images" if name == "pixel_values" else "audio"
    raise GenerationError(
        f"the request has {kind}, but no session of this pipeline reads "
        f"{' or '.join(ALIASES.get(name, (name,)))} (request inputs: {', '.join(wanted) or 'none'})"
    )


def _dtype(wanted: dict[str, str], name: str) -> str:
    found = [wanted[a] for a in ALIASES.get(name, (name,)) if a in wanted]
    return found[0] if found and found[0] in ("float32", "float16") else "float32"


def _joined(b: Backend, parts: list[Handle], dtype: str) -> Work:
    shapes = {tuple(b.shape(p)[1:]) for p in parts}
    if len(shapes) > 1:
        raise GenerationError(
            f"the request's items have different shapes after preprocessing ({sorted(shapes)}); "
            "this pipeline's preprocessing must make them equal to batch them"
        )
    joined = parts[0]
    for part in parts[1:]:
        joined = (yield Run(kernel("concat0", dtype), {"a": joined, "b": part}, ("y",)))["y"]
    return joined
