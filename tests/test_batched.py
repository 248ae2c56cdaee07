"""Continuous batching (loops/batched.py), shared-buffer and concat caches: rows joining and leaving a
running batch give, token for token, what each request gives alone (a concat row padded on the left, cut
back when it leaves); sampled rows keep their own seeded generator."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
from build import draft_models
from build.references import prompt_ids

import ortpipe
from ortpipe.errors import GenerationError
from ortpipe.execute.work import Run, drive
from ortpipe.loops.batched import Batch, batchable
from ortpipe.loops.speculative import DraftLength

NEW = 24
CAPACITY = 128


def prefilled(pipe: Any, prompt: list[int], **settings: Any) -> Any:
    gen = pipe.model.generator(len(prompt), max_length=CAPACITY, **settings)
    gen.append_tokens(prompt)
    pipe.driver.drive(gen.next_tokens(1))  # the prefill, alone
    return gen


@pytest.mark.parametrize(
    "model",
    [
        "llama_builder_fp32", "llama_builder_int4", "phi3_builder", "qwen2_builder",
        "llama_concat", "gpt2_optimum",
    ],
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
    joins = [0, 0, 3, 7, 8]  # the step each job joins before: 5 rows outgrow the batch's first 4 slots
    steps = 0
    while waiting or len(batch):
        if waiting and (joins[len(gens)] <= steps or not len(batch)):
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


@pytest.mark.parametrize("model", ["llama_builder_fp32", "llama_concat"])
def test_a_row_that_left_goes_on_alone_from_its_cache(model: str, request: pytest.FixtureRequest) -> None:
    folder = request.getfixturevalue(model)
    pipe = ortpipe.load(folder, threads=1)
    ids = prompt_ids(Path(folder))
    expected = pipe.generate(prompt_ids=ids[:12], max_new_tokens=20).tokens
    batch = Batch(pipe.plan, pipe.model.backend, CAPACITY)
    gen, other = prefilled(pipe, ids[:12]), prefilled(pipe, ids[40:70])
    for g in (other, gen):  # a concat batch pads the shorter row, `gen`, on the left
        pipe.driver.drive(batch.join(g))
    for _ in range(9):
        pipe.driver.drive(batch.step())
    pipe.driver.drive(batch.leave(gen))
    shapes = {pipe.model.backend.shape(x) for x in batch.cache.values()}
    if pipe.plan.fused.layout == "concat":  # the other row's own length, no padding left
        assert {s[2] for s in shapes} == {other.flow.position} and other.flow.position > 12 + 9
    else:
        assert {s[2] for s in shapes} == {CAPACITY}
    while gen.generated < 20:  # alone again: the fused path over the cache the batch handed back
        pipe.driver.drive(gen.next_tokens(1))
    assert gen.tokens[12:32] == expected


def test_what_cannot_be_batched_says_why(
    llama_concat: Path, gemma_builder: Path, llama_builder_fp32: Path, whisper_builder: Path
) -> None:
    concat = ortpipe.load(llama_concat).plan
    assert batchable(concat) is None
    unplaced = dataclasses.replace(concat, fused=dataclasses.replace(concat.fused, positions=None))
    assert "no position ids" in batchable(unplaced)
    unmasked = dataclasses.replace(concat, fused=dataclasses.replace(concat.fused, mask=None))
    assert "no attention mask" in batchable(unmasked)
    assert "slides" in batchable(ortpipe.load(gemma_builder).plan)
    assert "inputs fixed for each request" in batchable(ortpipe.load(whisper_builder).plan)
    pipe = ortpipe.load(llama_builder_fp32, threads=1)
    assert batchable(pipe.plan) is None
    batch = Batch(pipe.plan, pipe.model.backend, CAPACITY)
    gen = pipe.model.generator(3, max_length=CAPACITY + 1)
    gen.append_tokens([5, 6, 7])
    pipe.driver.drive(gen.next_tokens(1))
    with pytest.raises(GenerationError, match="make the generator with max_length 128"):
        pipe.driver.drive(batch.join(gen))
    pipe.model.backend.row_views = False  # the browser's tensors: no buffer of rows to view
    try:
        with pytest.raises(GenerationError, match="cannot batch rows"):
            Batch(pipe.plan, pipe.model.backend, CAPACITY)
    finally:
        pipe.model.backend.row_views = True


def test_a_target_that_cannot_write_in_place_gets_the_same_tokens(llama_builder_fp32: Path) -> None:
    """A target may answer a shared buffer's present instead of writing it in place (work.Run's contract):
    the batch then copies the answer into its buffer of rows, and every row still gives its tokens alone."""
    pipe = ortpipe.load(llama_builder_fp32, threads=1)
    ids = prompt_ids(llama_builder_fp32)
    prompts = [ids[:9], ids[20:45], ids[3:17]]
    alone = [pipe.generate(prompt_ids=p, max_new_tokens=12).tokens for p in prompts]
    answered: list[str] = []

    def copying(work: Any) -> Any:  # the decoder's runs: new presents, the inputs left as they were
        if isinstance(work, Run) and work.inplace and work.session == pipe.plan.fused.session:
            out = pipe.driver.execute(Run(work.session, work.feeds, work.outputs, None, work.label))
            answered.extend(name for name in work.inplace if name in out)
            return out
        return pipe.driver.execute(work)

    batch = Batch(pipe.plan, pipe.model.backend, CAPACITY)
    gens = [prefilled(pipe, p) for p in prompts]
    for gen in gens:
        drive(batch.join(gen), copying)
    for _ in range(11):
        drive(batch.step(), copying)
    for gen in gens:
        drive(batch.leave(gen), copying)
    assert answered  # the fallback ran
    assert [gen.tokens[len(p) : len(p) + 12] for gen, p in zip(gens, prompts, strict=True)] == alone


@pytest.mark.parametrize("model", ["llama_builder_fp32", "llama_builder_int4", "qwen2_builder"])
def test_rows_prefilled_together_give_what_they_give_alone(
    model: str, request: pytest.FixtureRequest
) -> None:
    """Fresh prompts of different lengths prefill in one right-padded run, into the batch's next slots (more
    than it has: the buffer grows), while other rows are mid-generation; each row then decodes as alone."""
    folder = request.getfixturevalue(model)
    pipe = ortpipe.load(folder, threads=1)
    ids = prompt_ids(Path(folder))
    jobs = [
        (ids[:20], {}),
        (ids[5:9], {"do_sample": True, "seed": 5, "top_k": 20}),
        (ids[10:41], {}),
        (ids[2:13], {"repetition_penalty": 1.3}),
        (ids[30:33], {}),
    ]
    alone = [pipe.generate(prompt_ids=p, max_new_tokens=NEW, **s).tokens for p, s in jobs]

    def fresh(prompt: list[int], **settings: Any) -> Any:
        gen = pipe.model.generator(len(prompt), max_length=CAPACITY, **settings)
        gen.append_tokens(prompt)
        return gen

    batch = Batch(pipe.plan, pipe.model.backend, CAPACITY, slots=2)
    gens = [prefilled(pipe, *jobs[0][:1], **jobs[0][1])]
    pipe.driver.drive(batch.join(gens[0]))
    for _ in range(3):
        pipe.driver.drive(batch.step())
    together = [fresh(p, **s) for p, s in jobs[1:4]]
    firsts = pipe.driver.drive(batch.prefill(together))
    assert [g.tokens[-1] for g in together] == firsts
    gens += together
    for _ in range(5):
        pipe.driver.drive(batch.step())
    gens.append(fresh(*jobs[4][:1], **jobs[4][1]))
    pipe.driver.drive(batch.prefill(gens[-1:]))
    while len(batch):
        pipe.driver.drive(batch.step())
        for gen in list(batch.rows):
            if gen.generated >= NEW or gen.done:
                pipe.driver.drive(batch.leave(gen))
    got = [gen.tokens[len(p) : len(p) + NEW] for gen, (p, _) in zip(gens, jobs, strict=True)]
    assert got == alone
    with pytest.raises(GenerationError, match="fresh generator"):
        pipe.driver.drive(batch.prefill([gens[0]]))  # prefilled already


@pytest.mark.parametrize("model", ["llama_concat", "gpt2_optimum"])
def test_rows_that_check_drafts_together_give_what_they_give_alone(
    model: str, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Concat rows check their drafted tokens in one run (`speculate`), each row its own number of positions,
    padded to the longest: every row's tokens equal those it gives alone without speculation (fp32 graphs),
    greedy, seeded sampled, with a penalty, drafted by a draft model, a row that does not speculate beside
    them, rows that stop at their budget inside an accepted run, and a row that leaves and goes on alone."""
    folder = request.getfixturevalue(model)
    pipe = ortpipe.load(folder, threads=1)
    ids = prompt_ids(Path(folder))
    loop = ids[:12] * 4  # a prompt that repeats itself: prompt lookup drafts, and the model copies some
    jobs = [
        (loop[:40], {"do_sample": False}, 30),
        (ids[5:20] * 3, {"do_sample": True, "seed": 3, "top_k": 20}, 27),
        (loop[3:30], {"do_sample": False, "repetition_penalty": 1.2}, 33),
        (ids[40:52] * 2, {"do_sample": False}, 25),  # no speculation: one position a run
        (loop[:9], {"do_sample": False}, 31),
    ]
    if model == "llama_concat":  # a row drafting with a draft model (a one-layer cut of the model) too
        cut = str(draft_models.get("llama-draft-concat"))
        jobs.append((ids[20:44], {"do_sample": False, "draft_model": cut}, 29))
    monkeypatch.setattr(DraftLength, "timed", lambda *_: None)  # draft lengths from guessed costs, not the
    monkeypatch.setattr(DraftLength, "drafted", lambda *_: None)  # clock (tests/test_serve.py's `unclocked`)
    alone = [pipe.generate(prompt_ids=p, max_new_tokens=n, **s).tokens for p, s, n in jobs]
    widths: list[tuple[int, int]] = []  # (rows, positions) of each run of the decoder
    execute = pipe.driver.execute

    def noted(work: Any) -> Any:
        if isinstance(work, Run) and work.session == pipe.plan.fused.session:
            widths.append(tuple(work.feeds[pipe.plan.fused.ids[0]].shape))
        return execute(work)

    batch = Batch(pipe.plan, pipe.model.backend, CAPACITY)
    assert batch.verifies_together
    gens = []
    for i, (prompt, settings, _) in enumerate(jobs):
        lookup = {} if i == 3 or "draft_model" in settings else {"prompt_lookup_num_tokens": 6}
        pipe.driver.drive(pipe.model.prepare(settings))  # a draft model, loaded once
        gens.append(prefilled(pipe, prompt, **settings, **lookup))
    for gen in [*gens[:4], *gens[5:]]:
        pipe.driver.drive(batch.join(gen))
    budget = {id(gen): n for gen, (_, _, n) in zip(gens, jobs, strict=True)}
    _speculate_to_the_end(pipe, batch, gens, budget, noted)
    first = gens[0]
    while first.generated < budget[id(first)] and not first.done:
        pipe.driver.drive(first.next_tokens(budget[id(first)] - first.generated))
    got = [gen.tokens[len(p) : len(p) + n] for gen, (p, _, n) in zip(gens, jobs, strict=True)]
    assert got == alone
    assert any(rows > 1 and positions > 1 for rows, positions in widths)  # rows checked drafts together
    assert sum(g.speculator.accepted for g in gens if g.speculator) > 0
    assert gens[3].speculator is None
    if model == "llama_concat":
        assert gens[5].speculator.drafted > 0


