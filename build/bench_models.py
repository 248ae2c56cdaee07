"""Random-weight Llama models for `ortpipe bench`, exported by onnxruntime-genai's model builder.

Two sizes: "tiny" (about 1M parameters, where per-step overhead dominates) and "200m" (about 200M
parameters, where the model's own compute dominates), fp32 and int4 for the larger one. Weights
come from a fixed seed; norm weights are perturbed because HF initialises them to ones, which
would hide any bug there. Each model folder gets a small WordLevel tokenizer (the builder needs
one). Output: OUT/<name>-<precision>/ (a genai_config.json v1 folder), HF sources in OUT/hf/.

    python -m build.bench_models --out build/cache/bench [--only tiny-fp32,200m-int4]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

SEED = 1234
SPECIALS = ["<unk>", "<s>", "</s>"]  # ids 0, 1, 2: unk, bos, eos


@dataclass(frozen=True)
class Size:
    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    precisions: tuple[str, ...] = ()  # the builder's -p values (bench_models); none for other exports


# head_size = hidden / heads must be a multiple of 16: GroupQueryAttention on the CPU EP needs it.
SIZES = (
    Size("tiny", hidden=128, layers=2, heads=4, kv_heads=2, intermediate=768, vocab=1024,
         precisions=("fp32",)),
    Size("200m", hidden=1024, layers=12, heads=16, kv_heads=4, intermediate=2816, vocab=32000,
         precisions=("fp32", "int4")),
)


def make_tokenizer(vocab: int, folder: Path) -> None:
    """A WordLevel tokenizer over `vocab` ids ("t3", "t4", ...), saved as an HF fast tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {tok: i for i, tok in enumerate(SPECIALS)}
    words.update({f"t{i}": i for i in range(len(SPECIALS), vocab)})
    tok = Tokenizer(models.WordLevel(vocab=words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(str(folder))


def make_hf_model(size: Size, folder: Path) -> int:
    """Save a seeded random Llama and its tokenizer to `folder`; returns the parameter count."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(SEED)
    config = LlamaConfig(
        vocab_size=size.vocab, hidden_size=size.hidden, intermediate_size=size.intermediate,
        num_hidden_layers=size.layers, num_attention_heads=size.heads, num_key_value_heads=size.kv_heads,
        max_position_embeddings=2048, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2, pad_token_id=0, torch_dtype="float32")
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):  # ones by default: make a wrong norm visible
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
    model.save_pretrained(str(folder), safe_serialization=True)
    make_tokenizer(size.vocab, folder)
    return sum(p.numel() for p in model.parameters())


def patch_config(folder: Path) -> None:
    """Spell transformers-5 rope settings the old way too, for builders that read `rope_theta`."""
    path = folder / "config.json"
    config = json.loads(path.read_text())
    rope = config.get("rope_parameters") or {}
    if "rope_theta" not in config and "rope_theta" in rope:
        config["rope_theta"] = rope["rope_theta"]
        path.write_text(json.dumps(config, indent=2))


def export(hf_dir: Path, out: Path, precision: str, cache: Path) -> None:
    """Run onnxruntime-genai's model builder (as a CLI: it keeps global state between models)."""
    if out.exists():
        shutil.rmtree(out)
    cmd = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(hf_dir), "-o", str(out),
           "-p", precision, "-e", "cpu", "-c", str(cache)]
    done = subprocess.run(cmd, capture_output=True, text=True)  # its progress bars drown everything else
    if done.returncode != 0:
        raise RuntimeError(f"the builder failed on {hf_dir} ({precision}):\n{done.stderr[-4000:]}")
    if not (out / "genai_config.json").is_file():
        raise RuntimeError(f"the builder wrote no genai_config.json in {out}")


def build(out: Path, only: set[str] | None = None, force: bool = False) -> list[Path]:
    """Build every selected model that is missing (or all of them with `force`); returns their folders."""
    built = []
    for size in SIZES:
        wanted = [p for p in size.precisions if only is None or f"{size.name}-{p}" in only]
        if not wanted:
            continue
        hf_dir = out / "hf" / size.name
        if force or not (hf_dir / "config.json").is_file():
            count = make_hf_model(size, hf_dir)
            patch_config(hf_dir)
            print(f"{size.name}: {count / 1e6:.2f}M parameters -> {hf_dir}")
        for precision in wanted:
            target = out / f"{size.name}-{precision}"
            if force or not (target / "genai_config.json").is_file():
                export(hf_dir, target, precision, out / "builder-cache")
                print(f"{size.name}-{precision}: exported -> {target}")
            built.append(target)
    return built


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("build/cache/bench"))
    parser.add_argument("--only", help="comma-separated model names, e.g. tiny-fp32,200m-int4")
    parser.add_argument("--force", action="store_true", help="rebuild even if the folders exist")
    args = parser.parse_args(argv)
    only = set(args.only.split(",")) if args.only else None
    for folder in build(args.out, only, args.force):
        print(folder)
    return 0


if __name__ == "__main__":
    sys.exit(main())
