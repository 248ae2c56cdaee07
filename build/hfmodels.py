"""Tiny random-weight Hugging Face models and their ONNX exports, for conformance tests.

Everything here is deterministic and offline: a byte-level BPE tokenizer trained on a fixed list
of Python standard-library sources, tiny causal LMs initialised from a fixed seed, and exports
made by onnxruntime-genai's model builder (a subprocess of this interpreter) or by Optimum (a
subprocess of a separate virtualenv, because optimum-onnx needs transformers < 4.58).

    python -m build.hfmodels --all          # build every test model into the cache
    python -m build.hfmodels llama-builder-fp32 gpt2-optimum

Builds land in build/cache/<name>/ (or $ORTPIPE_CACHE/<name>/) and are reused once complete.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
VOCAB_SIZE = 512
SPECIALS = ("<pad>", "<s>", "</s>")  # ids 0, 1, 2: the trainer numbers special tokens first
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
CONTEXT_LENGTH = 512
ARCHS = ("llama", "qwen2", "phi3", "gemma2", "gpt2")
GEMMA_SLIDING_WINDOW = 32  # shorter than prompt + generation, so the window really cuts

# Sorted and fixed: the same text (and tokenizer) on every machine with the same Python version.
CORPUS = ("argparse.py", "bisect.py", "csv.py", "functools.py", "heapq.py", "json/decoder.py",
          "json/encoder.py", "string.py", "textwrap.py")

# The separate environment for Optimum. torch is pinned in the same pip command: any other version
# pulls CUDA wheels.
OPTIMUM_VENV = Path(os.environ.get("ORTPIPE_OPTIMUM_VENV", REPO / ".venv-optimum"))
OPTIMUM_REQUIREMENTS = ("torch==2.13.0", "transformers==4.57.6", "optimum-onnx==0.1.0", "optimum==2.1.0",
                        "onnx==1.23.2", "onnxruntime==1.31.1")


# --- cache -------------------------------------------------------------------------------------

def cache_root() -> Path:
    return Path(os.environ.get("ORTPIPE_CACHE", REPO / "build" / "cache"))


def _fingerprint(name: str, recipe: str = "") -> str:
    """Changes with this file, the caller's `recipe`, the Python version (the training text) and
    the tools' versions, so an edited recipe or an upgraded tool never reuses a stale build."""
    from importlib.metadata import PackageNotFoundError, version

    parts = [name, recipe, sys.version, Path(__file__).read_text(encoding="utf-8")]
    for package in ("torch", "transformers", "tokenizers", "onnxruntime-genai", "onnx-ir"):
        try:
            parts.append(f"{package}=={version(package)}")
        except PackageNotFoundError:
            parts.append(f"{package} missing")
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()


def cached(name: str, build_fn: Callable[[Path], Path], root: Path | None = None, recipe: str = "") -> Path:
    """Build into <root>/<name>/ (root: the cache) once; later calls return the folder without
    rebuilding, until this file, `recipe` (what else decides the build) or a tool changes.

    The build runs in a scratch folder that is renamed into place, and the marker
    (<root>/<name>.done, outside the model folder so the folder stays exactly as built) is
    written last: an interrupted build is never mistaken for a complete one.
    """
    root = root or cache_root()
    out = root / name
    marker = root / f"{name}.done"
    fingerprint = _fingerprint(name, recipe)
    if out.is_dir() and marker.is_file() and marker.read_text() == fingerprint:
        return out
    root.mkdir(parents=True, exist_ok=True)
    marker.unlink(missing_ok=True)
    scratch = root / f".{name}.partial"
    shutil.rmtree(scratch, ignore_errors=True)
    build_fn(scratch)
    shutil.rmtree(out, ignore_errors=True)
    os.replace(scratch, out)
    marker.write_text(fingerprint)
    return out


# --- tokenizer ---------------------------------------------------------------------------------

def _corpus() -> list[str]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts = [(stdlib / name).read_text(encoding="utf-8") for name in CORPUS if (stdlib / name).is_file()]
    if not texts:
        raise FileNotFoundError(f"no training text found under {stdlib}")
    return texts


