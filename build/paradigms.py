"""Tiny random models for the single_pass and denoising loops (issue 16): ONNX exports and torch references.

    python -m build.paradigms st-minilm vits-tiny sd-tiny     # or --all (every test model; not sd-bench)
    python -m build.paradigms sd-bench                        # the benchmark UNet (88M parameters)

Seven folders as people have them (docs/paradigm-models.md says what each holds):
- `st-minilm` (and `-cls`, `-nonorm`): a sentence-transformers folder with optimum's `onnx/model.onnx`;
- `vits-tiny`: a transformers.js-style VITS folder (optimum's text-to-audio export);
- `sd-tiny`: optimum's Stable Diffusion export (`model_index.json`, `text_encoder/`, `unet/`, ...);
- `sd-inpaint-tiny`: optimum's inpainting export of the same with an inpainting UNet (9 input channels);
- `lcm-tiny`: the same of a latent consistency model (its UNet takes the guidance embedded);
- `sdxl-tiny`: optimum's Stable Diffusion XL export (`text_encoder_2/`, `tokenizer_2/` beside those);
- `sd3-tiny`: optimum's Stable Diffusion 3 export (three text encoders, `transformer/`).
Each holds `references/`: what sentence-transformers, transformers' VitsModel or diffusers'
StableDiffusionPipeline, LatentConsistencyModelPipeline, StableDiffusionXLPipeline or StableDiffusion3Pipeline
computed (torch, fp32) from the same weights; each image folder's also what diffusers' image-to-image
pipeline of its kind (StableDiffusionImg2ImgPipeline, LatentConsistencyModelImg2ImgPipeline,
StableDiffusionXLImg2ImgPipeline, StableDiffusion3Img2ImgPipeline) made of its `references/init.png`
(`img2img.json`).

The torch work runs in two virtualenvs this module creates on first use (torch pinned, see hfmodels):
the export environment (optimum-onnx, transformers 4.57, diffusers 0.39; $ORTPIPE_PARADIGMS_EXPORT_VENV)
makes the models and exports them; the reference environment (transformers 5, diffusers 0.42,
sentence-transformers; $ORTPIPE_PARADIGMS_REFERENCE_VENV) computes the references. The two cannot be one:
diffusers 0.42 and optimum-onnx 0.1 want incompatible huggingface_hub versions.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import time
import zlib
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from build import hfmodels

REPO = hfmodels.REPO
TORCH = "torch==2.13.0"  # any other version pulls CUDA wheels
EXPORT_VENV = Path(os.environ.get("ORTPIPE_PARADIGMS_EXPORT_VENV", REPO / ".venv-paradigms-export"))
EXPORT_REQUIREMENTS = (*hfmodels.OPTIMUM_REQUIREMENTS, "diffusers==0.39.0")
REFERENCE_VENV = Path(os.environ.get("ORTPIPE_PARADIGMS_REFERENCE_VENV", REPO / ".venv-paradigms-ref"))
REFERENCE_REQUIREMENTS = (TORCH, "transformers==5.23.0", "diffusers==0.42.1", "sentence-transformers==6.2.0",
                          "numpy>=1.24")


def _torch(venv: Path, requirements: tuple[str, ...], command: str, spec: dict,
           module: str = "build.paradigm_torch") -> str:
    """Run one command of `module` (build.paradigm_torch) in a virtualenv; returns its stdout."""
    python = hfmodels.ensure_venv(venv, requirements, venv.name)
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as handle:
        json.dump(spec, handle)
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    try:
        proc = subprocess.run([str(python), "-m", module, command, handle.name], cwd=REPO,
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              check=False)
    finally:
        os.unlink(handle.name)
    if proc.returncode != 0:
        raise RuntimeError(f"{module} {command} failed ({proc.returncode}):\n"
                           f"{proc.stdout[-6000:]}")
    return proc.stdout


def _export_env(command: str, spec: dict) -> str:
    return _torch(EXPORT_VENV, EXPORT_REQUIREMENTS, command, spec)


def _reference_env(command: str, spec: dict) -> str:
    return _torch(REFERENCE_VENV, REFERENCE_REQUIREMENTS, command, spec)


def _optimum(model: Path, out: Path, task: str, *extra: str) -> Path:
    """optimum's ONNX exporter (python -m optimum.exporters.onnx) in the export environment."""
    python = hfmodels.ensure_venv(EXPORT_VENV, EXPORT_REQUIREMENTS, EXPORT_VENV.name)
    hfmodels._run([str(python), "-m", "optimum.exporters.onnx", "--model", str(model), "--task", task, *extra,
                   str(out)], f"optimum export ({task})")
    return out


# --- tokenizers ----------------------------------------------------------------------------------

def _words(limit: int) -> Counter[str]:
    """The `limit` most frequent lower-case words of the standard-library training text (hfmodels)."""
    counts = Counter(w for text in hfmodels._corpus() for w in re.findall(r"[a-z]+", text.lower()))
    return Counter(dict(counts.most_common(limit)))


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's and CLIP's map of the 256 bytes to printable characters, in CLIP's vocabulary order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    codes = list(keep)
    extra = [byte for byte in range(256) if byte not in keep]
    keep += extra
    codes += [256 + i for i in range(len(extra))]
    return dict(zip(keep, map(chr, codes), strict=True))


def _learn_merges(words: Counter[str], count: int) -> list[tuple[str, str]]:
    """Plain BPE over word frequencies with CLIP's end-of-word marker; ties go to the larger pair."""
    chars = _bytes_to_unicode()
    seqs = {}
    for word in words:
        symbols = [chars[b] for b in word.encode()]
        symbols[-1] += "</w>"
        seqs[word] = symbols
    merges = []
    for _ in range(count):
        pairs: Counter[tuple[str, str]] = Counter()
        for word, seq in seqs.items():
            for pair in zip(seq, seq[1:], strict=False):
                pairs[pair] += words[word]
        if not pairs:
            break
        best = max(pairs.items(), key=lambda item: (item[1], item[0]))[0]
        merges.append(best)
        for word, seq in seqs.items():
            i, merged = 0, []
            while i < len(seq):
                if i + 1 < len(seq) and (seq[i], seq[i + 1]) == best:
                    merged.append(seq[i] + seq[i + 1])
                    i += 2
                else:
                    merged.append(seq[i])
                    i += 1
            seqs[word] = merged
    return merges


CLIP_MERGES = 300
CLIP_LENGTH = 77  # diffusers pads every prompt to the tokenizer's model_max_length


def clip_tokenizer(out: Path) -> Path:
    """vocab.json + merges.txt in CLIP's format (bytes, bytes + </w>, merges, then the two specials)."""
    out.mkdir(parents=True, exist_ok=True)
    base = list(_bytes_to_unicode().values())
    merges = _learn_merges(_words(2000), CLIP_MERGES)
    tokens = [*base, *(c + "</w>" for c in base), *("".join(m) for m in merges),
              "<|startoftext|>", "<|endoftext|>"]
    (out / "vocab.json").write_text(json.dumps({t: i for i, t in enumerate(tokens)}, ensure_ascii=False))
    (out / "merges.txt").write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges))
    config = {"tokenizer_class": "CLIPTokenizer", "model_max_length": CLIP_LENGTH, "do_lower_case": True,
              "bos_token": "<|startoftext|>", "eos_token": "<|endoftext|>", "unk_token": "<|endoftext|>",
              "pad_token": "<|endoftext|>", "errors": "replace"}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


T5_WORDS = 400


