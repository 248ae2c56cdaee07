"""Browser benchmark: ortpipe against transformers.js in headless Chromium, on wasm. Not a test.

    python -m build.bench_web [--models demo,20m,100m] [--threads 1] [--rounds 3] [--warmup-runs 1]
                              [--warm-runs 3] [--prompt-tokens 64] [--new-tokens 128]
                              [--engines ortpipe,transformers.js,transformers.js-text,
                                         transformers.js-own-ort,ort]
                              [--interleave] [--profile] [--quiet 1] [--json results.json]

An engine may name the model variant it runs and a mode: `ortpipe@q8`, `transformers.js@q8:sampled`,
`ort@q4acc0` (web/bench.js). Ratios compare the first engine named with each other one.

Every engine loads the same model folder from the same origin and generates from the same prompt
ids: the demo model (models/demo, with every variant of build/variants.py beside the ones it ships)
or an Optimum (concat-layout) export of a random-weight Llama. The engines: ortpipe; transformers.js over the
onnxruntime-web build ortpipe bundles (the same kernels), taking ids only or (transformers.js-text)
streaming text as well with its TextStreamer, as ortpipe does; transformers.js over the onnxruntime-web
it bundles itself (as shipped); and the floor, a hand-written greedy loop over ortpipe's
onnxruntime-web build: the kernels' time with no framework. For each engine and round, a fresh
browser context opens web/bench.html, which measures the cold start (navigation start to the first
generated token, nothing cached), then warm generations: time to first token and decode tokens/s,
taken where the tokens arrive (the page's thread). The engines take turns page by page, in an order
rotated every round, so that load from other processes hits them all. Every generation's tokens are
compared with transformers.js's; a difference is a warning (and exit status 1). With --interleave,
each round is one page instead that loads every engine and lets them take turns generation by
generation (rotating who goes first), so that a moment of load from elsewhere hits all engines
alike; no cold start is measured then. A request that
leaves the page's origin is an error. --profile traces one more page load per model and engine with
V8's sampling profiler and splits each engine's per-token time by kind of code (kernels, Python,
JS glue, ...).

Models are built once into build/cache/bench-web/ (a torch model, exported by Optimum in its own
virtualenv, see build/hfmodels.py); the bundle goes to dist/bench-web/ (build/web.py, plus
transformers.js and the onnxruntime-web files it needs). Results: tables with ortpipe /
transformers.js ratios on stdout and, with --json, every measurement. The "Browser" section of
docs/benchmarks.md reads them.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from build import hfmodels, web
from build.bench import interval
from build.bench_models import Size

ROOT = Path(__file__).resolve().parent.parent
CACHE = hfmodels.cache_root() / "bench-web"
OUT = ROOT / "dist" / "bench-web"
SEED = 0

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
ENGINES = ("ortpipe", "transformers.js", "transformers.js-text", "transformers.js-own-ort", "ort")
DEMO = ROOT / "models" / "demo"
# One page (load + cold generation + warm generations) may take this long on the larger model.
PAGE_TIMEOUT_MS = 15 * 60 * 1000


# --- models --------------------------------------------------------------------------------------

# Head size 64 in both.
SIZES = {
    "20m": Size("20m", hidden=384, layers=8, heads=6, kv_heads=2, intermediate=1024, vocab=8000),
    "100m": Size("100m", hidden=768, layers=12, heads=12, kv_heads=4, intermediate=2048, vocab=16000),
}


def model_folder(name: str) -> Path:
    return demo_folder() if name == "demo" else with_q8(optimum_folder(SIZES[name]))


def with_q8(folder: Path) -> Path:
    """A copy of an Optimum folder with its q8 variant beside the fp32 graph (build/variants.py)."""
    from build import variants

    def build(out: Path) -> Path:
        shutil.copytree(folder, out)
        variants.write_variants(out / "onnx" / "model.onnx", ["q8"])
        return out

    recipe = (folder.parent / f"{folder.name}.done").read_text()  # the fp32 build's fingerprint
    recipe += (ROOT / "build" / "variants.py").read_text()
    return hfmodels.cached(f"{folder.name}-q8", build, root=CACHE, recipe=recipe)


def demo_folder() -> Path:
    """models/demo with, beside its q4 and q8 graphs, the variants it does not ship (build/variants.py,
    from its int4 graph dequantized): fp32, fp16, q4f16, and the q4 graph at accuracy levels 0 and
    1 (`ort@q4acc0`, `ort@q4acc1`; the shipped q4 is at level 4). Weights inside each graph."""

    def build(out: Path) -> Path:
        shutil.copytree(DEMO, out)
        onnx_dir = out / "onnx"
        q4 = onnx_dir / "model_q4.onnx"
        fp32 = variants.save(variants.dequantized(onnx.load(q4)), onnx_dir / "model.onnx")
        variants.write_variants(fp32, ["fp16"])
        variants.to_fp16(q4, onnx_dir / "model_q4f16.onnx")
        for level in (0, 1):
            variants.with_accuracy_level(q4, onnx_dir / f"model_q4acc{level}.onnx", level)
        return out

    import onnx

    from build import variants

    sources = [*sorted(p for p in DEMO.rglob("*") if p.is_file()), ROOT / "build" / "variants.py"]
    recipe = hashlib.sha256(b"".join(f.read_bytes() for f in sources)).hexdigest()
    return hfmodels.cached("demo", build, root=CACHE, recipe=recipe)


def optimum_folder(size: Size) -> Path:
    """The transformers.js layout of `size`, built into the cache once."""

    def build(out: Path) -> Path:
        with tempfile.TemporaryDirectory(prefix=f"bench-web-{size.name}-", dir=CACHE) as scratch:
            hf_dir = make_hf_model(size, Path(scratch) / "hf")
            export = hfmodels.export_concat(hf_dir, Path(scratch) / "export")
            transformers_js_layout(export, out)
        return out

    return hfmodels.cached(size.name, build, root=CACHE, recipe=_fingerprint(size))


def _fingerprint(size: Size) -> str:
    """Changes with the size, the recipe's code and Optimum's environment: never a stale build."""
    import inspect

    recipe = (make_hf_model, write_tokenizer, transformers_js_layout, hfmodels._perturb)
    parts = [
        json.dumps(asdict(size)),
        str(SEED),
        *map(inspect.getsource, recipe),
        *hfmodels.OPTIMUM_REQUIREMENTS,
    ]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()


def make_hf_model(size: Size, out: Path) -> Path:
    """A seeded random Llama saved with save_pretrained, with a WordLevel tokenizer over its vocab.

    hfmodels._perturb makes the logits peaky (clear greedy margins, so both engines pick the same
    tokens) and zeroes the output rows of pad, bos and eos: greedy decoding never stops early.
    """
    import torch
    import transformers

    torch.manual_seed(SEED)
    config = transformers.LlamaConfig(
        vocab_size=size.vocab,
        hidden_size=size.hidden,
        intermediate_size=size.intermediate,
        num_hidden_layers=size.layers,
        num_attention_heads=size.heads,
        num_key_value_heads=size.kv_heads,
        head_dim=size.hidden // size.heads,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        bos_token_id=hfmodels.BOS_ID,
        eos_token_id=hfmodels.EOS_ID,
        pad_token_id=hfmodels.PAD_ID,
    )
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    hfmodels._perturb(model, SEED)
    model.generation_config = transformers.GenerationConfig(
        bos_token_id=hfmodels.BOS_ID,
        eos_token_id=hfmodels.EOS_ID,
        pad_token_id=hfmodels.PAD_ID,
        do_sample=False,
    )
    model.save_pretrained(out, safe_serialization=True)
    write_tokenizer(size.vocab, out)
    return out


def parameter_count(folder: Path) -> int:
    config = json.loads((folder / "config.json").read_text())
    hidden, vocab = config["hidden_size"], config["vocab_size"]
    head = config["head_dim"]
    attention = hidden * head * (2 * config["num_attention_heads"] + 2 * config["num_key_value_heads"])
    layer = attention + 3 * hidden * config["intermediate_size"] + 2 * hidden
    tables = 1 if config.get("tie_word_embeddings") else 2
    return config["num_hidden_layers"] * layer + tables * vocab * hidden + hidden


def write_tokenizer(vocab: int, folder: Path) -> None:
    """tokenizer.json (WordLevel: "<pad>", "<s>", "</s>", then "t3", "t4", ...) + tokenizer_config.json."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = {token: i for i, token in enumerate(hfmodels.SPECIALS)}
    words.update({f"t{i}": i for i in range(len(words), vocab)})
    tokenizer = Tokenizer(models.WordLevel(vocab=words, unk_token=hfmodels.SPECIALS[0]))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens(list(hfmodels.SPECIALS))
    tokenizer.save(str(folder / "tokenizer.json"))
    pad, bos, eos = hfmodels.SPECIALS
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "pad_token": pad,
        "bos_token": bos,
        "eos_token": eos,
        "unk_token": pad,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 2048,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def transformers_js_layout(export: Path, out: Path) -> None:
    """Optimum's folder as transformers.js reads it: the graph (and any external data) under onnx/."""
    (out / "onnx").mkdir(parents=True)
    for item in sorted(export.iterdir()):
        if item.name.startswith("model.onnx"):
            shutil.copy2(item, out / "onnx" / item.name)
        elif item.suffix == ".json":
            shutil.copy2(item, out / item.name)