def _qwen2_split():
    """The normalizer and pre-tokenizer transformers 5 imposes on every qwen2 tokenizer.

    AutoTokenizer forces Qwen2Tokenizer for model_type qwen2 whatever tokenizer_config.json
    says, and that class rebuilds the pipeline around the vocab and merges; the builder then
    saves the rebuilt tokenizer. Training the Qwen2 tokenizer with the same pipeline keeps the
    Hugging Face folder and the exported folder tokenizing alike.
    """
    from tokenizers import Regex, normalizers, pre_tokenizers
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    pre = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    return normalizers.NFC(), pre


def train_tokenizer(out_dir: str | Path, *, style: str = "bytelevel") -> Path:
    """A byte-level BPE tokenizer (VOCAB_SIZE ids, specials first) as tokenizer.json + tokenizer_config.json.

    style "qwen2" splits the text the way transformers' Qwen2Tokenizer does (see _qwen2_split).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    if style == "qwen2":
        tok.normalizer, tok.pre_tokenizer = _qwen2_split()
    elif style == "bytelevel":
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        raise ValueError(f"unknown tokenizer style {style!r}")
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=list(SPECIALS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_corpus(), trainer=trainer)
    assert [tok.token_to_id(t) for t in SPECIALS] == [PAD_ID, BOS_ID, EOS_ID]
    tok.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>",
        # No unknown token (byte-level BPE needs none). Left unset, Qwen2Tokenizer adds
        # <|endoftext|> as id VOCAB_SIZE, past the end of the model's vocabulary.
        "unk_token": None,
        "add_bos_token": False, "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": CONTEXT_LENGTH,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


# --- Hugging Face models -----------------------------------------------------------------------

HIDDEN, LAYERS, HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE = 64, 2, 4, 2, 16, 128
MATRIX_STD = 0.1  # HF's default 0.02 leaves logits flat and greedy choices on near-ties
LOGIT_GAIN = 4.0  # the final norm is scaled further: peaky next-token distributions


def _hf_config(arch: str, vocab: int):
    """The tiny config of each architecture.

    Head size 16: GroupQueryAttention on the CPU EP needs a multiple of 16.
    """
    import transformers

    tokens = {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID}
    common = {"vocab_size": vocab, "hidden_size": HIDDEN, "num_hidden_layers": LAYERS,
              "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS,
              "intermediate_size": INTERMEDIATE, "max_position_embeddings": CONTEXT_LENGTH,
              "tie_word_embeddings": False, **tokens}
    if arch == "llama":
        return transformers.LlamaConfig(head_dim=HEAD_DIM, **common)
    if arch == "qwen2":
        return transformers.Qwen2Config(**common)
    if arch == "phi3":
        # original == max position embeddings: plain RoPE, not LongRoPE (which the builder misreads).
        return transformers.Phi3Config(original_max_position_embeddings=CONTEXT_LENGTH, **common)
    if arch == "gemma2":
        # Layer 0 sliding, layer 1 global. Untied, unlike the real Gemma 2: with random tied
        # weights the sqrt(hidden)-scaled input embedding dominates and greedy decoding repeats
        # one token forever.
        return transformers.Gemma2Config(**common, head_dim=HEAD_DIM,
                                         query_pre_attn_scalar=HEAD_DIM, sliding_window=GEMMA_SLIDING_WINDOW,
                                         layer_types=["sliding_attention", "full_attention"])
    if arch == "gpt2":
        return transformers.GPT2Config(vocab_size=vocab, n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS,
                                       n_inner=INTERMEDIATE, n_positions=CONTEXT_LENGTH, **tokens)
    raise ValueError(f"unknown arch {arch!r}; expected one of {ARCHS}")


def _redraw(model, seed: int) -> None:
    """Noise on every 1-D parameter, every matrix redrawn with MATRIX_STD (seeded)."""
    import torch

    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for _, param in sorted(model.named_parameters()):
            noise = torch.randn(param.shape, generator=gen, dtype=param.dtype)
            if param.ndim == 1:
                param.add_(0.1 * noise)
            else:
                param.copy_(noise * MATRIX_STD)


def _perturb(model, seed: int) -> None:
    """Make the random model informative for tests.

    - 1-D parameters (norm weights, biases) get noise: HF initialises them to constants, and a
      bug that swaps or drops one stays invisible otherwise.
    - Matrices are redrawn with a larger spread, and the final norm is scaled by LOGIT_GAIN, so
      logits are peaky: greedy decoding has clear margins and fp32 ONNX vs torch never flip on a
      near-tie. The gain goes into the norm, not the output matrix, because tied models share
      that matrix with the input embedding, and large embeddings drown the layers' outputs (the
      model then repeats its input token forever).
    - The output rows of the special tokens are zero, so their logit is exactly 0 while the best
      of ~500 random logits is positive: the model never predicts eos and always runs to length.
    """
    import torch

    _redraw(model, seed)
    with torch.no_grad():
        _scale_final_norm(model, LOGIT_GAIN)
        model.get_output_embeddings().weight[[PAD_ID, BOS_ID, EOS_ID]] = 0.0


def _scale_final_norm(model, gain: float) -> None:
    base = model.model if hasattr(model, "model") else model.transformer  # GPT-2 calls it transformer
    norm = base.norm if hasattr(base, "norm") else base.ln_f
    if model.config.model_type.startswith("gemma"):
        norm.weight.copy_((1.0 + norm.weight) * gain - 1.0)  # Gemma norms scale by (1 + weight)
    else:
        norm.weight.mul_(gain)
    if getattr(norm, "bias", None) is not None:
        norm.bias.mul_(gain)


def make_hf_model(arch: str, out_dir: str | Path, seed: int = 0) -> Path:
    """A tiny random causal LM saved with save_pretrained (safetensors), tokenizer and generation_config."""
    import torch
    import transformers

    out = Path(out_dir)
    train_tokenizer(out, style="qwen2" if arch == "qwen2" else "bytelevel")
    vocab = json.loads((out / "tokenizer.json").read_text())["model"]["vocab"]
    config = _hf_config(arch, len(vocab))
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _perturb(model, seed)
    model.generation_config = transformers.GenerationConfig(
        bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID, do_sample=False)
    model.save_pretrained(out, safe_serialization=True)
    return out


# --- Whisper (encoder-decoder) -------------------------------------------------------------------

# Whisper's own 30 s window: the builder declares the encoder input as [batch, mels, 3000] (fixed),
# and transformers refuses features of any other length than 2 * max_source_positions.
WHISPER_SOURCE_POSITIONS = 1500
WHISPER_MELS = 80
# Not VOCAB_SIZE: the builder takes any Embedding with VOCAB_SIZE rows for the token table.
WHISPER_TARGET_POSITIONS = 128
WHISPER_START_ID = BOS_ID  # decoder_start_token_id
WHISPER_QUERY_GAIN, WHISPER_EMBED_GAIN, WHISPER_LOGIT_GAIN = 8.0, 2.0, 8.0  # see _perturb_whisper


def _whisper_config(vocab: int):
    """Head size 16 (64 / 4) like the causal LMs. The builder never uses GroupQueryAttention for Whisper
    (no attention mask): com.microsoft Attention in the encoder, MultiHeadAttention in the decoder."""
    import transformers

    return transformers.WhisperConfig(
        vocab_size=vocab, num_mel_bins=WHISPER_MELS, d_model=HIDDEN,
        encoder_layers=LAYERS, decoder_layers=LAYERS, encoder_attention_heads=HEADS,
        decoder_attention_heads=HEADS, encoder_ffn_dim=INTERMEDIATE, decoder_ffn_dim=INTERMEDIATE,
        max_source_positions=WHISPER_SOURCE_POSITIONS, max_target_positions=WHISPER_TARGET_POSITIONS,
        bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID,
        decoder_start_token_id=WHISPER_START_ID, suppress_tokens=[], begin_suppress_tokens=None,
        # Untied, so zeroing the special tokens' output rows leaves their input embeddings alone.
        tie_word_embeddings=False)


def _perturb_whisper(model, seed: int) -> None:
    """_perturb for Whisper: noisy norms and biases, wide matrices, zero output rows for the special
    tokens (never eos: runs to length), and three gains.

    - Queries x WHISPER_QUERY_GAIN: with plain random weights every attention is nearly uniform, so the
      cross-attention averages 1500 frames into one constant vector and the model repeats a handful of
      tokens whatever the audio; sharper attention makes each frame and each past token count.
    - Token embeddings x WHISPER_EMBED_GAIN: the current token weighs more against that constant.
    - The final decoder norm x WHISPER_LOGIT_GAIN: peaky logits, clear greedy margins.
    """
    import torch

    _redraw(model, seed)
    with torch.no_grad():
        for layer in (*model.model.encoder.layers, *model.model.decoder.layers):
            for attention in (layer.self_attn, getattr(layer, "encoder_attn", None)):
                if attention is not None:
                    attention.q_proj.weight.mul_(WHISPER_QUERY_GAIN)
                    attention.q_proj.bias.mul_(WHISPER_QUERY_GAIN)
        model.model.decoder.embed_tokens.weight.mul_(WHISPER_EMBED_GAIN)
        norm = model.model.decoder.layer_norm
        norm.weight.mul_(WHISPER_LOGIT_GAIN)
        norm.bias.mul_(WHISPER_LOGIT_GAIN)
        model.proj_out.weight[[PAD_ID, BOS_ID, EOS_ID]] = 0.0


def make_hf_whisper(out_dir: str | Path, seed: int = 0) -> Path:
    """A tiny random WhisperForConditionalGeneration (save_pretrained), the byte-level tokenizer and a
    plain greedy generation_config (no forced or suppressed tokens)."""
    import torch
    import transformers

    out = Path(out_dir)
    train_tokenizer(out)
    vocab = json.loads((out / "tokenizer.json").read_text())["model"]["vocab"]
    torch.manual_seed(seed)
    model = transformers.WhisperForConditionalGeneration(_whisper_config(len(vocab))).to(torch.float32)
    _perturb_whisper(model, seed)
    model.generation_config = transformers.GenerationConfig(
        bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID,
        decoder_start_token_id=WHISPER_START_ID, do_sample=False)
    model.save_pretrained(out, safe_serialization=True)
    return out


# --- onnxruntime-genai model builder -----------------------------------------------------------

def _run(cmd: list[str], what: str) -> None:
    """Run a build step quietly; its whole output becomes the error message if it fails."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}  # local folders only: never wait on the Hub
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, check=False,
                          env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"{what} failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stdout[-6000:]}")


