"""`python -m build.bench MODEL_DIR`: decode speed beside onnxruntime-genai and a hand-written floor.

The engines run one genai_config.json v1 folder with the same prompt ids, greedy (but `sampled`),
and the same intra-op thread count; rounds are interleaved with the engine order rotated each
round, so the machine's noise hits every engine alike. Each engine first runs one untimed warm-up
generation.

Where an engine's weights land in memory depends on the order the engines load in: on 200M models
the engine loaded first decoded up to 14% slower than the others, whichever engine it was, and a
session created before onnxruntime-genai's model could trail one created after it. So the engines
are loaded `loads` times, each time in a fresh process, and the traces of all loads are pooled. The
orders are the rotations of the engine list, then the rotations of the list reversed (for three
engines, all six orders): over a full cycle (the default number of loads) every engine is loaded
in every position equally often, and each of two engines before the other in half the loads.

- ortpipe: `load()` and the step-wise generator, one `next_token()` timed per step.
- genai: onnxruntime-genai's Generator. `append_tokens` runs the prefill; the first
  `generate_next_token` only picks from its logits, so it counts in the prefill; every later one
  runs one decode and is timed as a step.
- floor: the fastest loop we can write in Python over one InferenceSession: shared past/present
  buffers bound once through IOBinding, only the input ids (written in place) and the attention
  mask (a view of a preallocated row of ones) change per step, logits land in a preallocated
  array, numpy argmax.
- sampled (optional): ortpipe with top-k 50 / top-p 0.9, for what the sampling kernels cost.

Prefill is the time to the first token, request set-up included. A decode step is one later
token. The token lists of the greedy engines must be equal, or the bench warns and exits 1; an
engine that fails is left out of the table (exit 1 too).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from ortpipe.errors import ConfigError, GenerationError, OrtpipeError

ENGINES = ("ortpipe", "genai", "floor", "sampled")
SAMPLING = {"do_sample": True, "top_k": 50, "top_p": 0.9, "seed": 0}  # the "sampled" engine's settings
CONFIG = "genai_config.json"


@dataclass
class Trace:
    """One generation: the generated ids (prompt excluded) and its timings."""

    tokens: list[int]
    prefill_ms: float
    steps_us: list[float]


@dataclass
class Stats:
    prefill_ms: float  # median over rounds
    decode_tokens_per_s: float  # all decode steps of all rounds over their total time
    step_mean_us: float
    step_median_us: float
    steps: int
    round_tokens_per_s: list[float] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {
            "prefill_ms": round(self.prefill_ms, 3),
            "decode_tokens_per_s": round(self.decode_tokens_per_s, 2),
            "step_mean_us": round(self.step_mean_us, 1),
            "step_median_us": round(self.step_median_us, 1),
            "steps": self.steps,
            "round_tokens_per_s": [round(x, 2) for x in self.round_tokens_per_s],
        }


Engine = Callable[[list[int], int], Trace]  # (prompt ids, new tokens) -> trace


# --- the model folder -----------------------------------------------------------------------------


def pinned_folder(src: Path, threads: int, dst: Path, decoder_file: str | None = None) -> Path:
    """A copy of `src` whose genai_config.json pins the decoder's intra-op threads (genai defaults to
    half the cores) and, given `decoder_file`, names that graph (another variant of the decoder); every
    other file is a hard link where the file system allows (ortpipe opens no symbolic link that leads
    out of a model folder), else a copy."""
    for item in src.iterdir():
        if item.name == CONFIG:
            continue
        if item.is_dir():
            shutil.copytree(item, dst / item.name)
            continue
        try:
            os.link(item.resolve(), dst / item.name)
        except OSError:
            shutil.copy2(item, dst / item.name)
    config = json.loads((src / CONFIG).read_text())
    options = config["model"]["decoder"].setdefault("session_options", {})
    options["intra_op_num_threads"] = threads
    if decoder_file is not None:
        config["model"]["decoder"]["filename"] = decoder_file
        _describe_variant(config, dst / decoder_file)
    (dst / CONFIG).write_text(json.dumps(config, indent=2))
    return dst


def _describe_variant(config: dict[str, Any], graph: Path) -> None:
    """What onnxruntime-genai must be told of a variant exported otherwise than by its builder (the
    demo's int8 graph is Optimum's): its position ids input, and a cache that grows by Concat instead of
    a shared buffer. ortpipe finds both in the graph."""
    from ortpipe.graphfacts import decoder_facts
    from ortpipe.onnxinfo import read_model

    model = read_model(graph)
    if "position_ids" in {v.name for v in model.graph.inputs}:
        config["model"]["decoder"].setdefault("inputs", {})["position_ids"] = "position_ids"
    if decoder_facts(model).concatenated:
        config["search"]["past_present_share_buffer"] = False


def read_config(folder: Path) -> dict[str, Any]:
    path = folder / CONFIG
    if not path.is_file():
        raise ConfigError(f"no {CONFIG}: the bench needs a folder written by the model builder (v1 config)")
    config = json.loads(path.read_text())
    if config.get("version") == 2 or "decoder" not in config.get("model", {}):
        raise ConfigError(
            f"{CONFIG} is not a v1 (model builder) config with model.decoder: the bench "
            "compares against onnxruntime-genai, which reads only those"
        )
    return config


def prompt_ids(config: dict[str, Any], count: int) -> list[int]:
    """`count` ids drawn from the vocabulary with a fixed seed, never a special token."""
    model = config["model"]
    special = {model.get("bos_token_id"), model.get("pad_token_id")}
    eos = model.get("eos_token_id", [])
    special.update(eos if isinstance(eos, list) else [eos])
    rng = random.Random(0)
    ids: list[int] = []
    while len(ids) < count:
        i = rng.randrange(model["vocab_size"])
        if i not in special:
            ids.append(i)
    return ids


def eos_ids(config: dict[str, Any]) -> frozenset[int]:
    eos = config["model"].get("eos_token_id", [])
    return frozenset(eos if isinstance(eos, list) else [eos])


# --- engines --------------------------------------------------------------------------------------


def ortpipe_engine(folder: Path, threads: int, **settings: Any) -> Engine:
    from ortpipe import load

    pipe = load(folder, threads=threads)

    def generate(prompt: list[int], new_tokens: int) -> Trace:
        clock = time.perf_counter
        start = clock()
        gen = pipe.generator(len(prompt), max_new_tokens=new_tokens, **settings)
        gen.append_tokens(prompt)
        tokens = [gen.next_token()]
        prefill_ms = (clock() - start) * 1e3
        steps = []
        while not gen.done:
            t = clock()
            tokens.append(gen.next_token())
            steps.append((clock() - t) * 1e6)
        return Trace(tokens, prefill_ms, steps)

    return generate


def genai_engine(folder: Path, threads: int) -> Engine:
    import onnxruntime_genai as og  # lazily: only this engine needs it

    model = og.Model(str(folder))  # threads come from the pinned genai_config.json

    def generate(prompt: list[int], new_tokens: int) -> Trace:
        clock = time.perf_counter
        start = clock()
        params = og.GeneratorParams(model)
        params.set_search_options(do_sample=False, max_length=len(prompt) + new_tokens)
        gen = og.Generator(model, params)
        gen.append_tokens(np.asarray([prompt], dtype=np.int32))  # runs the prefill
        gen.generate_next_token()  # picks from the prefill's logits, runs nothing
        tokens = [int(gen.get_next_tokens()[0])]
        prefill_ms = (clock() - start) * 1e3
        steps = []
        while not gen.is_done():
            t = clock()
            gen.generate_next_token()
            tokens.append(int(gen.get_next_tokens()[0]))
            steps.append((clock() - t) * 1e6)
        return Trace(tokens, prefill_ms, steps)

    return generate


class Floor:
    """A hand-written greedy loop over one InferenceSession with a shared past/present buffer."""

    def __init__(self, folder: Path, config: dict[str, Any], threads: int):
        decoder = config["model"]["decoder"]
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        self.session = ort.InferenceSession(
            str(folder / decoder["filename"]), options, providers=["CPUExecutionProvider"]
        )
        self.eos = eos_ids(config)
        names = decoder.get("inputs", {})
        outs = decoder.get("outputs", {})
        self.ids_name = names.get("input_ids", "input_ids")
        self.mask_name = names.get("attention_mask", "attention_mask")
        self.logits_name = outs.get("logits", "logits")
        inputs = {i.name: i for i in self.session.get_inputs()}
        self.kv = self._kv_pairs(inputs, names, outs, decoder)
        extra = set(inputs) - {self.ids_name, self.mask_name} - {p for p, _, _, _ in self.kv}
        if extra:
            raise ValueError(f"the floor loop cannot feed decoder input(s) {', '.join(sorted(extra))}")
        self.ids_dtype = _np_type(inputs[self.ids_name].type)
        logits = next(o for o in self.session.get_outputs() if o.name == self.logits_name)
        self.vocab, self.logits_dtype = logits.shape[-1], _np_type(logits.type)
        if not isinstance(self.vocab, int):
            self.vocab = config["model"]["vocab_size"]

    @staticmethod
    def _kv_pairs(
        inputs: dict[str, Any], names: dict[str, str], outs: dict[str, str], decoder: dict[str, Any]
    ) -> list[tuple[str, str, tuple[int, int], Any]]:
        """(past name, present name, (kv heads, head size), dtype) per cache entry.

        Sizes come from the signature; the builder leaves the head size symbolic ("kv_cache_dim"),
        and then the config's head_size / num_key_value_heads say it."""
        fallback = (decoder.get("num_key_value_heads"), decoder.get("head_size"))
        pairs = []
        for layer in range(decoder["num_hidden_layers"]):
            for kind in ("key", "value"):
                past = names[f"past_{kind}_names"] % layer
                present = outs[f"present_{kind}_names"] % layer
                info = inputs[past]
                dims = zip(info.shape[1::2], fallback, strict=True)  # axes 1 and 3: heads, head size
                heads, size = (d if isinstance(d, int) else f for d, f in dims)
                pairs.append((past, present, (heads, size), _np_type(info.type)))
        return pairs

    def __call__(self, prompt: list[int], new_tokens: int) -> Trace:
        clock = time.perf_counter
        start = clock()
        total = len(prompt) + new_tokens
        caches = [np.zeros((1, heads, total, size), dtype) for _, _, (heads, size), dtype in self.kv]
        ones = np.ones((1, total), np.int64)
        masks = [ort.OrtValue.ortvalue_from_numpy(ones[:, :n]) for n in range(total + 1)]  # views, no copies
        native_masks = [m._ortvalue for m in masks]  # what the C++ binding takes; saves a wrapper call a step
        prefill = self._binding(caches, np.asarray([prompt], self.ids_dtype), len(prompt))
        step_ids = np.zeros((1, 1), self.ids_dtype)
        decode = self._binding(caches, step_ids, 1)
        prefill.io.bind_ortvalue_input(self.mask_name, masks[len(prompt)])
        run = self.session._sess.run_with_iobinding  # the C++ call; the Python wrapper only forwards
        run(prefill.io._iobinding, None)
        token = int(prefill.logits[0, -1].argmax())
        prefill_ms = (clock() - start) * 1e3
        tokens, steps = [token], []
        native, row, mask = decode.io._iobinding, decode.logits[0, 0], self.mask_name
        for length in range(len(prompt) + 1, total):
            if token in self.eos:
                break
            t = clock()
            step_ids[0, 0] = token  # the bound input reads this memory
            native.bind_ortvalue_input(mask, native_masks[length])
            run(native, None)
            token = int(row.argmax())
            steps.append((clock() - t) * 1e6)
            tokens.append(token)
        return Trace(tokens, prefill_ms, steps)

    def _binding(self, caches: list[np.ndarray], ids: np.ndarray, n: int) -> _Bound:
        """An IOBinding over the shared caches, `ids` and a preallocated logits array for n positions."""
        bound = _Bound(self.session.io_binding(), np.empty((1, n, self.vocab), self.logits_dtype))
        bound.io.bind_ortvalue_input(self.ids_name, bound.value(ids))
        for (past, present, _, _), cache in zip(self.kv, caches, strict=True):
            value = bound.value(cache)
            bound.io.bind_ortvalue_input(past, value)
            bound.io.bind_ortvalue_output(present, value)  # written in place: past_present_share_buffer
        bound.io.bind_ortvalue_output(self.logits_name, bound.value(bound.logits))
        return bound