# --- the bundle ----------------------------------------------------------------------------------

TRANSFORMERS_JS = web.NODE_MODULES / "@huggingface" / "transformers"
# transformers.js bundles onnxruntime-web's JavaScript; the wasm build it picks (asyncify) comes
# from the onnxruntime-web package of the exact version it depends on.
TRANSFORMERS_JS_ORT_FILES = ("ort-wasm-simd-threaded.asyncify.mjs", "ort-wasm-simd-threaded.asyncify.wasm")


def build_bundle(out: Path, models: dict[str, Path]) -> Path:
    """build/web.py's bundle with the model folders, plus the benchmark page and transformers.js
    under tjs/."""
    web.build(out, list(models.items()))
    for name in web.BENCH_FILES:
        shutil.copy2(web.WEB / name, out / name)
    tjs = out / "tjs"
    tjs.mkdir()
    shutil.copy2(TRANSFORMERS_JS / "dist" / "transformers.min.js", tjs)
    ort = _transformers_js_ort()
    for name in TRANSFORMERS_JS_ORT_FILES:
        shutil.copy2(ort / "dist" / name, tjs)
    return out


def _transformers_js_ort() -> Path:
    """The onnxruntime-web package transformers.js depends on (nested, or hoisted when it matches)."""
    if not TRANSFORMERS_JS.is_dir():
        raise web.BuildError(f"{TRANSFORMERS_JS} is missing: run `npm ci` in {ROOT}")
    wanted = _package(TRANSFORMERS_JS)["dependencies"]["onnxruntime-web"]
    candidates = (TRANSFORMERS_JS / "node_modules" / "onnxruntime-web", web.NODE_MODULES / "onnxruntime-web")
    for folder in candidates:
        if folder.is_dir() and _package(folder)["version"] == wanted:
            return folder
    raise web.BuildError(f"onnxruntime-web {wanted} (for transformers.js) is not installed: run `npm ci`")


