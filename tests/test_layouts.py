"""Every KV layout of the hand-built graphs: ortpipe's tokens equal a hand-written onnxruntime loop."""

from __future__ import annotations

from pathlib import Path

import pytest
from build import graphs

import ortpipe
from tests.handloop import hand_greedy

PROMPT = [5, 17, 42, 8, 23, 61, 3, 77, 12, 30, 9, 54, 40]
NEW = 30

CASES = {
    "separate": (graphs.build_separate, {}, {"layout": "separate"}),
    "sparse-dual-heads": (graphs.build_separate, {"layers": (0, 2), "heads": {0: 2, 2: 1},
                                                  "head_size": {0: 8, 2: 16}}, {"layout": "separate"}),
    "no-position-ids": (graphs.build_separate, {"with_position_ids": False}, {"layout": "separate"}),
    "no-attention-mask": (graphs.build_separate, {"with_attention_mask": False}, {"layout": "separate"}),
    "combined": (graphs.build_combined, {}, {"layout": "combined"}),
    "sliding": (graphs.build_sliding, {"window": 8, "window_layers": (1,)},
                {"layout": "sliding", "window": 8, "window_layers": (1,)}),
}


@pytest.mark.parametrize("case", CASES)
def test_layout_matches_the_hand_loop(case: str, tmp_path: Path) -> None:
    build, options, reference = CASES[case]
    folder = build(tmp_path / case, seed=0, config=True, **options)
    expected = hand_greedy(folder, PROMPT, NEW, **reference)
    result = ortpipe.load(folder, threads=1).generate(prompt_ids=PROMPT, max_new_tokens=NEW)
    assert len(expected) == NEW
    assert result.tokens == expected
    assert result.finish_reason == "length"


def test_layout_is_detected_without_a_config(tmp_path: Path) -> None:
    folder = graphs.build_combined(tmp_path / "bare", seed=0)
    assert not (folder / "genai_config.json").exists()
    pipe = ortpipe.load(folder, threads=1)
    step = pipe.plan.step_phase[0]
    assert step.kv.format == "combined" and step.kv.layers == [0, 1]
    assert pipe.generate(prompt_ids=PROMPT, max_new_tokens=NEW).tokens == hand_greedy(folder, PROMPT, NEW,
                                                                                       layout="combined")


def test_sliding_window_cache_stays_bounded(tmp_path: Path) -> None:
    folder = graphs.build_sliding(tmp_path / "sliding", seed=0, config=True, window=8, window_layers=(1,))
    pipe = ortpipe.load(folder, threads=1)
    gen = pipe.generator(len(PROMPT), max_new_tokens=NEW)
    gen.append_tokens(PROMPT)
    while not gen.done:
        gen.next_token()
    feeds = gen.core.flow.caches["decoder"].feeds
    assert feeds["past_key_values.1.key"].shape[2] == 8  # the windowed layer
    assert feeds["past_key_values.0.key"].shape[2] == len(PROMPT) + NEW - 1  # a full layer


def test_eos_from_the_config_stops_generation(tmp_path: Path) -> None:
    folder = graphs.build_separate(tmp_path / "sep", seed=0)
    tokens = hand_greedy(folder, PROMPT, NEW, layout="separate")
    stop_at = tokens[5]
    graphs.build_separate(tmp_path / "eos", seed=0, config=True, eos=(stop_at,))
    result = ortpipe.load(tmp_path / "eos", threads=1).generate(prompt_ids=PROMPT, max_new_tokens=NEW)
    assert result.tokens == tokens[:tokens.index(stop_at) + 1]
    assert result.finish_reason == "eos"
