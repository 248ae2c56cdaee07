"""Kernel graphs: the shipped files equal a fresh build, and they compute what they claim."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort
from build.kernels import OUT_DIR, build_all

from ortpipe.sampling.sampler import Pick
from ortpipe.targets.cpython.sampling import Picker


def test_shipped_kernels_equal_a_fresh_build() -> None:
    fresh = build_all()
    shipped = {p.name: p.read_bytes() for p in Path(OUT_DIR).glob("*.onnx")}
    assert shipped == fresh


def run(name: str, **feeds: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(str(Path(OUT_DIR) / f"{name}.onnx"), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)[0]


def test_argmax_last_picks_the_last_position() -> None:
    logits = np.array([[[9.0, 0, 0, 0], [0, 0.5, 3.0, -1]],
                       [[0, 0, 0, 0], [4.0, 1, 1, 5.0]]], dtype=np.float32)
    assert run("argmax_last_float32", logits=logits).tolist() == [2, 3]
    assert run("argmax_last_float16", logits=logits.astype(np.float16)).tolist() == [2, 3]


def test_narrow_slices_one_axis() -> None:
    x = np.arange(2 * 3 * 6 * 4, dtype=np.float32).reshape(2, 3, 6, 4)
    big = np.array([2**62])
    y = run("narrow_float32", x=x, start=np.array([-4]), end=big, axis=np.array([2]))
    assert np.array_equal(y, x[:, :, 2:])
    combined = np.arange(2 * 1 * 2 * 5 * 3, dtype=np.float16).reshape(2, 1, 2, 5, 3)
    y = run("narrow_float16", x=combined, start=np.array([0]), end=np.array([2]), axis=np.array([3]))
    assert np.array_equal(y, combined[:, :, :, :2])


def test_cpython_native_twins_equal_the_kernel_graphs() -> None:
    from ortpipe.targets.cpython.driver import NATIVE_KERNELS

    rng = np.random.default_rng(0)
    logits = rng.standard_normal((3, 4, 50)).astype(np.float32)
    assert np.array_equal(NATIVE_KERNELS["argmax_last"](logits)[0], run("argmax_last_float32", logits=logits))
    for shape, axis in (((1, 2, 9, 4), 2), ((2, 1, 2, 7, 3), 3)):
        x = rng.standard_normal(shape).astype(np.float16)
        for start, end in ((-5, 2**62), (0, 3)):
            feeds = {"x": x, "start": np.array([start]), "end": np.array([end]), "axis": np.array([axis])}
            assert np.array_equal(NATIVE_KERNELS["narrow"](**feeds)[0], run("narrow_float16", **feeds))
    x = rng.standard_normal((5, 2, 12, 3)).astype(np.float32)
    for rows, length in (([3], 7), ([0, 4], 12), ([2], 0)):
        values = rng.standard_normal((len(rows), 2, 12, 3)).astype(np.float32)
        feeds = {"rows": np.array(rows), "values": values, "length": np.array([length])}
        graph = run("put_rows_float32", x=x, **feeds)
        native = NATIVE_KERNELS["put_rows"](x=x.copy(), **feeds)[0]  # writes into its x
        assert np.array_equal(native, graph)
        assert np.array_equal(graph[rows, :, :length], values[:, :, :length])
        others = [r for r in range(5) if r not in rows]
        assert np.array_equal(graph[others], x[others])
        assert np.array_equal(graph[rows, :, length:], x[rows, :, length:])


def test_guide_last_mixes_the_last_position_of_both_halves() -> None:
    # rows 0-1 conditional, rows 2-3 unconditional (two codebooks); only position -1 counts
    logits = np.array([[[7.0, 7, 7], [1, 2, 3]], [[7, 7, 7], [0, 4, 0]],
                       [[7, 7, 7], [1, 1, 1]], [[7, 7, 7], [2, 0, 1]]], dtype=np.float32)
    guided = run("guide_last_float32", logits=logits, scale=np.array([3.0], np.float32))
    assert guided.shape == (2, 1, 3)
    assert guided[:, 0].tolist() == [[1, 4, 7], [-4, 12, -2]]  # uncond + 3 * (cond - uncond)
    half = run("guide_last_float16", logits=logits.astype(np.float16), scale=np.array([3.0], np.float32))
    assert half.dtype == np.float32 and half[:, 0].tolist() == [[1, 4, 7], [-4, 12, -2]]


def _speculative_reference(scores: np.ndarray, q_scores: np.ndarray | None, drafts: list[int],
                           u: np.ndarray) -> tuple[int, int]:
    """The acceptance rule by hand (float64): draft i kept when u_i * q_i(d) <= p_i(d) (q a point mass on
    the draft without q_scores); after the first rejection, or all accepted, the first token whose share
    of max(0, p - q) (p after all were accepted) reaches u[-1]."""
    def softmax(x: np.ndarray) -> np.ndarray:
        e = np.exp(x.astype(np.float64) - x.max(-1, keepdims=True))
        return e / e.sum(-1, keepdims=True)

    p = softmax(scores)
    q = softmax(q_scores) if q_scores is not None else np.eye(p.shape[1])[drafts]
    m = 0
    while m < len(drafts) and u[m] * q[m, drafts[m]] <= p[m, drafts[m]]:
        m += 1
    residual = p[m] if m == len(drafts) else np.maximum(p[m] - q[m], 0)
    cdf = np.cumsum(residual)
    return m, int(np.searchsorted(cdf, u[-1] * cdf[-1]))


def test_speculative_sampling_kernels_and_their_numpy_twin_follow_the_rule() -> None:
    """The spec_accept kernels (the core's rounds) and the CPython driver's Picker.check (fused rounds,
    float64 as web/sampling.js) against the rule by hand."""
    rng = np.random.default_rng(0)
    vocab, k = 12, 4
    seen = set()
    for trial in range(300):
        scores = rng.normal(0, 2, (k + 1, vocab)).astype(np.float32)
        q_scores = (scores[:k] + rng.normal(0, 1.5, (k, vocab))).astype(np.float32)
        drafts = [int(rng.choice(vocab, p=np.exp(r) / np.exp(r).sum())) for r in q_scores.astype(np.float64)]
        u = rng.uniform(1e-6, 1, k + 1).astype(np.float32)
        feeds = {"scores": scores, "drafts": np.array(drafts, np.int64), "u": u}
        session = ort.InferenceSession(str(Path(OUT_DIR) / "spec_accept_q_float32.onnx"),
                                       providers=["CPUExecutionProvider"])
        accepted, token = session.run(None, {**feeds, "draft_scores": q_scores})
        assert (int(accepted[0]), int(token[0])) == _speculative_reference(scores, q_scores, drafts, u), trial
        seen.add(int(accepted[0]))
        session = ort.InferenceSession(str(Path(OUT_DIR) / "spec_accept_float32.onnx"),
                                       providers=["CPUExecutionProvider"])
        accepted, token = session.run(None, feeds)
        assert (int(accepted[0]), int(token[0])) == _speculative_reference(scores, None, drafts, u), trial
        pick = Pick(True, 1.0, 0, 1.0, 0.0, 1.0, (), (), tuple(u.tolist()))
        drafter = Picker(pick, vocab)
        dists = [drafter.kept(drafter.scores(row, "draft", 0)) for row in q_scores]
        twin = Picker(pick, vocab).check(scores, drafts, "model", 0, dists)
        assert twin == _speculative_reference(scores, q_scores, drafts, u), trial
        assert Picker(pick, vocab).check(scores, drafts, "model", 0) == _speculative_reference(
            scores, None, drafts, u), trial
    assert seen == set(range(k + 1))  # every count of accepted drafts, none to all, was met