def export_builder(hf_dir: str | Path, out_dir: str | Path, precision: str = "fp32") -> Path:
    """Export with onnxruntime-genai's model builder for the CPU EP.

    The folder holds model.onnx, model.onnx.data, genai_config.json and the tokenizer files.
    """
    if precision not in ("fp32", "int4"):
        raise ValueError(f"precision must be fp32 or int4, not {precision!r}")
    out = Path(out_dir)
    with tempfile.TemporaryDirectory(prefix="ortpipe-builder-") as scratch:
        cmd = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(hf_dir), "-o", str(out),
               "-p", precision, "-e", "cpu", "-c", scratch]
        _run(cmd, "onnxruntime-genai model builder")
    for name in ("tokenizer.json", "tokenizer_config.json"):  # the builder saves them; never overwrite
        if not (out / name).is_file():
            shutil.copy2(Path(hf_dir) / name, out / name)
    return out


# --- Optimum (separate virtualenv) -------------------------------------------------------------

def ensure_venv(venv: Path, requirements: tuple[str, ...], what: str) -> Path:
    """Create (once) a virtualenv holding exactly `requirements`; returns its python."""
    python = venv / "bin" / "python"
    stamp = venv / ".ortpipe-requirements"
    wanted = "\n".join(requirements)
    if python.is_file() and stamp.is_file() and stamp.read_text() == wanted:
        return python
    _run([sys.executable, "-m", "venv", str(venv)], f"creating the {what} virtualenv")
    _run([str(python), "-m", "pip", "install", "--disable-pip-version-check", "-q", *requirements],
         f"installing {what}")
    stamp.write_text(wanted)
    return python


