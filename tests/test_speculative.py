"""Speculative decoding (loops/speculative.py; the CPython driver's speculate.py).

Greedy decoding with drafts (prompt lookup, or a draft model) checked in one run must give the
tokens of plain greedy decoding, on the fused path (rounds inside the driver's bursts: plain greedy
ones, and ones that select by a pick, forced with `min_length=1`, a processor that changes nothing
after a prompt) and on the core's own rounds (forced with a `no_repeat_ngram_size` longer than any
text, which bans nothing and is not fused);
speculative sampling must keep the distribution of plain sampling (checked against the exact
distribution, computed by hand with onnxruntime) and be reproducible from its seed.
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest
from build import draft_models, variants
from build.references import prompt_ids

import ortpipe
from ortpipe.errors import ConfigError, GenerationError, OrtpipeError
from ortpipe.loops.speculative import ROUND, SHADOW_STEPS, DraftLength, NgramIndex
from tests.handloop import _run, _step_feeds, empty_pasts

NEW = 48
LOOKUP = ({"prompt_lookup_num_tokens": 4}, {"ngram_size": 3, "max_draft_tokens": 8})
# fused rounds in the driver's bursts, plain greedy and by a pick; the core's rounds
PATHS = ({}, {"min_length": 1}, {"no_repeat_ngram_size": 10_000})
CORE = PATHS[2]
REPO = Path(__file__).resolve().parent.parent
DEMO = REPO / "models" / "demo"


@pytest.fixture(autouse=True)
def unclocked(monkeypatch: pytest.MonkeyPatch) -> None:
    """The draft length from the guessed cost of longer runs, not from the driver's clock: rounds that
    do not depend on how busy the machine is (tokens never do)."""
    monkeypatch.setattr(DraftLength, "timed", lambda *_: None)
    monkeypatch.setattr(DraftLength, "drafted", lambda *_: None)


@pytest.fixture(scope="session")
def llama_draft_builder() -> Path:
    return draft_models.get("llama-draft-builder")


@pytest.fixture(scope="session")
def llama_draft_concat() -> Path:
    return draft_models.get("llama-draft-concat")


@pytest.fixture(scope="session")
def demo_draft() -> Path:
    return draft_models.get("demo-draft-builder")


def repeating(folder: Path) -> list[int]:
    """The test prompt and its start again: text a model may go on copying."""
    ids = prompt_ids(folder)
    return ids + ids[:20]


@pytest.mark.parametrize("model", ["llama_builder_fp32", "llama_builder_int4", "qwen2_builder",
                                   "phi3_builder", "llama_concat"])
def test_greedy_with_prompt_lookup_equals_greedy(model: str, request: pytest.FixtureRequest,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    # every round drafts all it may, whatever acceptance was: the checks are what is tested here
    monkeypatch.setattr(DraftLength, "best", lambda self, most, source=0: most)
    folder = request.getfixturevalue(model)
    ids = repeating(folder)
    pipe = ortpipe.load(folder, threads=1)
    plain = pipe.generate(prompt_ids=ids, max_new_tokens=NEW)
    assert plain.timings.drafted_tokens == 0
    for settings in LOOKUP:
        for path in PATHS:
            got = pipe.generate(prompt_ids=ids, max_new_tokens=NEW, **settings, **path)
            assert got.tokens == plain.tokens, (settings, path)
            assert got.finish_reason == plain.finish_reason
            t = got.timings
            # the core's rounds run with kernels; the driver's as fused steps
            assert t.drafted_tokens > 0
            assert t.fused_steps < NEW - 1 if path is CORE else t.fused_steps == NEW - 1
            if model in ("llama_builder_fp32", "llama_concat", "qwen2_builder"):  # their text loops
                assert 0 < t.accepted_tokens <= t.drafted_tokens


@pytest.mark.parametrize(("model", "draft"), [("llama_builder_fp32", "llama_draft_builder"),
                                              ("llama_concat", "llama_draft_concat"),
                                              ("llama_builder_fp32", "llama_draft_concat")])
def test_greedy_with_a_draft_model_equals_greedy(model: str, draft: str,
                                                 request: pytest.FixtureRequest) -> None:
    """A one-layer cut of the model drafts (mostly rejected), and the model itself (accepted)."""
    folder, cut = request.getfixturevalue(model), request.getfixturevalue(draft)
    ids = prompt_ids(folder)
    pipe = ortpipe.load(folder, threads=1)
    plain = pipe.generate(prompt_ids=ids, max_new_tokens=NEW)
    for drafter in (cut, folder):
        for path in PATHS:
            got = pipe.generate(prompt_ids=ids, max_new_tokens=NEW, draft_model=str(drafter), **path)
            assert got.tokens == plain.tokens, (drafter, path)
            assert got.timings.drafted_tokens > 0
            if drafter == folder:
                assert got.timings.accepted_tokens == got.timings.drafted_tokens
    assert len(pipe.model.drafts) == 2, "each draft model is loaded once"


@pytest.fixture(scope="session")
def demo_fp32(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo folder beside its fp32 graph (its int4 graph dequantized, build/variants.py)."""
    folder = tmp_path_factory.mktemp("demo") / "demo"
    shutil.copytree(DEMO, folder)
    variants.main([str(folder), "--file", "onnx/model_q4.onnx", "--from-q4", "--dtypes", ""])
    return folder


