"""Raw v2 mappings -> validated Config.

Checks everything that can be checked without opening a model: field types, vocabularies, flow
references, cycles, session files. Checks that need the graphs' signatures live in `plan`.
All problems are collected and raised together as one ConfigError.
"""

from __future__ import annotations

from typing import Any

from ..errors import Problems, did_you_mean, one_of
from ..folder import Folder, inside
from . import presets
from .schema import (
    GENERATION_LOOPS,
    KV_FORMATS,
    LOOP_MODES,
    MAX_FLOW_STEPS,
    POSITION_STRATEGIES,
    WHEN,
    WHEN_ALIASES,
    Config,
    CrossCacheSpec,
    DynamicShape,
    FlowStep,
    Generation,
    KVCacheSpec,
    PipelineSpec,
    PositionIdsSpec,
    Sampling,
    SessionSpec,
    SlidingWindow,
    StateSpec,
    Tokens,
    Wire,
)

_TYPE_NAMES = {bool: "true or false", int: "an integer", float: "a number", str: "a string",
               list: "a list", dict: "an object"}


class Section:
    """One JSON object of the config, with its dotted path for messages."""

    def __init__(self, raw: Any, path: str, problems: Problems):
        self.path, self.problems = path, problems
        if raw is None:
            raw = {}
        if not isinstance(raw, dict):
            problems.add(f"{path} must be an object, found {type(raw).__name__} {raw!r}")
            raw = {}
        self.raw: dict[str, Any] = raw

    def allow(self, *keys: str) -> None:
        for key in self.raw:
            if key not in keys:
                self.problems.add(f'Unknown key "{key}" in {self.path}.{did_you_mean(key, keys)} '
                                  f"Allowed keys: {one_of(keys)}")

    def get(self, key: str, kind: type, default: Any = None) -> Any:
        value = self.raw.get(key, default)
        if value is default or value is None:
            return value
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            return float(value)
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            self.problems.add(f"{self.path}.{key} must be {_TYPE_NAMES.get(kind, kind.__name__)}, "
                              f"found {value!r}")
            return default
        return value

    def choice(self, key: str, allowed: tuple[str, ...], default: str,
               aliases: dict[str, str] | None = None, what: str | None = None) -> str:
        value = self.get(key, str, default)
        value = (aliases or {}).get(value, value)
        if value not in allowed:
            names = list(allowed) + list(aliases or {})
            self.problems.add(f'Unknown {what or key} "{value}" in {self.path}.{key}. '
                              f"Valid options: {one_of(allowed)}.{did_you_mean(value, names)}")
            return default
        return value

    def sub(self, key: str) -> Section:
        return Section(self.raw.get(key), f"{self.path}.{key}", self.problems)

    def int_list(self, key: str) -> tuple[int, ...] | None:
        value = self.get(key, list)
        if value is None:
            return None
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            self.problems.add(f"{self.path}.{key} must be a list of integers, found {value!r}")
            return None
        return tuple(value)


def parse_config(raw: Any, folder: Folder, source: str = "v2") -> Config:
    """Validate a raw v2 config (already translated when it came from v1)."""
    problems = Problems()
    top = Section(raw, "config", problems)
    top.allow("version", "pipeline", "tokens", "generation", "metadata")
    pipe_raw = top.raw.get("pipeline")
    if not isinstance(pipe_raw, dict):
        problems.add('The config has no "pipeline" object. Add "pipeline": {"extends": '
                     '"autoregressive-decoder", "sessions": {"decoder": {"file": "model.onnx"}}}')
        problems.raise_if_any()
    pipeline = _pipeline(_resolve_preset(pipe_raw, problems), folder, problems)
    config = Config(
        pipeline=pipeline,
        tokens=_tokens(top.sub("tokens")),
        generation=_generation(top.sub("generation")),
        metadata=top.get("metadata", dict, {}),
        source=source,
    )
    problems.raise_if_any()
    return config


def _resolve_preset(pipe_raw: dict[str, Any], problems: Problems) -> dict[str, Any]:
    name = pipe_raw.get("extends")
    if name is None:
        return pipe_raw
    if name not in presets.PRESETS:
        problems.add(f'Unknown pipeline preset "{name}" in pipeline.extends. Built-in presets: '
                     f"{one_of(presets.PRESETS)}.{did_you_mean(name, presets.PRESETS)}")
        return {k: v for k, v in pipe_raw.items() if k != "extends"}
    return presets.expand(pipe_raw, name)


