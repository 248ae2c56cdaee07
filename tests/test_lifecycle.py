"""The request lifecycle (lifecycle.py): a step that fails puts the sequence in ERROR, a later step
is refused with a clear error, and a chat whose turn failed goes on from its last complete turn."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

import ortpipe
from ortpipe.errors import GenerationError, OrtpipeError
from ortpipe.lifecycle import (
    APPEND,
    BEGIN,
    DONE,
    END,
    ERROR,
    FAIL,
    FINISH,
    IDLE,
    READY,
    REFUSALS,
    REWIND,
    STEPPING,
    TRANSITIONS,
    Lifecycle,
)
from ortpipe.targets.cpython import driver as cpu_driver

TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
            "{% if add_generation_prompt %}<s>assistant\n{% endif %}")
TURNS = ["def count_words(path):", "Now sort the words by count.", "And print the top ten?"]


def test_the_table_allows_only_what_it_says() -> None:
    states = {state for state, _ in TRANSITIONS} | set(TRANSITIONS.values())
    events = {event for _, event in TRANSITIONS}
    assert states == {IDLE, READY, STEPPING, DONE, ERROR}
    for state in states:
        for event in events:
            life = Lifecycle()
            life.state = state
            if (state, event) in TRANSITIONS:
                life.fire(event)
                assert life.state == TRANSITIONS[(state, event)]
            else:
                with pytest.raises(GenerationError):
                    life.fire(event)
    assert (ERROR, BEGIN) in REFUSALS and (ERROR, APPEND) in REFUSALS  # the refusals users meet say why
    assert TRANSITIONS[(ERROR, REWIND)] == READY and (ERROR, APPEND) not in TRANSITIONS


def test_a_normal_step_goes_ready_stepping_ready_done() -> None:
    life = Lifecycle()
    seen = [life.state]
    for event in (APPEND, BEGIN, END, BEGIN, FINISH):
        life.fire(event)
        seen.append(life.state)
    assert seen == [IDLE, READY, STEPPING, READY, STEPPING, DONE]
    life = Lifecycle()
    life.fire(APPEND)
    life.fire(BEGIN)
    life.fail(RuntimeError("boom"))
    assert life.state == ERROR and life.cause == "RuntimeError: boom"
    assert TRANSITIONS[(STEPPING, FAIL)] == ERROR


class Failing:
    """Makes the runs of the driver's fused steps raise `error` after `steps` good ones (inside a
    burst), as a device or onnxruntime failing would; `stop()` gives the driver back its runs."""

    def __init__(self, pipe: Any, steps: int, error: BaseException):
        self.driver, self.calls = pipe.driver, 0
        fused_run = self.original = self.driver._fused_run

        def broken(*args: Any) -> Any:
            raise error

        def counted(d: Any, position: int, run: Any, *args: Any) -> Any:
            self.calls += 1
            return fused_run(d, position, broken if self.calls > steps else run, *args)

        self.driver._fused_run = counted

    def stop(self) -> None:
        self.driver._fused_run = self.original


@pytest.mark.parametrize("model", ["llama_builder_fp32", "llama_concat"])
def test_a_driver_failure_mid_burst_puts_the_request_in_error(model: str, request: pytest.FixtureRequest,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_driver, "BURST_SECONDS", 60.0)  # bursts end at their limit
    pipe = ortpipe.load(request.getfixturevalue(model), threads=1)
    gen = pipe.generator(3, max_new_tokens=30)
    gen.append_tokens([5, 6, 7])
    assert gen.next_token() >= 0  # the prefill
    Failing(pipe, 3, RuntimeError("the device went away"))
    req = pipe.request(prompt_ids=[5, 6, 7], max_new_tokens=30)
    with pytest.raises(OrtpipeError, match="failed on a decode step at position 6: the device went away"):
        for _ in pipe.drive(req):
            pass
    assert req.failed and req.gen.state == ERROR and len(req.tokens) == 1  # the burst's tokens are not taken
    with pytest.raises(
        GenerationError, match=r"an earlier step of this generation failed \(OrtpipeError: session"
    ):
        pipe.driver.drive(req.gen.next_token())
    with pytest.raises(GenerationError, match="rewind before appending"):
        req.gen.append_tokens([1])


@pytest.fixture(scope="module")
def chat_models(
    llama_builder_fp32: Path, llama_concat: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict:
    out = {}
    for name, source in (("shared", llama_builder_fp32), ("concat", llama_concat)):
        folder = tmp_path_factory.mktemp("chat") / name
        shutil.copytree(source, folder)
        config_file = folder / "tokenizer_config.json"
        config = json.loads(config_file.read_text()) if config_file.exists() else {}
        config["chat_template"] = TEMPLATE
        config_file.write_text(json.dumps(config))
        out[name] = folder
    return out


def replies(chat: Any, turns: list[str]) -> list[list[int]]:
    return [[c.token for c in chat.say(turn, max_new_tokens=12)] for turn in turns]


@pytest.mark.parametrize("cache", ["shared", "concat"])
@pytest.mark.parametrize("error", [RuntimeError("lost"), KeyboardInterrupt()], ids=["error", "ctrl-c"])
def test_a_failed_chat_turn_leaves_the_chat_at_its_last_complete_turn(
    chat_models: dict, cache: str, error: BaseException, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cpu_driver, "BURST_SECONDS", 60.0)
    expected = replies(ortpipe.load(chat_models[cache], threads=1).chat(max_length=400), TURNS)
    pipe = ortpipe.load(chat_models[cache], threads=1)
    chat = pipe.chat(max_length=400)
    assert replies(chat, TURNS[:1]) == expected[:1]
    after_first = list(chat.tokens)
    failing = Failing(pipe, 4, error)  # the second turn's prefill runs, then its burst fails midway
    with pytest.raises(KeyboardInterrupt if isinstance(error, KeyboardInterrupt) else OrtpipeError):
        replies(chat, TURNS[1:2])
    assert chat.last.failed
    failing.stop()  # the device is back
    assert replies(chat, TURNS[1:]) == expected[1:]  # as if the failed turn had never been said
    assert chat.core.messages[2] == {"role": "user", "content": TURNS[1]} and len(chat.core.messages) == 5
    chat.rewind()
    chat.rewind()
    assert chat.tokens == after_first


def test_rewind_drops_a_failed_turn(chat_models: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_driver, "BURST_SECONDS", 60.0)
    pipe = ortpipe.load(chat_models["shared"], threads=1)
    chat = pipe.chat(max_length=400)
    first = replies(chat, TURNS[:1])
    after_first = list(chat.tokens)
    failing = Failing(pipe, 2, RuntimeError("lost"))
    with pytest.raises(OrtpipeError):
        replies(chat, TURNS[1:2])
    failing.stop()
    chat.rewind()  # drops the failed turn, not the first one
    assert chat.tokens == after_first and len(chat.core.messages) == 2
    chat.rewind()
    assert chat.tokens == [] and replies(chat, TURNS[:1]) == first


def test_a_generator_resampled_between_requests_gives_a_fresh_generators_tokens(
    llama_builder_fp32: Path,
) -> None:
    """resample: a kept cache takes new settings (a seed starts over), as a fresh generator with them would
    sample; prompt lookup and a draft model start over."""
    from ortpipe.sampling.settings import settings_for

    pipe = ortpipe.load(llama_builder_fp32, threads=1)
    model = pipe.model
    prompt, more = [5, 9, 14, 3, 22], [7, 8]
    sampled = {"do_sample": True, "temperature": 0.9, "top_k": 30, "seed": 4}
    fresh = model.generator(0, max_length=64, **sampled)
    fresh.append_tokens(prompt + more)
    expected = pipe.driver.drive(fresh.next_tokens(6))
    while len(expected) < 6:
        expected += pipe.driver.drive(fresh.next_tokens(6 - len(expected)))

    kept = model.generator(0, max_length=64)  # greedy, then resampled
    kept.append_tokens(prompt)
    pipe.driver.drive(kept.next_tokens(3))
    pipe.driver.drive(kept.rewind(len(prompt)))
    kept.resample(settings_for(model.config.generation.settings, sampled))
    kept.append_tokens(more)
    got: list[int] = []
    while len(got) < 6:
        got += pipe.driver.drive(kept.next_tokens(6 - len(got)))
    assert got == expected

    # prompt lookup: resampled too, its index rebuilt from the tokens; the tokens of a fresh generator
    looking = model.generator(0, max_length=64, prompt_lookup_num_tokens=3)
    looking.append_tokens(prompt)
    pipe.driver.drive(looking.next_tokens(3))
    pipe.driver.drive(looking.rewind(len(prompt)))
    defaults = model.config.generation.settings
    looking.resample(settings_for(defaults, {**sampled, "prompt_lookup_num_tokens": 4}))
    assert looking.speculator is not None and looking.speculator.ngram.indexed == 0
    looking.append_tokens(more)
    got = []
    while len(got) < 6:
        got += pipe.driver.drive(looking.next_tokens(6 - len(got)))
    assert got == expected  # speculative sampling draws plain sampling's tokens

    # a draft model: its plan given with the settings (its cache starts over); greedy, a fresh generator's
    from build import draft_models

    drafting = {"draft_model": str(draft_models.get("llama-draft-builder")), "max_draft_tokens": 4}
    with pytest.raises(GenerationError, match="the plan of the draft model"):
        looking.resample(settings_for(defaults, drafting))
    pipe.driver.drive(model.prepare(drafting))
    plain = model.generator(0, max_length=64)
    plain.append_tokens(prompt + more)
    expected = []
    while len(expected) < 8:
        expected += pipe.driver.drive(plain.next_tokens(8 - len(expected)))
    pipe.driver.drive(looking.rewind(len(prompt)))
    looking.resample(settings_for(defaults, drafting), model.draft_plan(drafting))
    looking.append_tokens(more)
    got = []
    while len(got) < 8:
        got += pipe.driver.drive(looking.next_tokens(8 - len(got)))
    assert got == expected and looking.speculator.draft is not None and looking.speculator.drafted > 0