def _package(folder: Path) -> dict:
    return json.loads((folder / "package.json").read_text())


# --- the browser ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Settings:
    models: tuple[str, ...]
    threads: tuple[int, ...]
    rounds: int
    warmup_runs: int
    warm_runs: int
    prompt_tokens: int
    new_tokens: int
    engines: tuple[str, ...] = ENGINES
    quiet: float = 1.0  # wait before each page load until the CPUs are at most this busy (0 to 1)
    interleave: bool = False  # all engines in one page per round, taking turns generation by generation


def prompt_ids(vocab: int, count: int) -> list[int]:
    """The same seeded prompt for every engine: ids past the special tokens."""
    rng = random.Random(SEED)
    return [rng.randrange(len(hfmodels.SPECIALS), vocab) for _ in range(count)]


def page_queries(models: dict[str, Path], settings: Settings, threads: int) -> Iterator[dict]:
    """bench.html's query for each model and engine."""
    for name, folder in models.items():
        vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
        prompt = ",".join(map(str, prompt_ids(vocab, settings.prompt_tokens)))
        for engine in [",".join(settings.engines)] if settings.interleave else settings.engines:
            yield {
                "engine": engine,
                "model": name,
                "threads": threads,
                "newTokens": settings.new_tokens,
                "warmupRuns": settings.warmup_runs,
                "warmRuns": settings.warm_runs,
                "prompt": prompt,
            }


def measure(browser, bundle: Path, models: dict[str, Path], settings: Settings) -> list[dict]:  # noqa: ANN001
    """Every engine's timed runs: per thread count, model and round, each engine once, in rotated order
    (each engine goes first in some round); one page per engine, or one for all when interleaved."""
    runs = []
    for threads in settings.threads:
        with serving(bundle, threads) as url:
            queries = list(page_queries(models, settings, threads))
            for round_ in range(settings.rounds):
                for model in models:
                    engines = [q for q in queries if q["model"] == model]
                    for query in _rotated(engines, round_):
                        if settings.interleave:  # the page loads them in this order; who goes first rotates
                            query = {**query, "engine": ",".join(_rotated(settings.engines, round_))}
                        _progress(query, f"round {round_ + 1}")
                        busy = wait_for_quiet(settings.quiet)
                        page = open_page(browser, url, query)
                        for run in page.get("interleaved", [page]):
                            runs.append({**run, "round": round_, "busy_before": busy})
    return runs


def profile(browser, bundle: Path, models: dict[str, Path], settings: Settings) -> list[dict]:  # noqa: ANN001
    """One traced page load per model and engine at the first thread count: where the engine's worker
    spends its time during the measured runs, in ms per generated token."""
    threads = settings.threads[0]
    rows = []
    with serving(bundle, threads) as url:
        for query in page_queries(models, replace(settings, interleave=False), threads):  # one engine a page
            _progress(query, "profile")
            wait_for_quiet(settings.quiet)
            result, trace = open_page(browser, url, {**query, "profile": 1}, trace=True)
            tokens = sum(len(w["tokens"]) for w in result["warm"])
            functions = worker_functions(trace)
            rows.append(
                {
                    "model": query["model"],
                    "threads": threads,
                    "engine": query["engine"],
                    "ms_per_token": {kind: ms / tokens for kind, ms in by_kind(functions).items()},
                    "top_functions_ms_per_token": [
                        (f, file, ms / tokens) for f, file, ms in top_functions(functions)
                    ],
                    "decode_tokens_per_s": statistics.median(w["decodeTokensPerS"] for w in result["warm"]),
                }
            )
    return rows


