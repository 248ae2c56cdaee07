"""Fused decode steps that sample (or apply penalties and bans): the core hands the target a `Pick`
(sampling/sampler.py) with its random numbers; the CPython driver selects with numpy
(targets/cpython/sampling.py), the browser's Decoder with web/sampling.js (tests/web). Seeded, the
tokens must equal the generic path's, which runs the sampler's kernel graphs step by step."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from build.references import prompt_ids

import ortpipe
from ortpipe.config.settings import SearchSettings
from ortpipe.execute.work import Select
from ortpipe.sampling.sampler import Pick, Sampler
from ortpipe.targets.cpython import CpuBackend, Driver
from ortpipe.targets.cpython import driver as cpu_driver
from ortpipe.targets.cpython.sampling import Picker

SETTINGS = [
    {"do_sample": True, "seed": 1, "temperature": 0.7, "top_k": 40, "top_p": 0.95},
    {"do_sample": True, "seed": 2, "temperature": 1.6},
    {"do_sample": True, "seed": 3, "top_p": 0.6, "min_p": 0.05, "repetition_penalty": 1.4},
    {"do_sample": True, "seed": 4, "top_k": 3, "suppress_tokens": [7, 8, 9]},
    {"repetition_penalty": 1.5},
    {"suppress_tokens": [5, 6], "min_new_tokens": 9},
    {"frequency_penalty": 1.2, "presence_penalty": 0.6},
    {"do_sample": True, "seed": 5, "top_k": 40, "frequency_penalty": -0.5, "presence_penalty": 1.5},
    {"logit_bias": {3: 4.5, 7: -100, 11: 1.25}},
    {"do_sample": True, "seed": 6, "top_p": 0.9, "logit_bias": {3: 2.0, 9: -2.0}, "repetition_penalty": 1.2},
]
NEW = 32


def generic(folder: Path) -> ortpipe.Pipeline:
    """A pipeline that fuses greedy steps only: the reference path."""
    pipe = ortpipe.load(folder, threads=1)
    pipe.model.backend.fused_sampling = False
    return pipe


@pytest.mark.parametrize("model", ["llama_builder_fp32", "llama_concat"])
def test_fused_sampled_steps_equal_the_generic_path(model: str, request: pytest.FixtureRequest,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    folder = request.getfixturevalue(model)
    ids = prompt_ids(folder)
    reference = generic(folder)
    expected = [reference.generate(prompt_ids=ids, max_new_tokens=NEW, **s) for s in SETTINGS]
    assert all(r.timings.fused_steps == 0 for r in expected)
    assert len({tuple(r.tokens) for r in expected}) == len(SETTINGS)
    monkeypatch.setattr(cpu_driver, "BURST_SECONDS", 60.0)  # bursts end at their limit
    for burst in (1, 8, 64):
        pipe = ortpipe.load(folder, threads=1)
        pipe.model.backend.decode_burst = burst
        for settings, reference_result in zip(SETTINGS, expected, strict=True):
            result = pipe.generate(prompt_ids=ids, max_new_tokens=NEW, **settings)
            assert result.tokens == reference_result.tokens, (burst, settings)
            assert result.timings.fused_steps == NEW - 1


def test_a_burst_stops_where_the_eos_ban_lifts(llama_builder_fp32: Path) -> None:
    """min_new_tokens bans eos for the first steps: a burst ends there, and the rest may stop at eos."""
    ids = prompt_ids(llama_builder_fp32)
    free = generic(llama_builder_fp32).generate(prompt_ids=ids, max_new_tokens=NEW, do_sample=True, seed=7)
    eos = free.tokens[5]  # a token sampled early: with it as eos, the ban matters
    settings = {"do_sample": True, "seed": 7, "min_new_tokens": 12}
    sampler = Sampler(CpuBackend(), "float32", SearchSettings(**settings), frozenset({eos}))
    pick, limit = sampler.pick(ids + free.tokens[:3], 3, 64)
    assert limit == 9 and eos in pick.banned and len(pick.uniforms) == 9
    after, limit = sampler.pick(ids + free.tokens[:12], 12, 64)
    assert limit == 64 and eos not in after.banned


def test_a_burst_draws_what_the_sampler_would() -> None:
    """The uniform numbers of a burst are the sampler's next draws; after a burst of n steps the
    generator is where n draws would have left it."""
    settings = SearchSettings(do_sample=True, seed=11)
    sampler = Sampler(CpuBackend(), "float32", settings, frozenset())
    draws = random.Random(11)
    pick, _ = sampler.pick([1, 2], 1, 8)
    assert pick.uniforms == tuple(1.0 - draws.random() for _ in range(8))
    sampler.drew(3)
    again = random.Random(11)
    for _ in range(3):
        again.random()
    assert sampler.rng.random() == again.random()


def kernel_token(logits: np.ndarray, seen: list[int], u: float, generated: int = 1, **settings: Any) -> int:
    """The generic path's token: the sampler's kernel chain, with `u` as its draw (the last `generated`
    of `seen` generated)."""
    backend = CpuBackend()
    backend.fused_sampling = False  # the kernel graphs, not the driver's Picker (`Select`)
    sampler = Sampler(backend, str(logits.dtype), SearchSettings(**settings), frozenset())
    sampler.rng = type("Fixed", (), {"random": staticmethod(lambda: 1.0 - u)})()
    return Driver().drive(sampler.select(logits[None, None], seen, generated))


def counts(s: SearchSettings, seen: list[int], generated: int) -> tuple[tuple[int, int], ...]:
    """A Pick's counts: how often each of the last `generated` ids of `seen` occurs."""
    if not (s.frequency_penalty or s.presence_penalty) or not generated:
        return ()
    tail = seen[len(seen) - generated:]
    return tuple((t, tail.count(t)) for t in sorted(set(tail)))


