"""A Config written back as a plain v2 mapping: what `ortpipe inspect` shows as the expanded config."""

from __future__ import annotations

import dataclasses
from typing import Any

from .schema import Config, FlowStep, OutputSpec, SessionSpec, Wire
from .settings import SETTINGS


def as_v2(config: Config) -> dict[str, Any]:
    p = config.pipeline
    if p.stages:
        return _staged(config)
    pipeline: dict[str, Any] = {
        "sessions": {name: _session(s) for name, s in p.sessions.items()},
        "flow": [_step(s) for s in p.flow],
        "dataflow": [_wire(w) for w in p.dataflow],
        "state": _clean(dataclasses.asdict(p.state)),
    }
    if p.extends:
        pipeline = {"extends": p.extends, **pipeline}
    for key in ("preprocessing", "plugin"):
        if getattr(p, key):
            pipeline[key] = getattr(p, key)
    if p.outputs:
        pipeline["output"] = [_output(o) for o in p.outputs]
    return {
        "version": 2,
        "pipeline": pipeline,
        "tokens": _tokens(config.tokens),
        "generation": _generation(config),
        "metadata": config.metadata,
    }


def _staged(config: Config) -> dict[str, Any]:
    """pipeline.stages: each stage's flow, state, generation and tokens; every wire and output once."""
    p = config.pipeline
    stages = {}
    for stage in p.stages:
        own = as_v2(stage.config)
        stages[stage.name] = {"flow": own["pipeline"]["flow"], "state": own["pipeline"]["state"],
                              "generation": own["generation"], "tokens": own["tokens"]}
    pipeline: dict[str, Any] = {
        "sessions": {name: _session(s) for name, s in p.sessions.items()},
        "stages": stages,
        "dataflow": [_wire(w) for w in p.dataflow],
    }
    if p.preprocessing:
        pipeline["preprocessing"] = p.preprocessing
    if p.outputs:
        pipeline["output"] = [_output(o) for o in p.outputs]
    return {"version": 2, "pipeline": pipeline, "metadata": config.metadata}


def _wire(w: Wire) -> dict[str, Any]:
    source: Any = list(w.sources) if w.joined else w.source
    if w.groups:  # runs of sources: a list per run of several, a name per run of one, zeros as written
        starts = [sum(w.groups[:i]) for i in range(len(w.groups))]
        runs = [list(w.sources[a : a + n]) for a, n in zip(starts, w.groups, strict=True)]
        rows = w.zeros or (0,) * len(runs)
        source = [{"zeros": n} if n else run if len(run) > 1 else run[0]
                  for run, n in zip(runs, rows, strict=True)]
    out: dict[str, Any] = {"from": source, "to": f"{w.to_session}.{w.to_input}"}
    if w.stream:
        out["stream"] = True
    return out


def _generation(config: Config) -> dict[str, Any]:
    gen = config.generation
    out: dict[str, Any] = {"loop": gen.loop}
    for s in SETTINGS:
        value = gen.max_length if s.name == "max_length" else getattr(gen.settings, s.name, None)
        if s.v2 is None or value is None or gen.loop not in s.loops:
            continue
        if gen.codebooks is not None and s.name != "max_length":
            continue  # the codebook loop reads no other setting
        head, _, key = s.v2.rpartition(".")
        (out.setdefault(head, {}) if head else out)[key] = list(value) if isinstance(value, tuple) else value
    if gen.scheduler is not None:
        out["scheduler"] = gen.scheduler
    if gen.codebooks is not None:
        books = gen.codebooks
        out["codebooks"] = {"count": books.count, "delay": list(books.delay),
                            "guidance_scale": books.guidance_scale}
    return out


def _output(o: OutputSpec) -> dict[str, Any]:
    out: dict[str, Any] = {"session": o.session, "name": o.name, "as": o.kind}
    if o.sampling_rate is not None:
        out["sampling_rate"] = o.sampling_rate
    if o.kind == "embedding":
        out.update(pooling=o.pooling, normalize=o.normalize)
    return out


def _session(s: SessionSpec) -> dict[str, Any]:
    out: dict[str, Any] = {"file": s.file, "execution_provider": list(s.providers)}
    for key in ("provider_options", "session_options", "inputs", "outputs", "dtype"):
        if getattr(s, key):
            out[key] = getattr(s, key)
    if s.optional:
        out["optional"] = True
    if s.tokenizer is not None:
        out["tokenizer"] = s.tokenizer
    if s.max_length is not None:
        out["max_length"] = s.max_length
    return out


def _step(s: FlowStep) -> dict[str, Any]:
    defaults = FlowStep(run=s.run, when=s.when)
    out = {"run": s.run, "when": s.when}
    for f in dataclasses.fields(s):
        value = getattr(s, f.name)
        if f.name not in out and value != getattr(defaults, f.name):
            value = list(value) if isinstance(value, tuple) else value
            out[f.name] = dataclasses.asdict(value) if dataclasses.is_dataclass(value) else value
    return out


def _tokens(tokens: Any) -> dict[str, Any]:
    """tokens as written: the decoder's first ids as decoder_start (one id, or the list)."""
    out = _clean(dataclasses.asdict(tokens))
    prompt = out.pop("decoder_prompt")
    if prompt:
        out["decoder_start"] = prompt if len(prompt) > 1 else prompt[0]
    for key in ("languages", "tasks"):
        if out.get(key):
            out[key] = dict(out[key])
        else:
            out.pop(key, None)
    return out


def _clean(value: Any) -> Any:
    """Drop None fields and turn tuples into lists, recursively."""
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items() if v is not None}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value
