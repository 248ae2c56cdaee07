"""Preprocessing kernels: transformers' image processors and Whisper's log-mel features as ONNX graphs.

Image kernels reproduce the PIL path of transformers' image processors bit for bit: Pillow resizes
8-bit images in two passes (one per axis) with fixed-point weights and rounds each pass to uint8
(src/libImaging/Resample.c), so `resize_*` computes Pillow's weights in float64 and accumulates in
int32 exactly as Pillow does (ONNX Resize, even with antialias, is up to 17 levels off). `normalize`
then crops, rescales and normalizes as transformers does (rescale in float64, normalize in float32).
Sizes come from the core as inputs.

`PREPROCESS_KERNELS` has the format of build/kernels.py's `KERNELS`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import onnx
from onnx import TensorProto, helper

F64 = TensorProto.DOUBLE
I64 = TensorProto.INT64
I32 = TensorProto.INT32
PRECISION_BITS = 22  # Pillow's fixed-point precision for 8-bit images: 32 - 8 bits - 2 overflow bits


class _Nodes:
    """A node list where each op returns the name of its output, so graphs read like expressions."""

    def __init__(self, prefix: str):
        self.prefix = prefix
        self.nodes: list[onnx.NodeProto] = []

    def op(self, op_type: str, *inputs: str, out: str | None = None, **attrs: object) -> str:
        out = out or f"{self.prefix}{op_type[0].lower()}{op_type[1:]}{len(self.nodes)}"
        self.nodes.append(helper.make_node(op_type, list(inputs), [out], **attrs))
        return out

    def const(self, values: float | Sequence[float], elem: int) -> str:
        """A constant: a scalar for a bare number, a 1-D tensor for a sequence."""
        shape = [] if isinstance(values, (int, float)) else [len(values)]
        flat = [values] if isinstance(values, (int, float)) else list(values)
        name = f"{self.prefix}c{len(self.nodes)}"
        return self.op("Constant", out=name, value=helper.make_tensor(name, elem, shape, flat))


def _tensor(name: str, elem: int, shape: Sequence[int | str] | None) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, elem, None if shape is None else list(shape))


# Resampling filters of Pillow, written with its operation order so float64 results are identical.

@dataclass(frozen=True)
class _Filter:
    name: str
    support: float
    weights: Callable[[_Nodes, str], str]  # |x| as float64 -> filter value


def _bicubic(g: _Nodes, x: str) -> str:
    """Keys' cubic with a = -0.5: ((a+2)x - (a+3))x^2 + 1 below 1, (((x-5)x + 8)x - 4)a below 2."""
    a = -0.5
    near = g.op("Add", g.op("Mul", g.op("Mul", g.op("Sub", g.op("Mul", g.const(a + 2.0, F64), x),
                                                      g.const(a + 3.0, F64)), x), x), g.const(1.0, F64))
    far = g.op("Sub", g.op("Mul", g.op("Add", g.op("Mul", g.op("Sub", x, g.const(5.0, F64)), x),
                                       g.const(8.0, F64)), x), g.const(4.0, F64))
    far = g.op("Mul", far, g.const(a, F64))
    zero = g.const(0.0, F64)
    outer = g.op("Where", g.op("Less", x, g.const(2.0, F64)), far, zero)
    return g.op("Where", g.op("Less", x, g.const(1.0, F64)), near, outer)


def _bilinear(g: _Nodes, x: str) -> str:
    inside = g.op("Less", x, g.const(1.0, F64))
    return g.op("Where", inside, g.op("Sub", g.const(1.0, F64), x), g.const(0.0, F64))


BICUBIC = _Filter("bicubic", 2.0, _bicubic)
BILINEAR = _Filter("bilinear", 1.0, _bilinear)


