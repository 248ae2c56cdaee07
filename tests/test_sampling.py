"""Sampling kernels and processors: tiny exact cases, and transformers' processors as the reference."""

from __future__ import annotations

import numpy as np
import pytest

from ortpipe.config.settings import SearchSettings
from ortpipe.errors import GenerationError
from ortpipe.execute.work import Run
from ortpipe.sampling.processors import banned_ids, ngram_bans
from ortpipe.sampling.sampler import Sampler
from ortpipe.sampling.settings import settings_for
from ortpipe.targets.cpython import CpuBackend, Driver

INF = float("inf")


def kernel_backend() -> CpuBackend:
    """A CPU backend whose sampler selects with the kernel graphs (the generic path these tests check),
    not as the driver's fused steps do (`Select`, tests/test_fused_sampling.py)."""
    backend = CpuBackend()
    backend.fused_sampling = False
    return backend


def select(logits: np.ndarray, tokens: list[int] | None = None, generated: int = 1, eos=frozenset(),
           **settings) -> int:
    sampler = Sampler(kernel_backend(), str(logits.dtype), SearchSettings(**settings), frozenset(eos))
    return Driver().drive(sampler.select(logits[None, None], tokens or [], generated))


def scores(logits: np.ndarray, tokens: list[int] | None = None, **settings) -> np.ndarray:
    s = SearchSettings(**settings)
    sampler = Sampler(kernel_backend(), "float32", s, frozenset())
    sampler._vocab = logits.shape[-1]
    tokens = tokens or []
    work = sampler.scores(
        logits[None, None].astype(np.float32), [tokens], [banned_ids(s, tokens, 1, frozenset())]
    )
    return Driver().drive(work)[0]


LOGITS = np.array([1.0, -2.0, 3.0, 0.5, 2.0], dtype=np.float32)


def test_greedy_is_the_argmax() -> None:
    assert select(LOGITS) == 2


def test_repetition_penalty_divides_positive_and_multiplies_negative() -> None:
    out = scores(LOGITS, tokens=[2, 1, 2], repetition_penalty=2.0)
    assert out.tolist() == [1.0, -4.0, 1.5, 0.5, 2.0]
    assert select(LOGITS, tokens=[2], repetition_penalty=2.0) == 4


def test_temperature_scales() -> None:
    out = scores(LOGITS, do_sample=True, temperature=0.5)
    assert np.allclose(out, LOGITS / 0.5)


def test_top_k_keeps_the_k_best() -> None:
    out = scores(LOGITS, do_sample=True, top_k=2)
    assert out.tolist() == [-INF, -INF, 3.0, -INF, 2.0]


def test_top_p_keeps_the_smallest_set_reaching_p() -> None:
    probs = np.exp(LOGITS) / np.exp(LOGITS).sum()  # 0.085, 0.004, 0.628, 0.052, 0.231
    assert probs[2] < 0.8 < probs[2] + probs[4]
    out = scores(LOGITS, do_sample=True, top_p=0.8)
    assert out.tolist() == [-INF, -INF, 3.0, -INF, 2.0]


def test_min_p_drops_unlikely_tokens() -> None:
    out = scores(LOGITS, do_sample=True, min_p=0.2)  # floor: 0.2 * p(3.0); p(2.0) / p(3.0) = e^-1 > 0.2
    assert out.tolist() == [-INF, -INF, 3.0, -INF, 2.0]


def test_no_repeat_ngram_bans_completions() -> None:
    assert ngram_bans([1, 2, 3, 1, 2], 3) == [3]
    assert ngram_bans([1, 2, 1, 2, 1], 2) == [2, 2]
    assert select(LOGITS, tokens=[4, 2, 4], no_repeat_ngram_size=2) == 4  # (4, 2) was seen: 2 is banned


