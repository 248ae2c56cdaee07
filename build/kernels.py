"""Build ortpipe's kernel graphs: the numeric work that is not a model, as tiny ONNX graphs.

Run `python -m build.kernels` to rewrite py/ortpipe/kernels/*.onnx. The files are shipped as
package data; a test checks that a fresh build equals them byte for byte.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

import onnx
from onnx import TensorProto, helper

from build.loop_kernels import LOOP_KERNELS
from build.preprocess import PREPROCESS_KERNELS

OPSET = 17
IR_VERSION = 8
OUT_DIR = Path(__file__).resolve().parent.parent / "py" / "ortpipe" / "kernels"
FLOAT_TYPES = {"float32": TensorProto.FLOAT, "float16": TensorProto.FLOAT16}
ELEMENT_TYPES = {**FLOAT_TYPES, "int64": TensorProto.INT64, "uint8": TensorProto.UINT8}
INT64_MAX = 2**63 - 1


def _const(name: str, values: list[int]) -> onnx.NodeProto:
    return helper.make_node("Constant", [], [name], value=helper.make_tensor(name, TensorProto.INT64,
                                                                              [len(values)], values))


def argmax_last(elem: int) -> onnx.GraphProto:
    """logits [batch, seq, vocab] -> token int64 [batch]: the argmax of the last position."""
    nodes = [
        _const("start", [-1]), _const("end", [INT64_MAX]), _const("axis1", [1]),
        helper.make_node("Slice", ["logits", "start", "end", "axis1"], ["last"]),
        helper.make_node("ArgMax", ["last"], ["arg"], axis=-1, keepdims=0),
        helper.make_node("Squeeze", ["arg", "axis1"], ["token"]),
    ]
    return helper.make_graph(
        nodes, "argmax_last",
        [helper.make_tensor_value_info("logits", elem, ["batch", "seq", "vocab"])],
        [helper.make_tensor_value_info("token", TensorProto.INT64, ["batch"])])


def argmax_among(elem: int) -> onnx.GraphProto:
    """logits [1, seq, vocab], ids int64 [n] -> token int64 [1]: of `ids`, the one whose logit at the last
    position is highest (the first of them on a tie; a decoder prompt's language, chosen by the model)."""
    nodes = [
        _const("start", [-1]), _const("end", [INT64_MAX]), _const("axis1", [1]),
        helper.make_node("Slice", ["logits", "start", "end", "axis1"], ["last3"]),
        helper.make_node("Squeeze", ["last3", "axis1"], ["last"]),
        helper.make_node("Gather", ["last", "ids"], ["among"], axis=1),
        helper.make_node("ArgMax", ["among"], ["arg"], axis=-1, keepdims=0),
        helper.make_node("Gather", ["ids", "arg"], ["token"], axis=0),
    ]
    return helper.make_graph(
        nodes, "argmax_among",
        [helper.make_tensor_value_info("logits", elem, [1, "seq", "vocab"]),
         helper.make_tensor_value_info("ids", TensorProto.INT64, ["n"])],
        [helper.make_tensor_value_info("token", TensorProto.INT64, [1])])


def argmax_all(elem: int) -> onnx.GraphProto:
    """logits [batch, seq, vocab] -> tokens int64 [batch, seq]: the argmax of every position (a batch's
    rows checking drafted tokens, greedy)."""
    nodes = [helper.make_node("ArgMax", ["logits"], ["tokens"], axis=-1, keepdims=0)]
    return helper.make_graph(
        nodes, "argmax_all",
        [helper.make_tensor_value_info("logits", elem, ["batch", "seq", "vocab"])],
        [helper.make_tensor_value_info("tokens", TensorProto.INT64, ["batch", "seq"])])


def narrow(elem: int) -> onnx.GraphProto:
    """x, start [1], end [1], axis [1] -> x[start:end] along `axis` (cache windows and rewinds)."""
    nodes = [helper.make_node("Slice", ["x", "start", "end", "axis"], ["y"])]
    # Any rank: a tensor type with no shape field at all.
    x = helper.make_value_info("x", helper.make_tensor_type_proto(elem, shape=None))
    y = helper.make_value_info("y", helper.make_tensor_type_proto(elem, shape=None))
    ints = [helper.make_tensor_value_info(n, TensorProto.INT64, [1]) for n in ("start", "end", "axis")]
    return helper.make_graph(nodes, "narrow", [x, *ints], [y])


def pad(elem: int) -> onnx.GraphProto:
    """x, pads [2 * rank] -> x with zeros added before and after each axis (`pads` as ONNX Pad reads it:
    the counts before every axis, then after): a batch's concat KV cache padded on the left so that rows
    of different lengths line up."""
    x, y = (helper.make_value_info(n, helper.make_tensor_type_proto(elem, shape=None)) for n in "xy")
    pads = helper.make_tensor_value_info("pads", TensorProto.INT64, ["pads"])
    return helper.make_graph([helper.make_node("Pad", ["x", "pads"], ["y"])], "pad", [x, pads], [y])


def _rank4(name: str, elem: int, dims: list[str]) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, elem, dims)