def t5_tokenizer(out: Path) -> Path:
    """A unigram tokenizer in T5's conventions (tokenizer.json: <pad> 0, </s> 1, <unk> 2, "▁" word starts,
    </s> after every text) over the standard library's words and letters: what Stable Diffusion 3's
    tokenizer_3 is, small."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    out.mkdir(parents=True, exist_ok=True)
    words = _words(T5_WORDS)
    total = sum(words.values())
    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -2.0)]
    pieces += [(c, -8.0) for c in "abcdefghijklmnopqrstuvwxyz0123456789.,'-!?"]
    pieces += [(f"▁{w}", math.log(n / total)) for w, n in words.items()]
    tokenizer = Tokenizer(models.Unigram(pieces, unk_id=2))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    tokenizer.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    tokenizer.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    for special in ("<pad>", "</s>", "<unk>"):
        tokenizer.add_special_tokens([special])
    tokenizer.save(str(out / "tokenizer.json"))
    config = {"tokenizer_class": "T5TokenizerFast", "model_max_length": 512, "eos_token": "</s>",
              "pad_token": "<pad>", "unk_token": "<unk>", "extra_ids": 0, "additional_special_tokens": []}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


def wordpiece_vocab(out: Path, size: int) -> Path:
    """A lower-cased WordPiece vocab.txt ([PAD] [UNK] [CLS] [SEP] [MASK] first) trained on the same text."""
    from tokenizers import BertWordPieceTokenizer

    out.mkdir(parents=True, exist_ok=True)
    tokenizer = BertWordPieceTokenizer(lowercase=True)
    tokenizer.train_from_iterator(hfmodels._corpus(), vocab_size=size, show_progress=False,
                                  special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"])
    tokenizer.save_model(str(out))
    return out / "vocab.txt"


# --- sentence embeddings -------------------------------------------------------------------------

EMBED_TEXTS = (
    "Hello world.",
    "A",
    "Sorting is stable: equal keys keep their original order.",
    "The parser reads each line of the file, splits it on commas and keeps the fields it needs.",
    "def count_words(path): return a dictionary that maps every word in the file to its number of "
    "occurrences, ignoring case and punctuation; 42 files were read in 3.5 seconds.",
)
BERT = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 64,
        "max_position_embeddings": 128, "type_vocab_size": 2}
EMBED_MAX_LENGTH = 128
WORDPIECE_SIZE = 1000


def make_bert(out: Path) -> Path:
    with tempfile.TemporaryDirectory(prefix="ortpipe-wordpiece-") as scratch:
        vocab = wordpiece_vocab(Path(scratch), WORDPIECE_SIZE)
        _export_env("make-bert", {"out": str(out), "vocab": str(vocab), "config": BERT,
                                  "max_length": EMBED_MAX_LENGTH})
    return out


def export_embedder(bert: Path, out: Path) -> Path:
    """optimum's feature-extraction export of the plain transformers model: last_hidden_state, not pooled."""
    with tempfile.TemporaryDirectory(prefix="ortpipe-optimum-") as scratch:
        _optimum(bert, Path(scratch), "feature-extraction", "--library-name", "transformers")
        (out / "onnx").mkdir(parents=True, exist_ok=True)
        shutil.copy2(Path(scratch) / "model.onnx", out / "onnx" / "model.onnx")
    return out


def make_st(out: Path, pooling: str, normalize: bool, legacy: bool = False,
            onnx_from: Path | None = None) -> Path:
    """A sentence-transformers folder over the tiny BERT, its ONNX graph at onnx/model.onnx, and references.

    `legacy`: modules.json and 1_Pooling/config.json in sentence-transformers 2.x-3.x's keys, as most
    published folders have them (sentence-transformers 6 still reads them)."""
    bert = get("st-bert-hf")
    _reference_env("make-st", {"transformer": str(bert), "out": str(out), "pooling": pooling,
                               "normalize": normalize, "legacy": legacy, "max_length": EMBED_MAX_LENGTH})
    if onnx_from is None:
        export_embedder(bert, out)
    else:  # the same weights: the graph of the first folder serves
        (out / "onnx").mkdir(parents=True, exist_ok=True)
        shutil.copy2(onnx_from / "onnx" / "model.onnx", out / "onnx" / "model.onnx")
    _reference_env("st-refs", {"folder": str(out), "texts": list(EMBED_TEXTS)})
    return out


# --- VITS ----------------------------------------------------------------------------------------

VITS_VOCAB = {"<pad>": 0, "<unk>": 1, " ": 2, "'": 3, "-": 4,
              **{c: 5 + i for i, c in enumerate("abcdefghijklmnopqrstuvwxyz")}}
VITS = {"hidden_size": 16, "num_hidden_layers": 2, "num_attention_heads": 2, "window_size": 4, "ffn_dim": 32,
        "flow_size": 16, "spectrogram_bins": 17, "upsample_initial_channel": 16, "upsample_rates": [4, 4],
        "upsample_kernel_sizes": [8, 8], "resblock_kernel_sizes": [3, 5],
        "resblock_dilation_sizes": [[1, 3], [1, 3]],
        "duration_predictor_filter_channels": 16, "duration_predictor_num_flows": 2,
        "prior_encoder_num_flows": 2, "prior_encoder_num_wavenet_layers": 2,
        "posterior_encoder_num_wavenet_layers": 2, "depth_separable_num_layers": 2,
        "noise_scale": 0.0, "noise_scale_duration": 0.0, "sampling_rate": 16000}
VITS_TEXTS = ("Hello world.", "A", "The quick brown fox jumps over the lazy dog, doesn't it?")


def make_vits_hf(out: Path) -> Path:
    _export_env("make-vits", {"out": str(out), "vocab": VITS_VOCAB, "config": VITS, "vector_noise": 0.1})
    return out


def make_vits(out: Path) -> Path:
    """optimum's text-to-audio export at onnx/model.onnx beside config.json and the tokenizer files."""
    hf = get("vits-hf")
    with tempfile.TemporaryDirectory(prefix="ortpipe-optimum-") as scratch:
        _optimum(hf, Path(scratch), "text-to-audio")
        (out / "onnx").mkdir(parents=True)
        shutil.copy2(Path(scratch) / "model.onnx", out / "onnx" / "model.onnx")
    for file in hf.iterdir():
        if file.suffix != ".safetensors":
            shutil.copy2(file, out / file.name)
    _reference_env("vits-refs", {"hf": str(hf), "out": str(out), "texts": list(VITS_TEXTS)})
    return out


# --- Stable Diffusion ----------------------------------------------------------------------------

# Stable Diffusion 1.x's training schedule; each case sets the class, prediction type and spacing.
SCHEDULER_BASE = {"num_train_timesteps": 1000, "beta_start": 0.00085, "beta_end": 0.012,
                  "beta_schedule": "scaled_linear", "steps_offset": 1, "clip_sample": False,
                  "set_alpha_to_one": False}
FOLDER_SCHEDULER = {**SCHEDULER_BASE, "prediction_type": "epsilon", "timestep_spacing": "leading"}  # Euler
PROMPT, NEGATIVE = "a red cube on a wooden table", "blurry, low quality"
# they draw noise inside step()
NOISY_SCHEDULERS = ("EulerAncestralDiscreteScheduler", "LCMScheduler", "DDPMScheduler",
                    "KDPM2AncestralDiscreteScheduler")

