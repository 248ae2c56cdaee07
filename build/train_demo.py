"""Train the built-in demo model: a small Llama over the Python standard library, exported for ortpipe.

    python -m build.train_demo --minutes 45            # train from scratch, evaluate, export to models/demo
    python -m build.train_demo --minutes 90 --resume   # continue the last run up to 90 minutes in all
    python -m build.train_demo --export-only           # evaluate and export the last checkpoint
    python -m build.train_demo --stage copy --minutes 60   # the second stage: teach it to copy

The corpus is the standard library's own .py files (test suites, codec tables and site-packages
left out), a fixed sorted list with a fixed ~2% of the files held out for validation. A byte-level
BPE tokenizer is trained on the training files, then a LlamaForCausalLM with AdamW, linear warmup
and a cosine decay over the time budget. Checkpoints go to build/cache/demo-train/ every few
minutes.

Two stages: `pretrain` (random windows of the token stream) and `copy`, which goes on from the
first stage's weights (its checkpoint, else the exported folder's int4 graph, dequantized) on
longer windows of which a share shows a span of text twice, as a prompt that quotes code and asks
for it again does: the first stage's model, after 10M tokens, never copied from its context, which
is what prompt-lookup speculation and "write this again" prompts rely on.

The end of a run measures the validation loss beside a unigram baseline, exports with
onnxruntime-genai's model builder (int4, onnx/model_q4.onnx) and an int8 variant (build/variants.py:
Optimum's fp32 export dynamically quantized, onnx/model_quantized.onnx, what the browser runs fastest),
with transformers.js's config.json beside genai_config.json, and writes TRAINING.md into the folder.
"""

from __future__ import annotations

import os

os.environ.setdefault("RAYON_NUM_THREADS", "1")  # tokenizers: leave the other core to other jobs

import argparse
import hashlib
import json
import logging
import math
import shutil
import sys
import sysconfig
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
WORK = REPO / "build" / "cache" / "demo-train"
OUT = REPO / "models" / "demo"

SPECIALS = ("<pad>", "<s>", "</s>")  # ids 0, 1, 2: the trainer numbers special tokens first
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
EXCLUDED_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "encodings", "__pycache__"}
VALIDATION_BUCKETS = 50  # a file is held out when the hash of its path is 0 modulo this: ~2%
CHECKPOINT_SECONDS = 300
MAX_OUTPUT_MB = 30.0

log = logging.getLogger("train_demo")


@dataclass(frozen=True)
class Settings:
    vocab_size: int = 8192
    hidden_size: int = 384
    layers: int = 6
    heads: int = 6
    kv_heads: int = 2
    head_dim: int = 64  # GroupQueryAttention on the CPU EP needs a multiple of 16
    intermediate_size: int = 1024
    context_length: int = 512
    seq_len: int = 256
    batch_size: int = 8
    peak_lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 30
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    seed: int = 0
    threads: int = 1
    copy_share: float = 0.0  # the share of training windows that show a span of text twice


# The second stage (see the module's docstring): windows of the whole context, 60% of them copies.
STAGES = {
    "pretrain": Settings(),
    "copy": replace(Settings(), seq_len=512, peak_lr=1e-3, warmup_steps=20, copy_share=0.6, threads=2),
}
CHECKPOINTS = {"pretrain": "checkpoint.pt", "copy": "checkpoint-copy.pt"}
VALIDATION_SEQ = 256  # validation windows: the same length at every stage, so the losses compare
# copy accuracy: how many held-out spans, their length, the tokens of each copy not scored
COPY_SPANS, COPY_SPAN, COPY_SKIP = 32, 200, 8
SEPARATOR = "\n\n"  # between a span and its copy
COPY_QUOTE, COPY_PROMPT = 160, 24  # the copying sample: tokens quoted, of which repeated in the prompt


# --- corpus and tokenizer ----------------------------------------------------------------------

def corpus_files() -> tuple[list[Path], list[Path]]:
    """(training files, validation files): the standard library's sources in sorted order."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    train, val = [], []
    for path in sorted(stdlib.rglob("*.py")):
        rel = path.relative_to(stdlib)
        if EXCLUDED_DIRS & set(rel.parts[:-1]):
            continue
        digest = hashlib.sha256(rel.as_posix().encode()).digest()
        (val if int.from_bytes(digest[:8], "big") % VALIDATION_BUCKETS == 0 else train).append(path)
    if not train or not val:
        raise FileNotFoundError(f"no standard-library sources found under {stdlib}")
    return train, val


def read_texts(paths: list[Path]) -> list[str]:
    """The files' text; the few that are not UTF-8 are skipped."""
    texts = []
    for path in paths:
        try:
            texts.append(path.read_text(encoding="utf-8"))
        except UnicodeDecodeError:
            continue
    return texts