def ensure_optimum_venv(venv: Path = OPTIMUM_VENV) -> Path:
    """Create (once) the virtualenv Optimum runs in; returns its python."""
    return ensure_venv(venv, OPTIMUM_REQUIREMENTS, "Optimum")


def _legacy_config(config: dict) -> dict:
    """A transformers-5 config.json in the keys transformers < 4.58 reads.

    rope_parameters used to be rope_theta + rope_scaling (+ partial_rotary_factor), dtype was torch_dtype.
    """
    config = dict(config)
    rope = config.pop("rope_parameters", None)
    if rope:
        rope = dict(rope)
        config["rope_theta"] = rope.pop("rope_theta", 10000.0)
        if "partial_rotary_factor" in rope:
            config["partial_rotary_factor"] = rope.pop("partial_rotary_factor")
        kind = rope.get("rope_type", "default")
        config["rope_scaling"] = None if kind == "default" else {**rope, "type": kind}
    if "dtype" in config:
        config["torch_dtype"] = config.pop("dtype")
    return config


def _optimum_export(hf_dir: Path, out: Path) -> Path:
    python = ensure_optimum_venv()
    with tempfile.TemporaryDirectory(prefix="ortpipe-optimum-") as scratch:
        legacy = Path(scratch) / "hf"
        shutil.copytree(hf_dir, legacy)
        config = json.loads((legacy / "config.json").read_text())
        (legacy / "config.json").write_text(json.dumps(_legacy_config(config), indent=2))
        cmd = [str(python), "-m", "optimum.exporters.onnx", "--model", str(legacy),
               "--task", "text-generation-with-past", str(out)]
        _run(cmd, "Optimum ONNX export")
    return out


