"""The JS twin of the core's TextStream (web/bridge.js) against the core's own, under node.

The browser streams text with the twin (JsTokenizer.text_stream), over tokenizers.js; CPython
streams it with ortpipe.tokenizer.TextStream over the Rust tokenizers. Fed the same ids, every
token's delta and the final flush must be the same: byte-level and SentencePiece-style tokenizers
too small to hold most characters whole, and random ids that leave characters unfinished.
"""

from __future__ import annotations

import json
import random
import shutil
import subprocess
from pathlib import Path

import pytest
from build import web
from tests.test_streaming import TEXT, byte_level_bpe
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from ortpipe.targets.cpython.text import HFTokenizer
from ortpipe.tokenizer import TextStream

# Runs under node: argv[2] is a JSON file {tokenizer, sequences}; prints each sequence's deltas (its
# first half pushed one id a call, the rest in one pushMany) and the flush.
SCRIPT = """
import { readFileSync } from 'node:fs';
import { Tokenizer } from '@huggingface/tokenizers';
import { TextStream } from './bridge.js';
const { tokenizer, window, context, sequences } = JSON.parse(readFileSync(process.argv[2], 'utf8'));
const tok = new Tokenizer(JSON.parse(tokenizer), {});
const out = sequences.map((ids) => {
  const stream = new TextStream(tok, window, context);
  const half = ids.length >> 1;
  const deltas = ids.slice(0, half).map((id) => stream.push(id));
  deltas.push(...JSON.parse(stream.pushMany(...ids.slice(half))));
  return { deltas, flush: stream.flush() };
});
console.log(JSON.stringify(out));
"""


def byte_level(folder: Path) -> Path:
    return byte_level_bpe(folder / "byte_level.json")


def metaspace(folder: Path) -> Path:
    tok = Tokenizer(models.BPE(byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Sequence([decoders.Metaspace(), decoders.ByteFallback(), decoders.Fuse()])
    trainer = trainers.BpeTrainer(vocab_size=300, show_progress=False, special_tokens=["</s>"],
                                  initial_alphabet=[f"<0x{b:02X}>" for b in range(256)])
    tok.train_from_iterator(["the café and the straße and the naïve word " * 20], trainer=trainer)
    tok.save(str(folder / "metaspace.json"))
    return folder / "metaspace.json"


def twin_deltas(tmp_path: Path, tokenizer: Path, sequences: list[list[int]]) -> list[dict]:
    node = shutil.which("node")
    assert node, "node is missing: run tests/web/setup.sh (it installs Debian's nodejs)"
    work = tmp_path / "node"
    work.mkdir(exist_ok=True)
    for name in ("bridge.js", "sampling.js"):
        shutil.copy2(web.WEB / name, work / name)
    (work / "package.json").write_text('{"type": "module"}')  # .js files are ES modules
    (work / "twin.mjs").write_text(SCRIPT)
    (work / "node_modules").symlink_to(web.NODE_MODULES)
    (work / "input.json").write_text(json.dumps({
        "tokenizer": tokenizer.read_text(), "window": TextStream.WINDOW, "context": TextStream.CONTEXT,
        "sequences": sequences}))
    done = subprocess.run([node, "twin.mjs", "input.json"], cwd=work, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.mark.parametrize("make", [byte_level, metaspace])
def test_the_js_text_stream_gives_the_deltas_of_the_core(tmp_path: Path, make) -> None:  # noqa: ANN001
    path = make(tmp_path)
    tokenizer = HFTokenizer.from_file(path)
    vocab = Tokenizer.from_file(str(path)).get_vocab_size()
    rng = random.Random(0)
    sequences = [tokenizer.encode(" ".join([TEXT] * 3)), tokenizer.encode(TEXT)[::-1]]
    sequences += [[rng.randrange(vocab) for _ in range(rng.randrange(1, 80))] for _ in range(30)]
    assert len(sequences[0]) > 3 * TextStream.WINDOW  # the window restarts several times
    expected = []
    for ids in sequences:
        stream = TextStream(tokenizer)
        expected.append({"deltas": stream.push_many(ids), "flush": stream.flush()})
    got = twin_deltas(tmp_path, path, sequences)
    assert "".join(expected[0]["deltas"]) + expected[0]["flush"] == tokenizer.decode(sequences[0])
    assert sum(d == "" for e in expected for d in e["deltas"]) > 20  # unfinished characters held back
    for i, (ours, theirs) in enumerate(zip(got, expected, strict=True)):
        assert ours == theirs, f"sequence {i}: {sequences[i]}"
