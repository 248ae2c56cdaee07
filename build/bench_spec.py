"""`python -m build.bench_spec`: speculative decoding's speed, beside onnxruntime-genai's.

Each workload is a model folder, a prompt, greedy or sampled settings and a number of new tokens.
Four engines run it: ortpipe without speculation ("plain") and with prompt lookup ("lookup"),
onnxruntime-genai without ("genai") and with its n-gram speculation ("genai-ngram", the same
ngram_size and max_draft_tokens through `GeneratorParams.set_speculative_options`). Every engine
runs on one intra-op thread (the folder's genai_config.json is pinned in a copy).

The engines of a workload are loaded in a fresh process, `--loads` times with the load order
reversed each time, warmed up with one untimed generation, then run `--rounds` rounds with the
engine order rotated each round. Decode speed is all decode tokens (the first token, from the
prefill, left out) over their total time; the acceptance rate is accepted drafts over drafted ones
(genai: its own `acceptance_rate` statistic). Sampled rounds use the round's number as the seed.

    python -m build.bench_spec [--workloads demo-code,200m-repetitive] [--rounds 5] [--loads 2]
                               [--json out.json]
"""

from __future__ import annotations

import argparse
import gc
import inspect
import json
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from build.bench import machine, pinned_folder, versions
from build.hfmodels import cache_root

REPO = Path(__file__).resolve().parent.parent
ENGINES = ("plain", "lookup", "genai", "genai-ngram")
SPECULATIVE = {"ngram_size": 3, "max_draft_tokens": 8}
DEMO_SAMPLING = {"do_sample": True, "temperature": 0.7, "top_k": 40, "top_p": 0.95}  # the folder's defaults


@dataclass(frozen=True)
class Workload:
    name: str
    folder: str  # "demo", or a folder under the bench cache (build/bench_models.py)
    kind: str  # "extractive" or "open-ended", as the report groups them
    what: str
    new_tokens: int
    sampling: dict[str, Any] = field(default_factory=dict)


WORKLOADS = {w.name: w for w in (
    Workload("demo-code", "demo", "extractive", "the demo model on a long code prompt, greedy "
             "(its continuation repeats itself)", 192),
    Workload("200m-repetitive", "200m-fp32", "extractive", "the ~200M fp32 model on a prompt of 40 random "
             "ids four times, greedy", 128),
    Workload("200m-int4-repetitive", "200m-int4", "extractive", "the ~200M model's int4 export on the same "
             "prompt, greedy", 128),
    Workload("demo-open", "demo", "open-ended", "the demo model from `def `, sampled with the folder's "
             "defaults (temperature 0.7, top-k 40, top-p 0.95)", 128, DEMO_SAMPLING),
    Workload("200m-open", "200m-fp32", "open-ended", "the ~200M fp32 model on 160 random ids, sampled "
             "(temperature 0.8, top-k 40)", 64, {"do_sample": True, "temperature": 0.8, "top_k": 40}),
)}


def folder_of(w: Workload) -> Path:
    return REPO / "models" / "demo" if w.folder == "demo" else cache_root() / "bench" / w.folder


def prompt_of(w: Workload) -> list[int]:
    """The workload's prompt ids."""
    if w.folder == "demo":
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(str(folder_of(w) / "tokenizer.json"))
        if w.name == "demo-open":
            return tokenizer.encode("def ").ids
        import bisect

        source = inspect.getsource(bisect)
        code = source[source.index("def insort_right"):][:800]
        return tokenizer.encode(code + "\n\n" + code[:120]).ids
    rng = random.Random(0)
    if w.name in ("200m-repetitive", "200m-int4-repetitive"):
        return [rng.randrange(3, 32000) for _ in range(40)] * 4
    return [rng.randrange(3, 32000) for _ in range(160)]


# --- engines: (prompt, round) -> (tokens, decode seconds, drafted, accepted)

Run = tuple[list[int], float, int, int]


def ortpipe_engine(folder: Path, w: Workload, speculate: bool) -> Any:
    from ortpipe import load

    pipe = load(folder, threads=1)
    settings = {**w.sampling, **(SPECULATIVE if speculate else {})}
    if not w.sampling:
        settings["do_sample"] = False

    def run(prompt: list[int], seed: int) -> Run:
        seeded = {"seed": seed} if w.sampling else {}
        r = pipe.generate(prompt_ids=prompt, max_new_tokens=w.new_tokens, **settings, **seeded)
        t = r.timings
        return r.tokens, t.decode_ms / 1000, t.drafted_tokens, t.accepted_tokens

    return run


def genai_engine(folder: Path, w: Workload, speculate: bool) -> Any:
    import onnxruntime_genai as og

    model = og.Model(str(folder))

    def run(prompt: list[int], seed: int) -> Run:
        params = og.GeneratorParams(model)
        search = {"max_length": len(prompt) + w.new_tokens, "do_sample": bool(w.sampling)}
        search.update({k: v for k, v in w.sampling.items() if k in ("temperature", "top_k", "top_p")})
        if w.sampling:
            search["random_seed"] = seed
        params.set_search_options(**search)
        if speculate:
            params.set_speculative_options(**SPECULATIVE)
        gen = og.Generator(model, params)
        gen.append_tokens(np.asarray([prompt], dtype=np.int32))
        gen.generate_next_token()
        start = time.perf_counter()
        while not gen.is_done():
            gen.generate_next_token()
        seconds = time.perf_counter() - start
        tokens = [int(t) for t in gen.get_sequence(0)[len(prompt):]]
        drafted = accepted = 0
        if speculate:
            stats = dict(gen.get_speculative_stats())
            drafted, accepted = int(stats["draft_tokens_evaluated"]), int(stats["draft_tokens_accepted"])
        return tokens, seconds, drafted, accepted

    return run