def cpython(models: dict[str, Path], settings: Settings, dtypes: Sequence[str]) -> list[dict]:
    """The reference the browser is compared with: ortpipe under CPython, one thread, the same
    prompt, greedy; each variant of `dtypes` a folder has, the variants taking turns per round."""
    import ortpipe
    from ortpipe import variants
    from ortpipe.folder import LocalFolder

    rows = []
    for name, folder in models.items():
        vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
        ids = prompt_ids(vocab, settings.prompt_tokens)
        found = variants.present(LocalFolder(folder), "onnx/model.onnx")
        pipes = {d: ortpipe.load(folder, threads=1, dtype=d) for d in dtypes if d in found}
        runs: dict[str, list] = {d: [] for d in pipes}
        for round_ in range(settings.warmup_runs + max(1, settings.rounds) * settings.warm_runs):
            for dtype, pipe in pipes.items():
                result = pipe.generate(prompt_ids=ids, max_new_tokens=settings.new_tokens, do_sample=False)
                timings = result.timings
                if round_ >= settings.warmup_runs:
                    runs[dtype].append((timings.decode_tokens_per_s, timings.prefill_ms))
        rows += [{"model": name, "dtype": d, "decode_tokens_per_s": statistics.median(r[0] for r in got),
                  "prefill_ms": statistics.median(r[1] for r in got), "generations": len(got)}
                 for d, got in runs.items()]
    return rows


def cpython_table(rows: list[dict]) -> str:
    lines = ["| model | variant | CPython decode tok/s (1 thread) | prefill ms | generations |",
             "| --- | --- | ---: | ---: | ---: |"]
    lines += [f"| {r['model']} | {r['dtype']} | {r['decode_tokens_per_s']:.0f} | {r['prefill_ms']:.1f} "
              f"| {r['generations']} |" for r in rows]
    return "\n".join(lines)


def wait_for_quiet(limit: float, patience_s: float = 900) -> float:
    """Wait (at most `patience_s`) until other processes leave the CPUs idle enough to time a page
    load; returns how busy the CPUs were when we stopped waiting."""
    deadline = time.monotonic() + patience_s
    busy = cpu_busy()
    while busy > limit and time.monotonic() < deadline:
        time.sleep(5)
        busy = cpu_busy()
    if busy > limit:
        print(f"  the CPUs are {busy:.0%} busy: measuring anyway", file=sys.stderr)
    return round(busy, 3)


def cpu_busy(seconds: float = 2.0) -> float:
    """The fraction of all CPUs' time spent busy over `seconds` (/proc/stat)."""

    def sample() -> tuple[int, int]:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        return sum(fields[:8]), fields[3] + fields[4]  # all time (no guest), idle + iowait

    total0, idle0 = sample()
    time.sleep(seconds)
    total1, idle1 = sample()
    return 1 - (idle1 - idle0) / max(1, total1 - total0)


def _rotated(items: Sequence, by: int) -> list:
    by %= len(items)
    return [*items[by:], *items[:by]]


def _progress(query: dict, what: str) -> None:
    print(f"  {query['model']} threads={query['threads']} {what}: {query['engine']}", file=sys.stderr)


@contextmanager
def chromium() -> Iterator:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            yield browser
        finally:
            browser.close()


@contextmanager
def serving(bundle: Path, threads: int) -> Iterator[str]:
    """The bundle on a free port. More than one thread needs a cross-origin isolated page (COOP/COEP
    headers); one thread is served without them, where ortpipe's worker takes a single thread."""
    from ortpipe.static_server import serve_in_thread

    server, url = serve_in_thread(bundle, coop=threads > 1)
    try:
        yield url
    finally:
        server.shutdown()
        server.server_close()


def open_page(browser, url: str, query: dict, trace: bool = False):  # noqa: ANN001, ANN201 (Playwright)
    """One engine in a fresh context (no cache of any kind): bench.html's measurements, and with
    `trace` the Chrome trace (with V8's sampling profiler) of the page load as well."""
    from urllib.parse import urlencode

    context = browser.new_context()
    errors: list[str] = []
    requests: list[str] = []  # every URL the page and its workers asked for
    context.on("request", lambda r: requests.append(r.url))
    try:
        page = context.new_page()
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.set_default_timeout(PAGE_TIMEOUT_MS)
        if trace:
            browser.start_tracing(page=page, categories=TRACE_CATEGORIES)
        page.goto(f"{url}bench.html?{urlencode(query)}")
        result = page.evaluate("window.benchResult")
        traced = json.loads(browser.stop_tracing()) if trace else None
    finally:
        context.close()
    if "error" in result:
        details = "\n".join(errors[-5:])
        raise RuntimeError(f"{query['engine']} on {query['model']}: {result['error']}\n{details}")
    outside = [u for u in requests if not u.startswith((url, "blob:", "data:"))]
    if outside:
        raise RuntimeError(f"{query['engine']} on {query['model']} left the origin {url}: {outside[:5]}")
    result["requests"] = len(requests)
    return (result, traced) if trace else result


