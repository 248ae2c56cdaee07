"""Kernels of the loops that make no tokens (issue 16): pooling sentence embeddings, the denoising loop's
noise and scheduler steps, and turning a VAE's output into an image.

- `pool_*`: token states [batch, tokens, dim] and the attention mask -> one float32 vector per text, as
  sentence-transformers' Pooling computes it (mean, cls, max, lasttoken); `l2_normalize` as its Normalize.
- `normal`: standard normal noise from uniforms the core draws (random.Random(seed)), by Box-Muller in
  float64 on the CPU, so a seeded image is the same on every target.
- `denoise_init`, `denoise_step`: the scheduler's arithmetic between two UNet runs, one kernel a step. The
  core computes each step's coefficients from the scheduler's config (py/ortpipe/loops/schedulers.py); the
  kernel applies classifier-free guidance, the prediction of the clean latents, the update of the latents
  and the scaling (and repetition, for guidance) of the next UNet input.
- `image_latents`: image-to-image's first latents, a draw of a VAE encoder's latent distribution, scaled
  and noised to the first step's level.
- `inpaint_mask`, `inpaint_blend`: inpainting's mask at the latents' size, and the blend after each step of
  a UNet of the latents' channels (the kept region back to the image's latents, noised to the next step);
  `masked_pixels`, `inpaint_input`: an inpainting UNet's masked image, and its input (the latents, the mask
  and the masked image's latents along the channels).
- `divide`, `vae_image`, `rgba8`: the final latents divided by the VAE's scaling factor (plus its shift);
  the VAE's [-1, 1] output as a [0, 1] image [batch, height, width, 3]; that image as RGBA bytes.

`LOOP_KERNELS` has the format of build/kernels.py's `KERNELS`.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import onnx
from onnx import TensorProto, helper

from build.preprocess import _Nodes, _tensor

F32 = TensorProto.FLOAT
F64 = TensorProto.DOUBLE
I64 = TensorProto.INT64
INT64_MAX = 2**63 - 1
FLOATS = ("float32", "float16")

# The order of denoise_step's coefficients (loops/schedulers.py StepCoefficients writes them so).
STEP_COEFFICIENTS = (
    "guidance",
    "guidance_rescale",
    "x0_from_x",
    "x0_from_output",
    "clip_low",
    "clip_high",
    "from_x",
    "from_x0",
    "from_output",
    "from_noise",
    "from_previous_x0",
    "from_previous2_x0",
    "from_previous3_x0",
    "next_input_scale",
)


def _states(elem: int) -> onnx.ValueInfoProto:
    return _tensor("states", elem, ["batch", "tokens", "dim"])


def _mask() -> onnx.ValueInfoProto:
    return _tensor("mask", I64, ["batch", "tokens"])


def _embeddings(name: str = "embeddings") -> onnx.ValueInfoProto:
    return _tensor(name, F32, ["batch", "dim"])


def pool_mean(elem: int) -> onnx.GraphProto:
    """The mean of the states the mask keeps (sentence-transformers: the sum over max(count, 1e-9))."""
    n = _Nodes("")
    states = n.op("Cast", "states", to=F32)
    mask = n.op("Unsqueeze", n.op("Cast", "mask", to=F32), n.const([2], I64))
    total = n.op("ReduceSum", n.op("Mul", states, mask), n.const([1], I64), keepdims=0)
    count = n.op("ReduceSum", mask, n.const([1], I64), keepdims=0)
    n.op("Div", total, n.op("Max", count, n.const(1e-9, F32)), out="embeddings")
    return helper.make_graph(n.nodes, "pool_mean", [_states(elem), _mask()], [_embeddings()])


def pool_cls(elem: int) -> onnx.GraphProto:
    """The first token's state."""
    n = _Nodes("")
    n.op("Cast", n.op("Gather", "states", n.const(0, I64), axis=1), to=F32, out="embeddings")
    return helper.make_graph(n.nodes, "pool_cls", [_states(elem)], [_embeddings()])