def test_the_picker_selects_what_the_kernel_graphs_select() -> None:
    """numpy's float64 probabilities against the kernels' float32 ones: the same tokens on these
    cases (a case whose draw fell within a rounding error of a boundary could differ; none does)."""
    rng = np.random.default_rng(0)
    checked = set()
    for case in range(300):
        vocab = int(rng.choice([10, 64, 500]))
        scale = rng.choice([1.0, 4.0])
        logits = (rng.standard_normal(vocab) * scale).astype(rng.choice([np.float32, np.float16]))
        seen = rng.integers(0, vocab, 6).tolist()
        settings = {
            "do_sample": bool(case % 5), "temperature": float(rng.choice([0.5, 1.0, 1.5])),
            "top_k": int(rng.choice([0, 1, 8, vocab])), "top_p": float(rng.choice([1.0, 0.9, 0.4])),
            "min_p": float(rng.choice([0.0, 0.05])), "repetition_penalty": float(rng.choice([1.0, 1.3])),
            "suppress_tokens": tuple(rng.integers(0, vocab, case % 3).tolist()),
            "frequency_penalty": float(rng.choice([0.0, 0.7, -1.3])),
            "presence_penalty": float(rng.choice([0.0, 1.1, -0.4])),
            "logit_bias": tuple(sorted({int(i): float(rng.choice([-100.0, -1.5, 0.75, 3.0]))
                                        for i in rng.integers(0, vocab, case % 4)}.items())),  # as checked
        }
        generated = int(rng.integers(0, 7))
        u = float(1.0 - rng.random())
        s = SearchSettings(**settings)
        pick = Pick(s.sampling, s.temperature if s.sampling else 1.0, s.top_k, s.top_p, s.min_p,
                    s.repetition_penalty, tuple(sorted(set(seen))) if s.repetition_penalty != 1.0 else (),
                    s.suppress_tokens, (u,), s.frequency_penalty, s.presence_penalty,
                    counts(s, seen, generated), s.logit_bias or ())
        ours = Picker(pick, vocab).select(logits, "decoder", 0)
        assert ours == kernel_token(logits, seen, u, generated, **settings), (case, settings)
        checked.add(ours)
    assert len(checked) > 50