def test_min_new_tokens_and_suppressed_tokens() -> None:
    assert select(LOGITS, generated=0, eos={2}, min_new_tokens=1) == 4
    assert select(LOGITS, generated=1, eos={2}, min_new_tokens=1) == 2
    assert select(LOGITS, tokens=[7, 7], eos={2}, min_length=3) == 4
    assert select(LOGITS, suppress_tokens=(2, 4)) == 0


def test_top_k_one_sampling_equals_greedy() -> None:
    rng = np.random.default_rng(0)
    for seed in range(20):
        logits = rng.standard_normal(50).astype(np.float32)
        assert select(logits, do_sample=True, top_k=1, seed=seed) == int(logits.argmax())


def test_seeded_sampling_repeats_and_follows_the_distribution() -> None:
    logits = np.log(np.array([0.1, 0.6, 0.3], dtype=np.float32))
    driver = Driver()
    sampler = Sampler(CpuBackend(), "float32", SearchSettings(do_sample=True, seed=3), frozenset())
    draws = [driver.drive(sampler.select(logits[None, None], [], 1)) for _ in range(3000)]
    again = Sampler(CpuBackend(), "float32", SearchSettings(do_sample=True, seed=3), frozenset())
    assert draws[:50] == [driver.drive(again.select(logits[None, None], [], 1)) for _ in range(50)]
    freq = np.bincount(draws, minlength=3) / len(draws)
    assert np.allclose(freq, [0.1, 0.6, 0.3], atol=0.03)


def test_the_sampler_asks_for_kernels_in_order() -> None:
    settings = SearchSettings(do_sample=True, top_k=5, top_p=0.9, min_p=0.1)
    sampler = Sampler(kernel_backend(), "float16", settings, frozenset())
    work = sampler.select(np.zeros((1, 1, 10), np.float16), [], 1)
    names = []
    request = next(work)
    try:
        while True:
            assert isinstance(request, Run)
            names.append(request.session)
            reply = Driver().run(request)
            request = work.send(reply)
    except StopIteration:
        pass
    assert names == [
        "kernel:process_float16",
        "kernel:top_k_float32",
        "kernel:top_p_float32",
        "kernel:min_p_float32",
        "kernel:sample_float32",
    ]


@pytest.mark.parametrize(
    "settings,message",
    [
        ({"temperature": -1.0}, "temperature -1.0 is out of range: at least 0"),
        ({"top_p": 0.0}, "top_p 0.0 is out of range: more than 0 and at most 1"),
        ({"top_p": 1.5}, "top_p 1.5 is out of range: more than 0 and at most 1"),
        ({"num_beams": 0}, "num_beams 0 is out of range: at least 1"),
        ({"stop": ("",)}, "stop must be a non-empty string or a list of them"),
        ({"top_k": -3}, "top_k -3 is out of range: at least 0"),
        ({"repetition_penalty": 0.0}, "repetition_penalty 0.0 is out of range: more than 0"),
    ],
)
def test_bad_settings_are_refused(settings: dict, message: str) -> None:
    with pytest.raises(GenerationError) as info:
        settings_for(SearchSettings(), settings)
    assert message in str(info.value)


# transformers' processors on random inputs: the reference.

torch = pytest.importorskip("torch")
hf = pytest.importorskip("transformers.generation.logits_process")


@pytest.mark.parametrize("seed", range(5))
def test_matches_transformers_processors(seed: int) -> None:
    rng = np.random.default_rng(seed)
    vocab = 64
    logits = (rng.standard_normal(vocab) * 3).astype(np.float32)
    tokens = rng.integers(0, vocab, 12).tolist()
    ids = torch.tensor([tokens])
    ref = torch.tensor(logits[None])
    ref = hf.RepetitionPenaltyLogitsProcessor(1.3)(ids, ref)
    ref = hf.NoRepeatNGramLogitsProcessor(2)(ids, ref)
    ref = hf.TemperatureLogitsWarper(0.7)(ids, ref)
    ref = hf.TopKLogitsWarper(20)(ids, ref)
    ref = hf.TopPLogitsWarper(0.8)(ids, ref)
    ref = hf.MinPLogitsWarper(0.05)(ids, ref)
    ours = scores(
        logits,
        tokens,
        do_sample=True,
        repetition_penalty=1.3,
        no_repeat_ngram_size=2,
        temperature=0.7,
        top_k=20,
        top_p=0.8,
        min_p=0.05,
    )
    expected = ref[0].numpy()
    assert np.array_equal(np.isinf(ours), np.isinf(expected))
    kept = ~np.isinf(expected)
    assert np.allclose(ours[kept], expected[kept], atol=1e-5)