def pool_max(elem: int) -> onnx.GraphProto:
    """The largest value of each dim over the kept tokens (masked ones count as -1e9, as in
    sentence-transformers)."""
    n = _Nodes("")
    states = n.op("Cast", "states", to=F32)
    kept = n.op("Unsqueeze", n.op("Cast", "mask", to=TensorProto.BOOL), n.const([2], I64))
    masked = n.op("Where", kept, states, n.const(-1e9, F32))
    n.op("ReduceMax", masked, axes=[1], keepdims=0, out="embeddings")
    return helper.make_graph(n.nodes, "pool_max", [_states(elem), _mask()], [_embeddings()])


def pool_lasttoken(elem: int) -> onnx.GraphProto:
    """The state of the last token the mask keeps (padding on either side); the first when it keeps none."""
    n = _Nodes("")
    tokens = n.op("Slice", n.op("Shape", "mask"), n.const([1], I64), n.const([2], I64))
    positions = n.op("Range", n.const(0, I64), n.op("Squeeze", tokens, n.const([0], I64)), n.const(1, I64))
    last = n.op("ReduceMax", n.op("Mul", "mask", positions), axes=[1], keepdims=1)  # [batch, 1]
    index = n.op("Unsqueeze", last, n.const([2], I64))  # [batch, 1, 1]
    dims = n.op("Shape", "states")
    wide = n.op(
        "Concat",
        n.op("Slice", dims, n.const([0], I64), n.const([1], I64)),
        n.const([1], I64),
        n.op("Slice", dims, n.const([2], I64), n.const([3], I64)),
        axis=0,
    )
    picked = n.op("GatherElements", "states", n.op("Expand", index, wide), axis=1)
    n.op("Cast", n.op("Squeeze", picked, n.const([1], I64)), to=F32, out="embeddings")
    return helper.make_graph(n.nodes, "pool_lasttoken", [_states(elem), _mask()], [_embeddings()])


def l2_normalize(_: int) -> onnx.GraphProto:
    """x / max(||x||, 1e-12) per row (torch.nn.functional.normalize)."""
    n = _Nodes("")
    norm = n.op("ReduceL2", "x", axes=[1], keepdims=1)
    n.op("Div", "x", n.op("Max", norm, n.const(1e-12, F32)), out="y")
    return helper.make_graph(n.nodes, "l2_normalize", [_embeddings("x")], [_embeddings("y")])


def normal(_: int) -> onnx.GraphProto:
    """u [2, m] float64 uniforms in (0, 1], count [1], shape [rank] -> float32 standard normal noise of
    `shape`: Box-Muller, r = sqrt(-2 ln u0), theta = 2 pi u1, giving r cos(theta) then r sin(theta), the
    first `count`."""
    n = _Nodes("")
    u0 = n.op("Gather", "u", n.const(0, I64), axis=0)
    u1 = n.op("Gather", "u", n.const(1, I64), axis=0)
    radius = n.op("Sqrt", n.op("Mul", n.const(-2.0, F64), n.op("Log", u0)))
    theta = n.op("Mul", n.const(2 * math.pi, F64), u1)
    both = n.op(
        "Concat", n.op("Mul", radius, n.op("Cos", theta)), n.op("Mul", radius, n.op("Sin", theta)), axis=0
    )
    first = n.op("Slice", both, n.const([0], I64), "count")
    n.op("Reshape", n.op("Cast", first, to=F32), "shape", out="noise")
    inputs = [_tensor("u", F64, [2, "m"]), _tensor("count", I64, [1]), _tensor("shape", I64, ["rank"])]
    return helper.make_graph(n.nodes, "normal", inputs, [_tensor("noise", F32, None)])


def _latents(name: str, elem: int = F32, batch: str = "batch") -> onnx.ValueInfoProto:
    return _tensor(name, elem, [batch, "channels", "height", "width"])


def denoise_init(elem: int) -> onnx.GraphProto:
    """latents, coefficients [init_noise_sigma, input scale], repeats [4] -> the first latents (the given ones
    times the scheduler's initial sigma) and the first UNet input (scaled, repeated for guidance)."""
    n = _Nodes("")
    sigma = n.op("Gather", "coefficients", n.const(0, I64))
    scale = n.op("Gather", "coefficients", n.const(1, I64))
    x = n.op("Mul", "latents", sigma, out="x")
    n.op("Cast", n.op("Tile", n.op("Mul", x, scale), "repeats"), to=elem, out="sample")
    inputs = [_latents("latents"), _tensor("coefficients", F32, [2]), _tensor("repeats", I64, [4])]
    outputs = [_latents("x"), _latents("sample", elem, "rows")]  # rows: the batch, twice with guidance
    return helper.make_graph(n.nodes, "denoise_init", inputs, outputs)