def train_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIALS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    if [tok.token_to_id(t) for t in SPECIALS] != [PAD_ID, BOS_ID, EOS_ID]:
        raise RuntimeError("special tokens did not get ids 0, 1, 2")
    return tok


def tokenizer_config(context_length: int) -> dict:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>", "unk_token": None,
        "add_bos_token": False, "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": context_length,
    }


def encode(tok, texts: list[str]) -> np.ndarray:
    """One stream of documents, each as <s> tokens </s>."""
    parts = [np.asarray([BOS_ID, *enc.ids, EOS_ID], dtype=np.int32) for enc in tok.encode_batch(texts)]
    return np.concatenate(parts)


def prepare_data(settings: Settings, folder: Path | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Tokenizer and token streams, made once and cached in WORK. With `folder` (a stage that goes on
    from an exported model), that folder's tokenizer encodes the corpus instead of a newly trained one."""
    data = WORK / "tokens.npz"
    if data.is_file() and (WORK / "tokenizer.json").is_file():
        arrays = np.load(data)
        return arrays["train"], arrays["val"]
    train_paths, val_paths = corpus_files()
    train_texts, val_texts = read_texts(train_paths), read_texts(val_paths)
    log.info("corpus: %d training files, %d validation files", len(train_texts), len(val_texts))
    if folder is None:
        tok = train_tokenizer(train_texts, settings.vocab_size)
    else:
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    train, val = encode(tok, train_texts), encode(tok, val_texts)
    WORK.mkdir(parents=True, exist_ok=True)
    tok.save(str(WORK / "tokenizer.json"))
    config = tokenizer_config(settings.context_length)
    (WORK / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    (WORK / "files.json").write_text(json.dumps({
        "train": [p.relative_to(stdlib).as_posix() for p in train_paths],
        "val": [p.relative_to(stdlib).as_posix() for p in val_paths]}, indent=1) + "\n")
    np.savez(data, train=train, val=val)
    return train, val


def separator_ids() -> np.ndarray:
    from tokenizers import Tokenizer

    return np.asarray(Tokenizer.from_file(str(WORK / "tokenizer.json")).encode(SEPARATOR).ids, dtype=np.int64)


# --- model and training ------------------------------------------------------------------------

def hf_config(settings: Settings):
    import transformers

    return transformers.LlamaConfig(
        vocab_size=settings.vocab_size, hidden_size=settings.hidden_size,
        num_hidden_layers=settings.layers, num_attention_heads=settings.heads,
        num_key_value_heads=settings.kv_heads, head_dim=settings.head_dim,
        intermediate_size=settings.intermediate_size, max_position_embeddings=settings.context_length,
        tie_word_embeddings=True, bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID)


def make_optimizer(model, settings: Settings):
    import torch

    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": settings.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=settings.peak_lr, betas=settings.betas)


def learning_rate(settings: Settings, step: int, elapsed: float, budget: float) -> float:
    """Linear warmup over the first steps, then a cosine from the peak down to min_lr_ratio x the peak
    over the time budget."""
    warmup = min(1.0, (step + 1) / settings.warmup_steps)
    progress = min(1.0, elapsed / budget)
    floor = settings.min_lr_ratio
    return settings.peak_lr * warmup * (floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress)))


def sample_batch(stream, settings: Settings, generator, separator):
    """batch_size windows of seq_len + 1 tokens from the training stream: random windows, and with
    probability copy_share a copy window (copy_window)."""
    import torch

    length = settings.seq_len + 1
    if not settings.copy_share:
        starts = torch.randint(0, len(stream) - length, (settings.batch_size,), generator=generator)
        return stream[starts[:, None] + torch.arange(length)[None, :]]
    rows = []
    for _ in range(settings.batch_size):
        if torch.rand((), generator=generator).item() < settings.copy_share:
            rows.append(copy_window(stream, length, generator, separator))
        else:
            start = int(torch.randint(0, len(stream) - length, (), generator=generator))
            rows.append(stream[start:start + length])
    return torch.stack(rows)


