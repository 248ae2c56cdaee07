"""Continuous batching (loops/batched.py): rows joining and leaving a running batch give, token for
token, what each request gives alone; sampled rows keep their own seeded generator."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from build.references import prompt_ids

import ortpipe
from ortpipe.errors import GenerationError
from ortpipe.loops.batched import Batch, batchable

NEW = 24
CAPACITY = 128


def prefilled(pipe: Any, prompt: list[int], **settings: Any) -> Any:
    gen = pipe.model.generator(len(prompt), max_length=CAPACITY, **settings)
    gen.append_tokens(prompt)
    pipe.driver.drive(gen.next_tokens(1))  # the prefill, alone
    return gen


@pytest.mark.parametrize(
    "model", ["llama_builder_fp32", "llama_builder_int4", "phi3_builder", "qwen2_builder"]
)
def test_rows_that_join_and_leave_give_what_they_give_alone(
    model: str, request: pytest.FixtureRequest
) -> None:
    folder = request.getfixturevalue(model)
    pipe = ortpipe.load(folder, threads=1)
    ids = prompt_ids(Path(folder))
    jobs = [
        (ids[:20], {}),
        (ids[5:40], {"do_sample": True, "seed": 3, "top_k": 20}),
        (ids[:7], {}),
        (ids[10:60], {"repetition_penalty": 1.2}),
        (ids[30:33], {"do_sample": True, "seed": 8}),
    ]
    alone = [pipe.generate(prompt_ids=p, max_new_tokens=NEW, **s).tokens for p, s in jobs]
    batch = Batch(pipe.plan, pipe.model.backend, CAPACITY)
    gens: list[Any] = []
    waiting = list(jobs)
    steps = 0
    while waiting or len(batch):
        if waiting and (steps in (0, 3, 7, 8) or not len(batch)):  # rows join at different steps
            prompt, settings = waiting.pop(0)
            gens.append(prefilled(pipe, prompt, **settings))
            pipe.driver.drive(batch.join(gens[-1]))
            continue
        pipe.driver.drive(batch.step())
        steps += 1
        for gen in list(batch.rows):
            if gen.generated >= NEW or gen.done:
                pipe.driver.drive(batch.leave(gen))  # rows leave mid-run too
    assert len(batch) == 0
    got = [gen.tokens[len(p) : len(p) + NEW] for gen, (p, _) in zip(gens, jobs, strict=True)]
    assert got == alone


def test_a_row_that_left_goes_on_alone_from_its_cache(llama_builder_fp32: Path) -> None:
    pipe = ortpipe.load(llama_builder_fp32, threads=1)
    ids = prompt_ids(llama_builder_fp32)
    expected = pipe.generate(prompt_ids=ids[:30], max_new_tokens=20).tokens
    batch = Batch(pipe.plan, pipe.model.backend, CAPACITY)
    gen, other = prefilled(pipe, ids[:30]), prefilled(pipe, ids[40:50])
    for g in (other, gen):
        pipe.driver.drive(batch.join(g))
    for _ in range(9):
        pipe.driver.drive(batch.step())
    pipe.driver.drive(batch.leave(gen))
    while gen.generated < 20:  # alone again: the fused path over the cache the batch handed back
        pipe.driver.drive(gen.next_tokens(1))
    assert gen.tokens[30:50] == expected


def test_what_cannot_be_batched_says_why(
    llama_concat: Path, gemma_builder: Path, llama_builder_fp32: Path
) -> None:
    assert "shared past/present buffer" in batchable(ortpipe.load(llama_concat).plan)
    assert "slides" in batchable(ortpipe.load(gemma_builder).plan)
    pipe = ortpipe.load(llama_builder_fp32, threads=1)
    assert batchable(pipe.plan) is None
    batch = Batch(pipe.plan, pipe.model.backend, CAPACITY)
    gen = pipe.model.generator(3, max_length=CAPACITY + 1)
    gen.append_tokens([5, 6, 7])
    pipe.driver.drive(gen.next_tokens(1))
    with pytest.raises(GenerationError, match="make the generator with max_length 128"):
        pipe.driver.drive(batch.join(gen))