def test_the_picker_selects_what_the_kernels_select_on_a_wide_vocabulary() -> None:
    """A vocabulary as wide as the demo's, one Picker over a burst of rows, as the driver uses it: top-k
    looks for its k-th largest score among those above an estimate and divides only those by the
    temperature, and a few ids are drawn in Python's floats. Rows made to test each: heavy ties at the
    k-th largest, scores one float32 step apart that the division merges, a k-th largest near 0, bans
    that leave fewer than k ids."""
    rng = np.random.default_rng(5)
    vocab = 8192
    rows = [(rng.standard_normal(vocab) * 3).astype(np.float32) for _ in range(12)]
    tied = rows[0].copy()
    tied[np.argsort(tied)[-60:-20]] = np.sort(tied)[-40]  # 40 scores equal to the 40th largest
    close = rows[1] / np.float32(6.0)  # all below 3
    order = np.argsort(close)
    close[order[-39:]] += np.float32(4.0)
    close[order[-40]] = np.float32(3.006)  # the 40th largest, and 3.0059998 five times: one quotient over 3
    close[order[-45:-40]] = np.nextafter(np.float32(3.006), np.float32(-np.inf))
    assert np.sort(close)[-40] == np.float32(3.006) and np.sort(close)[-46] < 3.0
    assert close[order[-45]] / np.float32(3.0) == close[order[-40]] / np.float32(3.0)
    zero = rows[2].copy()
    zero[np.argsort(zero)[-40]] = 0.0
    zero -= np.sort(zero)[-40]  # the 40th largest is 0
    rows += [tied, zero] + [close] * 24  # a row drawn with many uniforms: the ids kept decide
    cases = [
        {"temperature": 0.7, "top_k": 40, "top_p": 0.95},
        {"temperature": 3.0, "top_k": 40},  # divides one-step neighbours into one quotient
        {"temperature": 1.0, "top_k": 200, "min_p": 0.02},  # more than the few a Python draw takes
        {"temperature": 0.9, "top_k": 8, "top_p": 0.5, "repetition_penalty": 1.3},
        {"temperature": 1.1, "top_k": 40, "suppress_tokens": tuple(range(8000))},  # 192 ids left
        {"temperature": 1.2, "top_k": 30},
    ]
    checked = 0
    for settings in cases:
        s = SearchSettings(do_sample=True, **settings)
        seen = rng.integers(0, vocab, 12).tolist()
        uniforms = [float(1.0 - rng.random()) for _ in rows]
        pick = Pick(True, s.temperature, s.top_k, s.top_p, s.min_p, s.repetition_penalty,
                    tuple(sorted(set(seen))) if s.repetition_penalty != 1.0 else (), s.suppress_tokens,
                    tuple(uniforms))
        picker = Picker(pick, vocab)
        for row, u in zip(rows, uniforms, strict=True):
            before = sorted(picker.seen)
            ours = picker.select(row, "decoder", 0)
            kernels = kernel_token(row, before, u, do_sample=True, **settings)
            assert ours == kernels, settings
            checked += 1
    assert checked == len(cases) * len(rows)


def test_a_first_token_is_selected_by_the_target_as_its_fused_steps_are() -> None:
    """On a target with fused sampling a request's first token (after its prefill) is a `Select`: the
    target's Picker, no kernel run and no kernel session to open; seeded, the tokens equal the kernel
    graphs' over many seeds and settings, and the generator is wound as the kernel path winds it."""
    rng = np.random.default_rng(3)
    cases = [{"do_sample": True, "temperature": 0.8, "top_k": 20, "top_p": 0.9},
             {"do_sample": True, "min_p": 0.05, "repetition_penalty": 1.3, "frequency_penalty": 0.5},
             {"suppress_tokens": (3, 4)}, {"logit_bias": ((2, 3.0),), "presence_penalty": 1.0}]
    for case in cases:
        fused = Sampler(CpuBackend(), "float32", SearchSettings(seed=5, **case), frozenset())
        assert fused.selects_in_target  # and opens no kernel but the argmax of a greedy step with no ban
        argmax = [] if case.get("do_sample") or "logit_bias" in case else ["kernel:argmax_last_float32"]
        assert fused.kernels() == argmax
        generic_backend = CpuBackend()
        generic_backend.fused_sampling = False
        generic = Sampler(generic_backend, "float32", SearchSettings(seed=5, **case), frozenset())
        assert generic.kernels()
        for _ in range(40):
            logits = (rng.standard_normal(300) * 3).astype(np.float32)[None, None]
            tokens = rng.integers(0, 300, 6).tolist()
            work = fused.select(logits, tokens, 2)
            assert isinstance(next(work), Select)
            want = Driver().drive(generic.select(logits, tokens, 2))
            assert Driver().drive(fused.select(logits, tokens, 2)) == want, case
        assert fused.rng.random() == generic.rng.random()  # both drew one number a selection


def test_nan_logits_are_an_error() -> None:
    pick = Pick(True, 1.0, 0, 1.0, 0.0, 1.0, (), (), (0.5,))
    with pytest.raises(ortpipe.OrtpipeError, match='session "decoder" gave NaN or infinite logits'):
        Picker(pick, 3).select(np.array([0.0, np.nan, 1.0], np.float32), "decoder", 4)