# --- profiles ------------------------------------------------------------------------------------

TRACE_CATEGORIES = ["disabled-by-default-v8.cpu_profiler", "blink.user_timing", "__metadata"]
# Where a sampled function's code comes from (the end of its script's URL) -> what it is.
SOURCES = (
    ("ort-wasm-simd-threaded", ".wasm", "onnxruntime kernels (wasm)"),
    ("ort", ".mjs", "onnxruntime-web JS (tensors in and out of the wasm heap)"),
    ("pyodide", "", "Python (Pyodide: interpreter, FFI)"),
    ("transformers", ".js", "transformers.js JS (with its bundled onnxruntime-web JS)"),
    ("tokenizers", ".mjs", "tokenizers.js (ortpipe's streamed text)"),
    ("", "bridge.js", "worker glue (bridge.js, worker.js, bench.js)"),
    ("", "worker.js", "worker glue (bridge.js, worker.js, bench.js)"),
    ("", "bench.js", "worker glue (bridge.js, worker.js, bench.js)"),
)
SPECIAL_FRAMES = {
    "(garbage collector)": "garbage collector",
    "(idle)": "idle (waiting)",
    "postMessage": "postMessage",
}
OTHER = "other (V8 and Blink internals, wasm <-> JS calls)"


def worker_functions(trace: dict) -> dict[tuple[str, str], float]:
    """Milliseconds per (function, script file) on the busiest worker thread between bench.html's
    bench-warm-start and bench-warm-end marks."""
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    marks = {e["name"]: e["ts"] for e in events if e.get("name") in ("bench-warm-start", "bench-warm-end")}
    start, end = marks["bench-warm-start"], marks["bench-warm-end"]
    workers = {
        (e["pid"], e["tid"])
        for e in events
        if e.get("name") == "thread_name" and e["args"]["name"] == "DedicatedWorker thread"
    }
    totals = []
    for thread, nodes, samples in _profiles(events):
        if thread not in workers:
            continue
        window = [(t, node) for t, node in samples if start <= t <= end]
        spent: dict[tuple[str, str], float] = {}
        for (t, node), (t_next, _) in zip(window, window[1:], strict=False):
            frame = nodes[node]["callFrame"]
            key = (frame["functionName"], frame.get("url", "").rsplit("/", 1)[-1])
            spent[key] = spent.get(key, 0.0) + (t_next - t) / 1000
        totals.append(spent)
    return max(totals, key=lambda s: sum(ms for (name, _), ms in s.items() if name != "(idle)"))


def by_kind(functions: dict[tuple[str, str], float]) -> dict[str, float]:
    kinds: dict[str, float] = {}
    for (name, script), ms in functions.items():
        kind = _kind(name, script)
        kinds[kind] = kinds.get(kind, 0.0) + ms
    return dict(sorted(kinds.items(), key=lambda kv: -kv[1]))


def top_functions(functions: dict[tuple[str, str], float], count: int = 15) -> list[tuple[str, str, float]]:
    ranked = sorted(functions.items(), key=lambda kv: -kv[1])[:count]
    return [(name, script, ms) for (name, script), ms in ranked]


def _profiles(events: list[dict]) -> Iterator[tuple[tuple, dict, list]]:
    """Each sampled thread: its (pid, tid), its call tree's nodes by id and its (time, node) samples."""
    profiles: dict[tuple, dict] = {}
    for e in events:
        if e.get("name") == "Profile":
            profiles[(e["pid"], e["id"])] = {
                "thread": (e["pid"], e["tid"]),
                "nodes": {},
                "samples": [],
                "time": e["args"]["data"]["startTime"],
            }
        elif e.get("name") == "ProfileChunk" and (e["pid"], e["id"]) in profiles:
            profile = profiles[(e["pid"], e["id"])]
            data = e["args"]["data"]
            tree = data.get("cpuProfile", {})
            profile["nodes"].update({n["id"]: n for n in tree.get("nodes", [])})
            for node, delta in zip(tree.get("samples", []), data.get("timeDeltas", []), strict=True):
                profile["time"] += delta
                profile["samples"].append((profile["time"], node))
    for profile in profiles.values():
        yield profile["thread"], profile["nodes"], profile["samples"]


def _kind(function: str, script: str) -> str:
    for prefix, suffix, kind in SOURCES:
        if script and script.startswith(prefix) and script.endswith(suffix):
            return kind
    return SPECIAL_FRAMES.get(function, OTHER)


# --- results -------------------------------------------------------------------------------------


