"""The hand-built test decoders: their caches are right (cached greedy == uncached greedy), their
outputs depend on what a cache bug would break, and greedy decoding on them is well conditioned."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from build import graphs

from tests.handloop import empty_pasts, hand_greedy, no_cache_greedy

SEED = 0
PROMPT = [5, 17, 42, 8, 23, 61, 30, 12, 77, 40, 9, 55, 33]  # 13 tokens: longer than the window
WINDOW = 8
NEW_TOKENS = 30

# name -> (builder, hand_greedy keywords)
CASES: dict[str, tuple[Callable[[Path, int], Path], dict[str, object]]] = {
    "separate": (lambda d, s: graphs.build_separate(d, s), {"layout": "separate"}),
    "separate-sparse-dual-heads": (
        lambda d, s: graphs.build_separate(d, s, layers=(0, 2), heads={0: 2, 2: 1}, head_size={0: 8, 2: 16}),
        {"layout": "separate"}),
    "separate-no-position-ids": (lambda d, s: graphs.build_separate(d, s, with_position_ids=False),
                                 {"layout": "separate"}),
    "separate-no-attention-mask": (lambda d, s: graphs.build_separate(d, s, with_attention_mask=False),
                                   {"layout": "separate"}),
    "combined": (lambda d, s: graphs.build_combined(d, s), {"layout": "combined"}),
    "sliding": (lambda d, s: graphs.build_sliding(d, s, window=WINDOW, window_layers=(1,)),
                {"layout": "sliding", "window": WINDOW, "window_layers": (1,)}),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("graphs")
    return {name: build(root / name, SEED) for name, (build, _) in CASES.items()}


def no_cache_keywords(case: str) -> dict[str, object]:
    return {"layout": CASES[case][1]["layout"]}


@pytest.mark.parametrize("case", CASES)
def test_cached_greedy_equals_uncached_greedy(models: dict[str, Path], case: str) -> None:
    cached = hand_greedy(models[case], PROMPT, NEW_TOKENS, **CASES[case][1])
    assert len(cached) == NEW_TOKENS
    assert cached == no_cache_greedy(models[case], PROMPT, NEW_TOKENS, **no_cache_keywords(case))


@pytest.mark.parametrize("case", CASES)
def test_greedy_does_not_fall_into_a_loop(models: dict[str, Path], case: str) -> None:
    tokens = hand_greedy(models[case], PROMPT, 40, **CASES[case][1])
    assert len(tokens) == 40
    assert len(set(tokens)) >= 12


@pytest.mark.parametrize("case", CASES)
def test_greedy_margins_are_clear(models: dict[str, Path], case: str) -> None:
    """Top-1 beats top-2 by far more than fp32 reordering noise (~1e-5) at every generated step."""
    tokens = hand_greedy(models[case], PROMPT, NEW_TOKENS, **CASES[case][1])
    sequence = PROMPT + tokens[:-1]
    session = ort.InferenceSession(str(models[case] / "model.onnx"), providers=["CPUExecutionProvider"])
    logits = run(session, sequence)["logits"][0, len(PROMPT) - 1:]
    assert np.array_equal(logits.argmax(-1), tokens)
    top = np.sort(logits, axis=-1)
    assert (top[:, -1] - top[:, -2]).min() > 0.05


def test_special_tokens_are_never_generated(models: dict[str, Path]) -> None:
    tokens = hand_greedy(models["separate"], PROMPT, 40, layout="separate")
    assert not {graphs.BOS, graphs.PAD, graphs.EOS} & set(tokens)


def test_generation_stops_after_eos(models: dict[str, Path]) -> None:
    tokens = hand_greedy(models["separate"], PROMPT, NEW_TOKENS, layout="separate")
    stop = tokens[10]
    expected = tokens[:tokens.index(stop) + 1]
    assert hand_greedy(models["separate"], PROMPT, NEW_TOKENS, layout="separate", eos={stop}) == expected
    assert no_cache_greedy(models["separate"], PROMPT, NEW_TOKENS, layout="separate", eos={stop}) == expected


def test_tokens_depend_on_the_distant_past(models: dict[str, Path]) -> None:
    """Changing only the first prompt token changes the continuation: decode steps see it via the cache."""
    for case in CASES:
        tokens = hand_greedy(models[case], PROMPT, 20, **CASES[case][1])
        assert tokens != hand_greedy(models[case], [6, *PROMPT[1:]], 20, **CASES[case][1])


def test_logits_depend_on_position_and_attention_mask(models: dict[str, Path]) -> None:
    session = ort.InferenceSession(str(models["separate"] / "model.onnx"), providers=["CPUExecutionProvider"])
    base = run(session, PROMPT)["logits"][0, -1]
    shifted = run(session, PROMPT, positions=np.arange(1, len(PROMPT) + 1))["logits"][0, -1]
    mask = np.ones(len(PROMPT), dtype=np.int64)
    mask[3] = 0
    masked = run(session, PROMPT, mask=mask)["logits"][0, -1]
    assert np.abs(shifted - base).max() > 1.0
    assert np.abs(masked - base).max() > 1.0


@pytest.mark.parametrize("case", ["separate", "sliding"])
def test_left_padding_is_masked(models: dict[str, Path], case: str) -> None:
    """A left-padded row of a batch gets the same logits as the same prompt alone."""
    session = ort.InferenceSession(str(models[case] / "model.onnx"), providers=["CPUExecutionProvider"])
    short = PROMPT[:5]
    pad = len(PROMPT) - len(short)
    mask = np.array([[1] * len(PROMPT), [0] * pad + [1] * len(short)])
    feeds = {"input_ids": np.array([PROMPT, [graphs.PAD] * pad + short]), "attention_mask": mask,
             "position_ids": np.maximum(np.cumsum(mask, axis=1) - 1, 0)}
    pasts = {name: np.concatenate([past, past]) for name, past in empty_pasts(session).items()}
    batched = session.run(["logits"], feeds | pasts)[0][:, -1]
    alone = [run(session, prompt)["logits"][0, -1] for prompt in (PROMPT, short)]
    assert np.allclose(batched, alone, atol=1e-4)


def test_the_window_changes_tokens(models: dict[str, Path]) -> None:
    """build_sliding and build_separate with one seed share their weights: only the window differs."""
    full = hand_greedy(models["separate"], PROMPT, NEW_TOKENS, layout="separate")
    assert full != hand_greedy(models["sliding"], PROMPT, NEW_TOKENS, **CASES["sliding"][1])


def test_sliding_tokens_are_the_same_with_the_cache_trimmed_or_not(models: dict[str, Path]) -> None:
    trimmed = hand_greedy(models["sliding"], PROMPT, NEW_TOKENS, **CASES["sliding"][1])
    assert trimmed == hand_greedy(models["sliding"], PROMPT, NEW_TOKENS, layout="sliding")


def test_windowed_layer_takes_a_past_shorter_than_the_attention_mask(models: dict[str, Path]) -> None:
    """A decode step as the runtime feeds it: layer 0's past has every position, layer 1's only the last W."""
    session = ort.InferenceSession(str(models["sliding"] / "model.onnx"), providers=["CPUExecutionProvider"])
    prefill = run(session, PROMPT)
    pasts = {f"past_key_values.{layer}.{kind}": prefill[f"present.{layer}.{kind}"]
             for layer in (0, 1) for kind in ("key", "value")}
    trimmed = {name: past[:, :, -WINDOW:] if ".1." in name else past for name, past in pasts.items()}
    token, total = int(prefill["logits"][0, -1].argmax()), len(PROMPT) + 1
    step = {"input_ids": np.array([[token]]), "attention_mask": np.ones((1, total), dtype=np.int64),
            "position_ids": np.array([[total - 1]])}
    out = dict(zip([o.name for o in session.get_outputs()], session.run(None, step | trimmed), strict=True))
    assert out["present.0.key"].shape == (1, 2, total, 8)
    assert out["present.1.key"].shape == (1, 2, WINDOW + 1, 8)
    untrimmed = session.run(["logits"], step | pasts)[0]
    assert np.allclose(out["logits"], untrimmed, atol=1e-4)


def test_signatures(models: dict[str, Path]) -> None:
    def signature(case: str) -> tuple[dict[str, list[object]], dict[str, list[object]]]:
        model = onnx.load(str(models[case] / "model.onnx"))
        onnx.checker.check_model(model, full_check=True)

        def dims(v: onnx.ValueInfoProto) -> list[object]:
            return [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim]
        return {v.name: dims(v) for v in model.graph.input}, {v.name: dims(v) for v in model.graph.output}

    b, s, p, t = "batch_size", "sequence_length", "past_sequence_length", "total_sequence_length"
    wp, wt = "window_past_sequence_length", "window_total_sequence_length"
    inputs, outputs = signature("separate-sparse-dual-heads")
    assert inputs == {"input_ids": [b, s], "attention_mask": [b, t], "position_ids": [b, s],
                      "past_key_values.0.key": [b, 2, p, 8], "past_key_values.0.value": [b, 2, p, 8],
                      "past_key_values.2.key": [b, 1, p, 16], "past_key_values.2.value": [b, 1, p, 16]}
    assert outputs == {"logits": [b, s, graphs.VOCAB],
                       "present.0.key": [b, 2, t, 8], "present.0.value": [b, 2, t, 8],
                       "present.2.key": [b, 1, t, 16], "present.2.value": [b, 1, t, 16]}
    inputs, outputs = signature("combined")
    assert inputs == {"input_ids": [b, s], "attention_mask": [b, t], "position_ids": [b, s],
                      "past_0": [2, b, 2, p, 8], "past_1": [2, b, 2, p, 8]}
    assert outputs == {"logits": [b, s, graphs.VOCAB],
                       "present_0": [2, b, 2, t, 8], "present_1": [2, b, 2, t, 8]}
    inputs, outputs = signature("sliding")
    assert inputs["past_key_values.0.key"] == [b, 2, p, 8]
    assert inputs["past_key_values.1.key"] == [b, 2, wp, 8]
    assert outputs["present.0.value"] == [b, 2, t, 8]
    assert outputs["present.1.value"] == [b, 2, wt, 8]
    assert "position_ids" not in signature("separate-no-position-ids")[0]
    assert "attention_mask" not in signature("separate-no-attention-mask")[0]


def test_genai_config(tmp_path: Path) -> None:
    folder = graphs.build_sliding(tmp_path, SEED, window=WINDOW, window_layers=(1,), config=True, eos=[7])
    config = json.loads((folder / "genai_config.json").read_text())
    assert config["version"] == 2
    assert config["pipeline"]["sessions"] == {"decoder": {"file": "model.onnx"}}
    assert config["pipeline"]["state"]["kv_cache"] == {
        "format": "separate", "sliding_window": {"window_size": WINDOW, "layers": [1]}}
    assert config["tokens"] == {"eos": [7], "bos": 0, "pad": 0}
    combined = graphs.build_combined(tmp_path / "combined", SEED, config=True)
    config = json.loads((combined / "genai_config.json").read_text())
    assert config["pipeline"]["state"]["kv_cache"] == {"format": "combined"}
    assert config["tokens"]["eos"] == [graphs.EOS]
    assert not (graphs.build_separate(tmp_path / "bare", SEED) / "genai_config.json").exists()


def run(session: ort.InferenceSession, ids: list[int], positions: np.ndarray | None = None,
        mask: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """One uncached run over `ids` (position_ids and attention_mask only if the graph has them)."""
    feeds = {"input_ids": np.array([ids]),
             "attention_mask": (np.ones(len(ids), dtype=np.int64) if mask is None else mask)[None],
             "position_ids": (np.arange(len(ids)) if positions is None else positions)[None]}
    names = {i.name for i in session.get_inputs()}
    feeds = {name: value for name, value in feeds.items() if name in names} | empty_pasts(session)
    outputs = [o.name for o in session.get_outputs()]
    return dict(zip(outputs, session.run(outputs, feeds), strict=True))