def test_seeded_sampling_is_identical_across_processes(tmp_path) -> None:
    import json
    import subprocess
    import sys

    from build import graphs

    folder = graphs.build_separate(tmp_path / "model", seed=0, config=True)

    def run(*extra: str) -> list[int]:
        command = [sys.executable, "-m", "ortpipe.cli", "run", str(folder), "--prompt-ids", "5,17,42,8",
                   "--max-new-tokens", "24", "--json", *extra]
        out = subprocess.run(command, capture_output=True, text=True, check=True)
        return json.loads(out.stdout)["tokens"]

    def sample(seed: int, *extra: str) -> list[int]:
        return run("--do-sample", "--seed", str(seed), *extra)

    first = sample(7, "--temperature", "1.5")
    assert first == sample(7, "--temperature", "1.5")
    assert first != sample(8, "--temperature", "1.5")
    assert sample(3, "--top-k", "1") == run()


@pytest.mark.parametrize("settings", [
    {}, {"repetition_penalty": 1.2}, {"do_sample": True}, {"do_sample": True, "top_p": 0.5},
    {"do_sample": True, "top_k": 5, "top_p": 0.9, "min_p": 0.1},
])
def test_the_sampler_names_the_kernels_it_runs(settings: dict) -> None:
    """What a target opens before the first request: exactly what select runs with nothing banned."""
    sampler = Sampler(kernel_backend(), "float32", SearchSettings(**settings), frozenset())
    work = sampler.select(np.zeros((1, 1, 10), np.float32), [], 1)
    names, request = [], next(work)
    try:
        while True:
            names.append(request.session)
            request = work.send(Driver().run(request))
    except StopIteration:
        pass
    assert names == sampler.kernels()


def test_logprobs_are_the_models_log_softmax(tmp_path) -> None:
    """Each token's log-probability and the top alternatives equal numpy's log-softmax of the logits
    onnxruntime gives for the whole sequence (no cache), greedy and sampled alike; asking for them
    changes no token."""
    from build import graphs

    import ortpipe
    from tests.handloop import _run, _session, _step_feeds, empty_pasts

    folder = graphs.build_separate(tmp_path / "model", seed=0, config=True)
    pipe = ortpipe.load(folder, threads=1)
    session = _session(folder, "separate")
    prompt = [5, 17, 42, 8, 23]
    for settings in ({}, {"do_sample": True, "seed": 4, "temperature": 1.3}):
        chunks = list(pipe.stream(prompt_ids=prompt, max_new_tokens=6, logprobs=3, **settings))
        without = pipe.generate(prompt_ids=prompt, max_new_tokens=6, **settings).tokens
        assert [c.token for c in chunks] == without

        ids = list(prompt)
        for chunk in chunks:
            logits = _run(session, _step_feeds(session, ids, len(ids)) | empty_pasts(session))["logits"][
                0, -1
            ]
            logp = logits - np.log(np.exp(logits - logits.max()).sum()) - logits.max()
            best = np.argsort(-logp)[:3]
            assert chunk.logprob == pytest.approx(float(logp[chunk.token]), abs=1e-4)
            assert [t for t, _ in chunk.top_logprobs] == best.tolist()
            assert [v for _, v in chunk.top_logprobs] == pytest.approx(logp[best].tolist(), abs=1e-4)
            ids.append(chunk.token)