def put_rows(elem: int) -> onnx.GraphProto:
    """x [n, heads, positions, size], rows [k], values [k, heads, p, size], length [1] -> x with positions
    [0, length) of those rows taken from values; the rest of x as it was. A batch's shared-buffer KV cache
    takes a row (a target with views writes into x in place, the Run asking for it)."""
    nodes = [
        _const("zero", [0]), _const("axis1", [1]), _const("axis2", [2]),
        _const("end", [INT64_MAX]),
        helper.make_node("Slice", ["values", "zero", "length", "axis2"], ["head"]),
        helper.make_node("Gather", ["x", "rows"], ["old"], axis=0),
        helper.make_node("Slice", ["old", "length", "end", "axis2"], ["tail"]),
        helper.make_node("Concat", ["head", "tail"], ["new"], axis=2),
        helper.make_node("Unsqueeze", ["rows", "axis1"], ["index"]),
        helper.make_node("ScatterND", ["x", "index", "new"], ["y"]),
    ]
    return helper.make_graph(
        nodes, "put_rows",
        [_rank4("x", elem, ["n", "heads", "positions", "size"]),
         helper.make_tensor_value_info("rows", TensorProto.INT64, ["k"]),
         _rank4("values", elem, ["k", "heads", "p", "size"]),
         helper.make_tensor_value_info("length", TensorProto.INT64, [1])],
        [_rank4("y", elem, ["n", "heads", "positions", "size"])])


def gather_seq(elem: int) -> onnx.GraphProto:
    """x [n, heads, positions, size], index [n, w] -> y [n, heads, w, size] with
    y[r, :, j] = x[r, :, index[r, j]]: each row of a batch's concat KV cache keeps its own positions (rows
    that accepted different numbers of drafted tokens lined up on the right again)."""
    nodes = [
        _const("axes", [1, 3]), _const("zero", [0]), _const("one", [1]), _const("two", [2]),
        _const("three", [3]), _const("four", [4]),
        helper.make_node("Shape", ["x"], ["xshape"]),
        helper.make_node("Shape", ["index"], ["ishape"]),
        helper.make_node("Slice", ["xshape", "zero", "two"], ["rows_heads"]),
        helper.make_node("Slice", ["ishape", "one", "two"], ["width"]),
        helper.make_node("Slice", ["xshape", "three", "four"], ["size"]),
        helper.make_node("Concat", ["rows_heads", "width", "size"], ["shape"], axis=0),
        helper.make_node("Unsqueeze", ["index", "axes"], ["index4"]),
        helper.make_node("Expand", ["index4", "shape"], ["wide"]),
        helper.make_node("GatherElements", ["x", "wide"], ["y"], axis=2),
    ]
    return helper.make_graph(
        nodes, "gather_seq",
        [_rank4("x", elem, ["n", "heads", "positions", "size"]),
         helper.make_tensor_value_info("index", TensorProto.INT64, ["n", "w"])],
        [_rank4("y", elem, ["n", "heads", "w", "size"])])


def _concat(axis: int) -> Callable[[int], onnx.GraphProto]:
    def make(elem: int) -> onnx.GraphProto:
        """a, b -> a and b joined along `axis` (0: per-image outputs gathered into one tensor; 1: a step
        output accumulated over the decode steps; -1: the sources of a joined wire, side by side)."""
        a, b, y = (helper.make_value_info(n, helper.make_tensor_type_proto(elem, shape=None)) for n in "aby")
        name = "concat_last" if axis == -1 else f"concat{axis}"
        graph = helper.make_node("Concat", ["a", "b"], ["y"], axis=axis)
        return helper.make_graph([graph], name, [a, b], [y])

    return make


