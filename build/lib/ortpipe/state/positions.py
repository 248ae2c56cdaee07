"""Position ids: 1D by default; mRoPE 3D (temporal, height, width) for Qwen2-VL style decoders.

mRoPE rule (docs/pipelines.md): text tokens get t = h = w = p, counting on from the largest
position so far + 1; a run of image tokens with grid (T, H, W) and merge size m gets
base + (ti, hi, wi) over the merged grid T x H/m x W/m, row-major. Generated tokens at sequence
index k get k + delta on every axis, delta = max(prompt positions) + 1 - prompt length.
"""

from __future__ import annotations

from ..errors import GenerationError


def mrope(ids: list[int], image_token: int | None, grids: list[list[int]], merge: int
          ) -> tuple[list[list[int]], int]:
    """([t, h, w] position lists for `ids`, delta for later tokens)."""
    axes: list[list[int]] = [[], [], []]
    nxt, i, image = 0, 0, 0
    while i < len(ids):
        if ids[i] != image_token:
            for axis in axes:
                axis.append(nxt)
            nxt, i = nxt + 1, i + 1
            continue
        if image >= len(grids):
            raise GenerationError(f"the prompt has more image-token runs than images ({len(grids)} grids)")
        t, h, w = grids[image][0], grids[image][1] // merge, grids[image][2] // merge
        count = t * h * w
        if ids[i:i + count] != [image_token] * count:
            raise GenerationError(f"image {image} needs {count} image tokens in a row (grid {grids[image]}, "
                                  f"merge {merge}); the prompt has fewer")
        for ti in range(t):
            for hi in range(h):
                for wi in range(w):
                    axes[0].append(nxt + ti)
                    axes[1].append(nxt + hi)
                    axes[2].append(nxt + wi)
        nxt, i, image = nxt + max(t, h, w), i + count, image + 1
    delta = (max(max(a) for a in axes) + 1 - len(ids)) if ids else 0
    return axes, delta