def image_latents(elem: int) -> onnx.GraphProto:
    """parameters [batch, 2c, h, w] (a VAE encoder's latent distribution: mean, then log variance, along the
    channels), sample_noise and noise float32 [batch, c, h, w], coefficients [scaling, shift, a, b] -> the
    first latents of image-to-image: z = (mean + exp(logvar / 2) * sample_noise - shift) * scaling (a draw
    of the distribution, its log variance clipped to [-30, 20], as diffusers' DiagonalGaussianDistribution
    keeps it), then a * z + b * noise (the scheduler's add_noise at the first step run)."""
    n = _Nodes("")
    params = n.op("Cast", "parameters", to=F32)
    half = n.op("Div", n.op("Shape", params, start=1, end=2), n.const([2], I64))
    mean = n.op("Slice", params, n.const([0], I64), half, n.const([1], I64))
    logvar = n.op("Slice", params, half, n.const([INT64_MAX], I64), n.const([1], I64))
    clipped = n.op("Clip", logvar, n.const(-30.0, F32), n.const(20.0, F32))
    std = n.op("Exp", n.op("Mul", clipped, n.const(0.5, F32)))
    draw = n.op("Add", mean, n.op("Mul", std, "sample_noise"))
    coefficient = [n.op("Gather", "coefficients", n.const(k, I64)) for k in range(4)]
    z = n.op("Mul", n.op("Sub", draw, coefficient[1]), coefficient[0])
    n.op("Add", n.op("Mul", z, coefficient[2]), n.op("Mul", "noise", coefficient[3]), out="latents")
    inputs = [_tensor("parameters", elem, ["batch", "twice_channels", "height", "width"]),
              _latents("sample_noise"), _latents("noise"), _tensor("coefficients", F32, [4])]
    return helper.make_graph(n.nodes, "image_latents", inputs, [_latents("latents")])


def inpaint_mask(_: int) -> onnx.GraphProto:
    """mask_image uint8 [height, width, 3], stride int64 [1] (the VAE's pixels per latent) -> mask float32
    [1, 1, height / stride, width / stride]: 1 where the image is repainted. As diffusers' inpainting
    pipeline makes it: the image's luminance as Pillow's convert("L") rounds it ((19595 R + 38470 G + 7471 B
    + 32768) >> 16), binarized at 0.5 (L / 255 >= 0.5: L >= 128), then resized to the latents' size by
    torch's nearest interpolation (the first pixel of each stride x stride block)."""
    n = _Nodes("")
    starts, ends = n.const([0, 0], I64), n.const([INT64_MAX, INT64_MAX], I64)
    steps = n.op("Concat", "stride", "stride", axis=0)
    picked = n.op("Cast", n.op("Slice", "mask_image", starts, ends, n.const([0, 1], I64), steps), to=I64)
    weighted = n.op("Mul", picked, n.const([19595, 38470, 7471], I64))
    luminance = n.op("Div", n.op("Add", n.op("ReduceSum", weighted, n.const([2], I64), keepdims=0),
                                 n.const(32768, I64)), n.const(65536, I64))
    repaint = n.op("Cast", n.op("GreaterOrEqual", luminance, n.const(128, I64)), to=F32)
    n.op("Unsqueeze", repaint, n.const([0, 1], I64), out="mask")
    inputs = [_tensor("mask_image", TensorProto.UINT8, ["height", "width", 3]), _tensor("stride", I64, [1])]
    return helper.make_graph(n.nodes, "inpaint_mask", inputs,
                             [_tensor("mask", F32, [1, 1, "latent_height", "latent_width"])])


