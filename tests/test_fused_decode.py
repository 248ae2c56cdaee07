"""Fused greedy decode steps (execute/work.py `Decode`, the CPython driver's `decode`).

Plain greedy decoding on a single decoder session (a shared-buffer or a concat cache) skips the
generic step (feeds dict, Run, argmax kernel) after the prefill. Its tokens must equal the generic
path's (forced here with GENERIC, an n-gram ban longer than any sequence here: the one processor
fused steps do not apply, and it bans nothing) and onnxruntime-genai's, across everything that
re-binds a session between steps. Sampled decoding fused: tests/test_fused_sampling.py.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from build.references import genai_greedy, prompt_ids

import ortpipe
from ortpipe.targets.cpython import driver as cpu_driver

NEW = 40
GENERIC = {"no_repeat_ngram_size": 10_000}


def counting(pipe: Any, decodes: bool = False) -> list[int]:
    """Record the position of every fused decode step the pipeline's driver runs (`decodes`: of the
    first step of every `Decode`, which runs a burst of steps)."""
    seen: list[int] = []
    driver = pipe.driver

    def counted(method: Any) -> Any:
        def run(d: Any, *rest: Any) -> Any:
            seen.append(rest[-1] if rest else d.position)  # a step's position is its last argument
            return method(d, *rest)
        return run

    if decodes:
        driver.decode = counted(driver.decode)
    else:  # the driver looks its step methods up on itself for every step
        driver._shared_step = counted(driver._shared_step)
        driver._concat_step = counted(driver._concat_step)
    return seen


@pytest.mark.parametrize("model", ["llama_builder_fp32", "llama_builder_int4", "gemma_builder"])
def test_greedy_decode_steps_are_fused_and_equal_the_generic_path(
    model: str, request: pytest.FixtureRequest
) -> None:
    folder = request.getfixturevalue(model)  # gemma: sliding-window layers kept as a ring in the buffer
    ids = prompt_ids(folder)
    pipe = ortpipe.load(folder, threads=1)
    fused = counting(pipe)
    ours = pipe.generate(prompt_ids=ids, max_new_tokens=NEW).tokens
    assert fused == list(range(len(ids), len(ids) + NEW - 1)), "every decode step after the prefill is fused"
    generic = pipe.generate(prompt_ids=ids, max_new_tokens=NEW, **GENERIC).tokens
    assert len(fused) == NEW - 1, "an n-gram ban turns fusing off"
    assert ours == generic
    assert ours == genai_greedy(folder, ids, NEW, threads=1)
    # the next request rebinds the session (new cache buffers, a generic prefill) and fuses again
    assert (
        pipe.generate(prompt_ids=ids[:7], max_new_tokens=NEW).tokens
        == pipe.generate(prompt_ids=ids[:7], max_new_tokens=NEW, **GENERIC).tokens
    )
    assert len(fused) == 2 * (NEW - 1)


def test_interleaved_generators_and_continued_decoding(llama_builder_fp32: Path) -> None:
    ids = prompt_ids(llama_builder_fp32)
    pipe = ortpipe.load(llama_builder_fp32, threads=1)

    def solo(prompt: list[int], more: list[int], **settings: Any) -> list[int]:
        gen = pipe.generator(len(prompt), max_length=len(prompt) + 24 + len(more), **settings)
        gen.append_tokens(prompt)
        out = [gen.next_token() for _ in range(12)]
        gen.append_tokens(more)  # continuous decoding: a generic prefill of two ids, then fused again
        return out + [gen.next_token() for _ in range(12)]

    first, second = (ids, [3, 4]), (ids[10:40], [5])
    expected = [solo(*first, **GENERIC), solo(*second, **GENERIC)]
    fused = counting(pipe)
    gens = []
    for prompt, more in (first, second):
        gen = pipe.generator(len(prompt), max_length=len(prompt) + 24 + len(more))
        gen.append_tokens(prompt)
        gens.append(gen)
    got: list[list[int]] = [[], []]
    for phase in range(2):
        for _ in range(12):  # step by step, alternating: each step finds the other's cache bound
            for i, gen in enumerate(gens):
                got[i].append(gen.next_token())
        if phase == 0:
            for gen, (_, more) in zip(gens, (first, second), strict=True):
                gen.append_tokens(more)
    assert got == expected
    assert len(fused) == 2 * 2 * 11


def test_traces_record_fused_steps(llama_builder_fp32: Path, tmp_path: Path) -> None:
    pipe = ortpipe.load(llama_builder_fp32, threads=1)
    path = tmp_path / "trace.json"
    pipe.generate(prompt_ids=prompt_ids(llama_builder_fp32), max_new_tokens=6, trace=str(path))
    events = [e for e in json.loads(path.read_text())["traceEvents"] if e.get("ph") == "X"]
    decoder = [e for e in events if e["name"] == pipe.plan.step_phase[0].session]
    assert len(decoder) == 6  # the prefill and five fused steps
    assert len({e["args"]["label"] for e in decoder}) == 6, "a traced request runs one step per Decode"


def test_concat_cache_steps_are_fused_and_equal_the_generic_path(llama_concat: Path) -> None:
    """Optimum's layout: each step's presents replace the pasts in the core's cache dict, so a
    continued generator (a generic prefill over that cache) and a rewound chat stay right."""
    ids = prompt_ids(llama_concat)
    pipe = ortpipe.load(llama_concat, threads=1)
    fused = counting(pipe)
    ours = pipe.generate(prompt_ids=ids, max_new_tokens=NEW).tokens
    assert fused == list(range(len(ids), len(ids) + NEW - 1))
    assert ours == pipe.generate(prompt_ids=ids, max_new_tokens=NEW, **GENERIC).tokens

    def continued(**settings: Any) -> list[int]:
        gen = pipe.generator(len(ids), max_length=len(ids) + 30, **settings)
        gen.append_tokens(ids)
        out = [gen.next_token() for _ in range(12)]
        gen.append_tokens([3, 4])
        return out + [gen.next_token() for _ in range(12)]

    assert continued() == continued(**GENERIC)


@pytest.mark.parametrize("model", ["llama_builder_fp32", "llama_concat"])
def test_bursts_of_decode_steps_give_the_same_tokens(
    model: str, request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Decode answered with several tokens (the CPython driver's bursts, as the browser's JS
    Decoder's) gives the tokens of one step per Decode, and stops at the eos inside a burst."""
    folder = request.getfixturevalue(model)
    ids = prompt_ids(folder)
    single = ortpipe.load(folder, threads=1)
    single.model.backend.decode_burst = 1
    decodes = counting(single, decodes=True)
    expected = single.generate(prompt_ids=ids, max_new_tokens=NEW).tokens
    assert decodes == list(range(len(ids), len(ids) + NEW - 1))
    monkeypatch.setattr(cpu_driver, "BURST_SECONDS", 60.0)  # bursts end at the limit, not at the clock
    pipe = ortpipe.load(folder, threads=1)
    pipe.model.backend.decode_burst = 8
    decodes = counting(pipe, decodes=True)
    assert pipe.generate(prompt_ids=ids, max_new_tokens=NEW).tokens == expected
    assert decodes == list(range(len(ids), len(ids) + NEW - 1, 8)), "39 steps in bursts of 8"
    monkeypatch.setattr(cpu_driver, "BURST_SECONDS", 0.0)  # every burst is over after its first step
    pipe = ortpipe.load(folder, threads=1)
    decodes = counting(pipe, decodes=True)
    assert pipe.generate(prompt_ids=ids, max_new_tokens=NEW).tokens == expected
    assert decodes == list(range(len(ids), len(ids) + NEW - 1))
    monkeypatch.setattr(cpu_driver, "BURST_SECONDS", 60.0)
    # an eos that greedy decoding reaches mid-burst: the copy's eos is the 12th token, new there
    at = next(i for i, t in enumerate(expected) if i >= 11 and t not in expected[:i])
    assert at % 8, "bursts end at tokens 8, 16, ...: this eos falls inside one"
    copy = tmp_path / "copy"
    shutil.copytree(folder, copy)
    if (copy / "genai_config.json").exists():
        config = json.loads((copy / "genai_config.json").read_text())
        config["model"]["eos_token_id"] = expected[at]
        (copy / "genai_config.json").write_text(json.dumps(config))
    else:
        config = json.loads((copy / "generation_config.json").read_text())
        config["eos_token_id"] = expected[at]
        (copy / "generation_config.json").write_text(json.dumps(config))
    pipe = ortpipe.load(copy, threads=1)
    pipe.model.backend.decode_burst = 8
    result = pipe.generate(prompt_ids=ids, max_new_tokens=NEW)
    assert (result.tokens, result.finish_reason) == (expected[: at + 1], "eos")


