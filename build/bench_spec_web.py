"""`python -m build.bench_spec_web`: speculative decoding's speed in headless Chromium (wasm). Not a test.

The workloads of build/bench_spec.py that fit a browser: the demo model (its wasm default, the int8
variant) on its long code prompt, greedy, and sampled from `def `; its fp32 graph with the demo folder
(int8 on wasm) drafting, greedy and sampled; and the ~200M model on a repetitive prompt, greedy: the
model builder's fp32 export, and Optimum's export of the same weights as its q8 variant (made on
first use: build/bench_spec.py's optimum_q8); a ~100M Optimum export, build/bench_web.py's "100m", on
request. One page per workload loads
the model once (wasm, one thread), warms up, then runs plain decoding and speculation (prompt lookup,
or the draft model) in turns, `--rounds` times each, the order swapped every round. Decode speed is
the worker's own timing (the core's Request: decode tokens over decode time, the first token left
out).

    python -m build.bench_spec_web [--workloads demo-code,demo-open,demo-draft,200m-repetitive]
                                   [--rounds 4] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path
from typing import Any

from build import bench_spec, web
from build.bench_web import chromium, cpu_busy, machine, serving

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "dist" / "bench-spec-web"

# Runs in the page: load the model, warm up, then the requests' turns; each run's timings.
PAGE = """async ({model, dtype, requests, rounds}) => {
  const {load} = await import('./ortpipe.js');
  const pipe = await load(model, {device: 'wasm', ...(dtype ? {dtype} : {})});
  try {
    for (const r of requests) await pipe.generate({...r, seed: 0});
    const runs = requests.map(() => []);
    for (let round = 0; round < rounds; round++) {
      const order = round % 2 ? [...requests.keys()].reverse() : [...requests.keys()];
      for (const i of order) {
        const {tokens, timings} = await pipe.generate({...requests[i], seed: round});
        runs[i].push({tokens, decodeMs: timings.decodeMs, newTokens: timings.newTokens,
                      drafted: timings.draftedTokens, accepted: timings.acceptedTokens});
      }
    }
    return runs;
  } finally {
    pipe.dispose();
  }
}"""


LOOKUP = {"ngramSize": bench_spec.SPECULATIVE["ngram_size"],
          "maxDraftTokens": bench_spec.SPECULATIVE["max_draft_tokens"]}
DRAFTING = {"draftModel": "models/demo/", "maxDraftTokens": bench_spec.DRAFTING["max_draft_tokens"]}


DEFAULT = ("demo-code", "demo-open", "demo-draft", "demo-draft-sampled", "200m-repetitive",
           "200m-q8-repetitive")


def workloads() -> dict[str, tuple[str, Any, dict[str, Any], dict[str, Any], str | None]]:
    """name -> (the served model's name, its folder (or what makes it, when chosen), the request in
    the JS API's names, what makes it speculate, the variant loaded)."""
    demo = bench_spec.WORKLOADS["demo-code"]
    sampled = bench_spec.WORKLOADS["demo-open"]
    drafted = bench_spec.WORKLOADS["demo-draft"]
    from build.bench_web import CACHE

    rng = random.Random(0)
    pattern = [rng.randrange(3, 1000) for _ in range(40)]
    demo_sampling = {"doSample": True, "temperature": 0.7, "topK": 40, "topP": 0.95}
    open_request = {"promptIds": bench_spec.prompt_of(sampled), "maxNewTokens": sampled.new_tokens}
    return {
        "demo-code": ("demo", bench_spec.folder_of(demo),
                      {"promptIds": bench_spec.prompt_of(demo), "maxNewTokens": demo.new_tokens,
                       "doSample": False}, LOOKUP, None),
        "demo-open": ("demo", bench_spec.folder_of(sampled), {**open_request, **demo_sampling}, LOOKUP, None),
        "demo-draft": ("demo-fp32", bench_spec.folder_of(drafted), {**open_request, "doSample": False},
                       DRAFTING, "fp32"),
        "demo-draft-sampled": ("demo-fp32", bench_spec.folder_of(drafted), {**open_request, **demo_sampling},
                               DRAFTING, "fp32"),
        "100m-repetitive": ("100m", CACHE / "100m",
                            {"promptIds": pattern * 4, "maxNewTokens": 64, "doSample": False}, LOOKUP, None),
        "200m-repetitive": ("200m", bench_spec.folder_of(bench_spec.WORKLOADS["200m-repetitive"]),
                            {"promptIds": bench_spec.prompt_of(bench_spec.WORKLOADS["200m-repetitive"]),
                             "maxNewTokens": 128, "doSample": False}, LOOKUP, None),
        # the same weights as the browser's users get such a model: Optimum's export, its q8 variant
        "200m-q8-repetitive": ("200m-q8", lambda: bench_spec.folder("200m-q8"),
                               {"promptIds": bench_spec.prompt_of(bench_spec.WORKLOADS["200m-repetitive"]),
                                "maxNewTokens": 128, "doSample": False}, LOOKUP, None),
    }


def measure(browser: Any, url: str, model: str, request: dict[str, Any], speculative: dict[str, Any],
            dtype: str | None, rounds: int) -> list[list[dict]]:
    context = browser.new_context()
    try:
        page = context.new_page()
        page.set_default_timeout(60 * 60 * 1000)
        page.goto(url)
        return page.evaluate(PAGE, {"model": f"models/{model}/", "dtype": dtype, "rounds": rounds,
                                    "requests": [request, {**request, **speculative}]})
    finally:
        context.close()


def summary(name: str, runs: list[list[dict]], busy: tuple[float, float]) -> dict[str, Any]:
    def speed(engine: list[dict]) -> float:
        return sum(r["newTokens"] - 1 for r in engine) * 1000 / sum(r["decodeMs"] for r in engine)

    plain, lookup = runs
    drafted = sum(r["drafted"] for r in lookup)
    return {
        "workload": name,
        "plain_tokens_per_s": round(speed(plain), 1),
        "speculative_tokens_per_s": round(speed(lookup), 1),
        "speculative_vs_plain": round(speed(lookup) / speed(plain), 2),
        "acceptance_rate": round(sum(r["accepted"] for r in lookup) / drafted, 3) if drafted else None,
        "same_tokens": all(a["tokens"] == b["tokens"] for a, b in zip(plain, lookup, strict=True)),
        "cpu_busy_before_after": busy,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m build.bench_spec_web",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", default=",".join(DEFAULT))
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    chosen = {name: workloads()[name] for name in args.workloads.split(",")}
    models = {model: folder() if callable(folder) else folder for model, folder, *_ in chosen.values()}
    if any(speculative is DRAFTING for *_, speculative, _ in chosen.values()):
        models["demo"] = bench_spec.folder("demo")
    bundle = web.build(OUT, list(models.items()))
    results = []
    with chromium() as browser, serving(bundle, 1) as url:
        for name, (model, _, request, speculative, dtype) in chosen.items():
            before = cpu_busy()
            runs = measure(browser, url, model, request, speculative, dtype, args.rounds)
            results.append(summary(name, runs, (round(before, 2), round(cpu_busy(), 2))))
            print(json.dumps(results[-1]), flush=True)
    report = {"machine": machine(), "settings": bench_spec.SPECULATIVE, "rounds": args.rounds,
              "results": results}
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