def inpaint_blend(elem: int) -> onnx.GraphProto:
    """After a step of inpainting with a UNet of the latents' channels (diffusers' blend): x (the step's
    latents), image_latents z (the image's clean latents), noise (the first latents' noise), mask [1, 1, h, w]
    (1: repaint), coefficients [a, b, next_input_scale] (the next step's add_noise level; 1, 0 after the
    last) -> x_blended = (1 - mask) * (a * z + b * noise) + mask * x, and the next UNet input (scaled,
    repeated for guidance)."""
    n = _Nodes("")
    c = [n.op("Gather", "coefficients", n.const(k, I64)) for k in range(3)]
    kept = n.op("Add", n.op("Mul", "image_latents", c[0]), n.op("Mul", "noise", c[1]))
    keep = n.op("Sub", n.const(1.0, F32), "mask")
    x = n.op("Add", n.op("Mul", keep, kept), n.op("Mul", "mask", "x"), out="x_blended")
    n.op("Cast", n.op("Tile", n.op("Mul", x, c[2]), "repeats"), to=elem, out="sample")
    inputs = [_latents("x"), _latents("image_latents"), _latents("noise"),
              _tensor("mask", F32, [1, 1, "height", "width"]), _tensor("coefficients", F32, [3]),
              _tensor("repeats", I64, [4])]
    return helper.make_graph(n.nodes, "inpaint_blend", inputs,
                             [_latents("x_blended"), _latents("sample", elem, "rows")])


def masked_pixels(elem: int) -> onnx.GraphProto:
    """pixels [1, 3, height, width] (an encoder's, in [-1, 1]), mask float32 [1, 1, height, width] (1:
    repaint) -> the masked image an inpainting UNet reads, pixels * (1 - mask): diffusers' image *
    (mask < 0.5) of a binary mask."""
    n = _Nodes("")
    keep = n.op("Sub", n.const(1.0, F32), "mask")
    n.op("Cast", n.op("Mul", n.op("Cast", "pixels", to=F32), keep), to=elem, out="masked")
    inputs = [_tensor("pixels", elem, [1, 3, "height", "width"]),
              _tensor("mask", F32, [1, 1, "height", "width"])]
    return helper.make_graph(n.nodes, "masked_pixels", inputs,
                             [_tensor("masked", elem, [1, 3, "height", "width"])])


def inpaint_input(elem: int) -> onnx.GraphProto:
    """sample [rows, c, h, w] (the UNet's latents input), extra float32 [1, e, h, w] (an inpainting UNet's
    mask and masked image's latents), repeats [4] -> [rows, c + e, h, w]: diffusers' torch.cat([latents,
    mask, masked_image_latents], dim=1), the extra repeated for each row."""
    n = _Nodes("")
    extra = n.op("Cast", n.op("Tile", "extra", "repeats"), to=elem)
    n.op("Concat", "sample", extra, axis=1, out="input")
    inputs = [_latents("sample", elem, "rows"), _tensor("extra", F32, [1, "extra", "height", "width"]),
              _tensor("repeats", I64, [4])]
    return helper.make_graph(n.nodes, "inpaint_input", inputs,
                             [_tensor("input", elem, ["rows", "all", "height", "width"])])


def _row_std(n: _Nodes, x: str) -> str:
    """The unbiased standard deviation of each row of latents [batch, channels, height, width]:
    [batch, 1, 1, 1]."""
    centred = n.op("Sub", x, n.op("ReduceMean", x, axes=[1, 2, 3], keepdims=1))
    total = n.op("ReduceSum", n.op("Mul", centred, centred), n.const([1, 2, 3], I64), keepdims=1)
    shape = n.op("Shape", x)
    count = n.op("Cast", n.op("ReduceProd", n.op("Slice", shape, n.const([1], I64), n.const([4], I64)),
                              keepdims=0), to=F32)
    return n.op("Sqrt", n.op("Div", total, n.op("Sub", count, n.const(1.0, F32))))