@dataclass
class _Bound:
    """An IOBinding, its logits array, and the OrtValues it binds (they borrow numpy memory)."""

    io: Any
    logits: np.ndarray
    values: list[Any] = field(default_factory=list)

    def value(self, array: np.ndarray) -> Any:
        self.values.append(ort.OrtValue.ortvalue_from_numpy(array))
        return self.values[-1]


def _np_type(ort_type: str) -> Any:
    return {
        "tensor(float)": np.float32,
        "tensor(float16)": np.float16,
        "tensor(int64)": np.int64,
        "tensor(int32)": np.int32,
    }[ort_type]


def floor_engine(folder: Path, threads: int) -> Engine:
    return Floor(folder, read_config(folder), threads)


def sampled_engine(folder: Path, threads: int) -> Engine:
    """ortpipe sampling with top-k 50 / top-p 0.9: what the sampling kernels add to a step."""
    return ortpipe_engine(folder, threads, **SAMPLING)


FACTORIES: dict[str, Callable[[Path, int], Engine]] = {
    "ortpipe": ortpipe_engine,
    "genai": genai_engine,
    "floor": floor_engine,
    "sampled": sampled_engine,
}


# --- measuring ------------------------------------------------------------------------------------


def start(
    names: list[str], folder: Path, threads: int, prompt: list[int], new_tokens: int, failed: dict[str, str]
) -> dict[str, Engine]:
    """Load each engine and run one untimed warm-up generation.

    An engine that fails to load or to warm up is left out and its error put in `failed`: one
    broken engine should not hide the others' numbers."""
    engines = {}
    for name in names:
        try:
            engine = FACTORIES[name](folder, threads)
            engine(prompt, new_tokens)
            engines[name] = engine
        except Exception as e:  # any engine's own error type
            failed[name] = f"{type(e).__name__}: {e}".strip()
    return engines


