"""Benchmarks of the single_pass and denoising loops beside their peers, under CPython. Not a test.

    python -m build.bench_loops sd [--folder sd-bench] [--steps 8] [--guidance 7.5] [--rounds 3] [--threads 2]
    python -m build.bench_loops embed [--folder st-bench] [--texts 1024] [--batch 32] [--rounds 3]
    python -m build.bench_loops tts [--folder vits-bench] [--rounds 3]
    python -m build.bench_loops seq2seq [--folder t5-bench] [--new-tokens 64] [--rounds 3]
    python -m build.bench_loops seq2seq --beams 4 --engines ortpipe,optimum     # beam search

sd: the time of one denoising step (the UNet on the guided batch of two rows and the scheduler's update),
median over the steps of a generation, for ortpipe, a hand-written onnxruntime loop (tests/paradigm_refs.py's,
numpy for the scheduler) and optimum's ORTDiffusionPipeline (diffusers' scheduler in torch). embed: texts
embedded per second by ortpipe, the hand loop and sentence-transformers' ONNX backend (optimum's
ORTModelForFeatureExtraction under SentenceTransformer.encode), all in batches of `--batch`. tts: the
real-time factor (seconds of compute per second of audio) of ortpipe and the hand loop. seq2seq (a loop
that makes tokens, here for its peer): the tokens per second of a greedy generation of an encoder-decoder
(t5-bench, below) by ortpipe, a hand-written onnxruntime loop over optimum's merged decoder and optimum's
ORTModelForSeq2SeqLM, from the same 32 prompt ids; every engine makes exactly `--new-tokens` tokens
(min_new_tokens) and their tokens must agree; with `--beams N`, beam search of N beams (ortpipe and optimum).

Each round is one process of the peers' virtualenv ($ORTPIPE_PARADIGMS_BENCH_VENV, default
.venv-paradigms-bench: the export environment of build/paradigms.py plus sentence-transformers 5.1.2,
which has ortpipe's dependencies too) that loads and warms up every engine, then runs each once, in an
order rotated round by round, so that load from other processes on this shared machine meets all of them
alike. Every session gets `--threads` intra-op threads; with one thread the times are the process's CPU
time, which other processes' load hardly changes (with more, wall time). The folders come from
build/paradigms.py, but st-bench (below).
docs/benchmarks.md reads the results.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCH_VENV = Path(os.environ.get("ORTPIPE_PARADIGMS_BENCH_VENV", ROOT / ".venv-paradigms-bench"))
PEER_REQUIREMENTS = ("torch==2.13.0", "transformers==4.57.6", "optimum-onnx==0.1.0", "optimum==2.1.0",
                     "onnx==1.23.2", "onnxruntime==1.31.1", "diffusers==0.39.0",
                     "sentence-transformers==5.1.2")
ENGINES = {"sd": ("ortpipe", "hand", "optimum"), "embed": ("ortpipe", "hand", "sentence-transformers"),
           "tts": ("ortpipe", "hand"), "seq2seq": ("ortpipe", "hand", "optimum")}
PROMPT = "a red cube on a wooden table, studio light"
NEGATIVE = "blurry, low quality"
SPEECH = ("The quick brown fox jumps over the lazy dog while the parser reads each line of the file and "
          "keeps the fields it needs.")


# A sentence-transformers folder of all-MiniLM-L6-v2's shape (6 layers, hidden 384, 12 heads; 22M parameters
# with its 30k vocabulary, 11M with the test tokenizer's 1000), random weights: made here, in the peers'
# virtualenv, into $ORTPIPE_CACHE/bench-loops/st-bench (sentence-transformers 5.1.2 saves it, optimum exports
# its Transformer for feature-extraction; mean pooling and Normalize as in all-MiniLM-L6-v2).
ST_BENCH = {"hidden_size": 384, "num_hidden_layers": 6, "num_attention_heads": 12, "intermediate_size": 1536,
            "max_position_embeddings": 512}
# A VITS of MMS-TTS's shape: transformers' VitsConfig defaults, which are facebook/mms-tts-*'s (hidden 192,
# 6 text-encoder layers, 4 flows, HiFi-GAN from 512 channels up 256x, stochastic duration predictor); random
# weights (seed 0), noise scales 0, vits-tiny's character vocabulary; optimum's text-to-audio export, in
# transformers.js's layout (build/tjs_layout.py) with vocab.json kept for the hand loop. Made in the peers'
# virtualenv into $ORTPIPE_CACHE/bench-loops/vits-bench.
VITS_BENCH = {"noise_scale": 0.0, "noise_scale_duration": 0.0, "sampling_rate": 16000}
# A T5 of t5-small's shape (60.5M parameters: 6 + 6 layers, d_model 512, 8 heads, d_ff 2048, its 32,128-token
# vocabulary), random weights (seed 0), no tokenizer (the engines take ids); optimum's
# text2text-generation-with-past export in transformers.js's layout (onnx/encoder_model.onnx,
# onnx/decoder_model_merged.onnx). Made in the peers' virtualenv into $ORTPIPE_CACHE/bench-loops/t5-bench.
T5_BENCH = {"vocab_size": 32128, "d_model": 512, "d_kv": 64, "d_ff": 2048, "num_layers": 6, "num_heads": 8,
            "feed_forward_proj": "relu", "decoder_start_token_id": 0, "pad_token_id": 0, "eos_token_id": 1}
SEQ2SEQ_PROMPT = 32  # prompt ids, drawn (seeded) from 5 to 32000


def st_bench_folder() -> Path:
    from build import hfmodels, paradigms

    out = hfmodels.cache_root() / "bench-loops" / "st-bench"
    if not (out / "onnx" / "model.onnx").is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        tokenizer = paradigms.get("st-minilm-cls")
        command = [str(peers_python()), "-m", "build.bench_loops", "_make_st_bench", str(tokenizer), str(out)]
        subprocess.run(command, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, check=True)
    return out


def vits_bench_folder() -> Path:
    from build import hfmodels, paradigms

    out = hfmodels.cache_root() / "bench-loops" / "vits-bench"
    if not (out / "onnx" / "model.onnx").is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        tokenizer = paradigms.get("vits-tiny")
        command = [str(peers_python()), "-m", "build.bench_loops", "_make_vits_bench", str(tokenizer),
                   str(out)]
        subprocess.run(command, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, check=True)
    return out


def t5_bench_folder() -> Path:
    from build import hfmodels

    out = hfmodels.cache_root() / "bench-loops" / "t5-bench"
    if not (out / "onnx" / "decoder_model_merged.onnx").is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        command = [str(peers_python()), "-m", "build.bench_loops", "_make_t5_bench", str(out)]
        subprocess.run(command, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, check=True)
    return out


def make_t5_bench(out: Path) -> None:
    import shutil
    import tempfile

    import torch
    import transformers

    with tempfile.TemporaryDirectory(prefix="t5-bench-") as scratch:
        hf, onnx = Path(scratch) / "hf", Path(scratch) / "onnx"
        torch.manual_seed(0)
        model = transformers.T5ForConditionalGeneration(transformers.T5Config(**T5_BENCH))
        model.generation_config = transformers.GenerationConfig(
            **{k: T5_BENCH[k] for k in ("decoder_start_token_id", "pad_token_id", "eos_token_id")})
        model.save_pretrained(hf)
        subprocess.run([sys.executable, "-m", "optimum.exporters.onnx", "--model", str(hf), "--task",
                        "text2text-generation-with-past", str(onnx)], check=True)
        (out / "onnx").mkdir(parents=True)
        for name in ("config.json", "generation_config.json"):
            shutil.copy2(onnx / name, out / name)
        for name in ("encoder_model.onnx", "decoder_model_merged.onnx"):
            shutil.copy2(onnx / name, out / "onnx" / name)


def seq2seq_ids() -> list[int]:
    return random.Random(0).choices(range(5, 32000), k=SEQ2SEQ_PROMPT)


def make_vits_bench(tokenizer: Path, out: Path) -> None:
    import tempfile

    import torch
    import transformers

    from build import tjs_layout

    with tempfile.TemporaryDirectory(prefix="vits-bench-") as scratch:
        hf = Path(scratch) / "hf"
        vocab = json.loads((tokenizer / "vocab.json").read_text())
        torch.manual_seed(0)
        config = transformers.VitsConfig(vocab_size=len(vocab), **VITS_BENCH)
        transformers.VitsModel(config).save_pretrained(hf)
        for name in ("vocab.json", "tokenizer_config.json", "special_tokens_map.json"):
            (hf / name).write_bytes((tokenizer / name).read_bytes())
        subprocess.run([sys.executable, "-m", "optimum.exporters.onnx", "--model", str(hf), "--task",
                        "text-to-audio", str(hf / "onnx")], check=True)
        tjs_layout.vits(hf, out, keep_vocab=True)


def make_st_bench(tokenizer: Path, out: Path) -> None:
    import shutil
    import tempfile

    import torch
    import transformers
    from sentence_transformers import SentenceTransformer, models

    with tempfile.TemporaryDirectory(prefix="st-bench-") as scratch:
        hf = Path(scratch) / "hf"
        fast = transformers.BertTokenizerFast(tokenizer_file=str(tokenizer / "tokenizer.json"))
        torch.manual_seed(0)
        config = transformers.BertConfig(vocab_size=len(fast), **ST_BENCH)
        transformers.BertModel(config).save_pretrained(hf)
        fast.save_pretrained(hf)
        word = models.Transformer(str(hf), max_seq_length=128)
        modules = [word, models.Pooling(ST_BENCH["hidden_size"], "mean"), models.Normalize()]
        SentenceTransformer(modules=modules).save(str(out))
        exported = Path(scratch) / "onnx"
        subprocess.run([sys.executable, "-m", "optimum.exporters.onnx", "--model", str(hf), "--task",
                        "feature-extraction", "--library-name", "transformers", str(exported)], check=True)
        (out / "onnx").mkdir(exist_ok=True)
        shutil.copy2(exported / "model.onnx", out / "onnx" / "model.onnx")


def texts(count: int) -> list[str]:
    """Sentences of 3 to 60 words drawn from the embedding test texts' words (seeded)."""
    from build import paradigms

    words = " ".join(paradigms.EMBED_TEXTS).split()
    rng = random.Random(0)
    return [" ".join(rng.choice(words) for _ in range(rng.randint(3, 60))) for _ in range(count)]