def copy_window(stream, length: int, generator, separator):
    """`length` tokens: text from one place, a span of 16 or more tokens from another, the separator,
    the same span again, then text from a third place (places and lengths drawn at random)."""
    import torch

    def draw(count: int) -> int:  # 0 .. count - 1
        return int(torch.randint(0, count, (), generator=generator))

    def piece(size: int):
        start = draw(len(stream) - size)
        return stream[start:start + size]

    room = length - len(separator)
    span = 16 + draw(room // 2 - 16 + 1)
    before = draw(room - 2 * span + 1)
    quoted = piece(span)
    return torch.cat([piece(before), quoted, separator, quoted, piece(room - before - 2 * span)])


def lm_loss(model, window):
    """Mean next-token cross-entropy (nats) over a [batch, seq + 1] window."""
    import torch

    logits = model(input_ids=window[:, :-1]).logits
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(),
                                             window[:, 1:].reshape(-1))


@dataclass
class Progress:
    step: int = 0
    tokens: int = 0
    elapsed: float = 0.0  # seconds spent in the training loop, over every resumed run
    wall: float = 0.0  # seconds of wall time, data preparation and checkpoints included


def save_checkpoint(stage: str, state: dict) -> None:
    import torch

    scratch = WORK / (CHECKPOINTS[stage] + ".partial")
    torch.save(state, scratch)
    os.replace(scratch, WORK / CHECKPOINTS[stage])


def read_checkpoint(stage: str) -> dict:
    import torch

    path = WORK / CHECKPOINTS[stage]
    state = torch.load(path, weights_only=False)
    if state["settings"] != asdict(STAGES[stage]):
        raise ValueError(f"{path} was trained with other settings: {state['settings']}")
    return state


def load_model(settings: Settings):
    import torch
    import transformers

    torch.manual_seed(settings.seed)
    return transformers.LlamaForCausalLM(hf_config(settings)).to(torch.float32)


def weights_from_folder(folder: Path, settings: Settings) -> dict:
    """The state dict of an exported folder's int4 graph (onnx/model_q4.onnx), each weight dequantized
    (build/variants.py): the model builder's fused qkv_proj split into q, k and v, its MatMul weights
    transposed back to torch's [out, in]."""
    import onnx
    import torch
    from onnx import numpy_helper

    from build import variants

    graph = variants.dequantized(onnx.load(folder / "onnx" / "model_q4.onnx"))
    weights = {t.name: numpy_helper.to_array(t) for t in graph.graph.initializer}
    q_size, kv_size = settings.heads * settings.head_dim, settings.kv_heads * settings.head_dim
    state = {"model.embed_tokens.weight": weights["model.embed_tokens.Reshape.output_0_fp32"],
             "model.norm.weight": weights[f"model.layers.{settings.layers}.final_norm_layernorm.weight"]}
    for i in range(settings.layers):
        layer = f"model.layers.{i}."
        qkv = weights[layer + "attn.qkv_proj.MatMul.weight_Q4_fp32"]
        for name, part in zip("qkv", np.split(qkv, [q_size, q_size + kv_size], axis=1), strict=True):
            state[layer + f"self_attn.{name}_proj.weight"] = part.T
        state[layer + "self_attn.o_proj.weight"] = weights[layer + "attn.o_proj.MatMul.weight_Q4_fp32"].T
        for name in ("gate", "up", "down"):
            matmul = weights[layer + f"mlp.{name}_proj.MatMul.weight_Q4_fp32"]
            state[layer + f"mlp.{name}_proj.weight"] = matmul.T
        for name in ("input_layernorm", "post_attention_layernorm"):
            state[layer + name + ".weight"] = weights[layer + name + ".weight"]
    return {name: torch.from_numpy(np.array(array, dtype=np.float32)) for name, array in state.items()}


def starting_point(stage: str, settings: Settings, folder: Path) -> tuple[dict, list[dict]]:
    """(weights, the stages before) that a new run of `stage` starts from: random weights for the
    first stage; for the copy stage, the first stage's checkpoint when there is one, else the
    exported folder's weights and its training.json."""
    if stage == "pretrain":
        return load_model(settings).state_dict(), []
    if (WORK / CHECKPOINTS["pretrain"]).is_file():
        state = read_checkpoint("pretrain")
        record = {"stage": "pretrain", "settings": state["settings"], "progress": state["progress"]}
        return state["model"], [record]
    history = json.loads((folder / "training.json").read_text())["stages"]
    if [record["stage"] for record in history] != ["pretrain"]:
        raise ValueError(f"{folder / 'training.json'} does not end with the first stage: {history}")
    return weights_from_folder(folder, STAGES["pretrain"]), history