# (name, scheduler class, prediction_type, timestep_spacing, steps, guidance_scale, negative prompt)
SD_CASES = (
    ("euler-eps-linspace", "EulerDiscreteScheduler", "epsilon", "linspace", 4, 1.0, None),
    ("euler-v-leading-cfg", "EulerDiscreteScheduler", "v_prediction", "leading", 3, 7.5, NEGATIVE),
    ("euler-eps-trailing-cfg-noneg", "EulerDiscreteScheduler", "epsilon", "trailing", 3, 4.0, None),
    ("euler_a-eps-leading", "EulerAncestralDiscreteScheduler", "epsilon", "leading", 4, 1.0, None),
    ("euler_a-v-trailing-cfg", "EulerAncestralDiscreteScheduler", "v_prediction", "trailing", 3, 5.0,
     NEGATIVE),
    ("euler_a-eps-linspace", "EulerAncestralDiscreteScheduler", "epsilon", "linspace", 2, 1.0, None),
    ("ddim-eps-leading-cfg", "DDIMScheduler", "epsilon", "leading", 4, 7.5, NEGATIVE),
    ("ddim-v-trailing", "DDIMScheduler", "v_prediction", "trailing", 3, 1.0, None),
    ("ddim-eps-linspace", "DDIMScheduler", "epsilon", "linspace", 5, 1.0, None),
    ("lcm-eps-4", "LCMScheduler", "epsilon", "leading", 4, 1.0, None),
    ("lcm-v-cfg", "LCMScheduler", "v_prediction", "leading", 2, 3.0, NEGATIVE),
    ("lcm-eps-1", "LCMScheduler", "epsilon", "leading", 1, 1.0, None),
    ("dpm-eps-leading-cfg", "DPMSolverMultistepScheduler", "epsilon", "leading", 5, 7.5, NEGATIVE),
    ("dpm-v-trailing", "DPMSolverMultistepScheduler", "v_prediction", "trailing", 4, 1.0, None),
    ("dpm-eps-linspace", "DPMSolverMultistepScheduler", "epsilon", "linspace", 6, 1.0, None),
    ("euler-karras-eps-leading-cfg", "EulerDiscreteScheduler", "epsilon", "leading", 4, 7.5, NEGATIVE),
    ("euler-karras-v-range", "EulerDiscreteScheduler", "v_prediction", "linspace", 3, 1.0, None),
    ("dpm-karras-eps-cfg", "DPMSolverMultistepScheduler", "epsilon", "linspace", 5, 5.0, NEGATIVE),
    ("dpm-karras-v-trailing", "DPMSolverMultistepScheduler", "v_prediction", "trailing", 4, 1.0, None),
    ("dpm-sde-karras-eps-cfg", "DPMSolverMultistepScheduler", "epsilon", "linspace", 5, 5.0, NEGATIVE),
    ("dpm-sde-heun-v-min", "DPMSolverMultistepScheduler", "v_prediction", "leading", 4, 1.0, None),
    ("ddim-v-trailing-zsnr", "DDIMScheduler", "v_prediction", "trailing", 4, 1.0, None),
    ("euler-v-trailing-zsnr-cfg", "EulerDiscreteScheduler", "v_prediction", "trailing", 3, 5.0, NEGATIVE),
    ("dpm-v-linspace-zsnr", "DPMSolverMultistepScheduler", "v_prediction", "linspace", 4, 1.0, None),
    ("dpm3-eps-linspace-cfg", "DPMSolverMultistepScheduler", "epsilon", "linspace", 6, 5.0, NEGATIVE),
    ("dpm3-sde-v-min", "DPMSolverMultistepScheduler", "v_prediction", "trailing", 5, 1.0, None),
    ("ddim-v-trailing-zsnr-cfg-rescale", "DDIMScheduler", "v_prediction", "trailing", 4, 7.5, NEGATIVE),
    ("euler-exp-eps-leading-cfg", "EulerDiscreteScheduler", "epsilon", "leading", 4, 5.0, NEGATIVE),
    ("euler-exp-v-trailing-range", "EulerDiscreteScheduler", "v_prediction", "trailing", 3, 1.0, None),
    ("pndm-eps-leading-cfg", "PNDMScheduler", "epsilon", "leading", 6, 7.5, NEGATIVE),
    ("pndm-v-trailing", "PNDMScheduler", "v_prediction", "trailing", 4, 1.0, None),
    ("pndm-eps-linspace-2", "PNDMScheduler", "epsilon", "linspace", 2, 3.0, None),
    ("ddpm-eps-leading-cfg", "DDPMScheduler", "epsilon", "leading", 5, 7.5, NEGATIVE),
    ("ddpm-v-trailing-large", "DDPMScheduler", "v_prediction", "trailing", 4, 1.0, None),
    ("ddpm-eps-linspace-log", "DDPMScheduler", "epsilon", "linspace", 3, 1.0, None),
    ("heun-eps-linspace", "HeunDiscreteScheduler", "epsilon", "linspace", 3, 1.0, None),
    ("heun-v-leading-cfg", "HeunDiscreteScheduler", "v_prediction", "leading", 3, 5.0, NEGATIVE),
    ("heun-karras-eps-trailing", "HeunDiscreteScheduler", "epsilon", "trailing", 4, 1.0, None),
    ("kdpm2-eps-linspace", "KDPM2DiscreteScheduler", "epsilon", "linspace", 3, 1.0, None),
    ("kdpm2-v-leading-cfg", "KDPM2DiscreteScheduler", "v_prediction", "leading", 3, 5.0, NEGATIVE),
    ("kdpm2-karras-eps-trailing", "KDPM2DiscreteScheduler", "epsilon", "trailing", 4, 1.0, None),
    ("unipc-eps-linspace-cfg", "UniPCMultistepScheduler", "epsilon", "linspace", 5, 7.5, NEGATIVE),
    ("unipc-v-trailing", "UniPCMultistepScheduler", "v_prediction", "trailing", 4, 1.0, None),
    ("unipc3-karras-eps-leading", "UniPCMultistepScheduler", "epsilon", "leading", 6, 1.0, None),
    ("unipc-bh1-v-leading-cfg", "UniPCMultistepScheduler", "v_prediction", "leading", 5, 5.0, NEGATIVE),
    ("lms-eps-linspace", "LMSDiscreteScheduler", "epsilon", "linspace", 6, 1.0, None),
    ("lms-v-leading-cfg", "LMSDiscreteScheduler", "v_prediction", "leading", 5, 7.5, NEGATIVE),
    ("lms-karras-eps-trailing", "LMSDiscreteScheduler", "epsilon", "trailing", 5, 1.0, None),
    ("euler-beta-eps-leading-cfg", "EulerDiscreteScheduler", "epsilon", "leading", 5, 5.0, NEGATIVE),
    ("euler-beta-v-trailing-range", "EulerDiscreteScheduler", "v_prediction", "trailing", 4, 1.0, None),
    ("heun-beta-v-linspace", "HeunDiscreteScheduler", "v_prediction", "linspace", 3, 1.0, None),
    ("kdpm2-beta-eps-trailing", "KDPM2DiscreteScheduler", "epsilon", "trailing", 3, 1.0, None),
    ("lms-beta-eps-linspace-cfg", "LMSDiscreteScheduler", "epsilon", "linspace", 5, 5.0, NEGATIVE),
    ("kdpm2_a-eps-linspace", "KDPM2AncestralDiscreteScheduler", "epsilon", "linspace", 4, 1.0, None),
    ("kdpm2_a-v-leading-cfg", "KDPM2AncestralDiscreteScheduler", "v_prediction", "leading", 3, 5.0, NEGATIVE),
    ("kdpm2_a-karras-eps-trailing", "KDPM2AncestralDiscreteScheduler", "epsilon", "trailing", 4, 1.0, None),
    ("deis-eps-linspace-cfg", "DEISMultistepScheduler", "epsilon", "linspace", 5, 7.5, NEGATIVE),
    ("deis3-v-leading", "DEISMultistepScheduler", "v_prediction", "leading", 6, 1.0, None),
    ("deis3-karras-eps-trailing", "DEISMultistepScheduler", "epsilon", "trailing", 6, 1.0, None),
    # EDMEuler has no timestep spacing (its sigmas run between sigma_max and sigma_min)
    ("edm-eps-karras-cfg", "EDMEulerScheduler", "epsilon", "linspace", 5, 7.5, NEGATIVE),
    ("edm-v-exponential-min", "EDMEulerScheduler", "v_prediction", "linspace", 4, 1.0, None),
    ("edm-eps-range", "EDMEulerScheduler", "epsilon", "linspace", 3, 1.0, None),
    # DDIM with eta (the pipeline's argument): noise every step
    ("ddim-eta-eps-leading-cfg", "DDIMScheduler", "epsilon", "leading", 4, 7.5, NEGATIVE),
    ("ddim-eta1-v-trailing", "DDIMScheduler", "v_prediction", "trailing", 3, 1.0, None),
    # TCD (its gamma the pipeline's eta; its timesteps LCM's, whatever the spacing)
    ("tcd-eps-cfg", "TCDScheduler", "epsilon", "leading", 4, 3.0, NEGATIVE),
    ("tcd-v-eta0", "TCDScheduler", "v_prediction", "leading", 3, 1.0, None),
    ("tcd-eps-eta1-8", "TCDScheduler", "epsilon", "leading", 8, 1.0, None),
    # DPM-Solver singlestep: its timesteps DPM-Solver's linspace ones whatever the spacing
    ("dpms-eps-linspace-cfg", "DPMSolverSinglestepScheduler", "epsilon", "linspace", 6, 7.5, NEGATIVE),
    ("dpms3-heun-v-min", "DPMSolverSinglestepScheduler", "v_prediction", "leading", 6, 1.0, None),
    ("dpms3-karras-eps-trailing", "DPMSolverSinglestepScheduler", "epsilon", "trailing", 7, 1.0, None),
)
# request options beyond the table's, per case (diffusers' StableDiffusionPipeline arguments)
SD_CASE_OPTIONS = {"ddim-v-trailing-zsnr-cfg-rescale": {"guidance_rescale": 0.7},
                   "ddim-eta-eps-leading-cfg": {"eta": 0.6}, "ddim-eta1-v-trailing": {"eta": 1.0},
                   "tcd-eps-cfg": {"eta": 0.3}, "tcd-eps-eta1-8": {"eta": 1.0}}
