"""What the tests of the diffusers folders (test_sdxl.py, test_sd3.py) share: the cases a folder's
references hold, a copy a test may change, a scheduler or a genai_config.json written into it."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np

import ortpipe
from ortpipe.loops.denoising import Noise
from ortpipe.loops.schedulers import make_schedule


def cases(folder: Path) -> dict[str, dict]:
    """The folder's references/cases.json, by case name."""
    index = json.loads((folder / "references" / "cases.json").read_text())
    return {case["name"]: case for case in index["cases"]}


def copy(folder: Path, out: Path) -> Path:
    """The folder without its references."""
    return Path(shutil.copytree(folder, out, ignore=shutil.ignore_patterns("references")))


def scheduled(folder: Path, case: dict) -> Path:
    """The folder with the case's scheduler as its scheduler/scheduler_config.json."""
    (folder / "scheduler" / "scheduler_config.json").write_text(json.dumps(case["scheduler"]))
    return folder


def with_v2(folder: Path, edit: Callable[[dict], object]) -> Path:
    """A genai_config.json written from what detection makes of the folder, changed by `edit`."""
    from ortpipe.detect import detect_config
    from ortpipe.folder import LocalFolder

    config = detect_config(LocalFolder(folder))
    edit(config)
    (folder / "genai_config.json").write_text(json.dumps(config))
    return folder


def expanded_config_makes_the_same_image(folder: Path, **request: object) -> None:
    """`ortpipe inspect`'s v2 config of the detected folder, written as genai_config.json, is the same
    pipeline and makes the same image."""
    from ortpipe.config.expand import as_v2

    detected = ortpipe.load(folder, threads=1)
    before = detected.generate("a cube", num_steps=2, seed=3, **request).image
    (folder / "genai_config.json").write_text(json.dumps(as_v2(detected.config)))
    written = ortpipe.load(folder, threads=1)
    assert written.config.source == "v2" and detected.config.source == "detected"
    assert written.config.pipeline == detected.config.pipeline
    assert np.array_equal(written.generate("a cube", num_steps=2, seed=3, **request).image, before)


def ortpipe_noise(pipe: ortpipe.Pipeline, case: dict, seed: int, latents: bool) -> tuple:
    """The initial latents (when not given) and the per-step noise ortpipe draws from `seed`, as the plain
    loop takes them: noise[k], the k-th a step draws."""
    schedule = make_schedule(pipe.model.loop.denoising.scheduler, case["num_inference_steps"],
                             eta=case.get("eta", 0.0))
    noise = Noise(pipe.model.backend, seed)
    first = None if latents else pipe.run(noise.draw((1, 4, 8, 8)))
    steps = [pipe.run(noise.draw((1, 4, 8, 8))) for step in schedule.steps if step.noise]
    return first, np.array(steps, np.float32).reshape(len(steps), 1, 4, 8, 8)
