"""The built-in demo model for `make demo`: a bigram language model over Python source.

A placeholder until the trained demo model lands: a byte-level BPE tokenizer and bigram counts,
both from the Python standard library's own sources (available offline), written as an ONNX
graph (`logits = log P(next | current)`) with a v2 genai_config.json. It needs only `onnx`,
`numpy` and `tokenizers`.
"""

from __future__ import annotations

import argparse
import json
import sysconfig
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

VOCAB_SIZE = 2048
SPECIALS = ["<pad>", "<s>", "</s>"]
SOURCES = ("textwrap.py", "string.py", "functools.py", "pathlib/__init__.py", "argparse.py", "csv.py",
           "json/__init__.py", "json/decoder.py", "dataclasses.py", "fractions.py", "heapq.py", "bisect.py")


def corpus() -> list[str]:
    """A fixed list of standard-library sources: the same text on every machine with the same Python."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return [(stdlib / name).read_text(encoding="utf-8") for name in SOURCES if (stdlib / name).is_file()]


def train_tokenizer(texts: list[str], vocab_size: int = VOCAB_SIZE) -> "Tokenizer":  # noqa: F821
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def bigram_logits(ids: list[list[int]], vocab: int) -> np.ndarray:
    counts = np.ones((vocab, vocab), dtype=np.float64) * 0.01  # smoothing: every pair stays possible
    for seq in ids:
        a = np.asarray(seq[:-1])
        b = np.asarray(seq[1:])
        np.add.at(counts, (a, b), 1.0)
    return np.log(counts / counts.sum(axis=1, keepdims=True)).astype(np.float32)


def bigram_graph(table: np.ndarray) -> onnx.ModelProto:
    vocab = table.shape[0]
    graph = helper.make_graph(
        [helper.make_node("Gather", ["table", "input_ids"], ["logits"])],
        "bigram",
        [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "sequence"])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", "sequence", vocab])],
        [numpy_helper.from_array(table, "table")])
    model = helper.make_model(graph, producer_name="ortpipe-demo", opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def build(out: Path) -> Path:
    if (out / "genai_config.json").is_file():
        return out
    out.mkdir(parents=True, exist_ok=True)
    texts = corpus()
    tok = train_tokenizer(texts)
    vocab = tok.get_vocab_size()
    table = bigram_logits([tok.encode(t).ids for t in texts], vocab)
    onnx.save(bigram_graph(table), str(out / "model.onnx"))
    tok.save(str(out / "tokenizer.json"))
    eos = tok.token_to_id("</s>")
    config = {
        "version": 2,
        "pipeline": {"extends": "autoregressive-decoder", "sessions": {"decoder": {"file": "model.onnx"}}},
        "tokens": {"eos": [eos], "bos": tok.token_to_id("<s>"), "pad": tok.token_to_id("<pad>")},
        "generation": {"max_length": 512},
        "metadata": {"model_type": "bigram", "source": "build/demo_model.py", "vocab_size": vocab},
    }
    (out / "genai_config.json").write_text(json.dumps(config, indent=2) + "\n")  # written last: marks done
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("build/cache/demo"))
    print(f"demo model: {build(parser.parse_args().out)}")


if __name__ == "__main__":
    main()
