"""Browser benchmark of the loops that make no tokens, in headless Chromium on wasm (one thread). Not a test.

    python -m build.bench_loops_web [--texts 512] [--batch 32] [--rounds 3] [--runs 3]

Embeddings per second of ortpipe's `embed` and of transformers.js's feature-extraction pipeline (mean
pooling, normalised; over the onnxruntime-web build ortpipe bundles, so both run the same kernels; its
batches in the texts' order, and longest first as ortpipe makes them) on the
same sentence-transformers folder (build/bench_loops.py's st-bench, all-MiniLM-L6-v2's shape), and the
real-time factor of ortpipe's `speak` and of transformers.js's text-to-speech pipeline on the same VITS
folder (build/bench_loops.py's vits-bench: MMS-TTS's shape, in transformers.js's layout, the same
sentence), and the tokens per second of a greedy generation by ortpipe's generate and transformers.js's
AutoModelForSeq2SeqLM.generate on the same encoder-decoder (build/bench_loops.py's t5-bench: t5-small's shape,
random weights; every engine makes exactly `--tokens` tokens from the same 32 prompt ids). Each engine and
round is a fresh browser context
(nothing cached), engines alternating; within a page, one warm-up and `--runs` timed runs. The bundle is
build/bench_web.py's (transformers.js beside ortpipe) plus the page of build/bench_loops_page.js.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from tests import paradigm_refs as refs

from build import bench_loops, bench_web

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "dist" / "bench-loops"
PAGE = ('<!doctype html><html lang="en"><head><meta charset="utf-8"><title>ortpipe loops benchmark</title>'
        '<script type="module" src="bench-loops.js"></script></head><body><p>build/bench_loops_web.py</p>'
        "</body></html>\n")


def bundle(texts: list[str]) -> Path:
    models = {"st-bench": bench_loops.st_bench_folder(), "vits-bench": bench_loops.vits_bench_folder(),
              "t5-bench": bench_loops.t5_bench_folder()}
    out = bench_web.build_bundle(OUT, models)
    (out / "bench-loops.html").write_text(PAGE)
    (out / "bench-loops.js").write_text((ROOT / "build" / "bench_loops_page.js").read_text())
    (out / "texts.json").write_text(json.dumps(texts))
    ids = refs.vits_ids(models["vits-bench"], bench_loops.SPEECH)  # for the hand-written loop
    (out / "speech-ids.json").write_text(json.dumps(ids))
    (out / "seq2seq-ids.json").write_text(json.dumps(bench_loops.seq2seq_ids()))
    return out


def open_page(browser, url: str, query: str) -> dict:  # noqa: ANN001 (Playwright's)
    context = browser.new_context()
    try:
        page = context.new_page()
        page.set_default_timeout(bench_web.PAGE_TIMEOUT_MS)
        page.goto(f"{url}bench-loops.html?{query}")
        result = page.evaluate("window.benchResult")
    finally:
        context.close()
    if "error" in result:
        raise RuntimeError(f"{query}: {result['error']}")
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m build.bench_loops_web",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--texts", type=int, default=512)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--tasks", default="embed,tts", help="embed, tts, seq2seq, comma-separated "
                        "(default: embed,tts)")
    parser.add_argument("--tokens", type=int, default=64, help="seq2seq: tokens each generation makes")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    out = bundle(bench_loops.texts(args.texts))
    pages = [("ortpipe", "embed", "st-bench"), ("transformers.js", "embed", "st-bench"),
             ("transformers.js-sorted", "embed", "st-bench"), ("ortpipe", "tts", "vits-bench"),
             ("transformers.js", "tts", "vits-bench"), ("ort", "tts", "vits-bench"),
             ("ortpipe", "seq2seq", "t5-bench"), ("transformers.js", "seq2seq", "t5-bench")]
    pages = [p for p in pages if p[1] in args.tasks.split(",")]
    results: dict[str, list[dict]] = {f"{e} {t}": [] for e, t, _ in pages}
    with bench_web.chromium() as browser, bench_web.serving(out, 1) as url:
        for round_ in range(args.rounds):
            for engine, task, model in pages[round_ % len(pages):] + pages[:round_ % len(pages)]:
                print(f"round {round_ + 1}/{args.rounds}: {engine} {task}", file=sys.stderr, flush=True)
                query = (f"engine={engine}&task={task}&model={model}&batch={args.batch}&runs={args.runs}"
                         f"&tokens={args.tokens}")
                results[f"{engine} {task}"].append(open_page(browser, url, query))
    import numpy as np

    print(f"wasm, 1 thread, {args.rounds} rounds of {args.runs} runs; {args.texts} texts in batches of "
          f"{args.batch}")
    for task in args.tasks.split(","):
        firsts = [r[0]["first"] for k, r in results.items() if k.endswith(task)]
        if task == "seq2seq":
            agree = all(f == firsts[0] for f in firsts)
            print(f"seq2seq: the engines' tokens {'agree' if agree else 'DIFFER'}")
            continue
        difference = max(float(np.abs(np.array(firsts[0]) - np.array(f)).max()) for f in firsts[1:])
        print(f"{task}: max |ortpipe - the others| difference {difference:.1e} (first rows / samples)")
    for name, rounds in results.items():
        if name.endswith("seq2seq"):
            rates = sorted(args.tokens / statistics.median(r["runs"]) for r in rounds)
            shown = ", ".join(f"{v:.1f}" for v in rates)
            print(f"{name:24s} {statistics.median(rates):9.1f} tokens/s (rounds {shown})")
        elif name.endswith("embed"):
            rates = sorted(args.texts / statistics.median(r["runs"]) for r in rounds)
            shown = ", ".join(f"{v:.1f}" for v in rates)
            print(f"{name:24s} {statistics.median(rates):9.1f} texts/s (rounds {shown})")
        else:
            factors = sorted(statistics.median(r["runs"]) / r["audioSeconds"] for r in rounds)
            shown = ", ".join(f"{v:.4f}" for v in factors)
            print(f"{name:24s} {statistics.median(factors):9.4f} real-time factor "
                  f"(rounds {shown}, {rounds[0]['audioSeconds']:.3f} s of audio)")
    if args.json:
        args.json.write_text(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