# Sampling: logits processors and samplers over float32 scores [batch, vocab] (seed 000's sampling,
# transformers' processor semantics). `process` starts from the model's logits; each later stage
# maps scores to scores, masking removed tokens with -inf; `sample` / `argmax` end the chain.

NEG_INF = float("-inf")


def _scores(name: str) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, ["batch", "vocab"])


def _scalar(name: str, elem: int = TensorProto.FLOAT) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, elem, [1])


def _fconst(name: str, value: float) -> onnx.NodeProto:
    return helper.make_node(
        "Constant", [], [name], value=helper.make_tensor(name, TensorProto.FLOAT, [], [value])
    )


def process(elem: int) -> onnx.GraphProto:
    """logits [b, s, v] -> scores [b, v]: last position, logit bias, repetition penalty, frequency and
    presence penalties, banned ids to -inf, temperature.

    `biased`, `banned`, `seen` and `counted` are id lists [b, n] padded with the id `vocab` (one past
    the end): they address an extra column that is dropped at the end, so rows of different lengths
    need no mask. `biases` [b, n] are the biased ids' biases; `counted` holds the distinct generated ids
    and `amounts` [b, n] what each one's score loses (0 in the padding).
    """
    nodes = [
        _const("start", [-1]),
        _const("end", [INT64_MAX]),
        _const("axis1", [1]),
        _const("zero", [0]),
        helper.make_node("Slice", ["logits", "start", "end", "axis1"], ["last3"]),
        helper.make_node("Squeeze", ["last3", "axis1"], ["last_any"]),
        helper.make_node("Cast", ["last_any"], ["last"], to=TensorProto.FLOAT),
        # the padding column
        helper.make_node("Shape", ["last"], ["shape"]),
        helper.make_node("Slice", ["shape", "zero", "axis1", "zero"], ["batch"]),
        helper.make_node("Concat", ["batch", "axis1"], ["pad_shape"], axis=0),
        helper.make_node(
            "ConstantOfShape",
            ["pad_shape"],
            ["pad"],
            value=helper.make_tensor("v", TensorProto.FLOAT, [1], [0.0]),
        ),
        helper.make_node("Concat", ["last", "pad"], ["plain_wide"], axis=1),
        # logit bias: each biased id's bias added to its score
        helper.make_node("GatherElements", ["plain_wide", "biased"], ["biased_scores"], axis=1),
        helper.make_node("Add", ["biased_scores", "biases"], ["raised"]),
        helper.make_node("ScatterElements", ["plain_wide", "biased", "raised"], ["wide"], axis=1),
        # repetition penalty: seen tokens' scores divided (positive) or multiplied (negative) by it
        _fconst("f0", 0.0),
        helper.make_node("GatherElements", ["wide", "seen"], ["seen_scores"], axis=1),
        helper.make_node("Less", ["seen_scores", "f0"], ["negative"]),
        helper.make_node("Mul", ["seen_scores", "penalty"], ["times"]),
        helper.make_node("Div", ["seen_scores", "penalty"], ["divided"]),
        helper.make_node("Where", ["negative", "times", "divided"], ["penalized"]),
        helper.make_node("ScatterElements", ["wide", "seen", "penalized"], ["penalized_wide"], axis=1),
        # frequency and presence penalties: each generated id's amount (count * frequency + presence)
        # subtracted from its score
        helper.make_node("GatherElements", ["penalized_wide", "counted"], ["counted_scores"], axis=1),
        helper.make_node("Sub", ["counted_scores", "amounts"], ["lowered"]),
        helper.make_node("ScatterElements", ["penalized_wide", "counted", "lowered"], ["repeated"], axis=1),
        # banned ids
        helper.make_node("Shape", ["banned"], ["banned_shape"]),
        helper.make_node(
            "ConstantOfShape",
            ["banned_shape"],
            ["minus_inf"],
            value=helper.make_tensor("v", TensorProto.FLOAT, [1], [NEG_INF]),
        ),
        helper.make_node("ScatterElements", ["repeated", "banned", "minus_inf"], ["allowed"], axis=1),
        helper.make_node("Shape", ["last"], ["narrow_shape"]),
        helper.make_node("Slice", ["narrow_shape", "axis1", "end", "zero"], ["vocab"]),
        helper.make_node("Slice", ["allowed", "zero", "vocab", "axis1"], ["trimmed"]),
        helper.make_node("Div", ["trimmed", "temperature"], ["scores"]),
    ]
    ids = [
        helper.make_tensor_value_info(n, TensorProto.INT64, ["batch", n + "_count"])
        for n in ("banned", "seen", "counted", "biased")
    ]
    return helper.make_graph(
        nodes,
        "process",
        [
            helper.make_tensor_value_info("logits", elem, ["batch", "seq", "vocab"]),
            *ids,
            helper.make_tensor_value_info("amounts", TensorProto.FLOAT, ["batch", "counted_count"]),
            helper.make_tensor_value_info("biases", TensorProto.FLOAT, ["batch", "biased_count"]),
            _scalar("penalty"),
            _scalar("temperature"),
        ],
        [_scores("scores")],
    )


