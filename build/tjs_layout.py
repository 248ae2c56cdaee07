"""transformers.js's layout of a model folder, made from the folder transformers (and optimum) saved: what
users of transformers.js download from the Hub's converted folders, for the tests and benchmarks that run
both engines on one folder.

    python -m build.tjs_layout vits SRC OUT
    python -m build.tjs_layout feature-extraction SRC OUT

feature-extraction: a sentence-transformers folder as transformers.js's feature-extraction folders have it:
onnx/model.onnx, config.json and the tokenizer files, no modules.json or pooling modules (its users pass
the pooling to the pipeline).

vits: SRC's onnx/model.onnx, config.json and tokenizer_config.json, and a tokenizer.json in the form of
transformers.js's converted VITS folders in place of vocab.json: transformers' VitsTokenizer written as
normalizers (lower case when `normalize`, Romanian's cedilla, characters outside the vocabulary dropped,
white space stripped, the pad token put before, between and after the characters when `add_blank`), the
pad token and every other character a piece of its own, and a model that is the vocabulary alone (no
`type`: tokenizers.js reads it as its legacy model). Multi-character vocabulary entries other than the
special tokens, or in upper case where the tokenizer lower-cases, are refused: transformers keeps them as
written, which these normalizers cannot.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
from pathlib import Path


def vits_tokenizer_json(vocab: dict[str, int], config: dict) -> dict:
    """tokenizer.json of a VitsTokenizer (vocab.json and tokenizer_config.json) for tokenizers.js."""
    pad = config.get("pad_token", "<pad>")
    pad = pad["content"] if isinstance(pad, dict) else pad
    special = sorted(t for t in vocab if t.startswith("<") and t.endswith(">"))
    long = [t for t in vocab if len(t) != 1 and t not in special]
    upper = [t for t in vocab if config.get("normalize", True) and t not in special and t != t.lower()]
    if long or upper:  # transformers keeps such entries as written; these normalizers cannot
        raise ValueError(f"vocabulary entries of several characters or upper case: {(long + upper)[:5]}")
    steps: list[dict] = []
    if config.get("normalize", True):
        steps.append({"type": "Lowercase"})
    if config.get("language") == "ron":
        steps.append({"type": "Replace", "pattern": {"String": "ț"}, "content": "ţ"})
    characters = "".join(sorted(t for t in vocab if len(t) == 1))
    steps.append({"type": "Replace", "pattern": {"Regex": f"[^{re.escape(characters)}]"}, "content": ""})
    steps.append({"type": "Strip", "strip_left": True, "strip_right": True})
    if config.get("add_blank", True):
        # an empty match before each character and one at the end of a text that is not empty
        steps.append({"type": "Replace", "pattern": {"Regex": "(?=.)|(?<!^)$"}, "content": pad})
    added = [{"id": vocab[t], "content": t, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": True} for t in special]
    return {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
        "normalizer": {"type": "Sequence", "normalizers": steps},
        "pre_tokenizer": {"type": "Split", "pattern": {"Regex": f"{re.escape(pad)}|."},
                          "behavior": "Isolated", "invert": False},
        "post_processor": None, "decoder": None,
        "model": {"vocab": vocab},
    }


def vits(src: Path, out: Path, keep_vocab: bool = False) -> Path:
    """SRC (transformers' VITS folder with optimum's onnx/model.onnx) in transformers.js's layout at OUT;
    `keep_vocab` keeps vocab.json beside it (for a hand-written loop that tokenizes from it)."""
    (out / "onnx").mkdir(parents=True, exist_ok=True)
    shutil.copy2(src / "onnx" / "model.onnx", out / "onnx" / "model.onnx")
    for name in ("config.json", "tokenizer_config.json", "special_tokens_map.json",
                 *(["vocab.json"] if keep_vocab else [])):
        if (src / name).is_file():
            shutil.copy2(src / name, out / name)
    vocab = json.loads((src / "vocab.json").read_text(encoding="utf-8"))
    config = json.loads((src / "tokenizer_config.json").read_text(encoding="utf-8"))
    tokenizer = vits_tokenizer_json(vocab, config)
    (out / "tokenizer.json").write_text(json.dumps(tokenizer, ensure_ascii=False, indent=1), encoding="utf-8")
    return out


def feature_extraction(src: Path, out: Path) -> Path:
    """SRC (a sentence-transformers folder with optimum's onnx/model.onnx) without its modules, at OUT."""
    (out / "onnx").mkdir(parents=True, exist_ok=True)
    shutil.copy2(src / "onnx" / "model.onnx", out / "onnx" / "model.onnx")
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (src / name).is_file():
            shutil.copy2(src / name, out / name)
    return out


LAYOUTS = {"vits": vits, "feature-extraction": feature_extraction}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m build.tjs_layout", description=__doc__.splitlines()[0])
    parser.add_argument("kind", choices=sorted(LAYOUTS))
    parser.add_argument("src", type=Path)
    parser.add_argument("out", type=Path)
    args = parser.parse_args(argv)
    print(LAYOUTS[args.kind](args.src, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
