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
    tokens = run("argmax_all_float32", logits=logits)
    assert np.array_equal(NATIVE_KERNELS["argmax_all"](logits)[0], tokens)
    assert np.array_equal(tokens, logits.argmax(-1)) and tokens.shape == (3, 4)
    cache = rng.standard_normal((3, 2, 9, 4)).astype(np.float16)
    index = np.array([[0, 0, 1, 2, 3], [4, 5, 6, 7, 8], [8, 2, 0, 5, 5]])
    picked = run("gather_seq_float16", x=cache, index=index)
    assert np.array_equal(NATIVE_KERNELS["gather_seq"](x=cache, index=index)[0], picked)
    for r in range(3):
        assert np.array_equal(picked[r], cache[r][:, index[r]])
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


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x.astype(np.float64) - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def test_the_numpy_twin_checks_drafts_as_plain_draws() -> None:
    """The CPython driver's Picker.check (fused speculative rounds, float64 as web/sampling.js) against
    the rule by hand: row i's token drawn from p_i with u_i (the first whose running sum reaches
    u_i), the drafts equal to them kept, and the token after them; no uniform taken before `took`."""
    rng = np.random.default_rng(0)
    vocab, k = 12, 4
    accepted = set()
    for trial in range(300):
        scores = rng.normal(0, 2, (k + 1, vocab)).astype(np.float32)
        u = rng.uniform(1e-6, 1, k + 1).astype(np.float32)
        picks = [int(np.searchsorted(np.cumsum(row), ui * np.cumsum(row)[-1]))
                 for row, ui in zip(_softmax(scores), u, strict=True)]
        drafts = [pick if rng.random() < 0.7 else int(rng.integers(vocab)) for pick in picks[:k]]
        m = 0
        while m < k and drafts[m] == picks[m]:
            m += 1
        picker = Picker(Pick(True, 1.0, 0, 1.0, 0.0, 1.0, (), (), tuple(u.tolist())), vocab)
        assert picker.check(scores, drafts, "model", 0) == (m, picks[m]) and picker.uniforms.taken == 0, trial
        accepted.add(m)
    assert accepted == set(range(k + 1))