# --- one engine, one round (run in a fresh process) ----------------------------------------------

def session_options(threads: int):  # noqa: ANN201 (onnxruntime's)
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    return options


# Each engine: open(folder, args) loads it and warms it up, and returns a run() giving one measurement.

def _now() -> tuple[float, float]:
    """(wall seconds, this process's CPU seconds): with one intra-op thread the CPU time of a step is its
    work alone, whatever else the machine runs."""
    return time.perf_counter(), time.process_time()


def _since(start: tuple[float, float], count: int = 1) -> dict:
    end = _now()
    return {"seconds": (end[0] - start[0]) / count, "cpu_seconds": (end[1] - start[1]) / count}


def _steps(marks: list[tuple[float, float]]) -> dict:
    return {"step_s": [b[0] - a[0] for a, b in zip(marks, marks[1:], strict=False)],
            "step_cpu_s": [b[1] - a[1] for a, b in zip(marks, marks[1:], strict=False)]}


def sd_ortpipe(folder: Path, args: dict) -> Callable[[], dict]:
    import ortpipe

    pipe = ortpipe.load(folder, threads=args["threads"])
    options = {"num_steps": args["steps"], "guidance_scale": args["guidance"], "negative_prompt": NEGATIVE,
               "seed": 0}
    pipe.generate(PROMPT, **{**options, "num_steps": 2})

    def run() -> dict:
        marks = []
        for _ in pipe.drive(pipe.request(PROMPT, **options)):
            marks.append(_now())
        # marks[0]: the init phase done, marks[i]: step i done; the last step's advance runs the VAE too
        return _steps(marks[:-1])

    return run