def _pipeline(raw: dict[str, Any], folder: Folder, problems: Problems) -> PipelineSpec:
    sec = Section(raw, "pipeline", problems)
    sec.allow("extends", "sessions", "flow", "dataflow", "state", "preprocessing", "plugin", "output")
    sessions = _sessions(sec.sub("sessions"), folder, problems)
    flow = _flow(sec.get("flow", list), sessions, problems)
    dataflow = _dataflow(sec.get("dataflow", list, []), sessions, problems)
    _check_cycles(flow, dataflow, problems)
    return PipelineSpec(
        sessions=sessions,
        flow=flow,
        dataflow=dataflow,
        state=_state(sec.sub("state")),
        preprocessing=sec.get("preprocessing", dict, {}),
        plugin=sec.get("plugin", dict),
        extends=sec.get("extends", str),
    )


def _sessions(sec: Section, folder: Folder, problems: Problems) -> dict[str, SessionSpec]:
    if not sec.raw:
        problems.add('Pipeline config requires at least one session. Add "sessions": '
                     '{"decoder": {"file": "model.onnx"}} to pipeline')
        return {}
    sessions = {}
    for name in sec.raw:
        s = sec.sub(name)
        s.allow("file", "execution_provider", "provider_options", "session_options", "optional",
                "inputs", "outputs")
        file = s.get("file", str)
        if file is None:
            problems.add(f'{s.path} has no "file". Add "file": "model.onnx" (a path inside the model folder)')
            continue
        optional = s.get("optional", bool, False)
        _check_file(s.path, file, folder, optional, problems)
        providers = s.raw.get("execution_provider", "cpu")
        providers = (providers,) if isinstance(providers, str) else tuple(providers)
        if not providers or not all(isinstance(p, str) for p in providers):
            problems.add(f"{s.path}.execution_provider must be a provider name or a list of names, "
                         f"found {s.raw.get('execution_provider')!r}")
            providers = ("cpu",)
        sessions[name] = SessionSpec(
            name=name, file=file, providers=providers,
            provider_options=s.get("provider_options", dict, {}),
            session_options=s.get("session_options", dict, {}),
            optional=optional,
            inputs=_role_map(s, "inputs"), outputs=_role_map(s, "outputs"),
        )
    return sessions


def _role_map(sec: Section, key: str) -> dict[str, str]:
    value = sec.get(key, dict, {})
    if not all(isinstance(v, str) for v in value.values()):
        sec.problems.add(f"{sec.path}.{key} maps roles to tensor names (strings), found {value!r}")
        return {}
    return dict(value)


def _check_file(path: str, file: str, folder: Folder, optional: bool, problems: Problems) -> None:
    if not inside(file):
        problems.add(f'{path}.file "{file}" points outside the model folder. Session files must be '
                     "relative paths inside it, like \"model.onnx\" or \"decoder/model.onnx\"")
    elif not optional and not folder.exists(file):
        problems.add(f'{path}.file "{file}" does not exist (looked for {folder.describe(file)}). '
                     "Fix the path, or mark the session \"optional\": true")


def _flow(raw: list[Any] | None, sessions: dict[str, SessionSpec], problems: Problems) -> tuple[FlowStep, ...]:
    if raw is None:
        problems.add('pipeline has no "flow". Add "flow": [{"run": "decoder", "when": "step"}] '
                     'or "extends": "autoregressive-decoder"')
        return ()
    if len(raw) > MAX_FLOW_STEPS:
        problems.add(f"pipeline.flow has {len(raw)} steps; at most {MAX_FLOW_STEPS} are allowed. "
                     "Merge steps, or use a plugin for longer pipelines")
    steps = []
    for i, item in enumerate(raw):
        s = Section(item, f"pipeline.flow[{i}]", problems)
        s.allow("run", "when", "loop", "loop_over", "dynamic_shape", "repeat", "counter", "optional",
                "after", "cross_attention_from")
        run = s.get("run", str)
        if run is None:
            problems.add(f'{s.path} has no "run": name the session this step runs')
            continue
        if sessions and run not in sessions:
            problems.add(f'Flow step {i} ({s.path}) references session "{run}" but no such session is '
                         f"declared in pipeline.sessions (declared: {one_of(sessions)}).{did_you_mean(run, sessions)}")
        steps.append(_flow_step(s, run))
    _check_flow_refs(steps, problems)
    return tuple(steps)