def top_k(_: int) -> onnx.GraphProto:
    """Keep the k highest scores (ties with the k-th included); k is at most the vocabulary size."""
    nodes = [
        helper.make_node("TopK", ["scores", "k"], ["values", "indices"], axis=-1),
        _const("last", [-1]),
        _const("end", [INT64_MAX]),
        _const("axis1", [1]),
        helper.make_node("Slice", ["values", "last", "end", "axis1"], ["threshold"]),
        helper.make_node("Less", ["scores", "threshold"], ["drop"]),
        _fconst("minus_inf", NEG_INF),
        helper.make_node("Where", ["drop", "minus_inf", "scores"], ["kept"]),
    ]
    return helper.make_graph(
        nodes, "top_k", [_scores("scores"), _scalar("k", TensorProto.INT64)], [_scores("kept")]
    )


def top_p(_: int) -> onnx.GraphProto:
    """Keep the smallest set of highest scores whose probability reaches p.

    A token is kept while the probability of the tokens above it is below p. Only the `k` highest
    are sorted: when top-k ran first, every other score is already -inf.
    """
    nodes = [
        helper.make_node("TopK", ["scores", "k"], ["values", "indices"], axis=-1),
        helper.make_node("Softmax", ["scores"], ["probs"], axis=-1),
        helper.make_node("GatherElements", ["probs", "indices"], ["sorted_probs"], axis=1),
        _const("axis1", [1]),
        helper.make_node("CumSum", ["sorted_probs", "axis1"], ["above"], exclusive=1),
        helper.make_node("Less", ["above", "p"], ["keep"]),
        helper.make_node("Cast", ["keep"], ["keep_int"], to=TensorProto.INT64),
        helper.make_node("ReduceSum", ["keep_int", "axis1"], ["count"], keepdims=1),
        _const("one", [1]),
        helper.make_node("Sub", ["count", "one"], ["last_kept"]),
        helper.make_node("GatherElements", ["values", "last_kept"], ["threshold"], axis=1),
        helper.make_node("Less", ["scores", "threshold"], ["drop"]),
        _fconst("minus_inf", NEG_INF),
        helper.make_node("Where", ["drop", "minus_inf", "scores"], ["kept"]),
    ]
    return helper.make_graph(
        nodes, "top_p", [_scores("scores"), _scalar("p"), _scalar("k", TensorProto.INT64)], [_scores("kept")]
    )


def min_p(_: int) -> onnx.GraphProto:
    """Drop tokens whose probability is below min_p times the most likely token's."""
    nodes = [
        helper.make_node("Softmax", ["scores"], ["probs"], axis=-1),
        helper.make_node("ReduceMax", ["probs"], ["top"], axes=[-1], keepdims=1),
        helper.make_node("Mul", ["top", "min_p"], ["floor"]),
        helper.make_node("Less", ["probs", "floor"], ["drop"]),
        _fconst("minus_inf", NEG_INF),
        helper.make_node("Where", ["drop", "minus_inf", "scores"], ["kept"]),
    ]
    return helper.make_graph(nodes, "min_p", [_scores("scores"), _scalar("min_p")], [_scores("kept")])


