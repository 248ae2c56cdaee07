"""Runs inside a flavour's virtualenv (build/flavours.py) for tests/test_openvino.py and tests/test_qnn.py:
one request as JSON on stdin, one answer as JSON in the file named by the first argument (native libraries
print to stdout). Only ortpipe, numpy and the standard library.

    {"installed": true}                                         -> providers and onnxruntime's version
    {"open": PATH, "session": {SessionSpec fields}, "override": [..] or null}
                                                                -> the Assignment, or the ConfigError
    {"generate": FOLDER, "prompt_ids": [..], "inputs": NPZ or null, "new": N,
     "provider": load()'s provider or null, "profile": NAME or null}
                                                                -> the tokens and each session's Assignment
                                                                   (ortpipe.load, Pipeline.generate)
Every answer carries the warnings raised while it was made.
"""

from __future__ import annotations

import json
import sys
import warnings
from typing import Any

import numpy as np
import onnxruntime as ort

import ortpipe
from ortpipe.config.schema import SessionSpec
from ortpipe.errors import ConfigError
from ortpipe.targets.cpython import providers


def installed() -> dict[str, Any]:
    devices = getattr(ort.capi._pybind_state, "get_available_openvino_device_ids", lambda: [])()
    return {"installed": providers.installed(), "onnxruntime": ort.__version__, "openvino_devices": devices}


def open_session(path: str, session: dict[str, Any], override: list[str] | None) -> dict[str, Any]:
    spec = SessionSpec(**{**session, "providers": tuple(session["providers"])})
    opened, assignment = providers.open_session(path, spec, override)
    return {**assignment.as_dict(), "describe": assignment.describe(),
            "session_providers": opened.get_providers()}


def generate(request: dict[str, Any]) -> dict[str, Any]:
    feeds = dict(np.load(request["inputs"])) if request.get("inputs") else {}
    pipe = ortpipe.load(request["generate"], threads=1, provider=request.get("provider"),
                        profile=request.get("profile"))
    result = pipe.generate(prompt_ids=request["prompt_ids"], max_new_tokens=request["new"], inputs=feeds)
    return {"tokens": result.tokens, "assignments": {n: a.as_dict() for n, a in pipe.assignments.items()}}


def answer(request: dict[str, Any]) -> dict[str, Any]:
    if "open" in request:
        return open_session(request["open"], request["session"], request.get("override"))
    if "generate" in request:
        return generate(request)
    return installed()


def main() -> None:
    request = json.load(sys.stdin)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            out = answer(request)
        except ConfigError as e:
            out = {"error": str(e)}
    out["warnings"] = [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
    with open(sys.argv[1], "w", encoding="utf-8") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main()
