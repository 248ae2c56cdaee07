"""Multi-turn chat with continuous decoding: the same tokens as re-running each conversation from
scratch, with only the new turn prefilled; rewind drops a turn."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

import ortpipe
from ortpipe.errors import GenerationError

TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
            "{% if add_generation_prompt %}<s>assistant\n{% endif %}")
TURNS = ["def count_words(path):", "Now sort the words by count.", "And print the top ten?"]
REPLY = 12


@pytest.fixture(scope="module")
def chat_model(llama_builder_fp32: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("chat") / "llama"
    shutil.copytree(llama_builder_fp32, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = TEMPLATE
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def from_scratch(pipe, ids: list[int]) -> list[int]:
    return pipe.generate(prompt_ids=ids, max_new_tokens=REPLY).tokens


def test_three_turns_equal_rerunning_each_conversation(chat_model: Path) -> None:
    pipe = ortpipe.load(chat_model, threads=1)
    chat = pipe.chat(max_length=400)
    prefills = []
    for turn in TURNS:
        replies = [c.token for c in chat.say(turn, max_new_tokens=REPLY)]
        conversation = chat.tokens[:len(chat.tokens) - len(replies)]
        assert replies == from_scratch(pipe, conversation)
        prefills.append((chat.last.timings.prompt_tokens, len(conversation)))
    (first, total1), (second, total2), (third, total3) = prefills
    assert first == total1  # the first turn prefills everything
    assert second < total2 - total1 and third < total3 - total2  # later turns: only their own tokens
    delta = pipe.tokenizer.encode(
        "</s>\n<s>user\n" + TURNS[1] + "</s>\n<s>assistant\n", add_special_tokens=False
    )
    assert second == len(delta) + 1  # the new turn and the last reply token, never run before


def test_rewind_drops_the_last_turn(chat_model: Path) -> None:
    pipe = ortpipe.load(chat_model, threads=1)
    chat = pipe.chat(max_length=400)
    first = [c.token for c in chat.say(TURNS[0], max_new_tokens=REPLY)]
    after_first = list(chat.tokens)
    second = [c.token for c in chat.say(TURNS[1], max_new_tokens=REPLY)]
    chat.rewind()
    assert chat.tokens == after_first and len(chat.core.messages) == 2
    again = [c.token for c in chat.say(TURNS[1], max_new_tokens=REPLY)]
    assert again == second and first
    chat.rewind()
    chat.rewind()
    assert chat.tokens == [] and chat.core.messages == []
    assert [c.token for c in chat.say(TURNS[0], max_new_tokens=REPLY)] == first


def test_chat_cli_keeps_the_conversation(chat_model: Path) -> None:
    import subprocess
    import sys

    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "ortpipe.cli",
            "chat",
            str(chat_model),
            "--max-new-tokens",
            "6",
            "--threads",
            "1",
        ],
        input="hello\n/rewind\nhello\n/quit\n",
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr
    assert "[rewound: 0 tokens in the conversation]" in out.stderr
    stats = [line for line in out.stderr.splitlines() if line.startswith("[prefill")]
    assert len(stats) == 2  # the same turn twice: after the rewind it is prefilled the same way
    assert stats[0].split(" tokens")[0] == stats[1].split(" tokens")[0]


@pytest.mark.parametrize(("settings", "turn", "words"), [
    ({"max_length": {}}, {}, "max_length must be an integer, found {}"),
    ({"max_length": 0}, {}, "max_length 0 is out of range"),  # read as "not given" before
    ({}, {"max_new_tokens": 0}, "max_new_tokens 0 is out of range"),
    ({}, {"max_new_tokens": -1}, "max_new_tokens -1 is out of range"),  # gave one token before
    ({}, {"max_new_tokens": 0.5}, "max_new_tokens must be an integer, found 0.5"),
    ({}, {"max_new_tokens": "x"}, 'max_new_tokens must be an integer, found "x"'),  # a TypeError before
])
def test_chat_lengths_are_checked(chat_model: Path, settings: dict, turn: dict, words: str) -> None:
    pipe = ortpipe.load(chat_model)
    with pytest.raises(GenerationError) as error:
        list(pipe.chat(**settings).say(TURNS[0], **turn))
    assert str(error.value).startswith(words), error.value