def _taps(g: _Nodes, filt: _Filter, in_size: str, out_size: str) -> tuple[str, str, str]:
    """Pillow's precompute_coeffs and normalize_coeffs_8bpc along one axis.

    in_size, out_size: int64 [1]. Returns (indices int64 [ksize, out], weights int32 [ksize, out],
    ksize int64 scalar): output pixel o is sum over t of input[indices[t, o]] * weights[t, o].
    """
    inp = g.op("Cast", in_size, to=F64)
    scale = g.op("Div", inp, g.op("Cast", out_size, to=F64))
    filterscale = g.op("Max", scale, g.const(1.0, F64))  # downscaling widens the filter (antialiasing)
    support = g.op("Mul", g.const(filt.support, F64), filterscale)
    reach = g.op("Cast", g.op("Ceil", support), to=I64)
    ksize = g.op("Squeeze", g.op("Add", g.op("Mul", reach, g.const(2, I64)), g.const(1, I64)))
    inverse = g.op("Div", g.const(1.0, F64), filterscale)
    outputs = g.op("Cast", g.op("Range", g.const(0, I64), g.op("Squeeze", out_size), g.const(1, I64)), to=F64)
    center = g.op("Mul", g.op("Add", outputs, g.const(0.5, F64)), scale)
    half = g.const(0.5, F64)
    # Pillow truncates to int; floor is the same here because negative starts are clamped to 0 anyway
    first = g.op("Max", g.op("Floor", g.op("Add", g.op("Sub", center, support), half)), g.const(0.0, F64))
    end = g.op("Min", g.op("Floor", g.op("Add", g.op("Add", center, support), half)), inp)
    count = g.op("Sub", end, first)
    taps = g.op("Unsqueeze", g.op("Cast", g.op("Range", g.const(0, I64), ksize, g.const(1, I64)), to=F64),
                g.const([1], I64))  # [ksize, 1]
    position = g.op("Add", taps, first)  # [ksize, out]
    x = g.op("Abs", g.op("Mul", g.op("Add", g.op("Sub", position, center), half), inverse))
    w = g.op("Where", g.op("Less", taps, count), filt.weights(g, x), g.const(0.0, F64))
    total = g.op("ReduceSum", w, g.const([0], I64), keepdims=1)
    total = g.op("Where", g.op("Equal", total, g.const(0.0, F64)), g.const(1.0, F64), total)
    w = g.op("Div", w, total)
    # fixed point, rounded half away from zero like Pillow's (int)(w * 2^22 +- 0.5)
    fixed = g.op("Mul", g.op("Abs", w), g.const(float(1 << PRECISION_BITS), F64))
    magnitude = g.op("Floor", g.op("Add", fixed, half))
    weights = g.op("Cast", g.op("Mul", g.op("Sign", w), magnitude), to=I32)
    last = g.op("Sub", inp, g.const(1.0, F64))
    indices = g.op("Cast", g.op("Min", position, last), to=I64)  # unused taps have weight 0
    return indices, weights, ksize


def _resample(g: _Nodes, image: str, filt: _Filter, out_size: str, out: str) -> str:
    """One pass of Pillow's two-pass resize along axis 0 of a uint8 [n, m, c] tensor, as a Loop over
    taps; along axis 0 each gathered index is one contiguous block."""
    shape = g.op("Shape", image)
    in_size = g.op("Slice", shape, g.const([0], I64), g.const([1], I64))
    indices, weights, ksize = _taps(g, filt, in_size, out_size)
    weights = g.op("Unsqueeze", weights, g.const([2, 3], I64))  # [ksize, out, 1, 1]
    out_shape = g.op("Concat", out_size, g.op("Slice", shape, g.const([1], I64), g.const([3], I64)), axis=0)
    start = g.op("ConstantOfShape", out_shape,
                 value=helper.make_tensor("v", I32, [1], [1 << (PRECISION_BITS - 1)]))  # Pillow's rounding
    body = _Nodes(f"{g.prefix}tap_")
    step, cond, acc = f"{g.prefix}step", f"{g.prefix}cond", f"{g.prefix}acc"
    pixels = body.op("Gather", image, body.op("Gather", indices, step, axis=0), axis=0)
    term = body.op("Mul", body.op("Cast", pixels, to=I32), body.op("Gather", weights, step, axis=0))
    body.op("Identity", cond, out=f"{g.prefix}cond_out")
    body.op("Add", acc, term, out=f"{g.prefix}acc_out")
    graph = helper.make_graph(
        body.nodes, f"{g.prefix}taps",
        [_tensor(step, I64, []), _tensor(cond, TensorProto.BOOL, []), _tensor(acc, I32, None)],
        [_tensor(f"{g.prefix}cond_out", TensorProto.BOOL, []), _tensor(f"{g.prefix}acc_out", I32, None)])
    total = g.op("Loop", ksize, "", start, body=graph)
    shifted = g.op("Div", total, g.const(1 << PRECISION_BITS, I32))  # negative sums truncate to <= 0: clamped
    clamped = g.op("Min", g.op("Max", shifted, g.const(0, I32)), g.const(255, I32))
    return g.op("Cast", clamped, to=TensorProto.UINT8, out=out)