def _flow_step(s: Section, run: str) -> FlowStep:
    dyn = None
    if "dynamic_shape" in s.raw:
        d = s.sub("dynamic_shape")
        d.allow("source", "apply_to_dims")
        source = d.get("source", str)
        if source is None:
            s.problems.add(f'{d.path} needs "source": the input holding each item\'s sizes, e.g. "image_sizes"')
        dyn = DynamicShape(source or "", d.int_list("apply_to_dims") or ())
    loop = s.choice("loop", LOOP_MODES, "batched", what="loop mode")
    repeat = s.get("repeat", int, 1)
    if repeat < 1:
        s.problems.add(f"{s.path}.repeat must be 1 or more, found {repeat}")
    after = s.get("after", list, [])
    if not all(isinstance(a, str) for a in after):
        s.problems.add(f"{s.path}.after must be a list of session names, found {after!r}")
        after = []
    if loop == "per_image" and not s.get("loop_over", str):
        s.problems.add(f'{s.path} has loop "per_image" but no "loop_over": name the input to iterate '
                       'over, e.g. "loop_over": "pixel_values"')
    return FlowStep(
        run=run, when=s.choice("when", WHEN, "step", WHEN_ALIASES, what="flow phase (when)"),
        loop=loop, loop_over=s.get("loop_over", str), dynamic_shape=dyn, repeat=repeat,
        counter=s.get("counter", str), optional=s.get("optional", bool, False), after=tuple(after))


def _check_flow_refs(steps: list[FlowStep], problems: Problems) -> None:
    names = [s.run for s in steps]
    for i, step in enumerate(steps):
        for dep in step.after:
            if dep not in names:
                problems.add(f'pipeline.flow[{i}].after names "{dep}", which no flow step runs '
                             f"(steps run: {one_of(names)}).{did_you_mean(dep, names)}")


def _dataflow(raw: list[Any], sessions: dict[str, SessionSpec], problems: Problems) -> tuple[Wire, ...]:
    wires = []
    for i, item in enumerate(raw):
        s = Section(item, f"pipeline.dataflow[{i}]", problems)
        s.allow("from", "to")
        ends = [_endpoint(s, key, sessions) for key in ("from", "to")]
        if ends[0] and ends[1]:
            wires.append(Wire(ends[0][0], ends[0][1], ends[1][0], ends[1][1]))
    return tuple(wires)


def _endpoint(s: Section, key: str, sessions: dict[str, SessionSpec]) -> tuple[str, str] | None:
    value = s.get(key, str)
    if value is None or "." not in value:
        s.problems.add(f'{s.path}.{key} must be "session.tensor", found {value!r}')
        return None
    session, tensor = value.split(".", 1)
    if sessions and session not in sessions:
        s.problems.add(f'{s.path}.{key} names session "{session}", which is not declared in '
                       f"pipeline.sessions (declared: {one_of(sessions)}).{did_you_mean(session, sessions)}")
        return None
    return session, tensor


