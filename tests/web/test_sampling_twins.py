"""The browser's token selection for fused decode steps (web/sampling.js) against CPython's
(targets/cpython/sampling.py), under node: fed the same rows of logits and picks, they select the
same tokens. Both are checked against the sampler's kernel graphs in tests/test_fused_sampling.py."""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
from pathlib import Path

import numpy as np
from build import web

from ortpipe.sampling.sampler import Pick
from ortpipe.targets.cpython.sampling import Picker

# Runs under node: argv[2] is a JSON file [{rows, half, pick}]; prints each case's tokens.
SCRIPT = """
import { readFileSync } from 'node:fs';
import { Picker } from './sampling.js';
const cases = JSON.parse(readFileSync(process.argv[2], 'utf8'));
console.log(JSON.stringify(cases.map(({ rows, half, vocab, pick }) => {
  const picker = new Picker(pick, vocab);
  return rows.map((row) => picker.select(half ? Uint16Array.from(row) : Float32Array.from(row), 0));
})));
"""


def cases() -> list[tuple[np.ndarray, Pick]]:
    """Rows of logits (several steps of one burst) and how to select from them: every stage alone
    and together, ties, float16 rows, large and small vocabularies."""
    rng = np.random.default_rng(0)
    out = []
    for i in range(48):
        vocab = (8, 100, 8192)[i % 3]
        rows = (rng.standard_normal((6, vocab)) * rng.choice([0.5, 3.0])).astype(np.float32)
        if i % 4 == 0:
            rows = np.round(rows)  # many ties
        if i % 5 == 0:
            rows = rows.astype(np.float16)
        sample = i % 6 != 5
        pick = Pick(
            sample=sample,
            temperature=float(rng.choice([0.3, 0.7, 1.0, 1.7])) if sample else 1.0,
            top_k=int(rng.choice([0, 1, 5, 40, vocab])),
            top_p=float(rng.choice([1.0, 0.95, 0.5, 0.05])),
            min_p=float(rng.choice([0.0, 0.0, 0.1])),
            penalty=float(rng.choice([1.0, 1.3, 0.8])),
            seen=tuple(sorted(set(rng.integers(0, vocab, 10).tolist()))),
            banned=tuple(rng.integers(0, vocab, int(rng.integers(0, 3))).tolist()),
            uniforms=tuple(1.0 - rng.random(6)),
        )
        if pick.penalty == 1.0:
            pick = dataclasses.replace(pick, seen=())
        out.append((rows, pick))
    return out


def test_the_js_picker_selects_the_tokens_of_cpythons(tmp_path: Path) -> None:
    expected, inputs = [], []
    for rows, pick in cases():
        picker = Picker(pick, rows.shape[1])
        expected.append([picker.select(row, "decoder", 0) for row in rows])
        half = rows.dtype == np.float16
        inputs.append({"rows": (rows.view(np.uint16) if half else rows).tolist(), "half": bool(half),
                       "vocab": rows.shape[1], "pick": dataclasses.asdict(pick)})
    work = tmp_path / "node"
    work.mkdir()
    shutil.copy2(web.WEB / "sampling.js", work / "sampling.js")
    (work / "package.json").write_text('{"type": "module"}')
    (work / "twin.mjs").write_text(SCRIPT)
    (work / "input.json").write_text(json.dumps(inputs))
    done = subprocess.run([shutil.which("node") or "node", "twin.mjs", "input.json"], cwd=work,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout)
    assert len({t for tokens in expected for t in tokens}) > 100  # the cases select many tokens
    for i, (ours, theirs) in enumerate(zip(got, expected, strict=True)):
        assert ours == theirs, f"case {i}: {cases()[i][1]}"
