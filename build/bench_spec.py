"""`python -m build.bench_spec`: speculative decoding's speed, beside onnxruntime-genai's.

Each workload is a model folder, a prompt, greedy or sampled settings and a number of new tokens.
Four engines run it: ortpipe without speculation ("plain") and with it, onnxruntime-genai without
("genai") and with it. Prompt-lookup workloads speculate with ortpipe's prompt lookup ("lookup") and
genai's n-gram speculation ("genai-ngram", the same ngram_size and max_draft_tokens through
`GeneratorParams.set_speculative_options`); draft-model workloads with a draft model ("draft":
ortpipe's `draft_model`; "genai-draft": genai's `model.draft` in a copy of the folder's config, the
same max_draft_tokens). The draft models are the target's own int4 export (the ~200M model's
200m-int4 folder, the demo's onnx/model_q4.onnx) drafting for its fp32 export: the same tokenizer,
weights that mostly agree, a quarter of the bytes. Every engine runs on one intra-op thread (the
folder's genai_config.json is pinned in a copy).

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
import os
import random
import shutil
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
from ortpipe.variants import file_of, split

REPO = Path(__file__).resolve().parent.parent
SPECULATIVE = {"ngram_size": 3, "max_draft_tokens": 8}
DRAFTING = {"max_draft_tokens": 4}  # genai's default draft length, for both engines
DEMO_CODE_REPEATED = 40  # the excerpt's tokens the demo's code prompt repeats
DEMO_SAMPLING = {"do_sample": True, "temperature": 0.7, "top_k": 40, "top_p": 0.95}  # the folder's defaults


@dataclass(frozen=True)
class Workload:
    name: str
    folder: str  # "demo", or a folder under the bench cache (build/bench_models.py)
    kind: str  # "extractive" or "open-ended", as the report groups them
    what: str
    new_tokens: int
    sampling: dict[str, Any] = field(default_factory=dict)
    dtype: str | None = None  # the decoder's variant, for every engine; None: the folder's default
    draft: str | None = None  # a draft-model workload: the draft's folder (as `folder`), its default variant

    @property
    def engines(self) -> tuple[str, str, str, str]:
        """(plain, speculative, genai, genai speculative)."""
        if self.draft is None:
            return ("plain", "lookup", "genai", "genai-ngram")
        return ("plain", "draft", "genai", "genai-draft")


WORKLOADS = {w.name: w for w in (
    Workload("demo-code", "demo", "extractive", "the demo model (int4) asked to write a code excerpt again, "
             "greedy", 192),
    Workload("demo-code-q8", "demo", "extractive", "the same on the demo's int8 variant", 192, dtype="q8"),
    Workload("200m-repetitive", "200m-fp32", "extractive", "the ~200M fp32 model on a prompt of 40 random "
             "ids four times, greedy", 128),
    Workload("200m-int4-repetitive", "200m-int4", "extractive", "the ~200M model's int4 export on the same "
             "prompt, greedy", 128),
    Workload("demo-open", "demo", "open-ended", "the demo model from `def `, sampled with the folder's "
             "defaults (temperature 0.7, top-k 40, top-p 0.95)", 128, DEMO_SAMPLING),
    Workload("demo-open-q8", "demo", "open-ended", "the same on the demo's int8 variant", 128, DEMO_SAMPLING,
             dtype="q8"),
    Workload("200m-open", "200m-fp32", "open-ended", "the ~200M fp32 model on 160 random ids, sampled "
             "(temperature 0.8, top-k 40)", 64, {"do_sample": True, "temperature": 0.8, "top_k": 40}),
    Workload("demo-draft", "demo-fp32", "open-ended", "the demo's fp32 graph from `def `, greedy, its int4 "
             "graph drafting", 128, dtype="fp32", draft="demo"),
    Workload("demo-draft-sampled", "demo-fp32", "open-ended", "the same sampled with the folder's defaults",
             128, DEMO_SAMPLING, dtype="fp32", draft="demo"),
    Workload("200m-draft", "200m-fp32", "open-ended", "the ~200M fp32 model on 160 random ids, greedy, its "
             "int4 export drafting", 64, draft="200m-int4"),
    Workload("200m-draft-sampled", "200m-fp32", "open-ended", "the same sampled (temperature 0.8, top-k 40)",
             64, {"do_sample": True, "temperature": 0.8, "top_k": 40}, draft="200m-int4"),
)}


def folder(name: str) -> Path:
    """A workload's folder by name: the demo model, the demo beside its fp32 graph (made on first use
    from the int4 one: build/variants.py --from-q4), or a folder of build/bench_models.py."""
    if name == "demo":
        return REPO / "models" / "demo"
    if name == "200m-q8":
        return optimum_q8(cache_root() / "bench" / "hf" / "200m")
    path = cache_root() / "bench" / name
    if name == "demo-fp32" and not (path / "onnx" / "model.onnx").is_file():
        from build import variants

        shutil.rmtree(path, ignore_errors=True)
        shutil.copytree(REPO / "models" / "demo", path)
        variants.main([str(path), "--file", "onnx/model_q4.onnx", "--from-q4", "--dtypes", ""])
    return path


def folder_of(w: Workload) -> Path:
    return folder(w.folder)


def optimum_q8(hf_dir: Path) -> Path:
    """The ~200M model (build/bench_models.py's HF folder) as the browser's users meet such a model:
    Optimum's export in transformers.js's layout (present = Concat(past, new), attention in MatMul and
    Softmax), with only its q8 variant (build/variants.py: int8 weights), the wasm default. The fp32
    graph it came from is not kept (800 MB the bundle would copy)."""
    from build import hfmodels, variants
    from build.bench_web import transformers_js_layout

    def build(out: Path) -> Path:
        with tempfile.TemporaryDirectory(prefix="bench-200m-q8-", dir=out.parent) as scratch:
            export = hfmodels.export_concat(hf_dir, Path(scratch) / "export")
            transformers_js_layout(export, out)
            for name in ("tokenizer.json", "tokenizer_config.json"):  # Optimum's export drops them
                if not (out / name).is_file():
                    shutil.copy2(hf_dir / name, out / name)
            variants.write_variants(out / "onnx" / "model.onnx", ["q8"])
            for item in (out / "onnx").iterdir():
                if item.name.startswith("model.onnx"):
                    item.unlink()
        return out

    recipe = "\0".join([(hf_dir / "config.json").read_text(), inspect.getsource(optimum_q8),
                        (REPO / "build" / "variants.py").read_text(), *hfmodels.OPTIMUM_REQUIREMENTS])
    return hfmodels.cached("200m-q8", build, root=cache_root() / "bench", recipe=recipe)


def prompt_of(w: Workload) -> list[int]:
    """The workload's prompt ids. The demo's code prompt: an excerpt of bisect.py, a blank line and the
    excerpt's first tokens again, to be continued (joined as ids: text cut inside a word tokenizes
    otherwise than the same text whole, and no prompt-lookup n-gram would match across the cut)."""
    if w.folder.startswith("demo"):
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(str(folder_of(w) / "tokenizer.json"))
        if w.name.startswith(("demo-open", "demo-draft")):
            return tokenizer.encode("def ").ids
        import bisect

        source = inspect.getsource(bisect)
        code = tokenizer.encode(source[source.index("def insort_right"):][:800]).ids
        return code + tokenizer.encode("\n\n").ids + code[:DEMO_CODE_REPEATED]
    rng = random.Random(0)
    if w.name.endswith("-repetitive"):
        return [rng.randrange(3, 32000) for _ in range(40)] * 4
    return [rng.randrange(3, 32000) for _ in range(160)]


# --- engines: (prompt, round) -> (tokens, decode seconds, drafted, accepted)

Run = tuple[list[int], float, int, int]


def ortpipe_engine(folder: Path, w: Workload, speculate: bool) -> Any:
    from ortpipe import load

    pipe = load(folder, threads=1, dtype=w.dtype)
    speculation = {}
    if speculate:
        speculation = SPECULATIVE if w.draft is None else drafting(w)
    settings = {**w.sampling, **speculation}
    if not w.sampling:
        settings["do_sample"] = False

    def run(prompt: list[int], seed: int) -> Run:
        seeded = {"seed": seed} if w.sampling else {}
        r = pipe.generate(prompt_ids=prompt, max_new_tokens=w.new_tokens, **settings, **seeded)
        t = r.timings
        return r.tokens, t.decode_ms / 1000, t.drafted_tokens, t.accepted_tokens

    return run


def genai_engine(folder: Path, w: Workload, speculate: bool) -> Any:
    """genai on the pinned folder; a draft-model workload's speculating engine on its copy whose config
    has `model.draft` (genai speculates whenever it is there)."""
    import onnxruntime_genai as og

    model = og.Model(str(folder / DRAFTED if speculate and w.draft else folder))

    def run(prompt: list[int], seed: int) -> Run:
        params = og.GeneratorParams(model)
        search = {"max_length": len(prompt) + w.new_tokens, "do_sample": bool(w.sampling)}
        search.update({k: v for k, v in w.sampling.items() if k in ("temperature", "top_k", "top_p")})
        if w.sampling:
            search["random_seed"] = seed
        params.set_search_options(**search)
        if speculate:
            params.set_speculative_options(**(SPECULATIVE if w.draft is None else DRAFTING))
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
    "draft": lambda f, w: ortpipe_engine(f, w, True),
    "genai": lambda f, w: genai_engine(f, w, False),
    "genai-ngram": lambda f, w: genai_engine(f, w, True),
    "genai-draft": lambda f, w: genai_engine(f, w, True),
}
DRAFTED = "drafted"  # the pinned folder's copy that names a draft model in its config


def drafting(w: Workload) -> dict[str, Any]:
    return {**DRAFTING, "draft_model": str(folder_of_draft(w))}


def folder_of_draft(w: Workload) -> Path:
    return folder(w.draft) if w.draft else folder_of(w)


def with_draft(pinned: Path, w: Workload) -> None:
    """pinned/DRAFTED: the pinned folder, its config's `model.draft` the draft's decoder (the draft's own
    genai_config.json entry, its graph and weights linked into draft/)."""
    target = pinned / DRAFTED
    target.mkdir()
    for item in pinned.iterdir():
        if item.name not in (DRAFTED, "genai_config.json"):
            (target / item.name).symlink_to(item.resolve(), target_is_directory=item.is_dir())
    draft_config = json.loads((folder_of_draft(w) / "genai_config.json").read_text())["model"]["decoder"]
    graph = folder_of_draft(w) / draft_config["filename"]
    (target / "draft").mkdir()
    for file in graph.parent.iterdir():  # the graph and its external weights
        if file.name.startswith(graph.name):
            os.link(file, target / "draft" / file.name)
    config = json.loads((pinned / "genai_config.json").read_text())
    config["model"]["draft"] = {**draft_config, "filename": f"draft/{graph.name}",
                                "session_options": config["model"]["decoder"]["session_options"]}
    (target / "genai_config.json").write_text(json.dumps(config, indent=2))


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
    runs: dict[str, list[Run]] = {name: [] for name in w.engines}
    with tempfile.TemporaryDirectory(prefix="ortpipe-bench-spec-") as scratch:
        decoder_file = None
        if w.dtype is not None:  # genai runs the graph its config names
            config = json.loads((folder_of(w) / "genai_config.json").read_text())
            decoder_file = file_of(split(config["model"]["decoder"]["filename"])[0], w.dtype)
        folder = pinned_folder(folder_of(w), 1, Path(scratch), decoder_file)
        if w.draft:
            with_draft(folder, w)
        for load in range(loads):
            order = list(w.engines) if load % 2 == 0 else list(reversed(w.engines))
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
    plain, ours, genai, theirs = w.engines
    speed = {name: e["decode_tokens_per_s"] for name, e in out["engines"].items()}
    out["speculative_vs_plain"] = round(speed[ours] / speed[plain], 2)
    out["genai_speculative_vs_genai"] = round(speed[theirs] / speed[genai], 2)
    out["speculative_vs_genai_speculative"] = round(speed[ours] / speed[theirs], 2)
    if not w.sampling:
        def same(a: str, b: str) -> bool:
            return all(x[0] == y[0] for x, y in zip(runs[a], runs[b], strict=True))

        pairs = ((ours, plain), (theirs, genai), (plain, genai))
        out["same_tokens"] = {f"{a} = {b}": same(a, b) for a, b in pairs}
    return out


def table(results: list[dict[str, Any]]) -> str:
    lines = ["| workload | plain | speculative | genai | genai speculative | speculative / plain | "
             "genai speculative / genai | speculative / genai speculative | acceptance (ortpipe, genai) |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for r in results:
        plain, ours, genai, theirs = WORKLOADS[r["workload"]].engines
        e = r["engines"]
        lines.append(
            f"| {r['workload']} ({r['kind']}, {ours}) | {e[plain]['decode_tokens_per_s']} | "
            f"{e[ours]['decode_tokens_per_s']} | {e[genai]['decode_tokens_per_s']} | "
            f"{e[theirs]['decode_tokens_per_s']} | {r['speculative_vs_plain']}x | "
            f"{r['genai_speculative_vs_genai']}x | {r['speculative_vs_genai_speculative']}x | "
            f"{e[ours]['acceptance_rate']}, {e[theirs]['acceptance_rate']} |")
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
              "settings": {"lookup": SPECULATIVE, "draft": DRAFTING}, "rounds": args.rounds,
              "loads": args.loads, "results": results}
    print(table(results))
    print(json.dumps({k: report[k] for k in ("machine_before", "machine_after", "settings")}))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
