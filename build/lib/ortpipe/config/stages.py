"""pipeline.stages: a multi-stage pipeline (vLLM-Omni's thinker -> talker -> code2wav, seed 002).

Each stage is a pipeline of its own (its flow, state, generation loop and tokens) over some of the
sessions declared in pipeline.sessions; stages run in the order written. `pipeline.dataflow` holds every
wire: one between two sessions of a stage belongs to that stage, one from an earlier stage's session feeds
a later stage (the later stage's "stage inputs"). A wire's source in an earlier stage is an output of an
init or final step, an output its step accumulates (flow[].accumulate), or "SESSION.tokens": the ids the
stage generated. Each stage is validated as a config of its own; its problems are named by its path.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ..errors import ConfigError, Problems, did_you_mean, one_of
from ..folder import Folder
from ..jsonfile import quote
from .schema import TOKENS_OUTPUT, Config, PipelineSpec, Stage, Wire

STAGE_KEYS = ("flow", "state", "generation", "tokens")
PER_STAGE = ("flow", "state", "extends", "plugin")  # pipeline keys a staged config gives per stage, or not
MAX_STAGES = 8


def parse_stages(top: Any, pipe_raw: dict[str, Any], folder: Folder, source: str,
                 notes: tuple[str, ...]) -> Config:
    """The Config of a staged pipeline: every session, wire and output, and each stage's own Config."""
    from .parse import Section, _dataflow, _metadata, _outputs, _sessions

    problems = top.problems
    for key in ("tokens", "generation"):
        if key in top.raw:
            problems.add(f"config.{key}: with pipeline.stages each stage has its own {key}: move it to "
                         f"pipeline.stages.NAME.{key}")
    top.allow("version", "pipeline", "metadata", "tokens", "generation")
    sec = Section(pipe_raw, "pipeline", problems, nulls=False)
    for key in PER_STAGE:
        if key in sec.raw:
            problems.add(f"pipeline.{key}: with pipeline.stages each stage has its own flow and state (and "
                         "no preset or plugin): move it into pipeline.stages.NAME, or drop it")
    sec.allow("sessions", "stages", "dataflow", "output", "preprocessing", *PER_STAGE)
    sessions = _sessions(sec.sub("sessions"), folder, problems)
    raw_stages = sec.get("stages", dict, {})
    if not raw_stages or len(raw_stages) > MAX_STAGES:
        problems.add(f"pipeline.stages must name 1 to {MAX_STAGES} stages, found {len(raw_stages)}: "
                     '{"thinker": {"flow": [...], "generation": {...}}, "talker": {...}}')
    owner = _owners(raw_stages, sessions, problems)
    wires = _dataflow(sec.get("dataflow", list, []), sessions, problems)
    outputs = _outputs(sec, sessions, problems)
    order = list(raw_stages)
    _check_stage_wires(wires, owner, order, raw_stages, problems)
    stages = []
    for i, name in enumerate(order):
        raw = _stage_raw(name, raw_stages[name], pipe_raw, owner, wires, i == 0, problems)
        if raw is None:
            continue
        config = _stage_config(name, raw, folder, problems)
        if config is not None:
            between = [w for w in wires if owner.get(w.from_session) != owner.get(w.to_session)]
            inputs = tuple(w for w in between if owner.get(w.to_session) == name)
            exported = tuple(dict.fromkeys(w.source for w in between if owner.get(w.from_session) == name))
            pipeline = dataclasses.replace(config.pipeline, stage_inputs=inputs, exported=exported)
            stages.append(Stage(name, dataclasses.replace(config, pipeline=pipeline)))
    problems.raise_if_any()
    _check_sources(stages, owner, wires, problems)
    problems.raise_if_any()
    first = stages[0].config
    pipeline = PipelineSpec(sessions=sessions, flow=(), dataflow=wires, outputs=outputs, stages=tuple(stages),
                            preprocessing=first.pipeline.preprocessing)
    return Config(pipeline=pipeline, tokens=first.tokens, generation=first.generation,
                  metadata=_metadata(top.sub("metadata")), source=source, notes=notes)