def sd_hand(folder: Path, args: dict) -> Callable[[], dict]:
    import numpy as np
    import onnxruntime as ort
    from tests import paradigm_refs as refs
    from transformers import CLIPTokenizer

    options = session_options(args["threads"])
    text, unet, vae = (ort.InferenceSession(str(folder / part / "model.onnx"), options,
                                            providers=["CPUExecutionProvider"])
                       for part in ("text_encoder", "unet", "vae_decoder"))
    tokenizer = CLIPTokenizer.from_pretrained(str(folder / "tokenizer"))
    ids = [tokenizer(t, padding="max_length", max_length=77, truncation=True).input_ids
           for t in (NEGATIVE, PROMPT)]
    config = json.loads((folder / "scheduler" / "scheduler_config.json").read_text())
    size = json.loads((folder / "unet" / "config.json").read_text())["sample_size"]
    latents = np.random.default_rng(0).standard_normal((1, 4, size, size)).astype(np.float32)
    scaling = json.loads((folder / "vae_decoder" / "config.json").read_text())["scaling_factor"]

    def generate(steps: int) -> dict:
        embeddings = text.run(["last_hidden_state"], {"input_ids": np.array(ids, np.int64)})[0]
        scheduler = refs.make_scheduler(config, steps)
        x, marks = latents * scheduler.init_noise_sigma, [_now()]
        for i, t in enumerate(scheduler.timesteps):
            batch = scheduler.scale_model_input(np.concatenate([x, x]), i).astype(np.float32)
            out = unet.run(["out_sample"], {"sample": batch, "timestep": np.array(t, np.float32),
                                            "encoder_hidden_states": embeddings})[0]
            uncond, cond = np.split(out, 2)
            x = scheduler.step(uncond + args["guidance"] * (cond - uncond), i, x, None).astype(np.float32)
            marks.append(_now())
        vae.run(["sample"], {"latent_sample": x / scaling})
        return _steps(marks[:-1])  # steps 1 to N-1, as ortpipe's

    generate(2)
    return lambda: generate(args["steps"])