def summarize(runs: list[dict]) -> list[dict]:
    """Medians per (model, threads, engine): cold start over rounds, the rest over all warm runs."""
    groups: dict[tuple, list[dict]] = {}
    for run in runs:
        groups.setdefault((run["model"], run["threads"], run["engine"]), []).append(run)
    rows = []
    for (model, threads, engine), group in groups.items():
        warm = [w for run in group for w in run["warm"]]
        rows.append(
            {
                "model": model,
                "threads": threads,
                "engine": engine,
                "versions": group[0]["versions"],
                # none when interleaved: the engines of a page load one after another
                "cold_start_ms": _median_or_none(run["coldStartMs"] for run in group if run["coldStartMs"]),
                "load_ms": _median_or_none(run["loadedMs"] for run in group if run["loadedMs"]),
                "first_token_ms": statistics.median(w["firstTokenMs"] for w in warm),
                "decode_tokens_per_s": statistics.median(w["decodeTokensPerS"] for w in warm),
                "token_ms": statistics.median(w["medianTokenMs"] for w in warm),
                # ortpipe's own count (its Python side: no worker-to-page message in it)
                "reported_decode_tokens_per_s": _median_or_none(
                    w["reported"]["decodeTokensPerS"] for w in warm if w.get("reported")
                ),
            }
        )
    return rows


def _median_or_none(values: Iterable[float]) -> float | None:
    values = list(values)
    return statistics.median(values) if values else None


def engine_name(spec: str) -> str:
    """"transformers.js@q8:sampled" -> "transformers.js" (web/bench.js parses the rest)."""
    return spec.split(":")[0].split("@")[0]


def _token_group(run: dict) -> tuple:
    """Generations that must give the same tokens: greedy ones of one graph (a model, a thread count
    and a variant), and the seeded sampled ones of one engine; None for unseeded sampling."""
    spec = run["engine"]
    dtype = run["versions"].get("dtype") or (spec.split(":")[0].split("@") + ["fp32"])[1]  # what it ran
    if spec.endswith(":sampled"):
        return (run["model"], run["threads"], spec) if engine_name(spec) == "ortpipe" else None
    return (run["model"], run["threads"], dtype)


def _reference(group: list[dict]) -> dict:
    return next((r for r in group if engine_name(r["engine"]) == "transformers.js"), group[0])


def token_mismatches(runs: list[dict], new_tokens: int) -> list[str]:
    """Every generation of a group (_token_group) against its first transformers.js one."""
    problems = []
    for key in dict.fromkeys(filter(None, map(_token_group, runs))):
        group = [run for run in runs if _token_group(run) == key]
        reference = _reference(group)
        expected = reference["cold"]["tokens"]
        for run in group:
            generations = {"cold": run["cold"], **{f"warm {i + 1}": w for i, w in enumerate(run["warm"])}}
            for label, generation in generations.items():
                where = f"{key[0]} threads={key[1]} {run['engine']} round {run['round'] + 1} {label}"
                problems += _compare(generation["tokens"], expected, new_tokens, where, reference["engine"])
    return problems


def token_report(runs: list[dict]) -> str:
    """Each group's reference tokens (transformers.js's first generation) and how many generations of
    which engines were compared with them."""
    lines = []
    for key in dict.fromkeys(filter(None, map(_token_group, runs))):
        group = [run for run in runs if _token_group(run) == key]
        reference = _reference(group)
        count = sum(1 + len(run["warm"]) for run in group)
        engines = ", ".join(dict.fromkeys(run["engine"] for run in group))
        lines.append(
            f"{key[0]} threads={key[1]} {key[2]}: {count} generations ({engines}) compared with "
            f"{reference['engine']}'s tokens {reference['cold']['tokens'][:12]}..."
        )
    return "\n".join(lines)


def _compare(tokens: list[int], expected: list[int], new_tokens: int, where: str, against: str) -> list[str]:
    problems = []
    if len(tokens) != new_tokens:
        problems.append(f"{where}: {len(tokens)} tokens, not {new_tokens}")
    first = next((i for i, (a, b) in enumerate(zip(tokens, expected, strict=False)) if a != b), None)
    if first is not None:
        problems.append(
            f"{where}: differs from {against} from token {first} ({tokens[first]} != {expected[first]})"
        )
    return problems