# scheduler fields beyond the table's, per case
SD_CASE_FIELDS = {
    "euler-karras-eps-leading-cfg": {"use_karras_sigmas": True},
    "euler-karras-v-range": {"use_karras_sigmas": True, "sigma_min": 0.05, "sigma_max": 12.0,
                             "final_sigmas_type": "sigma_min"},
    "dpm-karras-eps-cfg": {"use_karras_sigmas": True},
    "dpm-karras-v-trailing": {"use_karras_sigmas": True, "final_sigmas_type": "sigma_min"},
    "dpm-sde-karras-eps-cfg": {"algorithm_type": "sde-dpmsolver++", "use_karras_sigmas": True},
    "dpm-sde-heun-v-min": {"algorithm_type": "sde-dpmsolver++", "solver_type": "heun",
                           "final_sigmas_type": "sigma_min", "lower_order_final": False},
    "ddim-v-trailing-zsnr": {"rescale_betas_zero_snr": True},
    "euler-v-trailing-zsnr-cfg": {"rescale_betas_zero_snr": True},
    "dpm-v-linspace-zsnr": {"rescale_betas_zero_snr": True},
    "dpm3-eps-linspace-cfg": {"solver_order": 3},
    "ddim-v-trailing-zsnr-cfg-rescale": {"rescale_betas_zero_snr": True},
    "euler-exp-eps-leading-cfg": {"use_exponential_sigmas": True},
    "pndm-eps-leading-cfg": {"skip_prk_steps": True},  # Stable Diffusion 1.x's scheduler_config.json
    "pndm-v-trailing": {"skip_prk_steps": True, "set_alpha_to_one": True},
    "pndm-eps-linspace-2": {"skip_prk_steps": True},
    "ddpm-v-trailing-large": {"variance_type": "fixed_large", "clip_sample": True},
    "ddpm-eps-linspace-log": {"variance_type": "fixed_small_log"},
    "heun-karras-eps-trailing": {"use_karras_sigmas": True},
    "kdpm2-karras-eps-trailing": {"use_karras_sigmas": True},
    "euler-exp-v-trailing-range": {"use_exponential_sigmas": True, "sigma_min": 0.1, "sigma_max": 8.0},
    "dpm3-sde-v-min": {"solver_order": 3, "algorithm_type": "sde-dpmsolver++",
                       "final_sigmas_type": "sigma_min", "lower_order_final": False},
    "unipc3-karras-eps-leading": {"solver_order": 3, "use_karras_sigmas": True},
    "lms-karras-eps-trailing": {"use_karras_sigmas": True},
    "euler-beta-eps-leading-cfg": {"use_beta_sigmas": True},
    "euler-beta-v-trailing-range": {"use_beta_sigmas": True, "sigma_min": 0.1, "sigma_max": 8.0},
    "heun-beta-v-linspace": {"use_beta_sigmas": True},
    "kdpm2-beta-eps-trailing": {"use_beta_sigmas": True},
    "lms-beta-eps-linspace-cfg": {"use_beta_sigmas": True},
    "kdpm2_a-karras-eps-trailing": {"use_karras_sigmas": True},
    "deis3-v-leading": {"solver_order": 3},
    "deis3-karras-eps-trailing": {"solver_order": 3, "use_karras_sigmas": True, "lower_order_final": False},
    "edm-v-exponential-min": {"sigma_schedule": "exponential", "final_sigmas_type": "sigma_min",
                              "sigma_max": 14.6, "sigma_min": 0.03},
    "edm-eps-range": {"sigma_max": 14.6, "sigma_min": 0.03, "sigma_data": 1.0, "rho": 5.0},
    # order 3 without lower_order_final: groups 1, 2, 3 to the end
    "dpms3-heun-v-min": {"solver_order": 3, "solver_type": "heun", "final_sigmas_type": "sigma_min"},
    "dpms3-karras-eps-trailing": {"solver_order": 3, "use_karras_sigmas": True},
    # B(h) = h (bh1) needs a last sigma above 0; the corrector left out after step 1
    "unipc-bh1-v-leading-cfg": {"solver_type": "bh1", "final_sigmas_type": "sigma_min",
                                "disable_corrector": [1], "lower_order_final": False},
}


def sd_cases() -> list[dict]:
    """The cases as the reference environment takes them; latents and noise are drawn there from `seed`."""
    cases = []
    for seed, (name, cls, prediction, spacing, steps, guidance, negative) in enumerate(SD_CASES):
        scheduler = {"_class_name": cls, **SCHEDULER_BASE, "prediction_type": prediction,
                     "timestep_spacing": spacing, **SD_CASE_FIELDS.get(name, {})}
        options = SD_CASE_OPTIONS.get(name, {})
        # DPM-Solver's SDE and DDIM with eta: noise per step
        noisy = str(scheduler.get("algorithm_type", "")).startswith("sde") or options.get("eta", 0.0) > 0
        cases.append({"name": name, "scheduler": scheduler, "num_inference_steps": steps,
                      "guidance_scale": guidance, "prompt": PROMPT, "negative_prompt": negative, "seed": seed,
                      "latents": f"{name}.latents.npy",
                      "noise": f"{name}.noise.npy" if cls in NOISY_SCHEDULERS or noisy else None,
                      "guidance_rescale": options.get("guidance_rescale", 0.0),
                      "eta": options.get("eta", 0.0)})
    return cases


SD_SIZES = {
    # 32 x 32 images, 8 x 8 latents (three VAE blocks: a factor of 4).
    "tiny": {
        "text_encoder": {"hidden_size": 32, "intermediate_size": 37, "num_hidden_layers": 2,
                         "num_attention_heads": 4},
        "unet": {"sample_size": 8, "in_channels": 4, "out_channels": 4, "layers_per_block": 1,
                 "block_out_channels": [16, 32], "down_block_types": ["CrossAttnDownBlock2D", "DownBlock2D"],
                 "up_block_types": ["UpBlock2D", "CrossAttnUpBlock2D"], "cross_attention_dim": 32,
                 "attention_head_dim": 8, "norm_num_groups": 8},
        "vae": {"in_channels": 3, "out_channels": 3, "latent_channels": 4, "block_out_channels": [8, 16, 16],
                "down_block_types": ["DownEncoderBlock2D"] * 3, "up_block_types": ["UpDecoderBlock2D"] * 3,
                "layers_per_block": 1, "norm_num_groups": 4, "sample_size": 32},
        "vae_out_gain": 1.0,
    },
    # For benchmarks only: a UNet of SD 1.x's shape at ~0.35x its width, 32 x 32 latents, 256 x 256 images.
    "bench": {
        "text_encoder": {"hidden_size": 256, "intermediate_size": 1024, "num_hidden_layers": 2,
                         "num_attention_heads": 4},
        "unet": {"sample_size": 32, "in_channels": 4, "out_channels": 4, "layers_per_block": 2,
                 "block_out_channels": [128, 256, 384, 384],
                 "down_block_types": ["CrossAttnDownBlock2D"] * 3 + ["DownBlock2D"],
                 "up_block_types": ["UpBlock2D"] + ["CrossAttnUpBlock2D"] * 3, "cross_attention_dim": 256,
                 "attention_head_dim": 8, "norm_num_groups": 32},
        "vae": {"in_channels": 3, "out_channels": 3, "latent_channels": 4,
                "block_out_channels": [32, 64, 64, 64],
                "down_block_types": ["DownEncoderBlock2D"] * 4, "up_block_types": ["UpDecoderBlock2D"] * 4,
                "layers_per_block": 1, "norm_num_groups": 32, "sample_size": 256},
        "vae_out_gain": 1.0,
    },
}