def test_what_cannot_be_fused_runs_the_generic_path(llama_builder_fp32: Path, sliding_concat: Path) -> None:
    windowed = ortpipe.load(sliding_concat, threads=1)  # a concat cache that a kernel trims to its window
    fused = counting(windowed)
    windowed.generate(prompt_ids=[5, 17, 42, 8, 23, 61, 30, 12, 77, 40, 9], max_new_tokens=8)
    assert fused == []
    shared = ortpipe.load(llama_builder_fp32, threads=1)
    fused = counting(shared)
    for settings in ({"no_repeat_ngram_size": 2}, {"num_beams": 2}):
        shared.generate(prompt_ids=[5, 6, 7], max_new_tokens=6, **settings)
        assert fused == [], settings
    shared.model.backend.fused_sampling = False  # a target that fuses greedy steps only
    for settings in ({"do_sample": True, "seed": 1}, {"repetition_penalty": 1.3}, {"suppress_tokens": [5]},
                     {"min_new_tokens": 2}):
        shared.generate(prompt_ids=[5, 6, 7], max_new_tokens=6, **settings)
        assert fused == [], settings


@pytest.fixture
def sliding_concat(tmp_path: Path) -> Path:
    from build import graphs

    return graphs.build_sliding(tmp_path / "sliding", seed=3, window=8, window_layers=(1,), config=True)