def _check_cycles(flow: tuple[FlowStep, ...], wires: tuple[Wire, ...], problems: Problems) -> None:
    """Refuse cycles through dataflow and `after` (a session feeding itself is a carried state)."""
    edges: dict[str, set[str]] = {}
    for w in wires:
        if w.from_session != w.to_session:
            edges.setdefault(w.from_session, set()).add(w.to_session)
    for step in flow:
        for dep in step.after:
            edges.setdefault(dep, set()).add(step.run)
    cycle = find_cycle(edges)
    if cycle:
        problems.add(f"Circular dependency detected in dataflow/after: {' → '.join(cycle)}. "
                     "Remove one of these wires or dependencies")


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One cycle as [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1 on the stack, 2 done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for start in sorted(edges):
        if start not in state and (found := visit(start)):
            return found
    return None


def _state(sec: Section) -> StateSpec:
    sec.allow("kv_cache", "position_ids", "cross_cache", "type")
    kv = sec.sub("kv_cache")
    kv.allow("format", "past_key_pattern", "present_key_pattern", "past_value_pattern",
             "present_value_pattern", "past_pattern", "present_pattern", "share_buffer", "sliding_window")
    pos = sec.sub("position_ids")
    pos.allow("strategy", "input_name", "grid_source", "spatial_merge_size")
    cross = None
    if "cross_cache" in sec.raw:
        c = sec.sub("cross_cache")
        c.allow("source", "frozen")
        cross = CrossCacheSpec(source=c.get("source", str, "encoder"), frozen=c.get("frozen", bool, True))
    return StateSpec(
        kv_cache=KVCacheSpec(
            format=kv.choice("format", KV_FORMATS, "auto", what="kv_cache format"),
            **{k: kv.get(k, str) for k in ("past_key_pattern", "present_key_pattern", "past_value_pattern",
                                             "present_value_pattern", "past_pattern", "present_pattern")},
            share_buffer=kv.get("share_buffer", bool, False),
            sliding_window=_sliding(kv),
        ),
        position_ids=PositionIdsSpec(
            strategy=pos.choice("strategy", POSITION_STRATEGIES, "auto", what="position_ids strategy"),
            input_name=pos.get("input_name", str, "position_ids"),
            grid_source=pos.get("grid_source", str),
            spatial_merge_size=pos.get("spatial_merge_size", int, 2),
        ),
        cross_cache=cross,
    )


def _sliding(kv: Section) -> SlidingWindow | None:
    if kv.raw.get("sliding_window") is None:
        return None
    sw = kv.sub("sliding_window")
    sw.allow("window_size", "layers")
    size = sw.get("window_size", int)
    if size is None or size < 1:
        sw.problems.add(f"{sw.path}.window_size must be a positive integer, found {size!r}")
        return None
    return SlidingWindow(window_size=size, layers=sw.int_list("layers"))


def _tokens(sec: Section) -> Tokens:
    sec.allow("eos", "pad", "bos", "image_token", "audio_token", "decoder_start")
    eos = sec.raw.get("eos", [])
    eos = [eos] if isinstance(eos, int) and not isinstance(eos, bool) else eos
    if not isinstance(eos, list) or not all(isinstance(e, int) and not isinstance(e, bool) for e in eos):
        sec.problems.add(f"{sec.path}.eos must be a token id or a list of token ids, found {eos!r}")
        eos = []
    names = ("pad", "bos", "image_token", "audio_token", "decoder_start")
    return Tokens(eos=tuple(eos), **{k: sec.get(k, int) for k in names})


def _generation(sec: Section) -> Generation:
    sec.allow("loop", "max_length", "min_length", "sampling", "num_beams", "length_penalty", "num_steps",
              "scheduler", "guidance_scale", "stop", "early_stopping", "num_return_sequences",
              "no_repeat_ngram_size", "suppress_tokens")
    samp = sec.sub("sampling")
    samp.allow("do_sample", "temperature", "top_k", "top_p", "min_p", "repetition_penalty", "seed")
    stop = sec.get("stop", list, [])
    if not all(isinstance(x, str) for x in stop):
        sec.problems.add(f"{sec.path}.stop must be a list of strings, found {stop!r}")
        stop = []
    max_length = sec.get("max_length", int)
    if max_length is not None and max_length < 1:
        sec.problems.add(f"{sec.path}.max_length must be a positive integer, found {max_length}")
        max_length = None
    return Generation(
        loop=sec.choice("loop", GENERATION_LOOPS, "autoregressive", what="generation loop"),
        max_length=max_length,
        min_length=sec.get("min_length", int, 0),
        sampling=Sampling(
            do_sample=samp.get("do_sample", bool, False),
            temperature=samp.get("temperature", float, 1.0),
            top_k=samp.get("top_k", int, 0),
            top_p=samp.get("top_p", float, 1.0),
            min_p=samp.get("min_p", float, 0.0),
            repetition_penalty=samp.get("repetition_penalty", float, 1.0),
            seed=samp.get("seed", int),
        ),
        num_beams=sec.get("num_beams", int, 1),
        length_penalty=sec.get("length_penalty", float, 1.0),
        early_stopping=sec.get("early_stopping", bool, False),
        num_return_sequences=sec.get("num_return_sequences", int, 1),
        no_repeat_ngram_size=sec.get("no_repeat_ngram_size", int, 0),
        suppress_tokens=sec.int_list("suppress_tokens") or (),
        stop=tuple(stop),
        num_steps=sec.get("num_steps", int),
        scheduler=sec.get("scheduler", str),
        guidance_scale=sec.get("guidance_scale", float),
    )