def measure(
    engines: dict[str, Engine], prompt: list[int], new_tokens: int, rounds: int
) -> dict[str, list[Trace]]:
    """`rounds` rounds, the engine order rotated each round."""
    names = list(engines)
    traces: dict[str, list[Trace]] = {name: [] for name in names}
    for r in range(rounds):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            gc.collect()  # start each run with a clean heap, not with the last engine's garbage
            traces[name].append(engines[name](prompt, new_tokens))
    return traces


def balanced_orders(names: list[str]) -> list[list[str]]:
    """The rotations of `names`, then those of `names` reversed, without repeats.

    In the rotations every engine takes every position once; reversing the list reverses which of
    any two engines comes first, so over the whole cycle each comes first in half the orders."""
    orders: list[list[str]] = []
    for base in (names, names[::-1]):
        for i in range(len(base)):
            order = base[i:] + base[:i]
            if order not in orders:
                orders.append(order)
    return orders


def load_orders(names: list[str], loads: int | None) -> list[list[str]]:
    """The engine order of each load: `balanced_orders` in turn; `loads` None is one full cycle."""
    cycle = balanced_orders(names)
    return [cycle[i % len(cycle)] for i in range(len(cycle) if loads is None else loads)]


def measure_in_process(
    order: list[str],
    folder: Path,
    threads: int,
    prompt: list[int],
    new_tokens: int,
    rounds: int,
    failed: dict[str, str],
) -> dict[str, list[Trace]]:
    """Load the engines in `order` in a fresh Python process and measure them there."""
    job = {
        "order": order,
        "folder": str(folder),
        "threads": threads,
        "prompt": prompt,
        "new_tokens": new_tokens,
        "rounds": rounds,
    }
    done = subprocess.run(
        [sys.executable, "-m", "build.bench", "--child"],
        input=json.dumps(job),
        capture_output=True,
        text=True,
        check=False,
        cwd=Path(__file__).resolve().parent.parent,
    )
    if done.returncode != 0:
        raise GenerationError(
            f"bench: the process measuring {', '.join(order)} failed (exit "
            f"{done.returncode}):\n{done.stderr.strip()[-2000:]}"
        )
    sys.stderr.write(done.stderr)  # the engines' own warnings
    answer = json.loads(done.stdout)
    failed.update(answer["failed"])
    return {name: [Trace(*t) for t in runs] for name, runs in answer["traces"].items()}