def _owners(raw_stages: dict[str, Any], sessions: dict[str, Any], problems: Problems) -> dict[str, str]:
    """Session -> the stage whose flow runs it; each session runs in one stage."""
    owner: dict[str, str] = {}
    for name, raw in raw_stages.items():
        if not name or "." in name or not isinstance(raw, dict):
            problems.add(f"pipeline.stages.{name} must be an object under a name without dots, found "
                         f"{quote(raw)}")
            continue
        flow = raw.get("flow")
        for step in flow if isinstance(flow, list) else []:
            run = step.get("run") if isinstance(step, dict) else None
            if not isinstance(run, str):
                continue
            if run in owner and owner[run] != name:
                problems.add(f'session "{run}" runs in stages "{owner[run]}" and "{name}": a session belongs '
                             "to one stage (declare a second session for the same file)")
            owner.setdefault(run, name)
    unused = [s for s in sessions if s not in owner]
    if unused and raw_stages:
        problems.add(f"pipeline.sessions declares {one_of(unused)}, which no stage's flow runs: run it in a "
                     "stage or drop it")
    return owner


def _check_stage_wires(wires: tuple[Wire, ...], owner: dict[str, str], order: list[str],
                       raw_stages: dict[str, Any], problems: Problems) -> None:
    """A wire between stages goes forward; a streamed one joins two autoregressive stages' step sessions."""
    _check_stage_graph(wires, owner, problems)
    for w in wires:
        a, b = owner.get(w.from_session), owner.get(w.to_session)
        if a is None or b is None:
            continue
        if a == b:
            if w.stream:
                problems.add(f'pipeline.dataflow: the wire {w} joins two sessions of stage "{a}"; "stream" '
                             "is for wires between stages: drop it")
            continue
        if order.index(a) > order.index(b):
            problems.add(f'pipeline.dataflow: the wire {w} feeds stage "{b}" from stage "{a}", which runs '
                         f"after it (stages run in the order of pipeline.stages: {one_of(order)}); reorder "
                         "the stages")
        if w.stream:  # rows of a step output, fed to step runs of a stage that starts on the first rows
            for stage, session in ((a, w.from_session), (b, w.to_session)):
                raw = raw_stages[stage]
                if _loop(raw) != "autoregressive" or _when(raw, session) != "step":
                    problems.add(f'pipeline.dataflow: the wire {w} streams rows, which joins the "step" '
                                 f'sessions of two autoregressive stages; "{session}" of stage "{stage}" is '
                                 'not one: drop "stream"')


def _check_stage_graph(wires: tuple[Wire, ...], owner: dict[str, str], problems: Problems) -> None:
    """One wire per input; no cycle between stages."""
    from .parse import find_cycle

    targets = [f"{w.to_session}.{w.to_input}" for w in wires]
    for target in sorted({t for t in targets if targets.count(t) > 1}):
        problems.add(f"pipeline.dataflow: {target} is fed by two wires: keep one")
    edges: dict[str, set[str]] = {}
    for w in wires:
        a, b = owner.get(w.from_session), owner.get(w.to_session)
        if a and b and a != b:
            edges.setdefault(a, set()).add(b)
    cycle = find_cycle(edges)
    if cycle:
        problems.add(f"Circular dependency between stages: {' → '.join(cycle)}. A stage reads only what "
                     "earlier stages made: remove one of these wires")


def _loop(raw: dict[str, Any]) -> str:
    generation = raw.get("generation")
    return generation.get("loop", "autoregressive") if isinstance(generation, dict) else "autoregressive"


def _when(raw: dict[str, Any], session: str) -> str | None:
    from .schema import WHEN_ALIASES

    for step in raw.get("flow") or []:
        if isinstance(step, dict) and step.get("run") == session:
            when = step.get("when", "step")
            return WHEN_ALIASES.get(when, when)
    return None