def denoise_step(elem: int) -> onnx.GraphProto:
    """One scheduler step. `output` is the UNet's, [rows * batch, ...] with rows 1, or 2 for guidance
    ([unconditional, conditional]); `noise` and `previous_x0` to `previous3_x0` (the x0 of the last three
    steps that keep theirs: DPM-Solver's multistep memory, or PNDM's past outputs, its x0 being the output
    itself) broadcast ([1] zeros when a step has none).

        guided = out[first] + guidance * (out[last] - out[first])
        guided = guided * (1 + guidance_rescale * (std(out[last]) / std(guided) - 1))   (guidance_rescale > 0)
        x0 = clip(x0_from_x * x + x0_from_output * guided, clip_low, clip_high)
        x_next = from_x * x + from_x0 * x0 + from_output * guided + from_noise * noise
                 + from_previous_x0 * previous_x0 + from_previous2_x0 * previous2_x0
                 + from_previous3_x0 * previous3_x0
        sample = tile(x_next * next_input_scale, repeats), cast to the UNet's type
    """
    n = _Nodes("")
    c = {name: n.op("Gather", "coefficients", n.const(i, I64)) for i, name in enumerate(STEP_COEFFICIENTS)}
    out = n.op("Cast", "output", to=F32)
    batch = n.op("Slice", n.op("Shape", "x"), n.const([0], I64), n.const([1], I64))
    first = n.op("Slice", out, n.const([0], I64), batch, n.const([0], I64))
    last = n.op("Slice", out, n.op("Neg", batch), n.const([INT64_MAX], I64), n.const([0], I64))
    mixed = n.op("Add", first, n.op("Mul", c["guidance"], n.op("Sub", last, first)))
    # diffusers' rescale_noise_cfg: each row's guided prediction times (1 - r) + r * std(cond) / std(guided),
    # the standard deviations unbiased over the row's values; skipped at r = 0 (a flat row would be 0 / 0)
    ratio = n.op("Div", _row_std(n, last), _row_std(n, mixed))
    factor = n.op("Add", n.const([1.0], F32), n.op("Mul", c["guidance_rescale"],
                                                   n.op("Sub", ratio, n.const([1.0], F32))))
    rescale = n.op("Greater", c["guidance_rescale"], n.const(0.0, F32))
    guided = n.op("Where", rescale, n.op("Mul", mixed, factor), mixed)
    estimate = n.op("Add", n.op("Mul", c["x0_from_x"], "x"), n.op("Mul", c["x0_from_output"], guided))
    x0 = n.op("Clip", estimate, c["clip_low"], c["clip_high"], out="x0")
    terms = [
        n.op("Mul", c["from_x"], "x"),
        n.op("Mul", c["from_x0"], x0),
        n.op("Mul", c["from_output"], guided),
        n.op("Mul", c["from_noise"], "noise"),
        n.op("Mul", c["from_previous_x0"], "previous_x0"),
        n.op("Mul", c["from_previous2_x0"], "previous2_x0"),
        n.op("Mul", c["from_previous3_x0"], "previous3_x0"),
    ]
    total = terms[0]
    for term in terms[1:]:
        total = n.op("Add", total, term)
    x_next = n.op("Identity", total, out="x_next")
    n.op("Cast", n.op("Tile", n.op("Mul", x_next, c["next_input_scale"]), "repeats"), to=elem, out="sample")
    inputs = [
        _latents("x"),
        _latents("output", elem, "rows"),
        _tensor("previous_x0", F32, None),
        _tensor("previous2_x0", F32, None),
        _tensor("previous3_x0", F32, None),
        _tensor("noise", F32, None),
        _tensor("coefficients", F32, [len(STEP_COEFFICIENTS)]),
        _tensor("repeats", I64, [4]),
    ]
    return helper.make_graph(
        n.nodes,
        "denoise_step",
        inputs,
        [_latents("x_next"), _latents("x0"), _latents("sample", elem, "rows")],
    )


def divide(elem: int) -> onnx.GraphProto:
    """x / d + s in float32, then in the VAE's type `elem` (the final latents over the VAE's scaling factor,
    plus its shift factor, as diffusers computes them before it casts them to the VAE's dtype)."""
    n = _Nodes("")
    n.op("Cast", n.op("Add", n.op("Div", "x", "d"), "s"), to=elem, out="y")
    return helper.make_graph(
        n.nodes, "divide", [_tensor("x", F32, None), _tensor("d", F32, [1]), _tensor("s", F32, [1])],
        [_tensor("y", elem, None)]
    )