def _with_clip_tokenizer(command: str, out: Path, spec: Callable[[dict], dict]) -> Path:
    """Run the export environment's `command` with the CLIP tokenizer and `spec(the ids its text encoders'
    configs take)`: a diffusers pipeline saved in `out`."""
    with tempfile.TemporaryDirectory(prefix="ortpipe-clip-") as scratch:
        tokenizer = clip_tokenizer(Path(scratch))
        vocab = json.loads((tokenizer / "vocab.json").read_text())
        ids = {"vocab_size": len(vocab), "max_position_embeddings": CLIP_LENGTH,
               "bos_token_id": vocab["<|startoftext|>"], "eos_token_id": vocab["<|endoftext|>"],
               "pad_token_id": vocab["<|endoftext|>"]}
        printed = _export_env(command, {"out": str(out), "tokenizer": str(tokenizer), "vector_noise": 0.1,
                                        "scheduler": FOLDER_SCHEDULER, **spec(ids)})
    print(printed.strip().splitlines()[-1])
    return out


def make_sd_diffusers(out: Path, size: str) -> Path:
    """The diffusers pipeline (save_pretrained), made in the export environment."""
    sizes = SD_SIZES[size]
    return _with_clip_tokenizer("make-sd", out, lambda ids: {
        "text_encoder": {**sizes["text_encoder"], **ids}, "unet": sizes["unet"], "vae": sizes["vae"],
        "vae_out_gain": sizes["vae_out_gain"]})


def export_sd(hf: Path, out: Path) -> Path:
    """optimum's text-to-image export: model_index.json, text_encoder/, unet/, vae_decoder/, vae_encoder/,
    scheduler/, tokenizer/."""
    return _optimum(hf, out, "text-to-image")


def exported_with_references(out: Path, torch_folder: str, cases: list[dict], refs: str,
                             latent_shape: tuple[int, ...] = (1, 4, 8, 8), **spec: str) -> Path:
    """optimum's export of the built diffusers folder `torch_folder`, with each case's initial latents and
    the reference environment's images (its command `refs`, given `spec` too)."""
    export_sd(get(torch_folder), out)
    _reference_env("draw-case-inputs", {"out": str(out), "cases": cases, "latent_shape": list(latent_shape)})
    _reference_env(refs, {"hf": str(get(torch_folder)), "out": str(out), "cases": cases, **spec})
    return out


# Image to image (diffusers' StableDiffusionImg2ImgPipeline) over sd-tiny: the init image encoded, noised to
# the first timestep `strength` keeps, denoised over the rest of the schedule.
# (name, scheduler class, prediction_type, timestep_spacing, steps, strength, guidance_scale, negative prompt)
IMG2IMG_CASES = (
    ("i2i-pndm-eps-leading-cfg", "PNDMScheduler", "epsilon", "leading", 5, 0.6, 7.5, NEGATIVE),
    ("i2i-euler-eps-leading", "EulerDiscreteScheduler", "epsilon", "leading", 4, 0.75, 1.0, None),
    ("i2i-euler_a-eps-leading-cfg-empty", "EulerAncestralDiscreteScheduler", "epsilon", "leading", 5, 0.8,
     7.5, ""),
    ("i2i-ddim-v-linspace-cfg-noneg", "DDIMScheduler", "v_prediction", "linspace", 6, 0.5, 7.5, None),
    ("i2i-dpm-eps-trailing-cfg", "DPMSolverMultistepScheduler", "epsilon", "trailing", 6, 0.7, 7.5, NEGATIVE),
    ("i2i-heun-eps-trailing", "HeunDiscreteScheduler", "epsilon", "trailing", 4, 0.5, 1.0, None),
    ("i2i-kdpm2-v-leading", "KDPM2DiscreteScheduler", "v_prediction", "leading", 4, 0.6, 1.0, None),
    ("i2i-euler-eps-linspace-full", "EulerDiscreteScheduler", "epsilon", "linspace", 3, 1.0, 1.0, None),
    ("i2i-unipc-eps-leading-cfg", "UniPCMultistepScheduler", "epsilon", "leading", 7, 0.6, 7.5, NEGATIVE),
    ("i2i-lms-eps-leading-cfg", "LMSDiscreteScheduler", "epsilon", "leading", 7, 0.7, 7.5, NEGATIVE),
    ("i2i-deis-v-trailing", "DEISMultistepScheduler", "v_prediction", "trailing", 6, 0.6, 1.0, None),
    ("i2i-kdpm2_a-eps-leading", "KDPM2AncestralDiscreteScheduler", "epsilon", "leading", 5, 0.6, 1.0, None),
    # starts inside an order-3 group: the group's first steps run lower
    ("i2i-dpms3-eps-cfg", "DPMSolverSinglestepScheduler", "epsilon", "leading", 7, 0.75, 7.5, NEGATIVE),
)
IMG2IMG_FIELDS = {"i2i-pndm-eps-leading-cfg": {"skip_prk_steps": True},  # Stable Diffusion 1.x's
                  "i2i-dpms3-eps-cfg": {"solver_order": 3}}
IMG2IMG_INIT = "init.png"


def img2img_cases() -> list[dict]:
    """The image-to-image cases as the reference environment takes them; their noises are drawn there."""
    cases = []
    for seed, (name, cls, prediction, spacing, steps, strength, guidance, negative) in enumerate(
            IMG2IMG_CASES, 400):
        scheduler = {"_class_name": cls, **SCHEDULER_BASE, "prediction_type": prediction,
                     "timestep_spacing": spacing, **IMG2IMG_FIELDS.get(name, {})}
        cases.append({"name": name, "scheduler": scheduler, "num_inference_steps": steps,
                      "strength": strength, "guidance_scale": guidance, "prompt": PROMPT,
                      "negative_prompt": negative, "seed": seed, "noisy": cls in NOISY_SCHEDULERS})
    return cases


def _png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def init_image(path: Path, size: int = 32) -> Path:
    """The image-to-image cases' init image, an 8-bit RGB PNG written byte by byte (the same bytes each
    build): a smooth gradient, a red square off the centre, and a fine fixed ripple over both."""
    rows = bytearray()
    for y in range(size):
        rows.append(0)  # filter type 0: the row as it is
        for x in range(size):
            if 10 <= x < 22 and 6 <= y < 18:
                pixel = (220, 50, 40)
            else:
                pixel = (40 + 6 * x, 60 + 5 * y, 210 - 3 * x - 2 * y)
            ripple = (7 * x + 13 * y) % 9 - 4
            rows += bytes(max(0, min(255, value + ripple)) for value in pixel)
    header = struct.pack(">IIBBBBB", size, size, 8, 2, 0, 0, 0)  # 8 bits, truecolour, no interlace
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + _png_chunk(b"IHDR", header)
                     + _png_chunk(b"IDAT", zlib.compress(bytes(rows), 9)) + _png_chunk(b"IEND", b""))
    return path


def mask_image(path: Path, size: int = 32) -> Path:
    """The inpainting cases' mask, an 8-bit RGB PNG written byte by byte: white (repaint) over a rectangle
    that cuts the init image's red square, black elsewhere; one row of greys 127 and 128 and a colour on
    the pixels diffusers' nearest resize picks (every 4th), where the luminance threshold decides."""
    rows = bytearray()
    for y in range(size):
        rows.append(0)
        for x in range(size):
            pixel = (255, 255, 255) if 14 <= x < 30 and 4 <= y < 20 else (0, 0, 0)
            if y == 24:
                pixel = ((127, 127, 127), (128, 128, 128), (200, 60, 90), (90, 200, 60))[x // 4 % 4]
            rows += bytes(pixel)
    header = struct.pack(">IIBBBBB", size, size, 8, 2, 0, 0, 0)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + _png_chunk(b"IHDR", header)
                     + _png_chunk(b"IDAT", zlib.compress(bytes(rows), 9)) + _png_chunk(b"IEND", b""))
    return path


