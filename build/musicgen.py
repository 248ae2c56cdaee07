"""A tiny random MusicGen in optimum's export layout, with transformers' references (issue 21).

    python -m build.musicgen            # builds (once; cached like build/paradigms.py) and prints the folder

The folder is what optimum's text-to-audio export writes and transformers.js runs: `text_encoder.onnx`,
`decoder_model_merged.onnx` (merged here with optimum's merge_decoders: optimum-onnx 0.1 writes none for
MusicGen, PITFALLS), `encodec_decode.onnx`, `build_delay_pattern_mask.onnx`, config.json,
generation_config.json and the tokenizer; no genai_config.json. `references/cases.json` holds what
transformers' MusicgenForConditionalGeneration.generate (greedy) gave for each case: the codes EnCodec decoded
and the audio (`audio_N.npy`).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from build import hfmodels, paradigms

WORDS = ("the a of and to in is it that was for on are as with his they at be this from music drum piano "
         "guitar happy sad beat rock jazz loud soft slow fast song").split()
PAD = 64  # the codebook size: MusicGen's pad and start token
SPEC = {
    "words": list(WORDS),
    "text_encoder": {"d_model": 16, "d_kv": 8, "d_ff": 32, "num_layers": 2, "num_heads": 2},
    "audio_encoder": {"target_bandwidths": [8.0], "sampling_rate": 800, "audio_channels": 1, "num_filters": 4,
                      "num_residual_layers": 1, "upsampling_ratios": [2, 2], "codebook_size": PAD,
                      "hidden_size": 16, "num_lstm_layers": 1, "kernel_size": 3, "last_kernel_size": 3,
                      "residual_kernel_size": 3},
    # a large init: the text then changes the codes, so guidance is visible in them
    "decoder": {"vocab_size": PAD, "num_codebooks": 4, "hidden_size": 32, "num_hidden_layers": 2,
                "num_attention_heads": 4, "ffn_dim": 64, "max_position_embeddings": 256,
                "initializer_factor": 0.5, "pad_token_id": PAD, "bos_token_id": PAD, "eos_token_id": None},
    "generation": {"decoder_start_token_id": PAD, "pad_token_id": PAD, "bos_token_id": PAD,
                   "max_length": 24, "do_sample": False, "guidance_scale": 3.0},
}
CASES = [{"prompt": "happy rock song", "guidance_scale": 1.0, "max_new_tokens": 12},
         {"prompt": "happy rock song", "guidance_scale": 3.0, "max_new_tokens": 12},
         {"prompt": "slow sad piano music", "guidance_scale": 3.0, "max_new_tokens": 16}]
FILES = ("text_encoder.onnx", "decoder_model_merged.onnx", "encodec_decode.onnx",
         "build_delay_pattern_mask.onnx", "config.json", "generation_config.json", "tokenizer.json",
         "tokenizer_config.json", "special_tokens_map.json")


def _merge(onnx: Path) -> None:
    """optimum's merge_decoders, the hash seed fixed so the merged graph is the same every time (PITFALLS)."""
    python = hfmodels.ensure_venv(paradigms.EXPORT_VENV, paradigms.EXPORT_REQUIREMENTS,
                                  paradigms.EXPORT_VENV.name)
    code = ("import sys; from optimum.onnx import merge_decoders; "
            "merge_decoders(sys.argv[1], sys.argv[2], save_path=sys.argv[3], strict=False)")
    files = [str(onnx / f) for f in ("decoder_model.onnx", "decoder_with_past_model.onnx",
                                     "decoder_model_merged.onnx")]
    proc = subprocess.run([str(python), "-c", code, *files],
                          env={**os.environ, "PYTHONHASHSEED": "0", "HF_HUB_OFFLINE": "1"},
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"merging MusicGen's decoders failed:\n{proc.stdout[-6000:]}")


def make(out: Path) -> Path:
    with tempfile.TemporaryDirectory(prefix="ortpipe-musicgen-") as scratch:
        hf, onnx = Path(scratch) / "hf", Path(scratch) / "onnx"
        paradigms._torch(paradigms.EXPORT_VENV, paradigms.EXPORT_REQUIREMENTS, "make",
                         {"out": str(hf), **SPEC}, module="build.musicgen_torch")
        paradigms._optimum(hf, onnx, "text-to-audio")
        _merge(onnx)
        out.mkdir(parents=True)
        for file in FILES:
            shutil.copy2(onnx / file, out / file)
        paradigms._torch(paradigms.REFERENCE_VENV, paradigms.REFERENCE_REQUIREMENTS, "refs",
                         {"hf": str(hf), "out": str(out / "references"), "cases": CASES},
                         module="build.musicgen_torch")
    return out


def get() -> Path:
    recipe = "".join(p.read_text() for p in (Path(__file__), Path(__file__).with_name("musicgen_torch.py")))
    return hfmodels.cached("musicgen-tiny", make, recipe=recipe + "".join(paradigms.EXPORT_REQUIREMENTS
                                                                          + paradigms.REFERENCE_REQUIREMENTS))


if __name__ == "__main__":
    print(get())
    sys.exit(0)