def _speculate_to_the_end(pipe: Any, batch: Batch, gens: list[Any], budget: dict[int, int],
                          execute: Any) -> None:
    """Speculative steps until every row is done: gens[4] joins before the fourth, gens[0] leaves after it
    (and goes on alone from the cache handed back), the others leave at their budget."""
    steps = 0
    while len(batch):
        if steps == 3:
            pipe.driver.drive(batch.join(gens[4]))  # joins between speculative steps
        new = drive(batch.speculate([budget[id(g)] - g.generated for g in batch.rows]), execute)
        assert all(1 <= len(tokens) for tokens in new)
        steps += 1
        for gen in list(batch.rows):
            if gen is gens[0] and steps == 4:
                pipe.driver.drive(batch.leave(gen))
            elif gen.generated >= budget[id(gen)] or gen.done:
                assert gen.generated == budget[id(gen)] or gen.done  # a burst never runs past the budget
                pipe.driver.drive(batch.leave(gen))


def test_a_shared_buffer_batch_does_not_check_drafts_together(llama_builder_fp32: Path) -> None:
    pipe = ortpipe.load(llama_builder_fp32, threads=1)
    batch = Batch(pipe.plan, pipe.model.backend, CAPACITY)
    assert not batch.verifies_together
    with pytest.raises(GenerationError, match="cannot check drafted tokens together"):
        pipe.driver.drive(batch.speculate([]))