def sd_optimum(folder: Path, args: dict) -> Callable[[], dict]:
    from optimum.onnxruntime import ORTDiffusionPipeline

    pipe = ORTDiffusionPipeline.from_pretrained(str(folder), session_options=session_options(args["threads"]),
                                                provider="CPUExecutionProvider")
    pipe.set_progress_bar_config(disable=True)
    options = {"guidance_scale": args["guidance"], "negative_prompt": NEGATIVE, "output_type": "np"}
    pipe(PROMPT, num_inference_steps=2, **options)

    def run() -> dict:
        marks: list[float] = []

        def mark(_pipe, _i, _t, kwargs):  # noqa: ANN001, ANN202 (diffusers' callback)
            marks.append(_now())
            return kwargs

        pipe(PROMPT, num_inference_steps=args["steps"], callback_on_step_end=mark, **options)
        return _steps(marks)  # a callback marks the end of each step: steps 2 to N

    return run


def embed_ortpipe(folder: Path, args: dict) -> Callable[[], dict]:
    import ortpipe

    pipe = ortpipe.load(folder, threads=args["threads"])
    sentences = texts(args["texts"])
    pipe.embed(sentences[: args["batch"]], batch_size=args["batch"])

    def run() -> dict:
        start = _now()
        embeddings = pipe.embed(sentences, batch_size=args["batch"])
        return {**_since(start), "embeddings": embeddings[:8].tolist()}

    return run


def embed_hand(folder: Path, args: dict) -> Callable[[], dict]:
    """onnxruntime on batches of texts in their order, padded with the tokenizer; pooling in numpy."""
    import numpy as np
    import onnxruntime as ort
    from tests import paradigm_refs as refs
    from tokenizers import Tokenizer

    session = ort.InferenceSession(str(folder / "onnx" / "model.onnx"), session_options(args["threads"]),
                                   providers=["CPUExecutionProvider"])
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tokenizer.enable_padding(pad_id=0)
    tokenizer.enable_truncation(128)
    cls = refs.pooling_mode(folder) == "cls"

    def embed(batch: list[str]) -> np.ndarray:
        encodings = tokenizer.encode_batch(batch)
        feeds = {"input_ids": np.array([e.ids for e in encodings], np.int64),
                 "attention_mask": np.array([e.attention_mask for e in encodings], np.int64),
                 "token_type_ids": np.array([e.type_ids for e in encodings], np.int64)}
        hidden = session.run(["last_hidden_state"], feeds)[0]
        if cls:
            pooled = hidden[:, 0]
        else:
            mask = feeds["attention_mask"][:, :, None].astype(np.float32)
            pooled = (hidden * mask).sum(1) / np.maximum(mask.sum(1), 1e-9)
        return pooled / np.maximum(np.linalg.norm(pooled, axis=1, keepdims=True), 1e-12)

    sentences, batch = texts(args["texts"]), args["batch"]
    embed(sentences[:batch])

    def run() -> dict:
        start = _now()
        out = np.concatenate([embed(sentences[i:i + batch]) for i in range(0, len(sentences), batch)])
        return {**_since(start), "embeddings": out[:8].tolist()}

    return run


