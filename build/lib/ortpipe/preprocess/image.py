"""One decoded image -> a vision model's inputs, as kernel runs (build/preprocess.py).

The steps of transformers' PIL image processors: resize (Pillow's filters, exact to the uint8),
centre crop, rescale and normalize, and for Qwen2-VL the flattening into merge-ordered patches.
The sizes are integer arithmetic here (sizes.py); the pixels never leave the target.
"""

from __future__ import annotations

from ..errors import GenerationError
from ..execute.work import Backend, Handle, Run, Work, kernel
from . import sizes
from .config import ImageConfig, Patches, Size
from .features import Features


def target_size(config: ImageConfig, height: int, width: int) -> tuple[int, int]:
    """The (height, width) the processor resizes an image to."""
    size = config.size
    if size is None:
        return height, width
    if config.patches is not None:
        factor = config.patches.patch_size * config.patches.merge_size
        return sizes.fit_pixels(height, width, factor, size.min_pixels or 0, size.max_pixels or 0)
    return _resized(size, height, width)


def _resized(size: Size, height: int, width: int) -> tuple[int, int]:
    if size.height is not None and size.width is not None:
        return size.height, size.width
    edge = size.shortest_edge or 0
    if size.longest_edge is not None:
        return sizes.shortest_edge_within(height, width, edge, size.longest_edge)
    return sizes.shortest_edge(height, width, edge)


def image_features(backend: Backend, config: ImageConfig, image: Handle, height: int, width: int,
                   dtype: str = "float32") -> Work:
    """A uint8 [height, width, channels] RGB image -> Features: `pixel_values` ([1, c, h, w], or Qwen2-VL's
    patches [grid_h * grid_w, c * temporal * patch^2]) with `image_sizes` or `image_grid_thw`."""
    b = backend
    channels = b.shape(image)[-1]
    if len(config.image_mean) != channels or len(config.image_std) != channels:
        raise GenerationError(f"the image has {channels} channels but {config.source} gives image_mean and "
                              f"image_std for {len(config.image_mean)}")
    out_h, out_w = target_size(config, height, width)
    if (out_h, out_w) != (height, width):
        image = yield from _resize(b, config.resample, image, (height, width), (out_h, out_w))
    crop = sizes.whole(out_h, out_w)
    if config.crop_size:
        crop = sizes.center_crop(out_h, out_w, *config.crop_size)
    pixels = yield from _normalize(b, config, image, crop, channels, dtype)
    if config.patches is not None:
        return (yield from _patches(b, config.patches, pixels, channels, *crop.size, dtype))
    h, w = crop.size
    return Features({"pixel_values": pixels, "image_sizes": b.tensor([h, w], (1, 2), "int64")},
                    {"image_sizes": (h, w)})


def _resize(b: Backend, resample: str, image: Handle, size: tuple[int, int], out: tuple[int, int]) -> Work:
    resized = yield Run(kernel(f"resize_{resample}", "uint8"), {
        "image": image, "size": b.tensor(list(out), (2,), "int64"),
        "vertical_first": b.tensor([sizes.vertical_first(*size, *out)], (), "bool")}, ("resized",))
    return resized["resized"]


def _normalize(b: Backend, config: ImageConfig, image: Handle, crop: sizes.Crop, channels: int,
               dtype: str) -> Work:
    out = yield Run(kernel("normalize", dtype), {
        "image": image, "pads": b.tensor(list(crop.pads), (6,), "int64"),
        "starts": b.tensor(list(crop.starts), (2,), "int64"),
        "ends": b.tensor(list(crop.ends), (2,), "int64"),
        "scale": b.tensor([config.rescale_factor], (1,), "float64"),
        "mean": b.tensor(list(config.image_mean), (channels,), "float32"),
        "std": b.tensor(list(config.image_std), (channels,), "float32")}, ("pixel_values",))
    return out["pixel_values"]


def _patches(b: Backend, p: Patches, pixels: Handle, channels: int, height: int, width: int,
             dtype: str) -> Work:
    """Qwen2-VL's layout: patches in merge-window order, the one frame repeated temporal_patch_size times."""
    side = p.patch_size * p.merge_size
    if height % side or width % side:
        raise GenerationError(f"Qwen2-VL patches need sides that are multiples of {side}, the image is "
                              f"{height}x{width}: turn do_resize on")
    grid_h, grid_w = height // p.patch_size, width // p.patch_size
    m, s, t = p.merge_size, p.patch_size, p.temporal_patch_size
    out = yield Run(kernel("patchify", dtype), {
        "pixel_values": pixels,
        "blocks": b.tensor([channels, grid_h // m, m, s, grid_w // m, m, s], (7,), "int64"),
        "tiled": b.tensor([grid_h // m, grid_w // m, m, m, channels, t, s, s], (8,), "int64"),
        "flat": b.tensor([grid_h * grid_w, channels * t * s * s], (2,), "int64")}, ("patches",))
    grid = (1, grid_h, grid_w)
    return Features({"pixel_values": out["patches"], "image_grid_thw": b.tensor(list(grid), (1, 3), "int64")},
                    {"image_grid_thw": grid, "image_tokens": (grid_h * grid_w // (m * m),)})
