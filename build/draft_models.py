"""Draft models for speculative decoding's tests: smaller models that share a test model's tokenizer.

Built with build/hfmodels.py's machinery (its cache, its model builder and Optimum exports):

- llama-draft-hf: the llama test model cut to its first layer (the same embeddings, final norm
  and output layer), so its greedy choices often agree with the full model's;
- llama-draft-builder, llama-draft-concat: its model-builder (shared buffer) and Optimum (concat)
  exports;
- demo-draft-builder: a one-layer random Llama with the demo model's tokenizer (models/demo).

    python -m build.draft_models llama-draft-builder demo-draft-builder
"""

from __future__ import annotations

import argparse
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

from build import hfmodels

REPO = Path(__file__).resolve().parent.parent
DEMO = REPO / "models" / "demo"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def truncated(hf_dir: Path, out: Path, layers: int = 1) -> Path:
    """A Hugging Face model cut to its first `layers` decoder layers, with its tokenizer."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    model.model.layers = model.model.layers[:layers]
    model.config.num_hidden_layers = layers
    if getattr(model.config, "layer_types", None):
        model.config.layer_types = model.config.layer_types[:layers]
    model.save_pretrained(out, safe_serialization=True)
    for name in TOKENIZER_FILES:
        shutil.copy2(hf_dir / name, out / name)
    return out


def with_tokenizer_of(tokenizer_dir: Path, out: Path, seed: int = 3) -> Path:
    """A one-layer random Llama (hfmodels' tiny shape, perturbed) over another folder's tokenizer."""
    import json

    import torch
    import transformers

    out.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        shutil.copy2(tokenizer_dir / name, out / name)
    vocab = len(json.loads((out / "tokenizer.json").read_text())["model"]["vocab"])
    config = hfmodels._hf_config("llama", vocab)
    config.num_hidden_layers = 1
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    hfmodels._perturb(model, seed)
    model.save_pretrained(out, safe_serialization=True)
    return out


RECIPES: dict[str, Callable[[Path], Path]] = {
    "llama-draft-hf": lambda out: truncated(hfmodels.get("llama-hf"), out),
    "llama-draft-builder": lambda out: hfmodels.export_builder(get("llama-draft-hf"), out, "fp32"),
    "llama-draft-concat": lambda out: hfmodels.export_concat(get("llama-draft-hf"), out),
    "demo-draft-hf": lambda out: with_tokenizer_of(DEMO, out),
    "demo-draft-builder": lambda out: hfmodels.export_builder(get("demo-draft-hf"), out, "fp32"),
}


def get(name: str) -> Path:
    """The built folder of a named draft model, built on first use into hfmodels' cache."""
    if name not in RECIPES:
        raise KeyError(f"unknown draft model {name!r}; known: {', '.join(RECIPES)}")
    recipe = Path(__file__).read_text(encoding="utf-8")
    if name.startswith("demo-"):
        recipe += (DEMO / "tokenizer.json").read_text(encoding="utf-8")
    return hfmodels.cached(name, RECIPES[name], recipe=recipe)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m build.draft_models",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="+", metavar="NAME",
                        help=f"draft models to build: {', '.join(RECIPES)}")
    args = parser.parse_args(argv)
    for name in args.names:
        print(f"{name}: {get(name)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