def _unless_broken(token: str) -> list[onnx.NodeProto]:
    """`token` [batch] as "token", or -1 in each row whose scores hold a NaN or +inf (logits that are
    NaN or infinite: the core refuses the selection, as the targets' Pickers do)."""
    return [
        helper.make_node("IsNaN", ["scores"], ["nan"]),
        helper.make_node("IsInf", ["scores"], ["inf"], detect_negative=0),
        helper.make_node("Or", ["nan", "inf"], ["bad_cells"]),
        helper.make_node("Cast", ["bad_cells"], ["bad_int"], to=TensorProto.INT64),
        _const("bad_axis", [1]),
        helper.make_node("ReduceSum", ["bad_int", "bad_axis"], ["bad_count"], keepdims=0),
        _const("zero_count", [0]),
        helper.make_node("Greater", ["bad_count", "zero_count"], ["bad"]),
        _const("minus_one", [-1]),
        helper.make_node("Where", ["bad", "minus_one", token], ["token"]),
    ]


def sample(_: int) -> onnx.GraphProto:
    """scores, u in (0, 1] per row -> token: the first token whose cumulative probability reaches u
    (-1 for a row of NaN or +inf scores)."""
    nodes = [
        helper.make_node("Softmax", ["scores"], ["probs"], axis=-1),
        _const("axis1", [1]),
        helper.make_node("CumSum", ["probs", "axis1"], ["cdf"]),
        _const("last", [-1]),
        _const("end", [INT64_MAX]),
        helper.make_node("Slice", ["cdf", "last", "end", "axis1"], ["total"]),
        helper.make_node("Unsqueeze", ["u", "axis1"], ["u2"]),
        helper.make_node("Mul", ["u2", "total"], ["target"]),
        helper.make_node("Less", ["cdf", "target"], ["below"]),
        helper.make_node("Cast", ["below"], ["below_int"], to=TensorProto.INT64),
        helper.make_node("ReduceSum", ["below_int", "axis1"], ["count"], keepdims=0),
        helper.make_node("Shape", ["scores"], ["shape"]),
        helper.make_node("Slice", ["shape", "axis1", "end"], ["vocab"]),
        _const("one", [1]),
        helper.make_node("Sub", ["vocab", "one"], ["last_id"]),
        helper.make_node("Min", ["count", "last_id"], ["drawn"]),  # float rounding past the end
        *_unless_broken("drawn"),
    ]
    return helper.make_graph(
        nodes,
        "sample",
        [_scores("scores"), helper.make_tensor_value_info("u", TensorProto.FLOAT, ["batch"])],
        [helper.make_tensor_value_info("token", TensorProto.INT64, ["batch"])],
    )


def argmax(_: int) -> onnx.GraphProto:
    """scores -> token: the first index of the largest score (-1 for a row of NaN or +inf scores)."""
    nodes = [helper.make_node("ArgMax", ["scores"], ["largest"], axis=-1, keepdims=0),
             *_unless_broken("largest")]
    return helper.make_graph(
        nodes,
        "argmax",
        [_scores("scores")],
        [helper.make_tensor_value_info("token", TensorProto.INT64, ["batch"])],
    )