def test_frequency_and_presence_penalties_lower_generated_tokens_only() -> None:
    """OpenAI's rule: score - count * frequency - (count > 0) * presence, counting only the generated
    tokens (here the last 3 of the text), before bans and the temperature."""
    text = [1, 0, 2, 2, 3]  # prompt [1, 0]; generated [2, 2, 3]
    s = SearchSettings(frequency_penalty=0.5, presence_penalty=0.25, suppress_tokens=(4,))
    sampler = Sampler(kernel_backend(), "float32", s, frozenset())
    sampler._vocab = len(LOGITS)
    banned = [banned_ids(s, text, 3, frozenset())]
    out = Driver().drive(sampler.scores(LOGITS[None, None], [text], banned, [3]))
    expected = LOGITS.copy()
    expected[2] -= np.float32(2 * 0.5 + 0.25)
    expected[3] -= np.float32(1 * 0.5 + 0.25)
    expected[4] = -INF
    assert out[0].tolist() == expected.tolist()
    # a penalty turns greedy selection off the plain argmax: 2 (3.0) drops below 4 (2.0)
    assert select(LOGITS, tokens=[2, 2], generated=2, frequency_penalty=0.6) == 4
    assert select(LOGITS, tokens=[2, 2], generated=0, frequency_penalty=2.0) == 2  # the prompt is not counted
    assert select(LOGITS, tokens=[2], generated=1, presence_penalty=-2.0) == 2


def test_frequency_and_presence_penalties_and_logit_bias_equal_a_hand_loop(tmp_path) -> None:
    """Greedy decoding with the penalties (and a logit bias) equals onnxruntime driven by hand over the
    whole text each step
    (no cache), the penalties applied in numpy by OpenAI's documented formula; on the generic path
    (kernels) and the fused one (the driver's numpy Picker)."""
    from build import graphs

    import ortpipe
    from tests.handloop import _run, _session, _step_feeds, empty_pasts

    folder = graphs.build_separate(tmp_path / "model", seed=0, config=True)
    session = _session(folder, "separate")
    prompt = [5, 17, 42, 8, 23, 5, 17]
    cases = [{"frequency_penalty": 1.5}, {"presence_penalty": 2.0},
             {"frequency_penalty": -0.4, "presence_penalty": 1.9},
             {"frequency_penalty": 0.9, "presence_penalty": 0.4, "repetition_penalty": 1.3},
             {"logit_bias": {43: -100, 20: -3.5, 57: 2.25}},
             {"logit_bias": {"28": 7.5}, "repetition_penalty": 1.3, "presence_penalty": 0.5}]
    plain = ortpipe.load(folder, threads=1).generate(prompt_ids=prompt, max_new_tokens=16).tokens
    outputs = []
    for settings in cases:
        ids, generated = list(prompt), []
        for _ in range(16):
            feeds = _step_feeds(session, ids, len(ids)) | empty_pasts(session)
            logits = _run(session, feeds)["logits"][0, -1]
            scores = logits.astype(np.float32)
            for t, bias in settings.get("logit_bias", {}).items():  # first: OpenAI adds it to the logits
                scores[int(t)] += np.float32(bias)
            r = settings.get("repetition_penalty", 1.0)
            for t in set(ids):
                scores[t] = scores[t] * r if scores[t] < 0 else scores[t] / r
            for t in set(generated):
                n = generated.count(t)
                amount = n * settings.get("frequency_penalty", 0.0) + settings.get("presence_penalty", 0.0)
                scores[t] -= np.float32(amount)
            token = int(np.argmax(scores))
            ids.append(token)
            generated.append(token)
        for fused in (False, True):
            pipe = ortpipe.load(folder, threads=1)
            pipe.model.backend.fused_sampling = fused
            result = pipe.generate(prompt_ids=prompt, max_new_tokens=16, **settings)
            assert result.tokens == generated, (settings, fused)
            assert (result.timings.fused_steps > 0) == fused
        outputs.append(generated)
    assert all(o != plain for o in outputs)  # each penalty changed the text