def embed_sentence_transformers(folder: Path, args: dict) -> Callable[[], dict]:
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(folder), backend="onnx", model_kwargs={
        "file_name": "onnx/model.onnx", "provider": "CPUExecutionProvider",
        "session_options": session_options(args["threads"])})
    sentences = texts(args["texts"])
    model.encode(sentences[: args["batch"]], batch_size=args["batch"])

    def run() -> dict:
        start = _now()
        embeddings = model.encode(sentences, batch_size=args["batch"])
        return {**_since(start), "embeddings": embeddings[:8].tolist()}

    return run


def tts_ortpipe(folder: Path, args: dict) -> Callable[[], dict]:
    import ortpipe

    pipe = ortpipe.load(folder, threads=args["threads"])
    seconds = pipe.speak(SPEECH).seconds

    def run() -> dict:
        start = _now()
        for _ in range(args["repeats"]):
            pipe.speak(SPEECH)
        return {**_since(start, args["repeats"]), "audio_s": seconds}

    return run


def tts_hand(folder: Path, args: dict) -> Callable[[], dict]:
    import numpy as np
    import onnxruntime as ort
    from tests import paradigm_refs as refs

    session = ort.InferenceSession(str(folder / "onnx" / "model.onnx"), session_options(args["threads"]),
                                   providers=["CPUExecutionProvider"])
    ids = np.array([refs.vits_ids(folder, SPEECH)], np.int64)
    feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids)}
    rate = json.loads((folder / "config.json").read_text())["sampling_rate"]
    seconds = session.run(["waveform"], feeds)[0].shape[-1] / rate

    def run() -> dict:
        start = _now()
        for _ in range(args["repeats"]):
            session.run(["waveform"], feeds)
        return {**_since(start, args["repeats"]), "audio_s": seconds}

    return run


def seq2seq_ortpipe(folder: Path, args: dict) -> Callable[[], dict]:
    import ortpipe

    pipe = ortpipe.load(folder, threads=args["threads"])
    ids, n = seq2seq_ids(), args["new_tokens"]

    beams = {"num_beams": args["beams"], "early_stopping": False} if args["beams"] > 1 else {}

    def generate() -> list[int]:
        return pipe.generate(prompt_ids=ids, max_new_tokens=n, min_new_tokens=n, **beams).tokens

    return _timed_tokens(generate)


def seq2seq_hand(folder: Path, args: dict) -> Callable[[], dict]:
    """The floor: the encoder once, then the merged decoder token by token (the first run computes the
    cross-attention cache, later runs take it back unchanged), argmax in numpy; eos kept out as
    min_new_tokens does."""
    import numpy as np
    import onnxruntime as ort

    if args["beams"] > 1:
        raise SystemExit("the hand loop decodes greedily: run --beams with --engines ortpipe,optimum")
    options = session_options(args["threads"])
    encoder = ort.InferenceSession(str(folder / "onnx" / "encoder_model.onnx"), options,
                                   providers=["CPUExecutionProvider"])
    decoder = ort.InferenceSession(str(folder / "onnx" / "decoder_model_merged.onnx"), options,
                                   providers=["CPUExecutionProvider"])
    pasts = [i.name for i in decoder.get_inputs() if i.name.startswith("past_key_values.")]
    outputs = [o.name for o in decoder.get_outputs()]
    heads, size = T5_BENCH["num_heads"], T5_BENCH["d_kv"]
    ids, n, eos = np.array([seq2seq_ids()], np.int64), args["new_tokens"], T5_BENCH["eos_token_id"]

    def generate() -> list[int]:
        mask = np.ones_like(ids)
        states = encoder.run(None, {"input_ids": ids, "attention_mask": mask})[0]
        feeds = {"encoder_attention_mask": mask, "encoder_hidden_states": states,
                 "use_cache_branch": np.array([False])}
        feeds.update({name: np.zeros((1, heads, 0, size), np.float32) for name in pasts})
        token, tokens = T5_BENCH["decoder_start_token_id"], []
        for step in range(n):
            feeds["input_ids"] = np.array([[token]], np.int64)
            got = dict(zip(outputs, decoder.run(None, feeds), strict=True))
            logits = got["logits"][0, -1].copy()
            logits[eos] = -np.inf
            token = int(logits.argmax())
            tokens.append(token)
            for name in pasts:
                if step == 0 or ".decoder." in name:
                    feeds[name] = got[name.replace("past_key_values.", "present.")]
            feeds["use_cache_branch"] = np.array([True])
        return tokens

    return _timed_tokens(generate)