# Inpainting (diffusers' StableDiffusionInpaintPipeline) over sd-tiny, whose UNet takes the latents' 4
# channels: after each step the kept region goes back to the image's latents noised to the next step.
# (name, scheduler class, prediction_type, timestep_spacing, steps, strength, guidance_scale, negative prompt)
INPAINT_CASES = (
    ("inp-euler-eps-leading-cfg", "EulerDiscreteScheduler", "epsilon", "leading", 4, 1.0, 7.5, NEGATIVE),
    ("inp-ddim-v-linspace", "DDIMScheduler", "v_prediction", "linspace", 5, 0.6, 1.0, None),
    ("inp-dpm-eps-trailing-cfg", "DPMSolverMultistepScheduler", "epsilon", "trailing", 6, 0.75, 7.5, None),
    ("inp-euler_a-eps-leading", "EulerAncestralDiscreteScheduler", "epsilon", "leading", 4, 1.0, 1.0, None),
    ("inp-pndm-eps-leading-cfg", "PNDMScheduler", "epsilon", "leading", 5, 1.0, 7.5, NEGATIVE),
    ("inp-heun-eps-trailing", "HeunDiscreteScheduler", "epsilon", "trailing", 4, 0.5, 1.0, None),
    ("inp-kdpm2-v-leading", "KDPM2DiscreteScheduler", "v_prediction", "leading", 4, 1.0, 1.0, None),
    ("inp-unipc-v-linspace", "UniPCMultistepScheduler", "v_prediction", "linspace", 5, 0.8, 1.0, None),
    ("inp-lms-v-trailing", "LMSDiscreteScheduler", "v_prediction", "trailing", 5, 0.6, 1.0, None),
    ("inp-kdpm2_a-v-trailing", "KDPM2AncestralDiscreteScheduler", "v_prediction", "trailing", 4, 1.0, 1.0,
     None),
)
INPAINT_MASK = "mask.png"


# The same with an inpainting UNet (9 input channels: the latents, the mask, the masked image's latents), as
# stable-diffusion-inpainting's: sd-tiny's sizes, diffusers' StableDiffusionInpaintPipeline, optimum's
# "inpainting" export.
INPAINT9_CASES = (
    ("inp9-euler-eps-leading-cfg", "EulerDiscreteScheduler", "epsilon", "leading", 4, 1.0, 7.5, NEGATIVE),
    ("inp9-ddim-v-linspace", "DDIMScheduler", "v_prediction", "linspace", 5, 0.6, 1.0, None),
    ("inp9-euler_a-eps-trailing-cfg", "EulerAncestralDiscreteScheduler", "epsilon", "trailing", 4, 0.75, 7.5,
     None),
)


def make_sd_inpaint_diffusers(out: Path) -> Path:
    sizes = SD_SIZES["tiny"]
    return _with_clip_tokenizer("make-sd", out, lambda ids: {
        "text_encoder": {**sizes["text_encoder"], **ids}, "unet": {**sizes["unet"], "in_channels": 9},
        "vae": sizes["vae"], "vae_out_gain": sizes["vae_out_gain"],
        "pipeline": "StableDiffusionInpaintPipeline"})


def make_sd_inpaint_tiny(out: Path) -> Path:
    """optimum's inpainting export of sd-inpaint-tiny-diffusers, with references/inpaint.json."""
    _optimum(get("sd-inpaint-tiny-diffusers"), out, "inpainting")
    mask_image(out / "references" / INPAINT_MASK)
    return with_img2img_references(out, "sd-inpaint-tiny-diffusers", inpaint_cases(INPAINT9_CASES),
                                   "StableDiffusionInpaintPipeline", mask_image=INPAINT_MASK)


def inpaint_cases(table: tuple = INPAINT_CASES) -> list[dict]:
    return [{"name": name, "scheduler": {"_class_name": cls, **SCHEDULER_BASE, "prediction_type": prediction,
                                         "timestep_spacing": spacing,
                                         **({"skip_prk_steps": True} if cls == "PNDMScheduler" else {})},
             "num_inference_steps": steps, "strength": strength, "guidance_scale": guidance, "prompt": PROMPT,
             "negative_prompt": negative, "seed": seed, "noisy": cls in NOISY_SCHEDULERS}
            for seed, (name, cls, prediction, spacing, steps, strength, guidance, negative)
            in enumerate(table, 800)]


def make_sd_tiny(out: Path) -> Path:
    """optimum's export of sd-tiny-diffusers with the text-to-image references (cases.json), the
    image-to-image ones (img2img.json, from references/init.png) and the inpainting ones (inpaint.json,
    references/mask.png beside)."""
    exported_with_references(out, "sd-tiny-diffusers", sd_cases(), "sd-refs")
    with_img2img_references(out, "sd-tiny-diffusers", img2img_cases(), "StableDiffusionImg2ImgPipeline")
    mask_image(out / "references" / INPAINT_MASK)
    return with_img2img_references(out, "sd-tiny-diffusers", inpaint_cases(),
                                   "StableDiffusionInpaintPipeline", mask_image=INPAINT_MASK)


def with_img2img_references(out: Path, torch_folder: str, cases: list[dict], pipeline: str,
                            latent_shape: tuple[int, ...] = (1, 4, 8, 8), **spec: str) -> Path:
    """references/init.png and diffusers' image-to-image `pipeline` on each case (img2img.json; an
    inpainting pipeline's, given `mask_image`: inpaint.json)."""
    init_image(out / "references" / IMG2IMG_INIT)
    _reference_env("img2img-refs", {"hf": str(get(torch_folder)), "out": str(out), "pipeline": pipeline,
                                    "init_image": IMG2IMG_INIT, "cases": cases,
                                    "latent_shape": list(latent_shape), **spec})
    return out


# A latent consistency model: sd-tiny's parts, its UNet taking the guidance scale embedded (timestep_cond,
# time_cond_proj_dim wide), LCMScheduler, diffusers' LatentConsistencyModelPipeline (no unconditional row).
LCM_PIPELINE = "LatentConsistencyModelPipeline"
LCM_SCHEDULER = {"_class_name": "LCMScheduler", **SCHEDULER_BASE, "prediction_type": "epsilon",
                 "timestep_spacing": "leading"}
LCM_CASES = (("lcm-embedded-1", 1, 8.5), ("lcm-embedded-4", 4, 8.5), ("lcm-embedded-2-g1", 2, 1.0))


def make_lcm_diffusers(out: Path) -> Path:
    sizes = SD_SIZES["tiny"]
    return _with_clip_tokenizer("make-sd", out, lambda ids: {
        "text_encoder": {**sizes["text_encoder"], **ids}, "unet": {**sizes["unet"], "time_cond_proj_dim": 32},
        "vae": sizes["vae"], "vae_out_gain": sizes["vae_out_gain"], "scheduler": LCM_SCHEDULER,
        "pipeline": LCM_PIPELINE})


# LatentConsistencyModelImg2ImgPipeline: every step of the schedule LCMScheduler picks from the first
# int(original_inference_steps * strength) of its original timesteps. (name, steps, strength, guidance_scale)
LCM_IMG2IMG_CASES = (("lcm-i2i-4", 4, 0.6, 8.5), ("lcm-i2i-2-g1", 2, 0.3, 1.0))


def lcm_img2img_cases() -> list[dict]:
    return [{"name": name, "scheduler": LCM_SCHEDULER, "num_inference_steps": steps, "strength": strength,
             "guidance_scale": guidance, "prompt": PROMPT, "negative_prompt": None, "seed": seed,
             "noisy": True}
            for seed, (name, steps, strength, guidance) in enumerate(LCM_IMG2IMG_CASES, 700)]