def train(stage: str, minutes: float, resume: bool, folder: Path) -> Progress:
    import torch

    settings = STAGES[stage]
    torch.set_num_threads(settings.threads)
    run_start = time.perf_counter()
    train_ids, val_ids = prepare_data(settings, None if stage == "pretrain" else folder)
    stream = torch.from_numpy(train_ids.astype(np.int64))
    separator = torch.from_numpy(separator_ids())
    model = load_model(settings)
    optimizer = make_optimizer(model, settings)
    generator = torch.Generator().manual_seed(settings.seed)
    progress = Progress()
    if resume:
        state = read_checkpoint(stage)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        generator.set_state(state["generator"])
        progress, history = Progress(**state["progress"]), state["history"]
    else:
        weights, history = starting_point(stage, settings, folder)
        model.load_state_dict(weights, strict=False)  # lm_head is tied to the embedding
        model.tie_weights()
        if history:  # what the previous stage's weights give, measured as this stage's are
            history[-1] = {**history[-1], "val_loss": validation_loss(model, val_ids),
                           "copy_accuracy": copy_accuracy(model, val_ids, separator_ids())}
            log.info("starting from %s: validation %.3f, copy accuracy %.3f", history[-1]["stage"],
                     history[-1]["val_loss"], history[-1]["copy_accuracy"])
    log.info("stage %s, model: %.2fM parameters; %d training tokens; starting at step %d (%.1f min)", stage,
             parameter_count(model) / 1e6, len(stream), progress.step, progress.elapsed / 60)

    def save() -> None:
        progress.wall = wall_before + time.perf_counter() - run_start
        save_checkpoint(stage, {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                                "generator": generator.get_state(), "progress": asdict(progress),
                                "settings": asdict(settings), "history": history})

    budget = minutes * 60.0
    wall_before = progress.wall
    model.train()
    last_save = progress.elapsed
    smoothed = None
    while progress.elapsed < budget:
        start = time.perf_counter()
        lr = learning_rate(settings, progress.step, progress.elapsed, budget)
        for group in optimizer.param_groups:
            group["lr"] = lr
        loss = lm_loss(model, sample_batch(stream, settings, generator, separator))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), settings.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        progress.step += 1
        progress.tokens += settings.batch_size * settings.seq_len
        progress.elapsed += time.perf_counter() - start
        smoothed = loss.item() if smoothed is None else 0.95 * smoothed + 0.05 * loss.item()
        if progress.step % 10 == 0:
            log.info("step %d  loss %.3f  lr %.2e  tokens %d  %.1f min", progress.step, smoothed, lr,
                     progress.tokens, progress.elapsed / 60)
        if progress.elapsed - last_save >= CHECKPOINT_SECONDS:
            save()
            last_save = progress.elapsed
    save()
    return progress


def parameter_count(model) -> int:
    return sum(p.numel() for p in model.parameters())


# --- evaluation ----------------------------------------------------------------------------------

def validation_windows(val_ids: np.ndarray, seq_len: int) -> list[np.ndarray]:
    """Windows of seq_len + 1 tokens overlapping by one: every token but the first is a target once."""
    return [val_ids[start:start + seq_len + 1] for start in range(0, len(val_ids) - 1, seq_len)]


def validation_loss(model, val_ids: np.ndarray) -> float:
    """Mean next-token cross-entropy (nats/token) of the torch model over the held-out files."""
    import torch

    total, count = 0.0, 0
    was_training = model.training
    model.eval()
    with torch.no_grad():
        for window in validation_windows(val_ids, VALIDATION_SEQ):
            ids = torch.from_numpy(window.astype(np.int64))[None]
            logits = model(input_ids=ids[:, :-1]).logits[0].float()
            total += torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="sum").item()
            count += ids.shape[1] - 1
    model.train(was_training)
    return total / count


def copy_accuracy(model, val_ids: np.ndarray, separator: np.ndarray) -> float:
    """How well the model copies: over COPY_SPANS held-out spans of COPY_SPAN tokens (evenly spaced in
    the held-out stream), each followed by the separator and itself, the share of the second
    occurrence's tokens after its first COPY_SKIP that the model's argmax predicts (teacher-forced)."""
    import torch

    hits = total = 0
    was_training = model.training
    model.eval()
    with torch.no_grad():
        for start in np.linspace(0, len(val_ids) - COPY_SPAN, COPY_SPANS).astype(int):
            span = val_ids[start:start + COPY_SPAN].astype(np.int64)
            ids = np.concatenate([span, separator, span])
            guesses = model(input_ids=torch.from_numpy(ids)[None]).logits[0].argmax(-1).numpy()
            scored = len(span) + len(separator) + COPY_SKIP  # the first position scored
            hits += int((guesses[scored - 1:-1] == ids[scored:]).sum())
            total += len(ids) - scored
    model.train(was_training)
    return hits / total


