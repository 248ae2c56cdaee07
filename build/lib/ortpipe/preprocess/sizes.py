"""Image size arithmetic of transformers' image processors, in plain integers.

Each function states the transformers function whose results it reproduces; the float expressions
follow theirs operation for operation, so rounding lands on the same integers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..errors import GenerationError

MAX_ASPECT_RATIO = 200  # Qwen2-VL refuses images more elongated than this


def fit_pixels(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Qwen2-VL's `smart_resize`: both sides multiples of `factor`, the area within [min, max] pixels,
    the aspect ratio kept as closely as that allows."""
    if max(height, width) > MAX_ASPECT_RATIO * min(height, width):
        raise GenerationError(f"an image of {height}x{width} is too elongated: the longer side may be at "
                              f"most {MAX_ASPECT_RATIO} times the shorter")
    h, w = round(height / factor) * factor, round(width / factor) * factor
    if h * w > max_pixels:
        shrink = math.sqrt((height * width) / max_pixels)
        h = max(factor, math.floor(height / shrink / factor) * factor)
        w = max(factor, math.floor(width / shrink / factor) * factor)
    elif h * w < min_pixels:
        grow = math.sqrt(min_pixels / (height * width))
        h = math.ceil(height * grow / factor) * factor
        w = math.ceil(width * grow / factor) * factor
    return h, w


def shortest_edge(height: int, width: int, edge: int) -> tuple[int, int]:
    """The shorter side set to `edge`, the longer scaled and truncated (`get_resize_output_image_size`
    with default_to_square=False)."""
    short, long = min(height, width), max(height, width)
    scaled = int(edge * long / short)
    return (scaled, edge) if width <= height else (edge, scaled)


def shortest_edge_within(height: int, width: int, edge: int, longest: int) -> tuple[int, int]:
    """The shorter side set to `edge` unless the longer would then pass `longest`
    (`get_size_with_aspect_ratio`)."""
    short, long = float(min(height, width)), float(max(height, width))
    raw = None
    if long / short * edge > longest:
        raw = longest * short / long
        edge = int(round(raw))
    if (height <= width and height == edge) or (width <= height and width == edge):
        return height, width
    if width < height:
        return int((raw if raw is not None else edge) * height / width), edge
    return edge, int((raw if raw is not None else edge) * width / height)


def vertical_first(height: int, width: int, out_height: int, out_width: int) -> bool:
    """Pillow 13's pass order: vertical first when the height shrinks by more than twice as many pixels
    as the width. (Pillow 12 and older always run the horizontal pass first.)"""
    shrink = height - out_height
    return shrink > 0 and shrink > (width - out_width) * 2


@dataclass(frozen=True)
class Crop:
    """A centre crop as the normalize kernel takes it: zero padding (Pad's order over h, w, c), then a
    slice [starts, ends) over (h, w)."""

    pads: tuple[int, int, int, int, int, int]
    starts: tuple[int, int]
    ends: tuple[int, int]

    @property
    def size(self) -> tuple[int, int]:
        return self.ends[0] - self.starts[0], self.ends[1] - self.starts[1]


def whole(height: int, width: int) -> Crop:
    return Crop((0, 0, 0, 0, 0, 0), (0, 0), (height, width))


def center_crop(height: int, width: int, crop_height: int, crop_width: int) -> Crop:
    """transformers' `center_crop`: an image smaller than the crop is first padded with zeros around it."""
    (pad_top, pad_bottom, top, bottom) = _center(height, crop_height)
    (pad_left, pad_right, left, right) = _center(width, crop_width)
    return Crop((pad_top, pad_left, 0, pad_bottom, pad_right, 0), (top, left), (bottom, right))


def _center(size: int, crop: int) -> tuple[int, int, int, int]:
    """Along one side: padding before and after, then the slice's start and end in the padded image."""
    if crop <= size:
        start = (size - crop) // 2
        return 0, 0, start, start + crop
    padded = crop
    before = math.ceil((padded - size) / 2)
    start = (size - crop) // 2 + before
    return before, padded - size - before, max(0, start), min(padded, start + crop)