FACTORIES = {
    "plain": lambda f, w: ortpipe_engine(f, w, False),
    "lookup": lambda f, w: ortpipe_engine(f, w, True),
    "genai": lambda f, w: genai_engine(f, w, False),
    "genai-ngram": lambda f, w: genai_engine(f, w, True),
}


def _child() -> None:
    """One load: the engines of a job (stdin) loaded in order, warmed up, then rotated rounds."""
    job = json.load(sys.stdin)
    w = WORKLOADS[job["workload"]]
    prompt = prompt_of(w)
    engines = {}
    for name in job["order"]:
        engines[name] = FACTORIES[name](Path(job["folder"]), w)
        engines[name](prompt, 10_000)
    runs: dict[str, list[Run]] = {name: [] for name in engines}
    names = list(engines)
    for r in range(job["rounds"]):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            gc.collect()
            runs[name].append(engines[name](prompt, r))
    json.dump(runs, sys.stdout)


def measure(w: Workload, rounds: int, loads: int) -> dict[str, list[Run]]:
    runs: dict[str, list[Run]] = {name: [] for name in ENGINES}
    with tempfile.TemporaryDirectory(prefix="ortpipe-bench-spec-") as scratch:
        folder = pinned_folder(folder_of(w), 1, Path(scratch))
        for load in range(loads):
            order = list(ENGINES) if load % 2 == 0 else list(reversed(ENGINES))
            job = {"workload": w.name, "folder": str(folder), "order": order, "rounds": rounds}
            command = [sys.executable, "-m", "build.bench_spec", "--child"]
            done = subprocess.run(command, input=json.dumps(job), capture_output=True, text=True, check=False,
                                  cwd=REPO)
            if done.returncode != 0:
                raise SystemExit(f"bench_spec: {w.name} failed:\n{done.stderr[-3000:]}")
            for name, got in json.loads(done.stdout).items():
                runs[name] += [tuple(r) for r in got]
    return runs


def summary(w: Workload, runs: dict[str, list[Run]]) -> dict[str, Any]:
    out: dict[str, Any] = {"workload": w.name, "kind": w.kind, "what": w.what, "engines": {}}
    for name, got in runs.items():
        tokens = sum(len(r[0]) - 1 for r in got)
        seconds = sum(r[1] for r in got)
        drafted, accepted = sum(r[2] for r in got), sum(r[3] for r in got)
        out["engines"][name] = {
            "decode_tokens_per_s": round(tokens / seconds, 1) if seconds else 0.0,
            "acceptance_rate": round(accepted / drafted, 3) if drafted else None,
            "drafted_per_token": round(drafted / tokens, 2) if tokens else 0.0,
        }
    speed = {name: e["decode_tokens_per_s"] for name, e in out["engines"].items()}
    out["lookup_vs_plain"] = round(speed["lookup"] / speed["plain"], 2)
    out["genai_ngram_vs_genai"] = round(speed["genai-ngram"] / speed["genai"], 2)
    out["lookup_vs_genai_ngram"] = round(speed["lookup"] / speed["genai-ngram"], 2)
    if not w.sampling:
        out["same_tokens"] = {
            "lookup = plain": all(a[0] == b[0] for a, b in zip(runs["lookup"], runs["plain"], strict=True)),
            "genai-ngram = genai": all(a[0] == b[0] for a, b in zip(runs["genai-ngram"], runs["genai"],
                                                                   strict=True)),
            "plain = genai": all(a[0] == b[0] for a, b in zip(runs["plain"], runs["genai"], strict=True)),
        }
    return out


def table(results: list[dict[str, Any]]) -> str:
    lines = ["| workload | plain | lookup | genai | genai n-gram | lookup / plain | genai n-gram / genai | "
             "lookup / genai n-gram | acceptance (lookup, genai) |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for r in results:
        e = r["engines"]
        lines.append(
            f"| {r['workload']} ({r['kind']}) | {e['plain']['decode_tokens_per_s']} | "
            f"{e['lookup']['decode_tokens_per_s']} | {e['genai']['decode_tokens_per_s']} | "
            f"{e['genai-ngram']['decode_tokens_per_s']} | {r['lookup_vs_plain']}x | "
            f"{r['genai_ngram_vs_genai']}x | "
            f"{r['lookup_vs_genai_ngram']}x | {e['lookup']['acceptance_rate']}, "
            f"{e['genai-ngram']['acceptance_rate']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m build.bench_spec", description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--loads", type=int, default=2)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        _child()
        return 0
    results = []
    before = machine()
    for name in args.workloads.split(","):
        results.append(summary(WORKLOADS[name], measure(WORKLOADS[name], args.rounds, args.loads)))
        print(table(results[-1:]).splitlines()[-1], flush=True)
    report = {"machine_before": before, "machine_after": machine(), "versions": versions(),
              "settings": SPECULATIVE, "rounds": args.rounds, "loads": args.loads, "results": results}
    print(table(results))
    print(json.dumps({k: report[k] for k in ("machine_before", "machine_after", "settings")}))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