def _measure_job() -> None:
    """The child side of `measure_in_process`: a job on stdin, the traces as JSON on stdout."""
    job = json.load(sys.stdin)
    failed: dict[str, str] = {}
    prompt, new_tokens = job["prompt"], job["new_tokens"]
    engines = start(job["order"], Path(job["folder"]), job["threads"], prompt, new_tokens, failed)
    traces = measure(engines, prompt, new_tokens, job["rounds"])
    answer = {name: [[t.tokens, t.prefill_ms, t.steps_us] for t in runs] for name, runs in traces.items()}
    json.dump({"traces": answer, "failed": failed}, sys.stdout)


def summarize(traces: list[Trace]) -> Stats:
    steps = [s for t in traces for s in t.steps_us]
    per_round = [len(t.steps_us) * 1e6 / sum(t.steps_us) if t.steps_us else 0.0 for t in traces]
    total = sum(steps)
    return Stats(
        prefill_ms=statistics.median(t.prefill_ms for t in traces),
        decode_tokens_per_s=len(steps) * 1e6 / total if total else 0.0,
        step_mean_us=statistics.fmean(steps) if steps else 0.0,
        step_median_us=statistics.median(steps) if steps else 0.0,
        steps=len(steps),
        round_tokens_per_s=per_round,
    )