def seq2seq_optimum(folder: Path, args: dict) -> Callable[[], dict]:
    import torch
    from optimum.onnxruntime import ORTModelForSeq2SeqLM

    torch.set_num_threads(args["threads"])  # its logits processing in torch: the same threads as the others
    model = ORTModelForSeq2SeqLM.from_pretrained(folder, subfolder="onnx", session_options=session_options(
        args["threads"]), use_cache=True, use_merged=True, provider="CPUExecutionProvider")
    ids, n = torch.tensor([seq2seq_ids()]), args["new_tokens"]

    def generate() -> list[int]:
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                                 min_new_tokens=n, do_sample=False, num_beams=args["beams"],
                                 early_stopping=False)
        return out[0, 1:].tolist()

    return _timed_tokens(generate)


def _timed_tokens(generate: Callable[[], list[int]]) -> Callable[[], dict]:
    generate()  # warm-up

    def run() -> dict:
        start = _now()
        tokens = generate()
        return {**_since(start), "tokens": tokens}

    return run


RUNNERS = {("sd", "ortpipe"): sd_ortpipe, ("sd", "hand"): sd_hand, ("sd", "optimum"): sd_optimum,
           ("embed", "ortpipe"): embed_ortpipe, ("embed", "hand"): embed_hand,
           ("embed", "sentence-transformers"): embed_sentence_transformers,
           ("tts", "ortpipe"): tts_ortpipe, ("tts", "hand"): tts_hand,
           ("seq2seq", "ortpipe"): seq2seq_ortpipe, ("seq2seq", "hand"): seq2seq_hand,
           ("seq2seq", "optimum"): seq2seq_optimum}


# --- driving the rounds --------------------------------------------------------------------------

def peers_python() -> Path:
    from build import hfmodels

    return hfmodels.ensure_venv(BENCH_VENV, PEER_REQUIREMENTS, "benchmark peers")


def run_engines(task: str, engines: list[str], folder: Path, args: dict) -> dict[str, list[dict]]:
    """Every engine's rounds: each round one process of the peers' virtualenv (which has ortpipe's
    dependencies as well) that loads and warms up every engine, then runs each once, in an order (of loading
    and of running) rotated round by round: load from other processes meets every engine alike, and no
    engine is always the first loaded (the first session made in a process ran its steps up to 2% slower)."""
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'py'}{os.pathsep}{ROOT}", "TOKENIZERS_PARALLELISM": "false"}
    results: dict[str, list[dict]] = {e: [] for e in engines}
    for round_ in range(args["rounds"]):
        order = engines[round_ % len(engines):] + engines[:round_ % len(engines)]
        print(f"round {round_ + 1}/{args['rounds']}: {', '.join(order)}", file=sys.stderr, flush=True)
        command = [str(peers_python()), "-m", "build.bench_loops", "_round", task, ",".join(order),
                   str(folder), json.dumps(args)]
        done = subprocess.run(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"the {task} benchmark failed (exit {done.returncode})")
        for engine, result in json.loads(done.stdout.strip().splitlines()[-1]).items():
            results[engine].append(result)
    return results


def one_round(task: str, engines: list[str], folder: Path, args: dict) -> dict[str, dict]:
    runs = {engine: RUNNERS[(task, engine)](folder, args) for engine in engines}
    return {engine: runs[engine]() for engine in engines}