def test_demo_model_with_prompt_lookup_and_a_draft_model(demo_fp32: Path, demo_draft: Path) -> None:
    # on its fp32 graph: the int4 one (accuracy level 4) checks several rows with another kernel,
    # and where its two best logits are within a few hundredths the checks may choose the other
    pipe = ortpipe.load(demo_fp32, threads=1, dtype="fp32")
    code = (REPO / "py" / "ortpipe" / "lifecycle.py").read_text()[1500:2200]
    prompt = code + "\n\n" + code[:200]
    greedy = {"do_sample": False, "max_new_tokens": 64}
    plain = pipe.generate(prompt, **greedy)
    for settings in (*LOOKUP, {"draft_model": str(demo_draft)}, {"draft_model": str(demo_fp32)}):
        for path in PATHS:
            got = pipe.generate(prompt, **greedy, **settings, **path)
            assert (got.tokens, got.text) == (plain.tokens, plain.text), (settings, path)
            assert got.timings.drafted_tokens > 0
            if "draft_model" not in settings or settings["draft_model"] == str(demo_fp32):
                assert got.timings.accepted_tokens > 0


def test_short_budgets_streams_and_interrupts(llama_builder_fp32: Path) -> None:
    ids = repeating(llama_builder_fp32)
    pipe = ortpipe.load(llama_builder_fp32, threads=1)
    plain = pipe.generate(prompt_ids=ids, max_new_tokens=NEW)
    settings = {"prompt_lookup_num_tokens": 8}
    for n in range(1, 10):  # max length inside a round: drafts never run past it
        assert pipe.generate(prompt_ids=ids, max_new_tokens=n, **settings).tokens == plain.tokens[:n]
    long = pipe.generate(prompt_ids=ids, max_length=len(ids) + 17, **settings)
    assert (long.tokens, long.finish_reason) == (plain.tokens[:17], "length")
    chunks = list(pipe.stream(prompt_ids=ids, max_new_tokens=NEW, **settings))
    assert [c.token for c in chunks] == plain.tokens
    assert "".join(c.text for c in chunks) == plain.text
    pipe.model.backend.decode_burst = 4  # an interrupt lands after the burst being computed
    request = pipe.request(prompt_ids=ids, max_new_tokens=NEW, **settings)
    seen = []
    for chunk in pipe.drive(request):
        seen.append(chunk.token)
        if len(seen) == 3:
            request.interrupt()
    result = request.result()
    assert result.finish_reason == "interrupt"
    assert 3 <= len(result.tokens) < NEW and result.tokens == plain.tokens[:len(result.tokens)]