def beam_topk(elem: int) -> onnx.GraphProto:
    """logits [beams, s, v], running [beams], banned [beams, n], renormalize [1] -> the k best (running +
    log_softmax) over all beams, each beam's banned ids at -inf after the log_softmax (as transformers' logits
    processors ban them in beam search), and with `renormalize` the log_softmax again over the rest. `banned`
    is padded with the id `vocab`, a column dropped again, as in `process`.

    Indices run over the flattened [beams * vocab]: beam = index // vocab, token = index % vocab.
    """
    nodes = [
        _const("start", [-1]),
        _const("end", [INT64_MAX]),
        _const("axis1", [1]),
        _const("zero", [0]),
        _const("flat", [1, -1]),
        helper.make_node("Slice", ["logits", "start", "end", "axis1"], ["last3"]),
        helper.make_node("Squeeze", ["last3", "axis1"], ["last_any"]),
        helper.make_node("Cast", ["last_any"], ["last"], to=TensorProto.FLOAT),
        helper.make_node("LogSoftmax", ["last"], ["logp_all"], axis=-1),
        helper.make_node("Shape", ["last"], ["shape"]),
        helper.make_node("Slice", ["shape", "zero", "axis1", "zero"], ["batch"]),
        helper.make_node("Concat", ["batch", "axis1"], ["pad_shape"], axis=0),
        helper.make_node("ConstantOfShape", ["pad_shape"], ["pad"],
                         value=helper.make_tensor("v", TensorProto.FLOAT, [1], [0.0])),
        helper.make_node("Concat", ["logp_all", "pad"], ["wide"], axis=1),
        helper.make_node("Shape", ["banned"], ["banned_shape"]),
        helper.make_node("ConstantOfShape", ["banned_shape"], ["minus_inf"],
                         value=helper.make_tensor("v", TensorProto.FLOAT, [1], [NEG_INF])),
        helper.make_node("ScatterElements", ["wide", "banned", "minus_inf"], ["allowed"], axis=1),
        helper.make_node("Slice", ["shape", "axis1", "end", "zero"], ["vocab"]),
        helper.make_node("Slice", ["allowed", "zero", "vocab", "axis1"], ["kept"]),
        # renormalize: the log-softmax again over what the bans left (transformers' renormalize_logits)
        helper.make_node("LogSoftmax", ["kept"], ["renormalized"], axis=-1),
        helper.make_node("Where", ["renormalize", "renormalized", "kept"], ["logp"]),
        helper.make_node("Unsqueeze", ["running", "axis1"], ["running2"]),
        helper.make_node("Add", ["logp", "running2"], ["total"]),
        helper.make_node("Reshape", ["total", "flat"], ["flat_total"]),
        helper.make_node("TopK", ["flat_total", "k"], ["values2", "indices2"], axis=-1),
        _const("axis0", [0]),
        helper.make_node("Squeeze", ["values2", "axis0"], ["values"]),
        helper.make_node("Squeeze", ["indices2", "axis0"], ["indices"]),
    ]
    return helper.make_graph(
        nodes,
        "beam_topk",
        [
            helper.make_tensor_value_info("logits", elem, ["beams", "seq", "vocab"]),
            helper.make_tensor_value_info("running", TensorProto.FLOAT, ["beams"]),
            helper.make_tensor_value_info("banned", TensorProto.INT64, ["beams", "banned_count"]),
            helper.make_tensor_value_info("renormalize", TensorProto.BOOL, [1]),
            _scalar("k", TensorProto.INT64),
        ],
        [
            helper.make_tensor_value_info("values", TensorProto.FLOAT, ["k"]),
            helper.make_tensor_value_info("indices", TensorProto.INT64, ["k"]),
        ],
    )


# Speculative decoding (py/ortpipe/loops/speculative.py): the logits of every position of one verification
# run become rows, processed like a batch, and each row selects its token as a plain step would.


def unfold(elem: int) -> onnx.GraphProto:
    """logits [1, s, v] -> [s, 1, v]: each position a row of its own (the process kernel's batch)."""
    nodes = [helper.make_node("Transpose", ["logits"], ["rows"], perm=[1, 0, 2])]
    return helper.make_graph(
        nodes, "unfold",
        [helper.make_tensor_value_info("logits", elem, [1, "seq", "vocab"])],
        [helper.make_tensor_value_info("rows", elem, ["seq", 1, "vocab"])])