def _two_passes(filt: _Filter, vertical_first: bool, out_h: str, out_w: str) -> onnx.GraphProto:
    """Both passes in one order, as an If branch: Pillow 13 runs the vertical pass first when the
    height shrinks by more than twice as many pixels as the width; older Pillow always runs it second.

    The horizontal pass runs on the transposed image [w, h, c], so both passes gather along axis 0.
    """
    order = "vh" if vertical_first else "hv"
    g = _Nodes(f"{order}_")
    swap = {"perm": [1, 0, 2]}
    if vertical_first:
        g.prefix = f"{order}0_"
        tall = _resample(g, "image", filt, out_h, f"{order}_tall")
        g.prefix = f"{order}1_"
        wide = _resample(g, g.op("Transpose", tall, **swap), filt, out_w, f"{order}_wide")
        result = g.op("Transpose", wide, out=f"{order}_out", **swap)
    else:
        g.prefix = f"{order}0_"
        wide = _resample(g, g.op("Transpose", "image", **swap), filt, out_w, f"{order}_wide")
        g.prefix = f"{order}1_"
        result = _resample(g, g.op("Transpose", wide, **swap), filt, out_h, f"{order}_out")
    return helper.make_graph(g.nodes, order, [], [_tensor(result, TensorProto.UINT8, None)])


def _resize(filt: _Filter) -> Callable[[int], onnx.GraphProto]:
    def make(_: int) -> onnx.GraphProto:
        """image uint8 [h, w, c], size int64 [2] (height, width), vertical_first bool [] -> resized uint8.

        Pillow's resize; the core chooses the pass order as the Pillow it matches does.
        """
        g = _Nodes("")
        out_h = g.op("Slice", "size", g.const([0], I64), g.const([1], I64))
        out_w = g.op("Slice", "size", g.const([1], I64), g.const([2], I64))
        g.op("If", "vertical_first", out="resized", then_branch=_two_passes(filt, True, out_h, out_w),
             else_branch=_two_passes(filt, False, out_h, out_w))
        return helper.make_graph(
            g.nodes, f"resize_{filt.name}",
            [_tensor("image", TensorProto.UINT8, ["h", "w", "c"]), _tensor("size", I64, [2]),
             _tensor("vertical_first", TensorProto.BOOL, [])],
            [_tensor("resized", TensorProto.UINT8, ["out_h", "out_w", "c"])])
    return make


def normalize(elem: int) -> onnx.GraphProto:
    """image uint8 [h, w, c] -> pixel_values [1, c, crop_h, crop_w]: pad, crop, rescale, normalize, CHW.

    pads int64 [6] (Pad's order over h, w, c; zeros where the crop is larger than the image, as
    transformers' center_crop), starts / ends int64 [2] over (h, w), scale float64 [1], mean / std
    float32 [c]. The rescale runs in float64 and the normalization in float32, as transformers does.
    """
    g = _Nodes("")
    padded = g.op("Pad", "image", "pads")
    crop = g.op("Slice", padded, "starts", "ends", g.const([0, 1], I64))
    scaled = g.op("Cast", g.op("Mul", g.op("Cast", crop, to=F64), "scale"), to=TensorProto.FLOAT)
    normal = g.op("Div", g.op("Sub", scaled, "mean"), "std")
    chw = g.op("Unsqueeze", g.op("Transpose", normal, perm=[2, 0, 1]), g.const([0], I64))
    g.op("Cast", chw, to=elem, out="pixel_values")
    return helper.make_graph(
        g.nodes, "normalize",
        [_tensor("image", TensorProto.UINT8, ["h", "w", "c"]), _tensor("pads", I64, [6]),
         _tensor("starts", I64, [2]), _tensor("ends", I64, [2]), _tensor("scale", F64, [1]),
         _tensor("mean", TensorProto.FLOAT, ["c"]), _tensor("std", TensorProto.FLOAT, ["c"])],
        [_tensor("pixel_values", elem, [1, "c", "crop_h", "crop_w"])])


def patchify(elem: int) -> onnx.GraphProto:
    """pixel_values [1, c, h, w] -> patches [grid_h * grid_w, c * temporal * patch * patch] (Qwen2-VL).

    blocks int64 [7] = (c, grid_h / merge, merge, patch, grid_w / merge, merge, patch); tiled int64
    [8] = (grid_h / merge, grid_w / merge, merge, merge, c, temporal, patch, patch); flat int64 [2].
    Patches run in merge-window order; a single image is repeated `temporal` times.
    """
    g = _Nodes("")
    blocks = g.op("Reshape", "pixel_values", "blocks")
    ordered = g.op("Transpose", blocks, perm=[1, 4, 2, 5, 0, 3, 6])
    frames = g.op("Expand", g.op("Unsqueeze", ordered, g.const([5], I64)), "tiled")
    g.op("Reshape", frames, "flat", out="patches")
    return helper.make_graph(
        g.nodes, "patchify",
        [_tensor("pixel_values", elem, [1, "c", "h", "w"]), _tensor("blocks", I64, [7]),
         _tensor("tiled", I64, [8]), _tensor("flat", I64, [2])],
        [_tensor("patches", elem, ["patches", "patch_dim"])])