def first_mismatch(traces: dict[str, list[Trace]]) -> dict[str, Any] | None:
    """The first run whose tokens differ from the reference (the first engine's first round)."""
    greedy = {n: runs for n, runs in traces.items() if n != "sampled"}  # sampling picks other tokens
    if not greedy:
        return None
    ref_name = next(iter(greedy))
    ref = greedy[ref_name][0].tokens
    for name, runs in greedy.items():
        for r, trace in enumerate(runs):
            if trace.tokens != ref:
                at = next(
                    (i for i, (a, b) in enumerate(zip(ref, trace.tokens, strict=False)) if a != b),
                    min(len(ref), len(trace.tokens)),
                )
                return {
                    "reference": ref_name,
                    "engine": name,
                    "round": r,
                    "position": at,
                    "expected": ref[at] if at < len(ref) else None,
                    "found": trace.tokens[at] if at < len(trace.tokens) else None,
                    "lengths": [len(ref), len(trace.tokens)],
                }
    return None


# t distribution, two-sided 95%: the 0.975 quantile for 1 to 30 degrees of freedom
_T975 = (
    12.706,
    4.303,
    3.182,
    2.776,
    2.571,
    2.447,
    2.365,
    2.306,
    2.262,
    2.228,
    2.201,
    2.179,
    2.160,
    2.145,
    2.131,
    2.120,
    2.110,
    2.101,
    2.093,
    2.086,
    2.080,
    2.074,
    2.069,
    2.064,
    2.060,
    2.056,
    2.052,
    2.048,
    2.045,
    2.042,
)
PAIRS = (("ortpipe", "genai"), ("floor", "genai"), ("ortpipe", "floor"))  # the per-load ratios reported


def load_ratio(load: dict[str, list[Trace]], a: str, b: str) -> float | None:
    """a's decode tok/s ÷ b's within one load (one process), or None if either is missing."""
    if a not in load or b not in load:
        return None
    fast = [summarize(load[n]).decode_tokens_per_s for n in (a, b)]
    return fast[0] / fast[1] if fast[1] else None


def interval(values: list[float]) -> dict[str, Any]:
    """Mean and two-sided 95% interval (t distribution) of per-load values; no interval for one."""
    mean = statistics.fmean(values)
    out: dict[str, Any] = {"values": [round(v, 4) for v in values], "mean": round(mean, 4)}
    if len(values) > 1:
        df = len(values) - 1
        z = 1.959964
        t = _T975[df - 1] if df <= len(_T975) else z + (z**3 + z) / (4 * df)
        half = t * statistics.stdev(values) / len(values) ** 0.5
        out["ci95"] = [round(mean - half, 4), round(mean + half, 4)]
    return out