def export_concat(hf_dir: str | Path, out_dir: str | Path) -> Path:
    """Optimum's text-generation-with-past export: one model.onnx whose present = concat(past, new).

    Inputs input_ids, attention_mask, position_ids, past_key_values.N.key/value; outputs logits,
    present.N.key/value; beside it config.json, generation_config.json and the tokenizer files.
    """
    return _optimum_export(Path(hf_dir), Path(out_dir))


def export_gpt2(hf_dir: str | Path, out_dir: str | Path) -> Path:
    """GPT-2 through Optimum (the genai builder has no GPT-2): the same layout as export_concat.

    Optimum now writes one graph without a `use_cache_branch` input: the first run feeds an empty
    past (sequence length 0).
    """
    if json.loads((Path(hf_dir) / "config.json").read_text()).get("model_type") != "gpt2":
        raise ValueError(f"{hf_dir} is not a GPT-2 model")
    return _optimum_export(Path(hf_dir), Path(out_dir))


# --- the named test models ---------------------------------------------------------------------

def _hf(arch: str) -> Path:
    return get(f"{arch}-hf")


RECIPES: dict[str, Callable[[Path], Path]] = {
    **{f"{arch}-hf": (lambda out, arch=arch: make_hf_model(arch, out)) for arch in ARCHS},
    "llama-builder-fp32": lambda out: export_builder(_hf("llama"), out, "fp32"),
    "llama-builder-int4": lambda out: export_builder(_hf("llama"), out, "int4"),
    "qwen2-builder-fp32": lambda out: export_builder(_hf("qwen2"), out, "fp32"),
    "phi3-builder-fp32": lambda out: export_builder(_hf("phi3"), out, "fp32"),
    "gemma2-builder-fp32": lambda out: export_builder(_hf("gemma2"), out, "fp32"),
    "llama-concat": lambda out: export_concat(_hf("llama"), out),
    "gpt2-optimum": lambda out: export_gpt2(_hf("gpt2"), out),
    "whisper-hf": make_hf_whisper,
    "whisper-builder-fp32": lambda out: export_builder(get("whisper-hf"), out, "fp32"),
}


def get(name: str) -> Path:
    """The built folder of a named test model (see RECIPES), building it on first use."""
    if name not in RECIPES:
        raise KeyError(f"unknown test model {name!r}; known: {', '.join(RECIPES)}")
    return cached(name, RECIPES[name])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m build.hfmodels", description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", metavar="NAME",
                        help=f"test models to build: {', '.join(RECIPES)}")
    parser.add_argument("--all", action="store_true", help="build every test model")
    args = parser.parse_args(argv)
    names = list(RECIPES) if args.all else args.names
    if not names:
        parser.error("name at least one model, or pass --all")
    for name in names:
        start = time.perf_counter()
        path = get(name)
        print(f"{name}: {path} ({time.perf_counter() - start:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
