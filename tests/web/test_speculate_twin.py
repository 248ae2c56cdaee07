"""The JS twin of the core's drafting (web/speculate.js: NgramIndex, DraftLength) against the core's
own (py/ortpipe/loops/speculative.py), under node: the same drafts and the same draft lengths for the
same text, rounds and measured costs."""

from __future__ import annotations

import json
import random
import shutil
import subprocess
from pathlib import Path

from build import web

from ortpipe.loops.speculative import DraftLength, NgramIndex

# Runs under node: argv[2] is a JSON file {proposals, rounds}; prints what the twin answers.
SCRIPT = """
import { readFileSync } from 'node:fs';
import { NgramIndex, DraftLength } from './speculate.js';
const { proposals, lengths } = JSON.parse(readFileSync(process.argv[2], 'utf8'));
const drafts = proposals.map(({ size, text, asks }) => {
  const index = new NgramIndex(size);
  return asks.map(([end, k]) => [index.propose(text.slice(0, end), k), index.matched]);
});
const chosen = lengths.map(({ most, state, events }) => {
  const length = new DraftLength(most, state);
  return events.map(([kind, a, b]) => {
    if (kind === 'next') return length.next(a);
    if (kind === 'fit') return length.fit(a, b);
    if (kind === 'update') length.update(a, b);
    else if (kind === 'shadow') length.shadow(a, b);
    else if (kind === 'timed') length.timed(a, b);
    else length.drafted(a, b);
    return null;
  }).concat([length.state()]);
});
console.log(JSON.stringify({ drafts, chosen }));
"""


def run_twin(tmp_path: Path, job: dict) -> dict:
    node = shutil.which("node")
    assert node, "node is missing: run tests/web/setup.sh (it installs Debian's nodejs)"
    work = tmp_path / "node"
    work.mkdir()
    for name in ("speculate.js", "bridge.js", "sampling.js"):
        shutil.copy2(web.WEB / name, work / name)
    (work / "package.json").write_text('{"type": "module"}')
    (work / "twin.js").write_text(SCRIPT)
    (work / "input.json").write_text(json.dumps(job))
    done = subprocess.run([node, "twin.js", "input.json"], cwd=work, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_the_js_drafter_and_draft_length_are_the_cores(tmp_path: Path) -> None:
    rng = random.Random(0)
    proposals, expected_drafts = [], []
    for size in (1, 2, 3, 5):
        loop = [rng.randrange(8) for _ in range(rng.randrange(2, 9))]
        text = [rng.randrange(8) for _ in range(30)] + loop * 6 + [rng.randrange(8) for _ in range(30)]
        asks = sorted((rng.randrange(2, len(text)), rng.randrange(1, 9)) for _ in range(40))
        index = NgramIndex(size)
        expected_drafts.append([[index.propose(text[:end], k), index.matched] for end, k in asks])
        proposals.append({"size": size, "text": text, "asks": asks})
    assert sum(bool(d) for ds in expected_drafts for d, _ in ds) > 100, "most asks find a draft"
    lengths, expected_lengths = [], []
    for most, sources in ((1, 1), (4, 2), (8, 1), (16, 3), (6, 3)):
        length = DraftLength(most, model=most == 8, sources=sources)
        length.overhead = 0.5 if most == 6 else 0.0
        job = {"most": most, "state": length.state(), "events": []}
        answers = []
        for _ in range(300):
            kind = rng.choice(["next", "next", "fit", "update", "shadow", "shadow", "timed", "drafted"])
            if kind == "next":
                event = ["next", rng.randrange(0, 20), 0]
                answers.append(length.next(event[1]))
            elif kind == "fit":
                event = ["fit", rng.randrange(sources), rng.randrange(0, most + 1)]
                answers.append(length.fit(*event[1:]))
            elif kind == "shadow":
                event = ["shadow", rng.randrange(sources), rng.random() < 0.6]
                length.shadow(*event[1:])
                answers.append(None)
            elif kind == "update":
                drafted = rng.randrange(1, 9)
                event = ["update", drafted, rng.choice([drafted, rng.randrange(drafted + 1)])]
                length.update(*event[1:])
                answers.append(None)
            else:
                # a browser's coarse clock can read 0 for a fast run: no ratio comes of it
                event = [kind, rng.randrange(1, 6), rng.choice([0.0, rng.uniform(0.001, 0.01)])]
                getattr(length, kind)(*event[1:])
                answers.append(None)
            job["events"].append(event)
        expected_lengths.append([*answers, length.state()])
        lengths.append(job)
    assert {a for answers in expected_lengths for a in answers[:-1] if a is not None} >= {0, 1, 2}
    got = run_twin(tmp_path, {"proposals": proposals, "lengths": lengths})
    assert got["drafts"] == expected_drafts
    for ours, theirs in zip(got["chosen"], expected_lengths, strict=True):
        assert ours[:-1] == theirs[:-1]
        assert ours[-1] == json.loads(json.dumps(theirs[-1]))  # the state the core takes back