def logprobs(elem: int) -> onnx.GraphProto:
    """logits [b, s, v], token [b], k [1] -> the log-probability of each row's token at the last position,
    and that position's k most likely tokens with theirs (an OpenAI response's logprobs)."""
    nodes = [
        _const("start", [-1]),
        _const("end", [INT64_MAX]),
        _const("axis1", [1]),
        helper.make_node("Slice", ["logits", "start", "end", "axis1"], ["last3"]),
        helper.make_node("Squeeze", ["last3", "axis1"], ["last_any"]),
        helper.make_node("Cast", ["last_any"], ["last"], to=TensorProto.FLOAT),
        helper.make_node("LogSoftmax", ["last"], ["logp"], axis=-1),
        helper.make_node("Unsqueeze", ["token", "axis1"], ["token2"]),
        helper.make_node("GatherElements", ["logp", "token2"], ["chosen2"], axis=1),
        helper.make_node("Squeeze", ["chosen2", "axis1"], ["chosen"]),
        helper.make_node("TopK", ["logp", "k"], ["values", "indices"], axis=-1),
    ]
    return helper.make_graph(
        nodes,
        "logprobs",
        [
            helper.make_tensor_value_info("logits", elem, ["batch", "seq", "vocab"]),
            helper.make_tensor_value_info("token", TensorProto.INT64, ["batch"]),
            _scalar("k", TensorProto.INT64),
        ],
        [
            helper.make_tensor_value_info("chosen", TensorProto.FLOAT, ["batch"]),
            helper.make_tensor_value_info("values", TensorProto.FLOAT, ["batch", "k"]),
            helper.make_tensor_value_info("indices", TensorProto.INT64, ["batch", "k"]),
        ],
    )


def _gather_rows(axis: int) -> Callable[[int], onnx.GraphProto]:
    def make(elem: int) -> onnx.GraphProto:
        """x, rows [n] -> x's rows along the batch axis, in that order (beam search reorders caches)."""
        x = helper.make_value_info("x", helper.make_tensor_type_proto(elem, shape=None))
        y = helper.make_value_info("y", helper.make_tensor_type_proto(elem, shape=None))
        rows = helper.make_tensor_value_info("rows", TensorProto.INT64, ["n"])
        return helper.make_graph(
            [helper.make_node("Gather", ["x", "rows"], ["y"], axis=axis)],
            f"gather_rows{axis}",
            [x, rows],
            [y],
        )

    return make


# name -> (builder, element types it is built for); stages over float32 scores are built once.
KERNELS: dict[str, tuple[Callable[[int], onnx.GraphProto], tuple[str, ...]]] = {
    "argmax_last": (argmax_last, tuple(FLOAT_TYPES)),
    "argmax_among": (argmax_among, tuple(FLOAT_TYPES)),
    "argmax_all": (argmax_all, tuple(FLOAT_TYPES)),
    "narrow": (narrow, (*FLOAT_TYPES, "int64")),
    "concat0": (_concat(0), tuple(FLOAT_TYPES)),
    "concat1": (_concat(1), tuple(FLOAT_TYPES)),
    "concat_last": (_concat(-1), tuple(FLOAT_TYPES)),
    "pad": (pad, tuple(FLOAT_TYPES)),
    "put_rows": (put_rows, tuple(FLOAT_TYPES)),
    "gather_seq": (gather_seq, tuple(FLOAT_TYPES)),
    "process": (process, tuple(FLOAT_TYPES)),
    "top_k": (top_k, ("float32",)),
    "top_p": (top_p, ("float32",)),
    "min_p": (min_p, ("float32",)),
    "sample": (sample, ("float32",)),
    "argmax": (argmax, ("float32",)),
    "beam_topk": (beam_topk, tuple(FLOAT_TYPES)),
    "logprobs": (logprobs, tuple(FLOAT_TYPES)),

    "gather_rows0": (_gather_rows(0), tuple(FLOAT_TYPES)),
    "gather_rows1": (_gather_rows(1), tuple(FLOAT_TYPES)),
    "unfold": (unfold, tuple(FLOAT_TYPES)),
}
KERNELS.update(PREPROCESS_KERNELS)  # image resize / normalize / patches, Whisper log-mel
KERNELS.update(LOOP_KERNELS)  # pooling, noise, scheduler steps, images (single_pass and denoising loops)


def build_all() -> dict[str, bytes]:
    """File name -> serialized model, for every kernel and float type."""
    files = {}
    for name, (make, types) in KERNELS.items():
        for type_name in types:
            model = helper.make_model(
                make(ELEMENT_TYPES[type_name]),
                producer_name="ortpipe",
                opset_imports=[helper.make_opsetid("", OPSET)],
            )
            model.ir_version = IR_VERSION
            files[f"{name}_{type_name}.onnx"] = model.SerializeToString()
    return files


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUT_DIR)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for name, data in build_all().items():
        (args.out / name).write_bytes(data)
        print(f"wrote {args.out / name} ({len(data)} bytes)")


if __name__ == "__main__":
    main()