def table(rows: list[dict]) -> str:
    """Markdown: one line per model, thread count and engine, with its medians."""
    lines = [
        "| model | threads | engine | variant | onnxruntime-web | decode tok/s | ms/token | first token ms "
        "| cold start ms | load ms |",
        "| --- | ---: | --- | --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        ort = r["versions"].get("onnxruntime-web")
        lines.append(
            f"| {r['model']} | {r['threads']} | {r['engine']} | {r['versions'].get('dtype', '')} | {ort} "
            f"| {r['decode_tokens_per_s']:.1f} | {r['token_ms']:.2f} | {r['first_token_ms']:.0f} "
            f"| {_ms(r['cold_start_ms'])} | {_ms(r['load_ms'])} |"
        )
    return "\n".join(lines)


def _ms(value: float | None) -> str:
    return "" if value is None else f"{value:.0f}"


# What each ratio compares: (field of a page's result, higher is better for the engine).
# The median token interval shrugs off the stalls other processes cause better than tokens/s.
RATIO_FIELDS = {
    "decode tok/s": ("decodeTokensPerS", True),
    "median token interval": ("medianTokenMs", False),
    "first token": ("firstTokenMs", False),
    "cold start": ("coldStartMs", False),
}


def page_value(run: dict, field: str) -> float:
    """One page's number: the median over its warm generations, or its cold start (None when the
    page was interleaved)."""
    if field == "coldStartMs":
        return run[field]
    return statistics.median(w[field] for w in run["warm"])


def round_ratios(
    runs: list[dict], other: str, what: str, subject: str = "ortpipe"
) -> dict[tuple, list[float]]:
    """`subject`'s speed over `other`'s (above 1: the subject is faster) for `what`, one ratio per
    round from the two pages of that round (loaded minutes apart at most, under the same load)."""
    field, higher_is_better = RATIO_FIELDS[what]
    pages = {(r["model"], r["threads"], r["round"], r["engine"]): page_value(r, field) for r in runs}
    ratios: dict[tuple, list[float]] = {}
    for (model, threads, round_, engine), ours in pages.items():
        theirs = pages.get((model, threads, round_, other))
        # None: not measured; 0: a median interval of tokens that arrived in groups (runs saved before
        # bench.js shared a group's time among its tokens)
        if engine == subject and ours and theirs:
            ratio = ours / theirs if higher_is_better else theirs / ours
            ratios.setdefault((model, threads), []).append(ratio)
    return ratios


def ratio_table(runs: list[dict], others: Sequence[str], subject: str = "ortpipe") -> str:
    """Markdown: `subject`'s speed over each other engine, median of the per-round ratios (min-max;
    their mean and its 95% interval, t distribution over the rounds: the rounds are the samples)."""
    cells = [
        (other, what)
        for other in others
        for what in RATIO_FIELDS
        if engine_name(other) != "ort" or what not in ("first token", "cold start")
    ]  # the floor loads no framework
    lines = [
        "| model | threads | " + " | ".join(f"vs {o}: {w}" for o, w in cells) + " |",
        "| --- | ---: |" + " ---: |" * len(cells),
    ]
    found = {cell: round_ratios(runs, *cell, subject) for cell in cells}
    for key in dict.fromkeys((r["model"], r["threads"]) for r in runs):
        values = []
        for cell in cells:
            ratios = found[cell].get(key)
            if not ratios:
                values.append("")
                continue
            spread = interval(ratios)
            mean = (
                f"; mean {spread['mean']:.2f}, 95% {spread['ci95'][0]:.2f}-{spread['ci95'][1]:.2f}"
                if "ci95" in spread
                else ""
            )
            values.append(f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f}{mean})")
        lines.append(f"| {key[0]} | {key[1]} | " + " | ".join(values) + " |")
    return "\n".join(lines)


def rounds_table(runs: list[dict], engines: Sequence[str]) -> str:
    """Markdown: each round's decode tok/s per engine (median of the page's warm runs), and the first
    engine's over the second's."""
    pages = {
        (r["model"], r["threads"], r["round"], r["engine"]): page_value(r, "decodeTokensPerS") for r in runs
    }
    busy: dict[tuple, float] = {}  # the busiest the CPUs were before any page of the round
    for r in runs:
        key = (r["model"], r["threads"], r["round"])
        busy[key] = max(busy.get(key, 0.0), r["busy_before"])
    lines = [
        "| model | threads | round | CPUs busy before | "
        + " | ".join(engines)
        + f" | {' / '.join(engines[:2])} |",
        "| --- | ---: | ---: | ---: |" + " ---: |" * (len(engines) + 1),
    ]
    for model, threads, round_ in busy:
        values = [pages.get((model, threads, round_, e)) for e in engines]
        ours, theirs = values[0], values[1] if len(values) > 1 else None
        ratio = f"{ours / theirs:.2f}x" if ours and theirs else ""
        lines.append(
            f"| {model} | {threads} | {round_ + 1} | {busy[model, threads, round_]:.0%} | "
            + " | ".join(f"{v:.1f}" if v else "" for v in values)
            + f" | {ratio} |"
        )
    return "\n".join(lines)


def profile_table(rows: list[dict]) -> str:
    """Markdown: ms per generated token by kind of code, one column per model and engine."""
    kinds = list(dict.fromkeys(kind for row in rows for kind in row["ms_per_token"]))
    header = [f"{row['model']} {row['engine']}" for row in rows]
    lines = ["| ms per token | " + " | ".join(header) + " |", "| --- |" + " ---: |" * len(rows)]
    for kind in kinds:
        lines.append(_row(kind, (row["ms_per_token"].get(kind, 0.0) for row in rows), 2))
    lines.append(_row("**total**", (sum(row["ms_per_token"].values()) for row in rows), 2))
    lines.append(_row("decode tok/s while profiled", (row["decode_tokens_per_s"] for row in rows), 1))
    return "\n".join(lines)


