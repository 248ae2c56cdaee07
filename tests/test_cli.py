"""The `ortpipe` command: run --json, validate's exit codes, inspect, and errors without tracebacks."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
from build import graphs

from tests.handloop import hand_greedy

PROMPT = [5, 17, 42, 8, 23, 61, 3, 77]


REPO = Path(__file__).resolve().parent.parent


def ortpipe(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ortpipe.cli", *args], capture_output=True, text=True)


def bench(*args: str) -> subprocess.CompletedProcess:
    """The decode benchmark (build/bench.py), run from the repository as its docs say."""
    return subprocess.run(
        [sys.executable, "-m", "build.bench", *args], capture_output=True, text=True, cwd=REPO
    )


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return graphs.build_separate(tmp_path_factory.mktemp("cli") / "model", seed=0, config=True)


def test_run_json_prints_tokens_text_and_timings(model: Path) -> None:
    out = ortpipe(
        "run",
        str(model),
        "--prompt-ids",
        ",".join(map(str, PROMPT)),
        "--max-new-tokens",
        "12",
        "--threads",
        "1",
        "--json",
    )
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["tokens"] == hand_greedy(model, PROMPT, 12, layout="separate")
    assert result["text"] == ""  # this folder has no tokenizer
    assert result["timings"]["prefill_ms"] > 0 and result["timings"]["decode_tokens_per_s"] > 0


def test_run_logprobs_come_out_in_json_and_after_the_text(model: Path) -> None:
    import numpy as np

    from tests.handloop import _run, _session, _step_feeds, empty_pasts

    args = ["run", str(model), "--prompt-ids", ",".join(map(str, PROMPT)), "--max-new-tokens", "6",
            "--threads", "1", "--logprobs", "3"]
    out = ortpipe(*args, "--json")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert [p["token"] for p in result["logprobs"]] == result["tokens"]
    # the reference: one run over prompt and tokens without a cache, log-softmax by hand
    session = _session(model, "separate")
    ids = PROMPT + result["tokens"]
    logits = _run(session, _step_feeds(session, ids, len(ids)) | empty_pasts(session))["logits"][0]
    logits = logits[len(PROMPT) - 1:-1].astype(np.float64)
    expected = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
        - logits.max(-1, keepdims=True)
    for row, given in zip(expected, result["logprobs"], strict=True):
        top = np.argsort(-row)[:3]
        assert [t for t, _ in given["top_logprobs"]] == top.tolist()
        assert np.allclose([lp for _, lp in given["top_logprobs"]], row[top], atol=1e-4)
        assert abs(given["logprob"] - row[given["token"]]) < 1e-4
    streamed = ortpipe(*args)
    assert streamed.returncode == 0, streamed.stderr
    table = [line for line in streamed.stderr.splitlines() if line.startswith("[   ")]
    assert len(table) == 6 and all("top: " in line for line in table)
    assert table[0].split()[2] == str(result["tokens"][0])


def test_validate_accepts_a_good_folder(model: Path) -> None:
    out = ortpipe("validate", str(model))
    assert out.returncode == 0 and "ok (v2 config, 1 session(s), 1 flow step(s))" in out.stdout


def test_validate_prints_every_problem_and_exits_2(tmp_path: Path) -> None:
    (tmp_path / "genai_config.json").write_text(
        json.dumps(
            {
                "version": 2,
                "pipeline": {
                    "sessions": {"decoder": {"file": "../x.onnx"}},
                    "flow": [{"run": "decodr", "when": "never"}],
                },
            }
        )
    )
    out = ortpipe("validate", str(tmp_path))
    assert out.returncode == 2
    assert "3 problems" in out.stderr
    assert "points outside the model folder" in out.stderr
    assert 'Did you mean "decoder"?' in out.stderr
    assert 'Unknown flow phase (when) "never"' in out.stderr
    assert "Traceback" not in out.stderr


def test_validate_reports_an_unfeedable_input(tmp_path: Path, model: Path) -> None:
    (tmp_path / "model.onnx").write_bytes((model / "model.onnx").read_bytes())
    (tmp_path / "genai_config.json").write_text(
        json.dumps(
            {
                "version": 2,
                "pipeline": {
                    "extends": "autoregressive-decoder",
                    "sessions": {"decoder": {"file": "model.onnx", "inputs": {"input_ids": "ids"}}},
                },
            }
        )
    )
    out = ortpipe("validate", str(tmp_path))
    assert out.returncode == 2
    assert 'Session "decoder" input "input_ids"' in out.stderr and "cannot be fed" in out.stderr


def test_inspect_shows_the_detected_layout_and_expanded_config(model: Path) -> None:
    out = ortpipe("inspect", str(model), "--json")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    step = report["steps"][0]
    assert step["kv_cache"]["format"] == "separate" and step["kv_cache"]["layers"] == [0, 1]
    assert step["feeds"]["position_ids"] == "position_ids"
    assert report["config"]["pipeline"]["flow"] == [{"run": "decoder", "when": "step"}]


def test_missing_folder_and_bad_settings_are_clear_errors(model: Path) -> None:
    out = ortpipe("run", "/nonexistent/model", "--prompt-ids", "1,2")
    assert out.returncode == 2 and "does not exist" in out.stderr and "Traceback" not in out.stderr
    out = ortpipe("run", str(model), "--prompt-ids", "1,2", "--do-sample", "--temperature", "-1")
    assert out.returncode == 2 and "temperature -1.0 is out of range" in out.stderr
    out = ortpipe("run", str(model), "--prompt", "hello")
    assert out.returncode == 2 and "no tokenizer.json" in out.stderr


DEMO = REPO / "models" / "demo"


def test_the_prompt_can_come_after_the_folder_or_after_options() -> None:
    """`ortpipe run DIR "text"` is `--prompt "text"`, wherever the options are; greedy, so the same tokens."""
    flags = ("--max-new-tokens", "6", "--no-do-sample", "--threads", "1", "--json")
    by_flag = ortpipe("run", str(DEMO), "--prompt", "def fib(n):", *flags)
    assert by_flag.returncode == 0, by_flag.stderr
    for args in (("def fib(n):", *flags), (*flags, "def fib(n):"), (*flags, "--", "def fib(n):")):
        out = ortpipe("run", str(DEMO), *args)
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout)["tokens"] == json.loads(by_flag.stdout)["tokens"]


@pytest.mark.parametrize(
    "args, says",
    [
        (("--prompt", "hi", "--temprature", "0.5"),
         'unrecognized option --temprature. Did you mean "--temperature"?'),
        (("def", "fib"), "unexpected argument 'fib': give the prompt once, in quotes if it has spaces"),
        (("--prompt-ids", "1,2", "hi"), "unexpected argument 'hi'"),
        (("hi", "--prompt", "there"), "argument --prompt: not allowed with argument PROMPT"),
    ],
)
def test_arguments_run_cannot_place_are_named_with_its_usage(args: tuple[str, ...], says: str) -> None:
    out = ortpipe("run", str(DEMO), *args)
    assert out.returncode == 2 and out.stdout == ""
    assert says in out.stderr and "usage: ortpipe run " in out.stderr and "Traceback" not in out.stderr


def test_run_without_a_prompt_says_how_to_give_one() -> None:
    out = ortpipe("run", str(DEMO), "--max-new-tokens", "4")
    assert out.returncode == 2 and out.stdout == "" and "Traceback" not in out.stderr
    assert 'ortpipe run MODEL_DIR "TEXT", --prompt TEXT or --prompt-ids 1,2,3' in out.stderr


def test_other_commands_name_what_they_do_not_know_with_their_usage() -> None:
    out = ortpipe("embed", str(DEMO), "--batchsize", "3")
    assert out.returncode == 2 and "usage: ortpipe embed " in out.stderr
    assert 'unrecognized option --batchsize. Did you mean "--batch-size"?' in out.stderr
    out = ortpipe("inspect", str(DEMO), "extra")
    assert out.returncode == 2 and "usage: ortpipe inspect " in out.stderr
    assert "unrecognized arguments: extra" in out.stderr


def test_bench_pools_every_engine_over_rotated_loads(llama_builder_fp32: Path) -> None:
    """The bench loads the engines once per load in a fresh process, in a rotated order, and
    pools the steps; its greedy engines must agree with a hand-written greedy loop."""
    out = bench(
        str(llama_builder_fp32),
        "--prompt-tokens",
        "8",
        "--new-tokens",
        "6",
        "--rounds",
        "1",
        "--loads",
        "2",
        "--json",
    )
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["loads"] == [["ortpipe", "genai", "floor"], ["genai", "floor", "ortpipe"]]
    assert "load 2/2 (genai, floor, ortpipe)" in out.stderr
    assert report["failed"] == {} and report["tokens_match"]
    for name in ("ortpipe", "genai", "floor"):
        engine = report["engines"][name]
        assert engine["steps"] == 2 * 5 and len(engine["round_tokens_per_s"]) == 2  # 2 loads x 1 round
        assert engine["decode_tokens_per_s"] > 0
    # one round per load: a load's ratio is the ratio of the two engines' round speeds in that load
    speeds = {name: report["engines"][name]["round_tokens_per_s"] for name in ("ortpipe", "genai")}
    expected = [o / g for o, g in zip(speeds["ortpipe"], speeds["genai"], strict=True)]
    per_load = report["per_load"]["ortpipe_vs_genai"]
    assert per_load["values"] == pytest.approx(expected, rel=1e-3)
    mean, half = statistics.fmean(expected), 12.706 * statistics.stdev(expected) / 2**0.5  # t(0.975, 1 df)
    assert per_load["mean"] == pytest.approx(mean, rel=1e-3)
    assert per_load["ci95"] == pytest.approx([mean - half, mean + half], rel=1e-3, abs=1e-3)
    assert "ortpipe ÷ genai within each load" not in out.stdout  # --json prints only the object


@pytest.mark.parametrize("count", [1, 2, 3, 4, 5])
def test_bench_load_orders_are_balanced(count: int) -> None:
    """Over one cycle of load orders every engine takes every position equally often, and of any two
    engines each is loaded first in half the orders (a session created before another engine's model
    can run slower than one created after it, docs/benchmarks.md)."""
    from build.bench import load_orders

    names = [f"e{i}" for i in range(count)]
    cycle = load_orders(names, None)
    assert cycle[0] == names and all(sorted(order) == names for order in cycle)
    assert len({tuple(order) for order in cycle}) == len(cycle) == {1: 1, 2: 2}.get(count, 2 * count)
    for name in names:
        positions = [order.index(name) for order in cycle]
        assert all(positions.count(p) == len(cycle) // count for p in range(count))
    for a in names:
        for b in names:
            if a != b:
                assert sum(order.index(a) < order.index(b) for order in cycle) * 2 == len(cycle)
    assert load_orders(names, 2 * len(cycle) + 1) == cycle * 2 + cycle[:1]


def test_bench_rejects_bad_settings_and_non_builder_folders(model: Path, llama_builder_fp32: Path) -> None:
    out = bench(str(llama_builder_fp32), "--loads", "0")
    assert out.returncode == 2 and "--loads must be >= 1" in out.stderr and "Traceback" not in out.stderr
    out = bench(str(llama_builder_fp32), "--engines", "ortpipe,tjs")
    assert out.returncode == 2 and "unknown engine(s) tjs" in out.stderr
    out = bench(str(model))  # a v2 folder: genai cannot read it
    assert out.returncode == 2 and "not a v1 (model builder) config" in out.stderr