def vae_image(elem: int) -> onnx.GraphProto:
    """sample [batch, 3, height, width] in [-1, 1] -> float32 image [batch, height, width, 3] in [0, 1]
    (diffusers: (x / 2 + 0.5).clamp(0, 1), channels last)."""
    n = _Nodes("")
    x = n.op("Cast", "sample", to=F32)
    shifted = n.op("Add", n.op("Div", x, n.const(2.0, F32)), n.const(0.5, F32))
    clipped = n.op("Clip", shifted, n.const(0.0, F32), n.const(1.0, F32))
    n.op("Transpose", clipped, perm=[0, 2, 3, 1], out="image")
    return helper.make_graph(
        n.nodes,
        "vae_image",
        [_latents("sample", elem)],
        [_tensor("image", F32, ["batch", "height", "width", 3])],
    )


def rgba8(_: int) -> onnx.GraphProto:
    """image [batch, height, width, 3] in [0, 1] -> uint8 RGBA, round(x * 255) (diffusers' numpy_to_pil),
    alpha 255: what a canvas's ImageData holds."""
    n = _Nodes("")
    levels = n.op("Cast", n.op("Round", n.op("Mul", "image", n.const(255.0, F32))), to=TensorProto.UINT8)
    dims = n.op("Shape", "image")
    alpha_shape = n.op(
        "Concat", n.op("Slice", dims, n.const([0], I64), n.const([3], I64)), n.const([1], I64), axis=0
    )
    alpha = n.op("ConstantOfShape", alpha_shape, value=helper.make_tensor("v", TensorProto.UINT8, [1], [255]))
    n.op("Concat", levels, alpha, axis=3, out="rgba")
    return helper.make_graph(
        n.nodes,
        "rgba8",
        [_tensor("image", F32, ["batch", "height", "width", 3])],
        [_tensor("rgba", TensorProto.UINT8, ["batch", "height", "width", 4])],
    )


def guide_last(elem: int) -> onnx.GraphProto:
    """logits [2n, seq, vocab] (conditional rows, then unconditional), scale [1] -> the last position's
    guided logits [n, 1, vocab] in float32: uncond + scale * (cond - uncond) (classifier-free guidance,
    transformers' ClassifierFreeGuidanceLogitsProcessor)."""
    n = _Nodes("")
    last = n.op(
        "Cast",
        n.op("Slice", "logits", n.const([-1], I64), n.const([2**63 - 1], I64), n.const([1], I64)),
        to=F32,
    )
    half = n.op("Div", n.op("Shape", last, start=0, end=1), n.const([2], I64))
    cond = n.op("Slice", last, n.const([0], I64), half, n.const([0], I64))
    uncond = n.op("Slice", last, half, n.const([2**63 - 1], I64), n.const([0], I64))
    n.op("Add", uncond, n.op("Mul", "scale", n.op("Sub", cond, uncond)), out="guided")
    return helper.make_graph(
        n.nodes,
        "guide_last",
        [_tensor("logits", elem, ["rows", "seq", "vocab"]), _tensor("scale", F32, [1])],
        [_tensor("guided", F32, ["half", 1, "vocab"])],
    )


LOOP_KERNELS: dict[str, tuple[Callable[[int], onnx.GraphProto], tuple[str, ...]]] = {
    "pool_mean": (pool_mean, FLOATS),
    "pool_cls": (pool_cls, FLOATS),
    "pool_max": (pool_max, FLOATS),
    "pool_lasttoken": (pool_lasttoken, FLOATS),
    "l2_normalize": (l2_normalize, ("float32",)),
    "normal": (normal, ("float32",)),
    "image_latents": (image_latents, FLOATS),  # the VAE encoder's type
    "inpaint_mask": (inpaint_mask, ("uint8",)),
    "inpaint_blend": (inpaint_blend, FLOATS),  # the UNet's type
    "masked_pixels": (masked_pixels, FLOATS),  # the VAE encoder's type
    "inpaint_input": (inpaint_input, FLOATS),  # the UNet's type
    "denoise_init": (denoise_init, FLOATS),  # the UNet's type: its sample in, its output out
    "denoise_step": (denoise_step, FLOATS),
    "divide": (divide, FLOATS),  # the VAE's type
    "vae_image": (vae_image, FLOATS),
    "rgba8": (rgba8, ("uint8",)),
    "guide_last": (guide_last, FLOATS),
}