# Whisper's log-mel spectrogram (WhisperFeatureExtractor): a centred STFT with a periodic Hann window
# (reflect padding), power spectrum, Slaney mel filters over 0-8000 Hz, log10 clamped at 1e-10,
# floored 8 below the maximum, then (x + 4) / 4.

MEL_MAX_HZ = 8000.0
_SLANEY_BREAK_HZ, _SLANEY_BREAK_MEL = 1000.0, 15.0
_SLANEY_LOG_STEP = math.log(6.4) / 27.0  # mels per log-hertz above the break, inverted


def _hertz_to_mel(hz: float) -> float:
    """Slaney's mel scale: linear below 1 kHz, logarithmic above."""
    if hz < _SLANEY_BREAK_HZ:
        return 3.0 * hz / 200.0
    return _SLANEY_BREAK_MEL + math.log(hz / _SLANEY_BREAK_HZ) * (27.0 / math.log(6.4))


def _linspace(g: _Nodes, stop: str, count: str) -> str:
    """numpy.linspace(0, stop, count) in float64: arange(count) * (stop / (count - 1))."""
    step = g.op("Div", stop, g.op("Cast", g.op("Sub", count, g.const(1, I64)), to=F64))
    steps = g.op("Range", g.const(0, I64), g.op("Squeeze", count), g.const(1, I64))
    return g.op("Mul", g.op("Cast", steps, to=F64), step)


def _mel_filters(g: _Nodes, bins: str, n_mels: str, sampling_rate: str) -> str:
    """Slaney-normalized triangular filters [bins, n_mels] in float32 (transformers' mel_filter_bank)."""
    nyquist = g.op("Cast", g.op("Div", sampling_rate, g.const(2, I64)), to=F64)
    fft_hz = g.op("Unsqueeze", _linspace(g, nyquist, bins), g.const([1], I64))  # [bins, 1]
    points = g.op("Add", n_mels, g.const(2, I64))
    mels = _linspace(g, g.const([_hertz_to_mel(MEL_MAX_HZ)], F64), points)
    linear = g.op("Div", g.op("Mul", g.const(200.0, F64), mels), g.const(3.0, F64))
    logarithmic = g.op("Mul", g.const(_SLANEY_BREAK_HZ, F64), g.op("Exp", g.op(
        "Mul", g.const(_SLANEY_LOG_STEP, F64), g.op("Sub", mels, g.const(_SLANEY_BREAK_MEL, F64)))))
    hz = g.op("Where", g.op("Less", mels, g.const(_SLANEY_BREAK_MEL, F64)), linear, logarithmic)

    def span(tensor: str, begin: int, end: int) -> str:  # along the last axis
        return g.op("Slice", tensor, g.const([begin], I64), g.const([end], I64), g.const([-1], I64))

    end = 2**62
    widths = g.op("Sub", span(hz, 1, end), span(hz, 0, -1))
    slopes = g.op("Sub", hz, fft_hz)  # [bins, n_mels + 2]: each edge frequency minus each bin's
    down = g.op("Div", g.op("Neg", span(slopes, 0, -2)), span(widths, 0, -1))
    up = g.op("Div", span(slopes, 2, end), span(widths, 1, end))
    triangles = g.op("Max", g.op("Min", down, up), g.const(0.0, F64))
    area = g.op("Div", g.const(2.0, F64), g.op("Sub", span(hz, 2, end), span(hz, 0, -2)))
    return g.op("Cast", g.op("Mul", triangles, area), to=TensorProto.FLOAT)


def _dft(g: _Nodes, n_fft: str, bins: str) -> tuple[str, str]:
    """Real and imaginary DFT matrices [n_fft, bins] with the periodic Hann window folded in (float64)."""
    n = g.op("Range", g.const(0, I64), g.op("Squeeze", n_fft), g.const(1, I64))
    k = g.op("Range", g.const(0, I64), g.op("Squeeze", bins), g.const(1, I64))
    # k * n mod n_fft first: exact integers keep the angles small and precise
    turns = g.op("Mod", g.op("Mul", g.op("Unsqueeze", n, g.const([1], I64)), k), n_fft)
    radians = g.const(2.0 * math.pi, F64)
    size = g.op("Cast", n_fft, to=F64)
    angle = g.op("Div", g.op("Mul", g.op("Cast", turns, to=F64), radians), size)
    phase = g.op("Div", g.op("Mul", g.op("Cast", n, to=F64), radians), size)
    window = g.op("Sub", g.const(0.5, F64), g.op("Mul", g.const(0.5, F64), g.op("Cos", phase)))
    window = g.op("Unsqueeze", window, g.const([1], I64))
    return g.op("Mul", g.op("Cos", angle), window), g.op("Mul", g.op("Sin", angle), window)