def ratios(stats: dict[str, Stats]) -> dict[str, float]:
    out = {}
    if "ortpipe" in stats and "genai" in stats and stats["genai"].decode_tokens_per_s:
        out["ortpipe_vs_genai_decode"] = (
            stats["ortpipe"].decode_tokens_per_s / stats["genai"].decode_tokens_per_s
        )
    if "ortpipe" in stats and "floor" in stats:
        out["ortpipe_overhead_us"] = stats["ortpipe"].step_median_us - stats["floor"].step_median_us
    if "genai" in stats and "floor" in stats:
        out["genai_overhead_us"] = stats["genai"].step_median_us - stats["floor"].step_median_us
    if "sampled" in stats and "ortpipe" in stats and stats["ortpipe"].step_median_us:
        out["sampled_step_vs_greedy"] = stats["sampled"].step_median_us / stats["ortpipe"].step_median_us
    return out


def machine() -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "load_1min": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
    }


def versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    found = {"python": platform.python_version()}
    for package in ("ortpipe", "onnxruntime", "onnxruntime-genai", "numpy"):
        try:
            found[package] = version(package)
        except PackageNotFoundError:
            found[package] = "-"
    return found


# --- reporting ------------------------------------------------------------------------------------


def table(report: dict[str, Any]) -> str:
    m = report["machine"]
    head = (
        f"{report['model']}: {report['prompt_tokens']} prompt + {report['new_tokens']} new tokens, "
        f"{report['threads']} thread(s), {report['rounds']} round(s) after each of "
        f"{len(report['loads'])} load(s), greedy\n"
        f"{m['cpu']}, {m['cores']} cores, load {m['load_1min']} at the start"
    )
    rows = [
        ("engine", "prefill ms", "decode tok/s", "rounds tok/s", "mean step µs", "median step µs", "steps")
    ]
    for name, s in report["engines"].items():
        spread = f"{min(s['round_tokens_per_s']):.1f}-{max(s['round_tokens_per_s']):.1f}"
        rows.append(
            (
                name,
                f"{s['prefill_ms']:.2f}",
                f"{s['decode_tokens_per_s']:.1f}",
                spread,
                f"{s['step_mean_us']:.1f}",
                f"{s['step_median_us']:.1f}",
                str(s["steps"]),
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [head, ""] + [
        "  ".join(
            c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True))
        )
        for r in rows
    ]
    r = report["ratios"]
    if "ortpipe_vs_genai_decode" in r:
        lines.append(f"\nortpipe decode ÷ genai decode: {r['ortpipe_vs_genai_decode']:.3f}×")
    if "ortpipe_overhead_us" in r:
        lines.append(f"ortpipe per-step overhead over the floor (median): {r['ortpipe_overhead_us']:+.1f} µs")
    if "genai_overhead_us" in r:
        lines.append(f"genai per-step overhead over the floor (median): {r['genai_overhead_us']:+.1f} µs")
    for key, v in report["per_load"].items():
        a, b = key.split("_vs_")
        spread = f" (95% interval {v['ci95'][0]:.3f}-{v['ci95'][1]:.3f})" if "ci95" in v else ""
        lines.append(
            f"{a} ÷ {b} within each load: mean {v['mean']:.3f}{spread}, "
            f"{min(v['values']):.3f}-{max(v['values']):.3f} over {len(v['values'])} loads"
        )
    if "sampled_step_vs_greedy" in r:
        lines.append(
            f"sampled (top-k 50, top-p 0.9) step ÷ greedy step (median): {r['sampled_step_vs_greedy']:.3f}×"
        )
    for name, error in report["failed"].items():
        lines.append(f"{name}: FAILED ({error.splitlines()[0][:160]})")
    match = "all greedy engines equal" if report["tokens_match"] else "MISMATCH (see warning)"
    lines.append(f"tokens: {match}")
    return "\n".join(lines)


def warn_mismatch(m: dict[str, Any]) -> None:
    bar = "!" * 78
    print(
        f"{bar}\nWARNING: the engines generated different tokens: {m['engine']} (round {m['round']}) "
        f"differs from {m['reference']} at generated position {m['position']}: expected {m['expected']}, "
        f"found {m['found']} (lengths {m['lengths'][0]} and {m['lengths'][1]}). The timings do not compare "
        f"like with like.\n{bar}",
        file=sys.stderr,
    )