def test_stop_strings_and_eos_inside_an_accepted_run(llama_builder_fp32: Path, tmp_path: Path) -> None:
    """A burst of accepted drafts that passes a stop string is taken back to it; an eos among the
    accepted tokens ends the request there."""
    ids = repeating(llama_builder_fp32)
    pipe = ortpipe.load(llama_builder_fp32, threads=1)
    plain = pipe.generate(prompt_ids=ids, max_new_tokens=NEW)
    stop = plain.text[30:33]
    expected = pipe.generate(prompt_ids=ids, max_new_tokens=NEW, stop=stop)
    assert expected.finish_reason == "stop" and len(expected.tokens) < NEW
    for path in PATHS:
        request = pipe.request(prompt_ids=ids, max_new_tokens=NEW, stop=stop, prompt_lookup_num_tokens=8,
                               **path)
        chunks = list(pipe.drive(request))
        got = request.result()
        assert (got.tokens, got.text, got.finish_reason) == (expected.tokens, expected.text, "stop")
        assert [c.token for c in chunks] == got.tokens and "".join(c.text for c in chunks) == got.text
        assert request.gen.tokens == ids + got.tokens, "the generator took back what followed the stop"
        assert request.gen.flow.position == len(ids) + len(got.tokens) - 1
    at = max(plain.tokens.index(t) for t in plain.tokens)  # the last token that is new there
    assert at >= 5
    copy = tmp_path / "eos"
    shutil.copytree(llama_builder_fp32, copy)
    config = json.loads((copy / "genai_config.json").read_text())
    config["model"]["eos_token_id"] = plain.tokens[at]
    (copy / "genai_config.json").write_text(json.dumps(config))
    pipe = ortpipe.load(copy, threads=1)
    for settings in ({"draft_model": str(copy)}, {"prompt_lookup_num_tokens": 8}):  # the draft: the model
        for path in PATHS:
            got = pipe.generate(prompt_ids=ids, max_new_tokens=NEW, **settings, **path)
            assert (got.tokens, got.finish_reason) == (plain.tokens[: at + 1], "eos"), (settings, path)