def _row(label: str, values: Iterable[float], digits: int) -> str:
    return f"| {label} | " + " | ".join(f"{v:.{digits}f}" for v in values) + " |"


def machine() -> dict:
    """What the numbers were measured on, and how busy it was (load averages: 1, 5, 15 minutes)."""
    import os
    import platform
    import subprocess

    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        platform.processor(),
    )
    version = subprocess.run([CHROMIUM, "--version"], capture_output=True, text=True, check=False)
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "system": platform.platform(),
        "chromium": version.stdout.strip(),
        "load_average": [round(x, 2) for x in os.getloadavg()],
    }


# --- command line --------------------------------------------------------------------------------


def _csv(kind):  # noqa: ANN001, ANN202
    return lambda text: tuple(kind(item) for item in text.split(",") if item)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m build.bench_web", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--models", type=_csv(str), default=tuple(SIZES), help="comma-separated: demo,20m,100m"
    )
    parser.add_argument(
        "--threads",
        type=_csv(int),
        default=(1,),
        help="comma-separated thread counts; 1 is served without COOP/COEP, more with them",
    )
    parser.add_argument(
        "--rounds", type=int, default=3, help="page loads per engine (each a cold start); 0 for none"
    )
    parser.add_argument(
        "--warmup-runs", type=int, default=1, help="unmeasured generations after the cold one"
    )
    parser.add_argument("--warm-runs", type=int, default=3, help="measured generations per page load")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument(
        "--engines", type=_csv(str), default=ENGINES,
        help=f"comma-separated: {','.join(ENGINES)}, each with an optional @DTYPE and :sampled",
    )
    parser.add_argument(
        "--interleave",
        action="store_true",
        help="one page per model and round with every engine, taking turns generation "
        "by generation (no cold start then)",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="also trace one page load per model and engine (first thread count) and show "
        "where each engine's worker spends its time",
    )
    parser.add_argument(
        "--quiet",
        type=float,
        default=1.0,
        help="before each page load, wait until the CPUs are at most this busy "
        "(0 to 1; 1, the default: never wait, only record how busy they were)",
    )
    parser.add_argument(
        "--cpython", type=_csv(str), default=(), metavar="DTYPES",
        help="also time ortpipe under CPython (one thread, greedy) on these variants, e.g. q4,q8",
    )
    parser.add_argument("--out", type=Path, default=OUT, help="where the bundle is built")
    parser.add_argument("--json", type=Path, help="write every measurement here")
    parser.add_argument(
        "--show",
        type=Path,
        metavar="JSON",
        help="measure nothing: print the tables of a report written by --json",
    )
    args = parser.parse_args(argv)
    unknown = [m for m in args.models if m not in (*SIZES, "demo")]
    unknown += [e for e in args.engines if engine_name(e) not in ENGINES]
    if unknown:
        parser.error(f"unknown model or engine: {', '.join(unknown)}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.show:
        return show(json.loads(args.show.read_text()))
    settings = Settings(
        args.models,
        args.threads,
        args.rounds,
        args.warmup_runs,
        args.warm_runs,
        args.prompt_tokens,
        args.new_tokens,
        args.engines,
        args.quiet,
        args.interleave,
    )
    models = {name: model_folder(name) for name in settings.models}
    try:
        bundle = build_bundle(args.out, models)
    except web.BuildError as e:
        print(f"bench_web: {e}", file=sys.stderr)
        return 2
    report = {
        "machine_before": machine(),
        "settings": asdict(settings),
        "parameters": {name: parameter_count(folder) for name, folder in models.items()},
    }
    with chromium() as browser:
        runs = measure(browser, bundle, models, settings)
        profiles = profile(browser, bundle, models, settings) if args.profile else []
    report["cpython"] = cpython(models, settings, args.cpython) if args.cpython else []
    report.update(
        machine_after=machine(),
        summary=summarize(runs),
        profiles=profiles,
        token_mismatches=token_mismatches(runs, settings.new_tokens),
        runs=runs,
    )
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    return show(report)


def show(report: dict) -> int:
    """Print a report's token check and tables; 1 when generations differ."""
    runs, engines = report["runs"], report["settings"]["engines"]
    print(token_report(runs))
    if report["token_mismatches"]:
        print(
            f"\nWARNING: {len(report['token_mismatches'])} generations differ (near-ties aside, a bug in "
            "one engine):",
            file=sys.stderr,
        )
        for problem in report["token_mismatches"]:
            print(f"WARNING:   {problem}", file=sys.stderr)
    if runs:
        ratios = ratio_table(runs, engines[1:], engines[0])
        print(f"\n{table(report['summary'])}\n\n{ratios}\n\n{rounds_table(runs, engines)}")
    if report["profiles"]:
        print(profile_table(report["profiles"]))
    if report.get("cpython"):
        print(f"\n{cpython_table(report['cpython'])}")
    return 1 if report["token_mismatches"] else 0


if __name__ == "__main__":
    sys.exit(main())