def summarise(task: str, results: dict[str, list[dict]], args: dict) -> list[str]:
    """One line per engine: its median (and spread), and its ratio to ortpipe."""
    def value(r: dict) -> float:
        if task == "sd":
            return statistics.median(r["step_cpu_s" if args["threads"] == 1 else "step_s"]) * 1000
        seconds = r["cpu_seconds" if args["threads"] == 1 else "seconds"]
        if task == "embed":
            return args["texts"] / seconds
        if task == "seq2seq":
            return len(r["tokens"]) / seconds
        return seconds / r["audio_s"]

    unit = {"sd": "ms a step", "embed": "texts/s", "tts": "real-time factor", "seq2seq": "tokens/s"}[task]
    unit += " (CPU time)" if args["threads"] == 1 else ""
    medians = {e: statistics.median(value(r) for r in rs) for e, rs in results.items()}
    lines = []
    for engine, rs in results.items():
        values = sorted(value(r) for r in rs)
        ratio = medians[engine] / medians["ortpipe"]
        rounds = ", ".join(f"{v:.4f}" for v in values)
        lines.append(f"{engine:22s} {medians[engine]:10.4f} {unit} (rounds {rounds})  {ratio:.3f}x ortpipe's")
    return lines


def check_outputs(task: str, results: dict[str, list[dict]]) -> None:
    """The engines computed the same embeddings (and ortpipe its image), or the comparison means nothing."""
    if task == "seq2seq":
        for engine, rs in results.items():
            if any(r["tokens"] != results["ortpipe"][0]["tokens"] for r in rs):
                print(f"warning: {engine}'s tokens differ from ortpipe's")
    if task == "embed":
        import numpy as np

        first = {e: np.array(rs[0]["embeddings"]) for e, rs in results.items()}
        for engine, got in first.items():
            difference = float(np.abs(got - first["ortpipe"]).max())
            if difference > 1e-5:
                print(f"warning: {engine}'s embeddings differ from ortpipe's by {difference:.1e}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "_make_st_bench":
        make_st_bench(Path(argv[1]), Path(argv[2]))
        return 0
    if argv and argv[0] == "_make_t5_bench":
        make_t5_bench(Path(argv[1]))
        return 0
    if argv and argv[0] == "_make_vits_bench":
        make_vits_bench(Path(argv[1]), Path(argv[2]))
        return 0
    if argv and argv[0] == "_round":
        task, engines, folder, args = argv[1], argv[2].split(","), Path(argv[3]), json.loads(argv[4])
        print(json.dumps(one_round(task, engines, folder, args)))
        return 0
    parser = argparse.ArgumentParser(prog="python -m build.bench_loops", description=__doc__.splitlines()[0])
    parser.add_argument("task", choices=sorted(ENGINES))
    parser.add_argument("--folder", help="a folder of build/paradigms.py, st-bench or vits-bench (default: "
                        "sd-bench, st-bench, vits-bench) or a path")
    parser.add_argument("--engines", help=f"comma-separated (default: all of the task's: {ENGINES})")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--guidance", type=float, default=7.5)
    parser.add_argument("--texts", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--new-tokens", type=int, default=64, help="seq2seq: tokens each generation makes")
    parser.add_argument("--beams", type=int, default=1, help="seq2seq: beam search with this many beams "
                        "(ortpipe and optimum)")
    parser.add_argument("--json", type=Path, help="write every measurement here")
    args = parser.parse_args(argv)
    from build import paradigms

    name = args.folder or {"sd": "sd-bench", "embed": "st-bench", "tts": "vits-bench",
                           "seq2seq": "t5-bench"}[args.task]
    made_here = {"st-bench": st_bench_folder, "vits-bench": vits_bench_folder, "t5-bench": t5_bench_folder}
    if Path(name).is_dir():
        folder = Path(name)
    else:
        folder = made_here[name]() if name in made_here else paradigms.get(name)
    engines = args.engines.split(",") if args.engines else list(ENGINES[args.task])
    names = ("threads", "steps", "guidance", "texts", "batch", "repeats", "rounds", "new_tokens", "beams")
    settings = {k: getattr(args, k) for k in names}
    results = run_engines(args.task, engines, folder, settings)
    check_outputs(args.task, results)
    print(f"{args.task} on {folder.name}, {args.threads} threads, {args.rounds} rounds: {settings}")
    for line in summarise(args.task, results, settings):
        print(line)
    if args.json:
        args.json.write_text(json.dumps({"task": args.task, "folder": str(folder), "settings": settings,
                                         "results": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