def make_lcm_tiny(out: Path) -> Path:
    exported_with_references(out, "lcm-tiny-diffusers", lcm_cases(), "sd-refs", pipeline=LCM_PIPELINE)
    return with_img2img_references(out, "lcm-tiny-diffusers", lcm_img2img_cases(),
                                   "LatentConsistencyModelImg2ImgPipeline")


def lcm_cases() -> list[dict]:
    """The last step adds no noise: a one-step case is compared with diffusers directly."""
    return [{**_plain_case(name, LCM_SCHEDULER, steps, guidance, None, seed),
             "noise": f"{name}.noise.npy" if steps > 1 else None}
            for seed, (name, steps, guidance) in enumerate(LCM_CASES, 300)]


# Stable Diffusion XL: two text encoders (the second with a projection, its tokenizer padding with "!"), a
# UNet taking their joined penultimate states, the second's pooled projection and the size conditioning.
SDXL_CASES = (
    ("sdxl-euler-eps-leading-cfg-zeros", "EulerDiscreteScheduler", "epsilon", "leading", 4, 5.0, None),
    ("sdxl-euler-eps-leading-cfg-neg", "EulerDiscreteScheduler", "epsilon", "leading", 3, 5.0, NEGATIVE),
    ("sdxl-euler-eps-trailing-cfg-empty", "EulerDiscreteScheduler", "epsilon", "trailing", 3, 7.0, ""),
    ("sdxl-dpm-v-trailing", "DPMSolverMultistepScheduler", "v_prediction", "trailing", 4, 1.0, None),
)
SDXL_TINY = {
    "text_encoder": SD_SIZES["tiny"]["text_encoder"],
    "text_encoder_2": {**SD_SIZES["tiny"]["text_encoder"], "hidden_size": 48, "intermediate_size": 53,
                       "num_hidden_layers": 3, "projection_dim": 24},
    # cross attention over both encoders' states (32 + 48); the added embedding over the pooled projection
    # and six size values of addition_time_embed_dim each
    "unet": {**SD_SIZES["tiny"]["unet"], "cross_attention_dim": 80, "addition_embed_type": "text_time",
             "addition_time_embed_dim": 8, "projection_class_embeddings_input_dim": 24 + 6 * 8},
    "vae": SD_SIZES["tiny"]["vae"],
}


def _plain_case(name: str, scheduler: dict, steps: int, guidance: float, negative: str | None,
                seed: int) -> dict:
    """A case of a scheduler that draws no noise, without guidance_rescale, as the reference environment
    takes it."""
    return {"name": name, "scheduler": scheduler, "num_inference_steps": steps, "guidance_scale": guidance,
            "prompt": PROMPT, "negative_prompt": negative, "seed": seed, "latents": f"{name}.latents.npy",
            "noise": None, "guidance_rescale": 0.0}


# Stable Diffusion XL's image to image (StableDiffusionXLImg2ImgPipeline, no aesthetic score: a base model's)
# (name, scheduler class, prediction_type, timestep_spacing, steps, strength, guidance_scale, negative prompt)
SDXL_IMG2IMG_CASES = (
    ("sdxl-i2i-euler-eps-leading-cfg-zeros", "EulerDiscreteScheduler", "epsilon", "leading", 5, 0.6, 5.0,
     None),
    ("sdxl-i2i-dpm-v-trailing-cfg-neg", "DPMSolverMultistepScheduler", "v_prediction", "trailing", 6, 0.75,
     5.0, NEGATIVE),
    ("sdxl-i2i-euler_a-eps-leading", "EulerAncestralDiscreteScheduler", "epsilon", "leading", 4, 1.0, 1.0,
     None),
)


def sdxl_img2img_cases() -> list[dict]:
    return [{"name": name, "scheduler": {"_class_name": cls, **SCHEDULER_BASE, "prediction_type": prediction,
                                         "timestep_spacing": spacing},
             "num_inference_steps": steps, "strength": strength, "guidance_scale": guidance, "prompt": PROMPT,
             "negative_prompt": negative, "seed": seed, "noisy": cls in NOISY_SCHEDULERS}
            for seed, (name, cls, prediction, spacing, steps, strength, guidance, negative)
            in enumerate(SDXL_IMG2IMG_CASES, 600)]


# StableDiffusionXLInpaintPipeline with sdxl-tiny's UNet of the latents' channels (its blend)
SDXL_INPAINT_CASES = (
    ("sdxl-inp-euler-eps-leading-cfg-zeros", "EulerDiscreteScheduler", "epsilon", "leading", 4, 1.0, 5.0,
     None),
    ("sdxl-inp-dpm-v-trailing-neg", "DPMSolverMultistepScheduler", "v_prediction", "trailing", 5, 0.9999, 5.0,
     NEGATIVE),
)


def make_sdxl_tiny(out: Path) -> Path:
    exported_with_references(out, "sdxl-tiny-diffusers", sdxl_cases(), "sdxl-refs")
    with_img2img_references(out, "sdxl-tiny-diffusers", sdxl_img2img_cases(),
                            "StableDiffusionXLImg2ImgPipeline")
    mask_image(out / "references" / INPAINT_MASK)
    return with_img2img_references(out, "sdxl-tiny-diffusers", inpaint_cases(SDXL_INPAINT_CASES),
                                   "StableDiffusionXLInpaintPipeline", mask_image=INPAINT_MASK)


def sdxl_cases() -> list[dict]:
    return [_plain_case(name, {"_class_name": cls, **SCHEDULER_BASE, "prediction_type": prediction,
                               "timestep_spacing": spacing}, steps, guidance, negative, seed)
            for seed, (name, cls, prediction, spacing, steps, guidance, negative)
            in enumerate(SDXL_CASES, 100)]


def make_sdxl_diffusers(out: Path) -> Path:
    """A StableDiffusionXLPipeline of tiny random parts (save_pretrained), made in the export environment."""
    return _with_clip_tokenizer("make-sdxl", out, lambda ids: {
        "text_encoder": {**SDXL_TINY["text_encoder"], **ids},
        "text_encoder_2": {**SDXL_TINY["text_encoder_2"], **ids}, "unet": SDXL_TINY["unet"],
        "vae": SDXL_TINY["vae"]})


# Stable Diffusion 3: two CLIP encoders with projections (their penultimate states side by side, zero-padded
# to T5's width, then T5's states after them along the sequence; their pooled projections side by side), an
# SD3 transformer, a flow-matching Euler scheduler, a VAE whose latents are shifted.
SD3_TINY = {
    "text_encoder": {**SD_SIZES["tiny"]["text_encoder"], "projection_dim": 16},
    "text_encoder_2": SDXL_TINY["text_encoder_2"],
    "text_encoder_3": {"d_model": 96, "d_kv": 16, "d_ff": 64, "num_layers": 2, "num_heads": 4,
                       "relative_attention_num_buckets": 8, "pad_token_id": 0, "eos_token_id": 1,
                       "decoder_start_token_id": 0},
    # 16 latent channels, as Stable Diffusion 3's VAE has (its inpainting pipeline blends only then)
    "transformer": {"sample_size": 8, "patch_size": 2, "in_channels": 16, "num_layers": 2,
                    "attention_head_dim": 8,
                    "num_attention_heads": 4, "joint_attention_dim": 96, "caption_projection_dim": 32,
                    "pooled_projection_dim": 16 + 24, "out_channels": 16, "pos_embed_max_size": 16},
    "vae": {**SD_SIZES["tiny"]["vae"], "latent_channels": 16, "scaling_factor": 1.5305,
            "shift_factor": 0.0609, "use_quant_conv": False, "use_post_quant_conv": False},
    "flow_scheduler": {"num_train_timesteps": 1000, "shift": 3.0},
}


# (name, shift, steps, guidance_scale, negative prompt)
SD3_CASES = (
    ("sd3-flow-shift3-cfg-neg", 3.0, 4, 5.0, NEGATIVE),
    ("sd3-flow-shift3-cfg-empty", 3.0, 3, 7.0, None),
    ("sd3-flow-shift1", 1.0, 4, 1.0, None),
)