def run_bench(args: argparse.Namespace) -> int:
    names = [n.strip() for n in args.engines.split(",") if n.strip()]
    unknown = [n for n in names if n not in ENGINES]
    if unknown or not names:
        raise GenerationError(
            f"bench: unknown engine(s) {', '.join(unknown) or '(none)'}; choose from {', '.join(ENGINES)}"
        )
    if min(args.prompt_tokens, args.new_tokens, args.rounds, args.threads) < 1:
        raise GenerationError("bench: --prompt-tokens, --new-tokens, --rounds and --threads must be >= 1")
    if args.loads is not None and args.loads < 1:
        raise GenerationError("bench: --loads must be >= 1 (1 loads the engines once, in this process)")
    if args.new_tokens < 2:
        raise GenerationError("bench: --new-tokens must be >= 2 (the first token comes from the prefill)")
    src = Path(args.model)
    config = read_config(src)
    prompt = prompt_ids(config, args.prompt_tokens)
    host = machine()  # before the engines load: the load average says how quiet the machine was
    tmp = Path(tempfile.mkdtemp(prefix="ortpipe-bench-"))
    try:
        folder = pinned_folder(src, args.threads, tmp)
        failed: dict[str, str] = {}
        names = list(dict.fromkeys(names))
        loads: list[dict[str, list[Trace]]] = []  # each load's traces, when the loads are processes
        orders = load_orders(names, args.loads)
        if len(orders) == 1:
            engines = start(names, folder, args.threads, prompt, args.new_tokens, failed)
            traces = measure(engines, prompt, args.new_tokens, args.rounds)
        else:
            traces = {}
            for i, order in enumerate(orders, 1):
                print(
                    f"bench: load {i}/{len(orders)} ({', '.join(order)}), {args.rounds} round(s)",
                    file=sys.stderr,
                    flush=True,
                )
                load = measure_in_process(
                    order, folder, args.threads, prompt, args.new_tokens, args.rounds, failed
                )
                loads.append(load)
                for name, runs in load.items():
                    traces.setdefault(name, []).extend(runs)
            traces = {name: traces[name] for name in names if name in traces}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    stats = {name: summarize(runs) for name, runs in traces.items()}
    per_load = {}
    for a, b in PAIRS:
        values = [r for r in (load_ratio(load, a, b) for load in loads) if r is not None]
        if values:
            per_load[f"{a}_vs_{b}"] = interval(values)
    mismatch = first_mismatch(traces) if traces else None
    report = {
        "model": str(src),
        "prompt_tokens": args.prompt_tokens,
        "new_tokens": args.new_tokens,
        "rounds": args.rounds,
        "loads": orders,
        "threads": args.threads,
        "versions": versions(),
        "machine": host,
        "engines": {n: s.as_dict() for n, s in stats.items()},
        "failed": failed,
        "ratios": {k: round(v, 4) for k, v in ratios(stats).items()},
        "per_load": per_load,
        "tokens_match": mismatch is None,
        "mismatch": mismatch,
        "generated": {n: len(runs[0].tokens) for n, runs in traces.items()},
    }
    for name, error in failed.items():
        print(f"bench: engine {name} failed and is left out: {error}", file=sys.stderr)
    if mismatch:
        warn_mismatch(mismatch)
    print(json.dumps(report) if args.json else table(report))
    return 1 if mismatch or failed else 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m build.bench", description=__doc__.split("\n\n")[0])
    p.add_argument("model", metavar="MODEL_DIR", help="a folder written by onnxruntime-genai's model builder")
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds per engine after each load")
    p.add_argument(
        "--loads",
        type=int,
        default=None,
        help="load the engines this many times, each in a fresh process, cycling through load orders "
        "in which every engine comes first, and before each other engine, equally often "
        "(default: one cycle, 6 orders for 3 engines; 1: once, in this process)",
    )
    p.add_argument("--threads", type=int, default=1, help="intra-op threads, the same for every engine")
    p.add_argument(
        "--engines",
        default="ortpipe,genai,floor",
        help="comma-separated: ortpipe, genai, floor, sampled (ortpipe with top-k 50 / top-p 0.9)",
    )
    p.add_argument("--json", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv == ["--child"]:
        _measure_job()
        return 0
    try:
        return run_bench(parser().parse_args(argv))
    except OrtpipeError as e:
        print(f"bench: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
