"""Streaming text: chunks never split a character or a merged word, and stop strings cut cleanly."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from ortpipe.config.settings import SearchSettings
from ortpipe.request import Chunk, Request
from ortpipe.targets.cpython.text import HFTokenizer
from ortpipe.tokenizer import TextStream

TEXT = "Le café naïve — 日本語のテキスト 🙂🚀 and straße; ça va? Ünïcödé everywhere: 東京, Zürich."


def byte_level_bpe(path: Path) -> Path:
    """A byte-level BPE too small to hold most characters whole: they are split over several tokens."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, show_progress=False, special_tokens=["</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["the café and the straße and the naïve word " * 20], trainer=trainer)
    tok.save(str(path))
    return path


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> HFTokenizer:
    return HFTokenizer.from_file(byte_level_bpe(tmp_path_factory.mktemp("tok") / "tokenizer.json"))


class ScriptedGenerator:
    """Stands in for TokenGenerator: yields nothing, returns the next scripted ids (`burst` at most
    a call, as a target running bursts of fused decode steps gives them)."""

    def __init__(self, ids: list[int], eos: frozenset[int] = frozenset(), burst: int = 1):
        self.ids, self.i, self.burst = ids, 0, burst
        self.limits = SimpleNamespace(eos=eos)
        self.interrupted = False
        self.fused_steps = 0
        self.speculator = None
        self.plan = SimpleNamespace(final_phase=())  # the script's pipeline runs no final steps
        self.budgets: list[int | None] = []  # what each next_token was told the request takes at most

    @property
    def done(self) -> bool:
        return self.i >= len(self.ids)

    def next_tokens(self, budget: int | None = None):
        self.budgets.append(budget)
        n = min(self.burst, len(self.ids) - self.i, self.burst if budget is None else budget)
        self.i += n
        return self.ids[self.i - n:self.i]
        yield  # a generator, like the real one

    def named_outputs(self) -> tuple[dict, dict]:
        return {}, {}  # the script's pipeline names no outputs


def run(request: Request) -> list[str]:
    return [c.text for c in chunks_of(request)]


def chunks_of(request: Request) -> list[Chunk]:
    chunks = []
    while not request.done:
        work = request.advance()
        try:
            next(work)
        except StopIteration as stop:
            chunks += stop.value
    return chunks


def test_joined_stream_equals_the_full_decode(tokenizer: HFTokenizer) -> None:
    ids = tokenizer.encode(TEXT)
    assert len(ids) > len(TEXT.encode()) // 3  # many characters span several tokens
    pieces = run(Request(ScriptedGenerator(ids), SearchSettings(), tokenizer, 0))
    assert "".join(pieces) == tokenizer.decode(ids) == TEXT
    assert not any("\ufffd" in p for p in pieces)
    assert sum(1 for p in pieces if p == "") > 0  # some tokens completed no character yet


def test_a_long_stream_of_a_metaspace_tokenizer_equals_the_full_decode(tmp_path) -> None:  # noqa: ANN001
    """SentencePiece-style ("▁word", the first word's space dropped on decoding): the stream's
    window restarts mid-text many times, and no space may be lost or doubled where it does."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=70, show_progress=False, special_tokens=["</s>"])
    tok.train_from_iterator([TEXT * 3], trainer=trainer)
    tok.save(str(tmp_path / "tokenizer.json"))
    tokenizer = HFTokenizer.from_file(tmp_path / "tokenizer.json")
    ids = tokenizer.encode(" ".join([TEXT] * 4))
    assert len(ids) > 4 * TextStream.WINDOW
    pieces = run(Request(ScriptedGenerator(ids), SearchSettings(), tokenizer, 0))
    assert "".join(pieces) == tokenizer.decode(ids)
    assert "  " not in "".join(pieces) and "\ufffd" not in "".join(pieces)


@pytest.mark.parametrize("stop,expected", [
    ("日本語", "Le café naïve — "),
    ("🚀", "Le café naïve — 日本語のテキスト 🙂"),
    ("straße;", "Le café naïve — 日本語のテキスト 🙂🚀 and "),
])
def test_stop_strings_match_across_token_boundaries(tokenizer: HFTokenizer, stop: str, expected: str) -> None:
    ids = tokenizer.encode(TEXT)
    request = Request(ScriptedGenerator(ids), SearchSettings(stop=(stop,)), tokenizer, 0)
    pieces = run(request)
    assert request.finish_reason == "stop"
    assert "".join(pieces) == request.text == expected
    assert request.result().text == expected


def test_bursts_of_tokens_give_the_chunks_of_single_steps(tokenizer: HFTokenizer) -> None:
    ids = tokenizer.encode(TEXT)
    single = chunks_of(Request(ScriptedGenerator(ids), SearchSettings(), tokenizer, 0))
    for burst in (2, 5, len(ids)):
        request = Request(ScriptedGenerator(ids, burst=burst), SearchSettings(), tokenizer, 0)
        assert chunks_of(request) == single
        assert request.text == TEXT and request.timings.new_tokens == len(ids)


def test_a_request_bounds_what_a_burst_of_decode_steps_may_select(tokenizer: HFTokenizer) -> None:
    """Tokens a burst selects past where the request stops would sit in the cache: none may."""
    ids = tokenizer.encode(TEXT)[:6]
    gen = ScriptedGenerator(ids)
    run(Request(gen, SearchSettings(), tokenizer, 0))
    assert gen.budgets == [None] * 6  # no limit of its own: the generator's length limit bounds it
    gen = ScriptedGenerator(ids)
    run(Request(gen, SearchSettings(), tokenizer, 0, max_new_tokens=4))  # a chat turn's budget
    assert gen.budgets == [4, 3, 2, 1]
    gen = ScriptedGenerator(ids)
    run(Request(gen, SearchSettings(stop=("@@",)), tokenizer, 0))
    assert gen.budgets == [1] * 6  # the text decides after every token


def test_a_stop_string_that_never_completes_is_released(tokenizer: HFTokenizer) -> None:
    ids = tokenizer.encode("naïve caf")
    request = Request(ScriptedGenerator(ids), SearchSettings(stop=("café!",)), tokenizer, 0)
    assert "".join(run(request)) == "naïve caf"
    assert request.finish_reason == "length"