def _stage_raw(name: str, raw: Any, pipe_raw: dict[str, Any], owner: dict[str, str], wires: tuple[Wire, ...],
               first: bool, problems: Problems) -> dict[str, Any] | None:
    """The stage as a config of its own: its sessions, flow, state, its own wires and outputs."""
    if not isinstance(raw, dict):
        return None
    unknown = [k for k in raw if k not in STAGE_KEYS]
    for key in unknown:
        problems.add(f'Unknown key "{quote(key)[1:-1]}" in pipeline.stages.{name}.'
                     f"{did_you_mean(key, STAGE_KEYS)} Allowed keys: {one_of(STAGE_KEYS)}")
    sessions = pipe_raw.get("sessions") if isinstance(pipe_raw.get("sessions"), dict) else {}
    mine = {s: spec for s, spec in sessions.items() if owner.get(s) == name}
    own_wires = [{"from": f"{w.from_session}.{w.from_output}", "to": f"{w.to_session}.{w.to_input}"}
                 for w in wires if owner.get(w.from_session) == name and owner.get(w.to_session) == name]
    raw_outputs = pipe_raw.get("output")
    listed = raw_outputs if isinstance(raw_outputs, list) else [raw_outputs] if raw_outputs else []
    outputs = [o for o in listed if isinstance(o, dict) and owner.get(o.get("session")) == name]
    pipeline: dict[str, Any] = {"sessions": mine, "flow": raw.get("flow"), "dataflow": own_wires}
    for key, value in (("state", raw.get("state")), ("output", outputs or None),
                       ("preprocessing", pipe_raw.get("preprocessing") if first else None)):
        if value is not None:
            pipeline[key] = value
    config = {"version": 2, "pipeline": pipeline}
    for key in ("tokens", "generation"):
        if key in raw:
            config[key] = raw[key]
    return config


def _stage_config(name: str, raw: dict[str, Any], folder: Folder, problems: Problems) -> Config | None:
    from .parse import parse_config

    try:
        return parse_config(raw, folder)
    except ConfigError as e:
        for p in e.problems:
            problems.add(f"pipeline.stages.{name}: {p}")
        return None


def _check_sources(stages: list[Stage], owner: dict[str, str], wires: tuple[Wire, ...],
                   problems: Problems) -> None:
    """What a later stage reads of an earlier one exists when that stage is done (or, streamed, row by
    row): an init or final step's output, an accumulated step output, or a generator's tokens."""
    by_name = {s.name: s for s in stages}
    for w in wires:
        a, b = owner.get(w.from_session), owner.get(w.to_session)
        if a == b or a not in by_name:
            continue
        producer = by_name[a].config
        step = next(s for s in producer.pipeline.flow if s.run == w.from_session)
        if producer.generation.loop != "autoregressive":
            problems.add(f'pipeline.dataflow: the wire {w} reads stage "{a}", whose loop is '
                         f'"{producer.generation.loop}": later stages read autoregressive stages only (what '
                         "a single_pass or denoising stage makes is returned by pipeline.output)")
        elif w.from_output == TOKENS_OUTPUT:
            if step.when != "step" or w.stream:
                problems.add(f'pipeline.dataflow: the wire {w} reads the ids stage "{a}" generated: its '
                             'session must be a "step" session, and the wire not "stream"')
        elif step.when == "step" and w.from_output not in step.accumulate:
            problems.add(f'pipeline.dataflow: the wire {w} reads a step output of stage "{a}", which changes '
                         f'at every step: add "accumulate": ["{w.from_output}"] to its flow step (the rows '
                         "of every step, joined along the sequence axis)")
        elif w.stream and w.from_output not in step.accumulate:
            problems.add(f'pipeline.dataflow: the wire {w} streams rows of an output "{w.from_session}" does '
                         "not accumulate")