def _frames(g: _Nodes, waveform: str, samples: str, n_fft: str, hop: str) -> str:
    """The waveform padded with zeros or cut to `samples`, then framed [frames, n_fft] like
    torch.stft(center=True) without its last frame, as Whisper does."""
    cut = g.op("Slice", waveform, g.const([0], I64), samples)
    missing = g.op("Sub", samples, g.op("Shape", cut))
    audio = g.op("Pad", cut, g.op("Concat", g.const([0], I64), missing, axis=0))
    half = g.op("Div", n_fft, g.const(2, I64))
    padded = g.op("Pad", audio, g.op("Concat", half, half, axis=0), mode="reflect")
    length = g.op("Add", samples, g.op("Mul", half, g.const(2, I64)))
    count = g.op("Div", g.op("Sub", length, n_fft), hop)  # torch.stft gives count + 1 frames
    starts = g.op("Mul", g.op("Range", g.const(0, I64), g.op("Squeeze", count), g.const(1, I64)), hop)
    offsets = g.op("Range", g.const(0, I64), g.op("Squeeze", n_fft), g.const(1, I64))
    index = g.op("Add", g.op("Unsqueeze", starts, g.const([1], I64)), offsets)
    return g.op("Gather", padded, index)


def log_mel(elem: int) -> onnx.GraphProto:
    """waveform float32 [n] (mono) -> input_features [1, n_mels, samples // hop_length].

    samples, n_fft, hop_length, n_mels, sampling_rate: int64 [1] from the feature extractor's config.
    """
    g = _Nodes("")
    bins = g.op("Add", g.op("Div", "n_fft", g.const(2, I64)), g.const(1, I64))
    frames = _frames(g, "waveform", "samples", "n_fft", "hop_length")
    real, imag = _dft(g, "n_fft", bins)
    # float64: float32 sums over n_fft taps lose the quiet bins near the floor (1e-4 off after the log)
    frames = g.op("Cast", frames, to=F64)
    re, im = g.op("MatMul", frames, real), g.op("MatMul", frames, imag)
    power = g.op("Cast", g.op("Add", g.op("Mul", re, re), g.op("Mul", im, im)), to=TensorProto.FLOAT)
    mel = g.op("MatMul", power, _mel_filters(g, bins, "n_mels", "sampling_rate"))
    log10 = g.op("Div", g.op("Log", g.op("Max", mel, g.const(1e-10, TensorProto.FLOAT))),
                 g.const(math.log(10.0), TensorProto.FLOAT))
    floor = g.op("Sub", g.op("ReduceMax", log10, keepdims=0), g.const(8.0, TensorProto.FLOAT))
    scaled = g.op("Div", g.op("Add", g.op("Max", log10, floor), g.const(4.0, TensorProto.FLOAT)),
                  g.const(4.0, TensorProto.FLOAT))
    features = g.op("Unsqueeze", g.op("Transpose", scaled, perm=[1, 0]), g.const([0], I64))
    g.op("Cast", features, to=elem, out="input_features")
    ints = [_tensor(n, I64, [1]) for n in ("samples", "n_fft", "hop_length", "n_mels", "sampling_rate")]
    return helper.make_graph(
        g.nodes, "log_mel", [_tensor("waveform", TensorProto.FLOAT, ["n"]), *ints],
        [_tensor("input_features", elem, [1, "n_mels", "frames"])])


FLOATS = ("float32", "float16")

# name -> (builder, element types): the format of build/kernels.py's KERNELS. Resize kernels work
# on uint8 images; the others are built per output float type.
PREPROCESS_KERNELS: dict[str, tuple[Callable[[int], onnx.GraphProto], tuple[str, ...]]] = {
    "resize_bicubic": (_resize(BICUBIC), ("uint8",)),
    "resize_bilinear": (_resize(BILINEAR), ("uint8",)),
    "normalize": (normalize, FLOATS),
    "patchify": (patchify, FLOATS),
    "log_mel": (log_mel, FLOATS),
}