def sd3_cases() -> list[dict]:
    flow = {"_class_name": "FlowMatchEulerDiscreteScheduler", **SD3_TINY["flow_scheduler"]}
    return [_plain_case(name, {**flow, "shift": shift}, steps, guidance, negative, seed)
            for seed, (name, shift, steps, guidance, negative) in enumerate(SD3_CASES, 200)]


# Stable Diffusion 3's image to image (StableDiffusion3Img2ImgPipeline): steps - int(steps - steps *
# strength) steps kept (5 at 0.75 of 6: the float product; Stable Diffusion's pipeline would keep 4).
# (name, shift, steps, strength, guidance_scale, negative prompt)
SD3_IMG2IMG_CASES = (
    ("sd3-i2i-shift3-cfg-neg", 3.0, 6, 0.75, 5.0, NEGATIVE),
    ("sd3-i2i-shift1", 1.0, 4, 0.6, 1.0, None),
    ("sd3-i2i-shift3-full", 3.0, 3, 1.0, 1.0, None),
)


def sd3_img2img_cases() -> list[dict]:
    flow = {"_class_name": "FlowMatchEulerDiscreteScheduler", **SD3_TINY["flow_scheduler"]}
    return [{"name": name, "scheduler": {**flow, "shift": shift}, "num_inference_steps": steps,
             "strength": strength, "guidance_scale": guidance, "prompt": PROMPT, "negative_prompt": negative,
             "seed": seed, "noisy": False}
            for seed, (name, shift, steps, strength, guidance, negative) in enumerate(SD3_IMG2IMG_CASES, 500)]


# StableDiffusion3Pipeline loaded without T5 (text_encoder_3=None, tokenizer_3=None): zeros in place of T5's
# states. (name, shift, steps, guidance_scale, negative prompt)
SD3_NO_T5_CASES = (
    ("sd3-no-t5-cfg-neg", 3.0, 4, 5.0, NEGATIVE),
    ("sd3-no-t5-shift1", 1.0, 3, 1.0, None),
)
SD3_NO_T5_INDEX = "no-t5.json"


def sd3_no_t5_cases() -> list[dict]:
    flow = {"_class_name": "FlowMatchEulerDiscreteScheduler", **SD3_TINY["flow_scheduler"]}
    return [_plain_case(name, {**flow, "shift": shift}, steps, guidance, negative, seed)
            for seed, (name, shift, steps, guidance, negative) in enumerate(SD3_NO_T5_CASES, 250)]


# StableDiffusion3InpaintPipeline (sd3-tiny's transformer of the latents' 16 channels: the pipeline's blend,
# flow matching's scale_noise at the next sigma). (name, shift, steps, strength, guidance_scale, negative)
SD3_INPAINT_CASES = (
    ("sd3-inp-shift3-cfg-neg", 3.0, 5, 1.0, 5.0, NEGATIVE),
    ("sd3-inp-shift1-default", 1.0, 6, 0.6, 1.0, None),  # the pipeline's default strength
)
SD3_LATENTS = (1, 16, 8, 8)


def sd3_inpaint_cases() -> list[dict]:
    flow = {"_class_name": "FlowMatchEulerDiscreteScheduler", **SD3_TINY["flow_scheduler"]}
    return [{"name": name, "scheduler": {**flow, "shift": shift}, "num_inference_steps": steps,
             "strength": strength, "guidance_scale": guidance, "prompt": PROMPT, "negative_prompt": negative,
             "seed": seed, "noisy": False}
            for seed, (name, shift, steps, strength, guidance, negative) in enumerate(SD3_INPAINT_CASES, 900)]


def make_sd3_tiny(out: Path) -> Path:
    exported_with_references(out, "sd3-tiny-diffusers", sd3_cases(), "sd3-refs", SD3_LATENTS)
    cases = sd3_no_t5_cases()
    _reference_env("draw-case-inputs", {"out": str(out), "cases": cases, "latent_shape": list(SD3_LATENTS)})
    _reference_env("sd3-refs", {"hf": str(get("sd3-tiny-diffusers")), "out": str(out), "cases": cases,
                                "without_t5": True, "index": SD3_NO_T5_INDEX})
    with_img2img_references(out, "sd3-tiny-diffusers", sd3_img2img_cases(), "StableDiffusion3Img2ImgPipeline",
                            SD3_LATENTS)
    mask_image(out / "references" / INPAINT_MASK)
    return with_img2img_references(out, "sd3-tiny-diffusers", sd3_inpaint_cases(),
                                   "StableDiffusion3InpaintPipeline", SD3_LATENTS, mask_image=INPAINT_MASK)


def make_sd3_diffusers(out: Path) -> Path:
    """A StableDiffusion3Pipeline of tiny random parts (save_pretrained), made in the export environment."""
    with tempfile.TemporaryDirectory(prefix="ortpipe-t5-") as scratch:
        t5 = t5_tokenizer(Path(scratch))
        vocab = len(json.loads((t5 / "tokenizer.json").read_text())["model"]["vocab"])
        return _with_clip_tokenizer("make-sd3", out, lambda ids: {
            "text_encoder": {**SD3_TINY["text_encoder"], **ids},
            "text_encoder_2": {**SD3_TINY["text_encoder_2"], **ids},
            "text_encoder_3": {**SD3_TINY["text_encoder_3"], "vocab_size": vocab}, "tokenizer_3": str(t5),
            **{k: SD3_TINY[k] for k in ("transformer", "vae", "flow_scheduler")}})


# --- the named folders ---------------------------------------------------------------------------

RECIPES: dict[str, Callable[[Path], Path]] = {
    "st-bert-hf": make_bert,
    "st-minilm": lambda out: make_st(out, "mean", normalize=True),
    "st-minilm-cls": lambda out: make_st(out, "cls", normalize=True, legacy=True, onnx_from=get("st-minilm")),
    "st-minilm-nonorm": lambda out: make_st(out, "mean", normalize=False, onnx_from=get("st-minilm")),
    "vits-hf": make_vits_hf,
    "vits-tiny": make_vits,
    "sd-tiny-diffusers": lambda out: make_sd_diffusers(out, "tiny"),
    "sd-tiny": make_sd_tiny,
    "sd-inpaint-tiny-diffusers": make_sd_inpaint_diffusers,
    "sd-inpaint-tiny": make_sd_inpaint_tiny,
    "lcm-tiny-diffusers": make_lcm_diffusers,
    "lcm-tiny": make_lcm_tiny,
    "sdxl-tiny-diffusers": make_sdxl_diffusers,
    "sd3-tiny-diffusers": make_sd3_diffusers,
    "sd3-tiny": make_sd3_tiny,
    "sdxl-tiny": make_sdxl_tiny,
    "sd-bench-diffusers": lambda out: make_sd_diffusers(out, "bench"),
    "sd-bench": lambda out: export_sd(get("sd-bench-diffusers"), out),
}
BENCH_ONLY = ("sd-bench-diffusers", "sd-bench")


def _recipe_text() -> str:
    """What decides a build beside hfmodels' fingerprint: both modules of this build, their environments."""
    parts = [Path(__file__).read_text(encoding="utf-8"),
             (Path(__file__).parent / "paradigm_torch.py").read_text(encoding="utf-8"),
             *EXPORT_REQUIREMENTS, *REFERENCE_REQUIREMENTS]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()


def get(name: str) -> Path:
    """The built folder of a named model (see RECIPES), building it on first use."""
    if name not in RECIPES:
        raise KeyError(f"unknown paradigm model {name!r}; known: {', '.join(RECIPES)}")
    return hfmodels.cached(name, RECIPES[name], recipe=_recipe_text())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m build.paradigms", description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", metavar="NAME", help=f"folders to build: {', '.join(RECIPES)}")
    parser.add_argument("--all", action="store_true", help="build every test folder (not the benchmark's)")
    args = parser.parse_args(argv)
    names = [n for n in RECIPES if n not in BENCH_ONLY] if args.all else args.names
    if not names:
        parser.error("name at least one folder, or pass --all")
    for name in names:
        start = time.perf_counter()
        path = get(name)
        print(f"{name}: {path} ({time.perf_counter() - start:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