@pytest.fixture(scope="module")
def chat_model(llama_builder_fp32: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("chat") / "llama"
    shutil.copytree(llama_builder_fp32, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = ("{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n"
                               "{% endfor %}{% if add_generation_prompt %}<s>assistant\n{% endif %}")
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def test_chat_turns_and_rewinds_with_speculation(chat_model: Path, llama_draft_builder: Path) -> None:
    pipe = ortpipe.load(chat_model, threads=1)
    turns = ["def count_words(path):", "Now sort the words by count.", "And print the top ten?"]

    def conversation(**settings: Any) -> list[list[int]]:
        chat = pipe.chat(max_length=400, **settings)
        replies = [[c.token for c in chat.say(turn, max_new_tokens=16)] for turn in turns[:2]]
        chat.rewind()
        replies += [[c.token for c in chat.say(turn, max_new_tokens=16)] for turn in turns[1:]]
        assert replies[1] == replies[2]
        return replies

    plain = conversation()
    assert conversation(prompt_lookup_num_tokens=4) == plain
    assert conversation(draft_model=str(chat_model)) == plain
    assert conversation(draft_model=str(llama_draft_builder), min_length=1) == plain


def test_a_failure_mid_verification_puts_the_request_in_error(llama_builder_fp32: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    ids = repeating(llama_builder_fp32)
    pipe = ortpipe.load(llama_builder_fp32, threads=1)
    plain = pipe.generate(prompt_ids=ids, max_new_tokens=NEW).tokens
    driver, fused_run, runs = pipe.driver, pipe.driver._fused_run, []

    def failing(d: Any, position: int, run: Any, *args: Any) -> Any:
        runs.append(position)
        if len(runs) == 6:
            def run(*_: Any) -> Any:
                raise RuntimeError("the device is gone")
        return fused_run(d, position, run, *args)

    monkeypatch.setattr(driver, "_fused_run", failing)
    request = pipe.request(prompt_ids=ids, max_new_tokens=NEW, prompt_lookup_num_tokens=8)
    with pytest.raises(OrtpipeError, match="failed on a decode step at position .*the device is gone") as e:
        list(pipe.drive(request))
    assert request.failed and request.gen.state == "error"
    assert e.value.partial.tokens == plain[: len(e.value.partial.tokens)] and e.value.partial.tokens
    with pytest.raises(GenerationError, match="an earlier step of this generation failed"):
        list(pipe.drive(request))
    monkeypatch.undo()
    assert pipe.generate(prompt_ids=ids, max_new_tokens=NEW, prompt_lookup_num_tokens=8).tokens == plain


def test_what_speculation_refuses(gemma_builder: Path, llama_builder_fp32: Path, demo_draft: Path) -> None:
    gemma = ortpipe.load(gemma_builder, threads=1)
    with pytest.raises(GenerationError, match="speculative decoding needs .*cache slides"):
        gemma.generate(prompt_ids=[5, 6, 7], max_new_tokens=4, prompt_lookup_num_tokens=4)
    pipe = ortpipe.load(llama_builder_fp32, threads=1)
    with pytest.raises(GenerationError, match="must have the model's tokenizer: their tokenizer.json vocab"):
        pipe.generate(prompt_ids=[5, 6, 7], max_new_tokens=4, draft_model=str(demo_draft))
    with pytest.raises(GenerationError, match="cannot draft together"):
        pipe.generate(prompt_ids=[5, 6, 7], max_new_tokens=4, draft_model=str(llama_builder_fp32),
                      ngram_size=2)
    with pytest.raises(GenerationError, match="beam search with speculative decoding"):
        pipe.generate(prompt_ids=[5, 6, 7], max_new_tokens=4, num_beams=2, prompt_lookup_num_tokens=4)
    with pytest.raises(GenerationError, match="model folder /nowhere does not exist"):
        pipe.generate(prompt_ids=[5, 6, 7], max_new_tokens=4, draft_model="/nowhere")
    with pytest.raises(GenerationError, match="draft_model must be a folder's path"):
        pipe.generate(prompt_ids=[5, 6, 7], max_new_tokens=4, draft_model="")


def test_configs_and_the_cli(llama_builder_fp32: Path, llama_draft_builder: Path, tmp_path: Path) -> None:
    """onnxruntime-genai's v1 `speculative` block; a v2 config whose draft model lies in the folder;
    the CLI's flags."""
    ids = repeating(llama_builder_fp32)
    plain = ortpipe.load(llama_builder_fp32, threads=1).generate(prompt_ids=ids, max_new_tokens=NEW)
    v1 = tmp_path / "v1"
    shutil.copytree(llama_builder_fp32, v1)
    config = json.loads((v1 / "genai_config.json").read_text())
    config["speculative"] = {"ngram_size": 3, "max_draft_tokens": 6, "cooldown": False}
    (v1 / "genai_config.json").write_text(json.dumps(config))
    got = ortpipe.load(v1, threads=1).generate(prompt_ids=ids, max_new_tokens=NEW)
    assert got.tokens == plain.tokens and got.timings.drafted_tokens > 0
    v2 = tmp_path / "v2"
    shutil.copytree(llama_builder_fp32, v2)
    shutil.copytree(llama_draft_builder, v2 / "draft")
    config = {"version": 2, "pipeline": {"extends": "autoregressive-decoder",
                                         "sessions": {"decoder": {"file": "model.onnx"}}},
              "tokens": {"eos": [2]}, "generation": {"speculative": {"draft_model": "draft"}}}
    (v2 / "genai_config.json").write_text(json.dumps(config))
    pipe = ortpipe.load(v2, threads=1)
    got = pipe.generate(prompt_ids=ids, max_new_tokens=NEW)
    assert got.tokens == plain.tokens and got.timings.drafted_tokens > 0
    assert list(pipe.model.drafts) == [str(v2 / "draft")]
    assert "draft1/decoder" in pipe.driver.sessions, "the draft's sessions are named apart"
    config["generation"]["speculative"]["draft_model"] = "../draft"
    (v2 / "genai_config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="speculative.draft_model: .* not a path inside the model folder"):
        ortpipe.load(v2)
    ids_arg = ",".join(map(str, ids))
    for flags in (["--prompt-lookup-num-tokens", "4"], ["--draft-model", str(llama_draft_builder)]):
        command = [sys.executable, "-m", "ortpipe.cli", "run", str(llama_builder_fp32), "--prompt-ids",
                   ids_arg, "--max-new-tokens", str(NEW), "--threads", "1", "--json", *flags]
        out = subprocess.run(command, capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        result = json.loads(out.stdout)
        assert result["tokens"] == plain.tokens and result["timings"]["drafted_tokens"] > 0


# Speculative sampling keeps the distribution: generated sequences are counted over many seeds and
# compared with the exact distribution, computed from logits of plain onnxruntime runs.

SAMPLED = {"do_sample": True, "temperature": 1.0, "top_k": 4}
SEEDS = 3000


def exact_distribution(folder: Path, ids: list[int], n: int) -> dict[tuple[int, ...], float]:
    """The probability of every sequence of n tokens after `ids` under SAMPLED (top-k, ties with the
    k-th kept, then temperature), from full reruns of the graph with empty pasts."""
    session = ort.InferenceSession(str(folder / "model.onnx"), providers=["CPUExecutionProvider"])

    def next_probs(seq: list[int]) -> dict[int, float]:
        logits = _run(session, _step_feeds(session, seq, len(seq)) | empty_pasts(session))["logits"][0, -1]
        logits = logits.astype(np.float64)
        kth = np.sort(logits)[-SAMPLED["top_k"]]
        kept = np.flatnonzero(logits >= kth)
        weights = np.exp((logits[kept] - logits.max()) / SAMPLED["temperature"])
        return dict(zip(kept.tolist(), (weights / weights.sum()).tolist(), strict=True))

    sequences = {(): 1.0}
    for _ in range(n):
        sequences = {seq + (t,): p * q for seq, p in sequences.items()
                     for t, q in next_probs(ids + list(seq)).items()}
    return sequences


def chi_square_p(observed: Counter, expected: dict[tuple[int, ...], float], total: int) -> float:
    """The p-value of Pearson's chi-square test (Wilson-Hilferty's approximation), cells expected
    fewer than 5 times pooled into one."""
    cells, pooled_o, pooled_e = [], 0, 0.0
    for seq, p in expected.items():
        if p * total >= 5:
            cells.append((observed.get(seq, 0), p * total))
        else:
            pooled_o, pooled_e = pooled_o + observed.get(seq, 0), pooled_e + p * total
    cells.append((pooled_o + sum(c for s, c in observed.items() if s not in expected), pooled_e))
    statistic = sum((o - e) ** 2 / e for o, e in cells if e > 0)
    k = len(cells) - 1
    z = ((statistic / k) ** (1 / 3) - (1 - 2 / (9 * k))) / math.sqrt(2 / (9 * k))
    return 0.5 * math.erfc(z / math.sqrt(2))


@pytest.mark.parametrize("path", [{}, CORE], ids=["fused", "core"])
def test_speculative_sampling_keeps_the_distribution(llama_concat: Path, llama_draft_concat: Path,
                                                     monkeypatch: pytest.MonkeyPatch, path: dict) -> None:
    """Prompt lookup's drafts come from text the model sampled before (here mostly outside the top k:
    rejected); a draft model samples its drafts from its own distribution with the uniforms of their
    positions (the model's first layers: accepted or not; the model itself: nearly always accepted,
    as q = p). Every round drafts all it may: the acceptance rule is what is tested, in the driver's
    rounds (numpy) and the core's (kernels)."""
    monkeypatch.setattr(DraftLength, "best", lambda self, most, source=0: most)
    pipe = ortpipe.load(llama_concat, threads=1)
    start = prompt_ids(llama_concat)[:20]
    ids = start + pipe.generate(prompt_ids=start, max_new_tokens=60, seed=0, **SAMPLED).tokens
    expected = exact_distribution(llama_concat, ids, 3)
    for settings in ({}, {"prompt_lookup_num_tokens": 2}, {"draft_model": str(llama_draft_concat)},
                     {"draft_model": str(llama_concat)}):
        counts: Counter = Counter()
        drafted = accepted = 0
        for seed in range(SEEDS):
            got = pipe.generate(prompt_ids=ids, max_new_tokens=3, seed=seed, **SAMPLED, **settings, **path)
            counts[tuple(got.tokens)] += 1
            drafted, accepted = drafted + got.timings.drafted_tokens, accepted + got.timings.accepted_tokens
        assert drafted > SEEDS // 2 if settings else drafted == 0
        if settings.get("draft_model") == str(llama_draft_concat):
            assert 0 < accepted < drafted, "drafts were both accepted and rejected"
        elif "draft_model" in settings:
            assert accepted > 0.99 * drafted, (accepted, drafted)  # its own distribution, the same draws
        p = chi_square_p(counts, expected, SEEDS)
        assert p > 1e-3, (settings, p, counts.most_common(8))


@pytest.mark.parametrize("drafting", ["lookup", "draft model", "itself"])
def test_speculative_sampling_gives_plain_sampling_s_tokens(llama_builder_fp32: Path,
                                                             llama_draft_builder: Path,
                                                             monkeypatch: pytest.MonkeyPatch,
                                                             drafting: str) -> None:
    """Each position's token is drawn with the uniform plain sampling draws there (a draft model draws
    its drafts with the same ones), and drafts equal to them are kept: a seeded run's tokens are
    plain sampling's, whatever the rounds drafted (drafting as DraftLength says, or all it may), in
    the driver's rounds and in the core's."""
    ids = repeating(llama_builder_fp32)
    pipe = ortpipe.load(llama_builder_fp32, threads=1)
    speculation = {"lookup": {"prompt_lookup_num_tokens": 4},
                   "draft model": {"draft_model": str(llama_draft_builder)},
                   "itself": {"draft_model": str(llama_builder_fp32)}}[drafting]
    sampled = {**SAMPLED, "temperature": 0.5}
    penalties = {"frequency_penalty": 0.4, "presence_penalty": 0.3}
    for path in ({}, {"repetition_penalty": 1.3}, penalties, CORE, {**CORE, **penalties}):
        plain = {seed: pipe.generate(prompt_ids=ids, max_new_tokens=NEW, seed=seed, **sampled, **path).tokens
                 for seed in (1, 2)}
        assert plain[1] != plain[2]
        for every_draft in (False, True):
            if every_draft:
                monkeypatch.setattr(DraftLength, "best", lambda self, most, source=0: most)
            drafted = accepted = 0
            for seed in (1, 2):
                got = pipe.generate(prompt_ids=ids, max_new_tokens=NEW, seed=seed, **sampled, **path,
                                    **speculation)
                assert got.tokens == plain[seed], (path, every_draft, seed)
                assert (got.timings.fused_steps == NEW - 1) == ("no_repeat_ngram_size" not in path)
                drafted += got.timings.drafted_tokens
                accepted += got.timings.accepted_tokens
            if every_draft:
                assert drafted > 0, path
                if drafting == "itself":
                    assert accepted == drafted, path
                elif not path:  # (the penalty keeps the text from repeating; the core's looks wait longer)
                    assert 0 < accepted < drafted
            monkeypatch.undo()
            monkeypatch.setattr(DraftLength, "timed", lambda *_: None)
            monkeypatch.setattr(DraftLength, "drafted", lambda *_: None)


def test_prompt_lookup_drafts() -> None:
    index = NgramIndex(3)
    assert index.propose([1, 2, 3, 4, 1, 2], 3) == [3, 4, 1]  # after the latest earlier (1, 2)
    assert index.propose([1, 2, 3, 4, 1, 2, 3, 9], 3) == []  # nothing ever followed 9
    assert index.propose([1, 2, 3, 4, 1, 2, 3, 9, 1], 2) == [2, 3]  # only (9, 1) is new: a 1-gram match
    assert NgramIndex(2).propose([5, 6, 5, 6], 5) == [5, 6, 5, 6, 5], "a copy goes on over what it copied"
    index = NgramIndex(2)
    assert index.propose([7, 8, 7], 2) == [8, 7]
    assert index.propose([7, 3], 2) == [], "a shorter text (a rewind) starts the index over"


def test_the_draft_length_follows_acceptance_and_cost() -> None:
    assert DraftLength(8, sources=3).best(8, 2) == 1, "the prior (2/3 taken, 0.4 a token): one draft"
    # prompt lookup with 3-grams (a source per match length), sampled
    length = DraftLength(8, sources=3, sampled=True)
    assert length.next(20) == 0 and length.wait == SHADOW_STEPS - 1, (
        "the prior (1/3 taken, 0.4 a token): plain steps, lookup's proposals checked in their shadow")
    length.wait = 0
    for _ in range(10):
        length.shadow(2, True)  # plain steps that chose what a 3-gram match proposed
    assert length.next(20) == 8 and 0 < length.fit(2, 8) < 8, "the shadows found drafts that pay"
    for _ in range(10):
        length.update(8, 8)  # drafts after 3-gram matches, all taken
    assert length.next(20) == 8 and length.fit(2, 8) == 8, "high acceptance: as many as allowed"
    assert length.next(3) == 3 and length.fit(2, 3) == 3
    assert length.fit(0, 8) == 0, "1-gram matches keep their own count"
    for _ in range(10):
        length.shadow(0, False)  # plain steps where a 1-gram proposal was not the token chosen
    assert length.fit(0, 8) == 0 and length.fit(2, 8) == 8
    length.extras.extend([2.0] * 15)  # measured: each more token costs two steps
    assert length.best(8, 2) == 0, "nothing pays"
    steps = 2 * SHADOW_STEPS + 1
    got = [length.next(20) for _ in range(steps)]
    assert got == [0] * steps, "plain steps, their proposals checked in their shadow"
    assert length.wait == SHADOW_STEPS - 1, "looked again every SHADOW_STEPS steps"
    even, core = DraftLength(8), DraftLength(8)
    even.hits[0] = even.misses[0] = core.hits[0] = core.misses[0] = 1.0  # drafts taken half the time
    core.overhead = ROUND  # the rounds the core runs, with kernels, cost more: they no longer pay
    assert even.best(8) == 1 and core.best(8) == 0
    waits = []
    for _ in range(4):  # looks that draft nothing, where each ends a burst of fused steps: longer waits
        assert core.next(20) == 0
        waits.append(core.wait + 1)
        core.wait = 0
    assert waits == [8, 16, 32, 32]
    core.hits[0] = 50.0  # drafts that pay again: the next fruitless look waits SHADOW_STEPS
    assert core.next(20) == 8 and core.fit(0, 8) > 0
    core.hits[0], core.misses[0] = 1.0, 5.0
    assert core.next(20) == 0 and core.wait == SHADOW_STEPS - 1
    length = DraftLength(8, model=True)  # a draft model: its proposals cost a run, so it probes
    for _ in range(12):
        length.update(2, 0)
    got = []
    for _ in range(12):
        k = length.next(20)
        got.append(length.fit(0, k) if k else 0)
    assert got == [1, 0, 1, 0, 0, 1, 0, 0, 0, 0, 1, 0], "one-token probes, the pauses doubling"
    length = DraftLength(4, model=True)  # probes whose drafts are all taken grow: 1, 2, 4, 4
    length.extras.extend([2.0] * 15)  # where no round pays
    probes = []
    while len(probes) < 4:
        k = length.next(20)
        if k:
            probes.append(length.fit(0, k))
            length.update(probes[-1], probes[-1] if len(probes) < 4 else 0)
    assert probes == [1, 2, 4, 4] and length.probe == 1, "a rejection starts the probes at one again"
    length = DraftLength(8, model=True)
    length.drafts.extend([1.2] * 15)  # a draft model's step dearer than the model's: nothing could pay
    pauses = []
    for _ in range(9):
        while length.next(20) == 0:
            pass
        pauses.append(length.pause)
    length.wait = 0
    assert pauses == [128] * 9, "probes only watch for costs that change, after a first pause"
    assert length.probing
    length.drafts.extend([0.3] * 15)  # cheap again: a probe every 16 steps at most
    assert length.next(20) and length.pause == 16


def test_a_config_that_speculates_on_a_sliding_cache_is_refused_at_load(gemma_builder: Path,
                                                                          tmp_path: Path) -> None:
    folder = tmp_path / "gemma"
    shutil.copytree(gemma_builder, folder)
    config = json.loads((folder / "genai_config.json").read_text())
    config["speculative"] = {"ngram_size": 3}
    (folder / "genai_config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="speculative decoding, which this model cannot run: its KV cache"):
        ortpipe.load(folder)


def test_measured_costs_carry_over_to_the_next_request(llama_builder_fp32: Path, llama_draft_builder: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """What runs cost is measured by the driver and kept per model and draft model: a request starts
    from what the ones before it measured."""
    monkeypatch.undo()  # the driver's clock
    ids = repeating(llama_builder_fp32)
    pipe = ortpipe.load(llama_builder_fp32, threads=1)
    costs = pipe.model.backend.speculation_costs
    pipe.generate(prompt_ids=ids, max_new_tokens=NEW, prompt_lookup_num_tokens=4)
    pipe.generate(prompt_ids=ids, max_new_tokens=NEW, draft_model=str(llama_draft_builder))
    assert len(costs) == 2 and all(len(ones) > 0 for ones, _, _ in costs.values()), "one entry a draft model"
    request = pipe.request(prompt_ids=ids, max_new_tokens=NEW, prompt_lookup_num_tokens=4, do_sample=True)
    length = request.gen.speculator.length
    assert any(length.ones is ones and length.extras is extras for ones, extras, _ in costs.values())
    list(pipe.drive(request))
    assert len(costs) == 2


def test_a_prediction_is_proposed_where_the_text_follows_it() -> None:
    """NgramIndex.predict: proposals continue the prediction at the longest n-gram ending the text, from
    where the last one began on; the text's own lookup when the prediction has no match."""
    index = NgramIndex(3)
    index.predict([10, 11, 12, 13, 11, 14, 15])
    assert index.propose([1, 2, 10], 3) == [11, 12, 13] and index.from_reference
    assert index.propose([1, 2, 10, 11, 12, 13, 11], 3) == [14, 15]  # the 11 after 13, not the first
    assert index.propose([1, 2, 10, 11, 12, 13, 11, 14, 15], 3) == []  # the end of the prediction
    assert index.propose([5, 6, 7, 5, 6], 2) == [7, 5] and not index.from_reference  # the text's lookup