def onnx_validation_loss(graph: Path, val_ids: np.ndarray, settings: Settings) -> float:
    """The same loss through an exported graph (plain onnxruntime, an empty KV cache per window)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = settings.threads
    session = ort.InferenceSession(str(graph), options, providers=["CPUExecutionProvider"])
    empty_past = np.zeros((1, settings.kv_heads, 0, settings.head_dim), dtype=np.float32)
    pasts = {i.name: empty_past for i in session.get_inputs() if i.name.startswith("past_key_values.")}
    total, count = 0.0, 0
    for window in validation_windows(val_ids, VALIDATION_SEQ):
        ids = window[None, :-1].astype(np.int64)
        feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids), **pasts}
        if "position_ids" in {i.name for i in session.get_inputs()}:  # Optimum's export (the int8 variant)
            feeds["position_ids"] = np.arange(ids.shape[1], dtype=np.int64)[None]
        logits = session.run(["logits"], feeds)[0][0].astype(np.float64)
        top = logits.max(axis=-1, keepdims=True)
        log_norm = (top + np.log(np.exp(logits - top).sum(axis=-1, keepdims=True)))[:, 0]
        total += float((log_norm - logits[np.arange(len(window) - 1), window[1:]]).sum())
        count += len(window) - 1
    return total / count


def unigram_loss(train_ids: np.ndarray, val_ids: np.ndarray, vocab_size: int) -> float:
    """Cross-entropy (nats/token) of the held-out targets under the training set's token frequencies,
    add-one smoothed."""
    counts = np.bincount(train_ids, minlength=vocab_size).astype(np.float64) + 1.0
    log_probs = np.log(counts / counts.sum())
    targets = np.concatenate([w[1:] for w in validation_windows(val_ids, 1 << 30)])
    return float(-log_probs[targets].mean())


# --- export ----------------------------------------------------------------------------------------

def load_checkpoint(stage: str):
    """(model, the checkpoint's state) of a stage's last checkpoint."""
    import torch

    settings = STAGES[stage]
    torch.set_num_threads(settings.threads)
    state = read_checkpoint(stage)
    model = load_model(settings)
    model.load_state_dict(state["model"])
    return model.eval(), state


def save_hf(model, settings: Settings) -> Path:
    """The checkpoint as a Hugging Face folder (safetensors, tokenizer, greedy generation_config)."""
    import transformers

    hf_dir = WORK / "hf"
    shutil.rmtree(hf_dir, ignore_errors=True)
    model.generation_config = transformers.GenerationConfig(
        bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID, do_sample=False)
    model.save_pretrained(hf_dir, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy2(WORK / name, hf_dir / name)
    return hf_dir


# Sampling by default reads better than greedy decoding, which loops on a model this small; greedy
# stays one flag away (do_sample false, or --no-do-sample on the CLI).
SEARCH_DEFAULTS = {"do_sample": True, "temperature": 0.7, "top_k": 40, "top_p": 0.95,
                   "repetition_penalty": 1.0}


def set_search_defaults(folder: Path) -> None:
    path = folder / "genai_config.json"
    config = json.loads(path.read_text())
    config["search"].update(SEARCH_DEFAULTS)
    path.write_text(json.dumps(config, indent=4) + "\n")
    generation = json.loads((folder / "generation_config.json").read_text())  # transformers.js's
    generation.update({k: v for k, v in SEARCH_DEFAULTS.items() if k != "repetition_penalty"})
    (folder / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")


def folder_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def export(hf_dir: Path, out: Path) -> Path:
    """The builder's int4 export (onnx/model_q4.onnx) and the int8 variant of Optimum's fp32 export
    (onnx/model_quantized.onnx) into a scratch folder beside out, with the demo's search defaults and
    transformers.js's config.json and generation_config.json."""
    import tempfile

    import onnx

    from build import variants
    from build.hfmodels import export_builder, export_concat

    scratch = out.parent / f".{out.name}.partial"
    shutil.rmtree(scratch, ignore_errors=True)
    export_builder(hf_dir, scratch, "int4")
    (scratch / "onnx").mkdir()
    q4 = onnx.load(scratch / "model.onnx", load_external_data=False)
    for tensor in q4.graph.initializer:
        for entry in tensor.external_data:
            if entry.key == "location":
                entry.value = "model_q4.onnx.data"
    onnx.save(variants.concrete_cache_dims(q4), scratch / "onnx" / "model_q4.onnx")
    os.replace(scratch / "model.onnx.data", scratch / "onnx" / "model_q4.onnx.data")
    (scratch / "model.onnx").unlink()
    with tempfile.TemporaryDirectory() as fp32_dir:
        # int8 from Optimum's export: attention in plain ONNX ops (MatMul, Softmax) and a cache that grows
        # by Concat, which onnxruntime-web runs on several new tokens at once in a fraction of the time
        # its GroupQueryAttention takes (what speculative decoding's checks are)
        fp32 = export_concat(hf_dir, Path(fp32_dir) / "concat") / "model.onnx"
        q8 = variants.quantize_q8(fp32, scratch / "onnx" / "model_quantized.onnx")
        variants.optimize_ahead(q8, q8)  # ortpipe's wasm and CPU sessions skip onnxruntime's optimizer
    config = json.loads((scratch / "genai_config.json").read_text())
    config["model"]["decoder"]["filename"] = "onnx/model_q4.onnx"
    (scratch / "genai_config.json").write_text(json.dumps(config, indent=4) + "\n")
    for name in ("config.json", "generation_config.json"):  # what transformers.js reads
        shutil.copy2(hf_dir / name, scratch / name)
    set_search_defaults(scratch)
    size = folder_bytes(scratch)
    if size > MAX_OUTPUT_MB * 1e6:
        raise RuntimeError(f"the exported folder is {size / 1e6:.1f} MB, over {MAX_OUTPUT_MB} MB")
    return scratch


def samples(folder: Path, prompts: tuple[str, ...], tokens: int, **settings) -> list[str]:
    """Continuations by ortpipe: greedy with do_sample=False, else the folder's search defaults."""
    import ortpipe

    pipe = ortpipe.load(folder, threads=1)
    return [pipe.generate(prompt, max_new_tokens=tokens, **settings).text for prompt in prompts]


SAMPLE_PROMPTS = ("def ", "import os\n", "class Stack:\n    def push(self, item):")


def shown(texts: list[str]) -> str:
    pairs = zip(SAMPLE_PROMPTS, texts, strict=True)
    return "\n\n".join(f"```python\n{prompt}{text}\n```" for prompt, text in pairs)


def copy_sample(folder: Path, val_ids: np.ndarray) -> dict:
    """A greedy continuation (ortpipe) of a prompt that quotes held-out code, then repeats its first
    COPY_PROMPT tokens: how many of the quoted tokens after those it reproduces before it differs."""
    from tokenizers import Tokenizer

    import ortpipe

    starts = np.flatnonzero(val_ids == BOS_ID)
    quoted = [int(t) for t in val_ids[starts[0] + 1:starts[0] + 1 + COPY_QUOTE]]
    prompt = [*quoted, *separator_ids().tolist(), *quoted[:COPY_PROMPT]]
    pipe = ortpipe.load(folder, threads=1)
    tokens = pipe.generate(prompt_ids=prompt, max_new_tokens=COPY_QUOTE - COPY_PROMPT, do_sample=False).tokens
    expected = quoted[COPY_PROMPT:]
    same = next((i for i, (a, b) in enumerate(zip(tokens, expected, strict=False)) if a != b),
                min(len(tokens), len(expected)))
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    return {"quoted": tokenizer.decode(quoted), "repeated": tokenizer.decode(quoted[:COPY_PROMPT]),
            "continuation": tokenizer.decode(tokens), "copied": same, "of": len(expected)}


def _maybe(value: float | None) -> str:
    return "" if value is None else f"{value:.3f}"


def loss_rows(metrics: dict, history: list[dict]) -> str:
    before = history[-1] if history and "val_loss" in history[-1] else None
    rows = [("unigram baseline (training frequencies, add-one)", metrics["unigram_loss"], None)]
    if before:
        rows.append((f"after the {before['stage']} stage (its int4 export, dequantized)", before["val_loss"],
                     before["copy_accuracy"]))
    rows += [("this model, torch fp32", metrics["val_loss"], metrics["copy_accuracy"]),
             ("this model, exported int4 (onnxruntime, onnx/model_q4.onnx)", metrics["onnx_val_loss"], None),
             ("this model, int8 (onnxruntime, onnx/model_quantized.onnx)", metrics["q8_val_loss"], None)]
    return "\n".join(f"| {name} | {loss:.3f} | {math.exp(loss):.1f} | {_maybe(copy)} |"
                     for name, loss, copy in rows)


def stage_rows(stages: list[dict], train_tokens: int) -> str:
    rows = []
    for record in stages:
        settings, progress = record["settings"], record["progress"]
        windows = (f"{settings['seq_len']} tokens" + (f", {settings['copy_share']:.0%} of them copies"
                                                     if settings.get("copy_share") else ""))
        rows.append(f"| {record['stage']} | {progress['step']:,} | {progress['tokens']:,} "
                    f"({progress['tokens'] / train_tokens:.2f} epochs) | {progress['elapsed'] / 60:.1f} / "
                    f"{progress['wall'] / 60:.1f} | {windows} | {settings['peak_lr']:g} | "
                    f"{settings['threads']} |")
    return "\n".join(rows)


def settings_table(stages: list[dict]) -> str:
    keys = list(stages[-1]["settings"])
    head = "| setting | " + " | ".join(r["stage"] for r in stages) + " |\n|---|" + "---|" * len(stages)
    cells = ("| " + key + " | " + " | ".join(str(r["settings"].get(key, "")) for r in stages) + " |"
             for key in keys)
    return head + "\n" + "\n".join(cells)


def training_report(stages: list[dict], metrics: dict, examples: dict, params: int) -> str:
    files = json.loads((WORK / "files.json").read_text())
    defaults = ", ".join(f"{key} {json.dumps(value)}" for key, value in SEARCH_DEFAULTS.items())
    copy = examples["copy"]
    return f"""# The demo model

A {params / 1e6:.1f}M-parameter LlamaForCausalLM trained from scratch on the Python standard
library's sources by `build/train_demo.py`, exported with onnxruntime-genai's model builder for
the CPU EP: int4 weights (block size 32), the embedding table shared with the output layer
(`onnx/model_q4.onnx`); and an int8 variant (`onnx/model_quantized.onnx`: Optimum's fp32 export,
its attention in plain ONNX ops and its cache grown by Concat, quantized by build/variants.py), which
the browser runs on wasm by default (the int4 graph has no fast wasm kernel, and onnxruntime-web
checks several drafted tokens at once far faster without GroupQueryAttention). Its byte-level BPE
tokenizer was trained on the same files. `training.json` holds the stages' records.

## Data

Python {sys.version.split()[0]}'s standard library, `*.py` files in sorted order without test
suites, codec tables and site-packages: {len(files["train"])} training files
({metrics["train_tokens"]:,} tokens) and {len(files["val"])} held-out files
({metrics["val_tokens"]:,} tokens), each file `<s> ... </s>`. Held out: {", ".join(files["val"])}.

## Training

AdamW, linear warmup, cosine decay to 0.1 x the peak over each stage's time budget, on the CPU.
`pretrain` trains from random weights on random windows of the token stream. `copy` goes on from
its weights on windows of the whole context, of which a share are copies: text from one place, a
span of 16 or more tokens from another, `{SEPARATOR!r}`, the same span again, then text from a third
place. The first stage's model never copied from its context, which prompt-lookup speculation and
prompts that quote code rely on.

| stage | steps | tokens seen | minutes (loop / wall) | windows | peak lr | threads |
|---|---|---|---|---|---|---|
{stage_rows(stages, metrics["train_tokens"])}

{settings_table(stages)}

## Validation (held-out files)

Loss in nats/token over windows of {VALIDATION_SEQ} tokens. Copy accuracy: {COPY_SPANS} held-out spans of
{COPY_SPAN} tokens, each followed by `{SEPARATOR!r}` and itself; the share of the second occurrence's tokens
(after its first {COPY_SKIP}) that the model's argmax predicts, teacher-forced.

| model | loss | perplexity | copy accuracy |
|---|---|---|---|
{loss_rows(metrics, stages[:-1])}

Folder size: {metrics["folder_mb"]:.1f} MB.

## Samples (ortpipe, the int4 graph)

Copying, greedy: the first {COPY_QUOTE} tokens of the first held-out file, `{SEPARATOR!r}`, and their
first {COPY_PROMPT} tokens again; the continuation reproduces {copy["copied"]} of the {copy["of"]} quoted
tokens that follow before it differs:

```python
{copy["repeated"]}{copy["continuation"]}
```

Greedy, 60 new tokens:

{shown(examples["greedy"])}

Sampled with the folder's defaults ({defaults}), seed 1, 60 new tokens:

{shown(examples["sampled"])}

## Reproduce or train longer

    python -m build.train_demo --minutes 180                       # the first stage, from scratch
    python -m build.train_demo --minutes 240 --resume              # ... or longer
    python -m build.train_demo --stage copy --minutes 60 --train-only
    python -m build.train_demo --stage copy --minutes 120 --resume # the second stage, exported

`--minutes` is the stage's budget in all, resumed time included; the cosine schedule stretches over the
new budget (the learning rate rises again to the value the longer schedule has at the time already
spent), which is how this folder's copy stage ran (the two commands above). Time-based schedules make
runs repeat only approximately. The copy stage starts from the first stage's checkpoint, or without
one from the folder's int4 graph, dequantized (how this folder was made: the first stage's
checkpoint was not kept).
"""


def finish(stage: str, out: Path) -> dict:
    """Evaluate the stage's last checkpoint, export it to out and write out/TRAINING.md and
    out/training.json."""
    model, state = load_checkpoint(stage)
    settings = STAGES[stage]
    train_ids, val_ids = prepare_data(settings)
    metrics = {"train_tokens": int(len(train_ids)), "val_tokens": int(len(val_ids)),
               "unigram_loss": unigram_loss(train_ids, val_ids, settings.vocab_size),
               "val_loss": validation_loss(model, val_ids),
               "copy_accuracy": copy_accuracy(model, val_ids, separator_ids())}
    log.info("validation: %.3f nats/token (unigram baseline %.3f), copy accuracy %.3f",
             metrics["val_loss"], metrics["unigram_loss"], metrics["copy_accuracy"])
    scratch = export(save_hf(model, settings), out)
    metrics["onnx_val_loss"] = onnx_validation_loss(scratch / "onnx" / "model_q4.onnx", val_ids, settings)
    q8 = scratch / "onnx" / "model_quantized.onnx"
    metrics["q8_val_loss"] = onnx_validation_loss(q8, val_ids, settings)
    examples = {"greedy": samples(scratch, SAMPLE_PROMPTS, 60, do_sample=False),
                "sampled": samples(scratch, SAMPLE_PROMPTS, 60, seed=1),
                "copy": copy_sample(scratch, val_ids)}
    record = {"stage": stage, "settings": state["settings"], "progress": state["progress"],
              **{k: metrics[k] for k in ("val_loss", "copy_accuracy", "onnx_val_loss")}}
    stages = json.loads(json.dumps([*state["history"], record]))  # as training.json holds them
    (scratch / "training.json").write_text(json.dumps({"stages": stages}, indent=2) + "\n")
    metrics["folder_mb"] = folder_bytes(scratch) / 1e6  # before TRAINING.md, which adds a few kB
    report = training_report(stages, metrics, examples, parameter_count(model))
    (scratch / "TRAINING.md").write_text(report)
    shutil.rmtree(out, ignore_errors=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    os.replace(scratch, out)
    log.info("exported %s: %.1f MB, int4 validation %.3f nats/token",
             out, metrics["folder_mb"], metrics["onnx_val_loss"])
    return metrics


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m build.train_demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--stage", choices=tuple(STAGES), default="pretrain",
                        help="pretrain (from scratch, the default) or copy (from the first stage's weights)")
    parser.add_argument("--minutes", type=float, default=45.0,
                        help="the stage's training-loop budget in all, resumed runs included (default 45)")
    parser.add_argument("--out", type=Path, default=OUT,
                        help=f"the exported model folder, which the copy stage starts from (default {OUT})")
    parser.add_argument("--resume", action="store_true", help="continue the stage from its last checkpoint")
    stage = parser.add_mutually_exclusive_group()
    stage.add_argument("--train-only", action="store_true",
                       help="train and checkpoint; no evaluation or export")
    stage.add_argument("--export-only", action="store_true",
                       help="evaluate and export the stage's last checkpoint")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stdout)
    if not args.export_only:
        wall = time.perf_counter()
        train(args.stage, args.minutes, args.resume, args.out.resolve())
        log.info("training done in %.1f min of wall time", (time.perf_counter() - wall) / 60)
    if not args.train_only:
        finish(args.stage, args.out.resolve())
    return 0


if __name__ == "__main__":
    sys.exit(main())
