"""Raw v2 mappings -> validated Config.

Checks everything that can be checked without opening a model: field types, ranges, vocabularies,
flow references, cycles, session files. Checks that need the graphs' signatures live in `plan`.
All problems are collected and raised together as one ConfigError.
"""

from __future__ import annotations

import dataclasses
import posixpath
from typing import Any

from .. import variants
from ..errors import ConfigError, Problems, did_you_mean, one_of
from ..folder import Folder
from ..jsonfile import quote
from . import ep, presets
from .schema import (
    GENERATED,
    GENERATION_LOOPS,
    KV_FORMATS,
    LOOP_MODES,
    MAX_FLOW_STEPS,
    OUTPUT_KINDS,
    POOLING_MODES,
    POSITION_STRATEGIES,
    WHEN,
    WHEN_ALIASES,
    Codebooks,
    Config,
    CrossCacheSpec,
    DynamicShape,
    FlowStep,
    Generation,
    KVCacheSpec,
    OutputSpec,
    PipelineSpec,
    PositionIdsSpec,
    SessionSpec,
    SlidingWindow,
    StateSpec,
    Tokens,
    Wire,
)
from .settings import CODEBOOK_SAMPLING, SETTINGS, SearchSettings, by_v2

_TYPE_NAMES = {bool: "true or false", int: "an integer", float: "a number", str: "a string",
               list: "a list", dict: "an object"}
MAX_REPEAT = 64  # a flow step run more often than this per iteration is a plugin's job


class Section:
    """One JSON object of the config, with its dotted path for messages.

    `nulls`: whether JSON null means "not given" (the processor configs transformers writes use it
    so); in ortpipe's own config a null is refused, since it would be a key accepted and ignored.
    """

    def __init__(self, raw: Any, path: str, problems: Problems, nulls: bool = True):
        self.path, self.problems, self.nulls = path, problems, nulls
        if raw is None:
            raw = {}
        if not isinstance(raw, dict):
            problems.add(f"{path} must be an object, found {type(raw).__name__} {quote(raw)}")
            raw = {}
        self.raw: dict[str, Any] = raw

    def allow(self, *keys: str) -> None:
        for key in self.raw:
            if key not in keys:
                self.problems.add(
                    f'Unknown key "{quote(key)[1:-1]}" in {self.path}.{did_you_mean(key, keys)} '
                    f"Allowed keys: {one_of(keys)}"
                )

    def get(self, key: str, kind: type, default: Any = None) -> Any:
        value = self.raw.get(key, default)
        if value is default:
            return value
        if value is None:
            if not self.nulls:
                self.problems.add(
                    f"{self.path}.{key} must be {_TYPE_NAMES.get(kind, kind.__name__)}, found null "
                    "(leave the key out for the default)"
                )
            return default
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            return float(value)
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            self.problems.add(
                f"{self.path}.{key} must be {_TYPE_NAMES.get(kind, kind.__name__)}, found {quote(value)}"
            )
            return default
        return value

    def number(self, key: str, kind: type, default: Any, low: float, high: float | None = None) -> Any:
        """An int or float in [low, high]."""
        value = self.get(key, kind, default)
        if value is default or value is None:
            return value
        if value != value or value < low or (high is not None and value > high):
            limit = f"at least {low}" + (f" and at most {high}" if high is not None else "")
            self.problems.add(f"{self.path}.{key} must be {limit}, found {quote(value)}")
            return default
        return value

    def choice(
        self,
        key: str,
        allowed: tuple[str, ...],
        default: str,
        aliases: dict[str, str] | None = None,
        what: str | None = None,
    ) -> str:
        value = self.get(key, str, default)
        value = (aliases or {}).get(value, value)
        if value not in allowed:
            names = list(allowed) + list(aliases or {})
            self.problems.add(
                f"Unknown {what or key} {quote(value)} in {self.path}.{key}. "
                f"Valid options: {one_of(allowed)}.{did_you_mean(value, names)}"
            )
            return default
        return value

    def sub(self, key: str) -> Section:
        return Section(self.raw.get(key), f"{self.path}.{key}", self.problems, self.nulls)

    def int_list(self, key: str) -> tuple[int, ...] | None:
        value = self.get(key, list)
        if value is None:
            return None
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            self.problems.add(f"{self.path}.{key} must be a list of integers, found {quote(value)}")
            return None
        return tuple(value)

    def str_list(self, key: str) -> tuple[str, ...]:
        value = self.get(key, list, [])
        if not all(isinstance(v, str) for v in value):
            self.problems.add(f"{self.path}.{key} must be a list of strings, found {quote(value)}")
            return ()
        return tuple(value)


def parse_config(raw: Any, folder: Folder, source: str = "v2", notes: tuple[str, ...] = ()) -> Config:
    """Validate a raw v2 config (already translated when it came from v1; `notes` are the
    translation's warnings)."""
    problems = Problems()
    top = Section(raw, "config", problems, nulls=False)
    top.allow("version", "pipeline", "tokens", "generation", "metadata")
    pipe_raw = top.raw.get("pipeline")
    if not isinstance(pipe_raw, dict):
        problems.add(
            'The config has no "pipeline" object. Add "pipeline": {"extends": '
            '"autoregressive-decoder", "sessions": {"decoder": {"file": "model.onnx"}}}'
        )
        problems.raise_if_any()
    if "stages" in pipe_raw:
        from .stages import parse_stages

        return parse_stages(top, pipe_raw, folder, source, notes)
    pipeline = _pipeline(_resolve_preset(pipe_raw, problems), folder, problems)
    generation = _generation(top.sub("generation"), folder)
    _check_loop(pipeline, generation, problems)
    tokens = _tokens(top.sub("tokens"))
    if generation.codebooks is not None and tokens.pad is None:
        problems.add('generation.codebooks fills the delay pattern with tokens.pad: set "tokens": '
                     '{"pad": ID} '
                     "(MusicGen's is its codebook size, e.g. 2048)")
    config = Config(
        pipeline=pipeline,
        tokens=tokens,
        generation=generation,
        metadata=_metadata(top.sub("metadata")),
        source=source,
        notes=notes,
    )
    problems.raise_if_any()
    return config


def _resolve_preset(pipe_raw: dict[str, Any], problems: Problems) -> dict[str, Any]:
    name = pipe_raw.get("extends")
    if name is None:
        return pipe_raw
    if not isinstance(name, str) or name not in presets.PRESETS:
        problems.add(
            f"Unknown pipeline preset {quote(name)} in pipeline.extends. Built-in presets: "
            f"{one_of(presets.PRESETS)}.{did_you_mean(str(name), presets.PRESETS)}"
        )
        return {k: v for k, v in pipe_raw.items() if k != "extends"}
    return presets.expand(pipe_raw, name)


def _pipeline(raw: dict[str, Any], folder: Folder, problems: Problems) -> PipelineSpec:
    sec = Section(raw, "pipeline", problems, nulls=False)
    sec.allow("extends", "sessions", "flow", "dataflow", "state", "preprocessing", "plugin", "output")
    plugin = _plugin(sec.sub("plugin"), folder) if "plugin" in sec.raw else None

    sessions = _sessions(sec.sub("sessions"), folder, problems)
    flow = () if plugin and "flow" not in sec.raw else _flow(sec.get("flow", list), sessions, problems)
    dataflow = _dataflow(sec.get("dataflow", list, []), sessions, problems)
    for w in dataflow:
        if w.stream:
            problems.add(f'pipeline.dataflow: the wire {w} has "stream", which is for wires between stages '
                         "of pipeline.stages: drop it")
    _check_cycles(flow, dataflow, problems)
    return PipelineSpec(
        sessions=sessions,
        flow=flow,
        dataflow=dataflow,
        state=_cross_attention(_state(sec.sub("state")), flow, sessions, problems),
        preprocessing=_preprocessing(sec.sub("preprocessing"), folder),
        plugin=plugin,
        extends=sec.get("extends", str),
        outputs=_outputs(sec, sessions, problems),
    )


def _plugin(sec: Section, folder: Folder) -> dict[str, Any]:
    """{module: "package.module:factory", wheel: a pure-Python wheel in the folder (optional)}: the
    loop is the plugin's (plugins.py), every session of the pipeline is opened for it, and the flow
    may be left out."""
    sec.allow("module", "wheel")
    module = sec.get("module", str)
    if module is None or not all(part.isidentifier() for part in module.replace(":", ".").split(".")):
        sec.problems.add(f'{sec.path}.module must name a factory as "package.module:factory", '
                         f"found {quote(module)}")
    wheel = sec.get("wheel", str)
    if wheel is not None:
        from ..errors import ConfigError

        try:
            found = wheel.endswith(".whl") and folder.exists(wheel)
        except ConfigError as e:
            sec.problems.add(f"{sec.path}.wheel: {e}")
        else:
            if not found:
                sec.problems.add(
                    f"{sec.path}.wheel must be a .whl file in the model folder, found {quote(wheel)}"
                )
    return {k: v for k, v in (("module", module), ("wheel", wheel)) if v is not None}


def _outputs(sec: Section, sessions: dict[str, SessionSpec], problems: Problems) -> tuple[OutputSpec, ...]:
    """pipeline.output: one {session, name, ...} or a list of them."""
    raw = sec.raw.get("output")
    if raw is None:
        return ()
    items = raw if isinstance(raw, list) else [raw]
    outputs = []
    for i, item in enumerate(items):
        o = Section(item, f"pipeline.output[{i}]" if isinstance(raw, list) else "pipeline.output", problems,
                    nulls=False)
        o.allow("session", "name", "as", "sampling_rate", "pooling", "normalize")
        session, name = o.get("session", str), o.get("name", str)
        if session is None or name is None:
            problems.add(
                f'{o.path} needs "session" and "name": the session and its output a request returns, '
                'e.g. {"session": "vocoder", "name": "waveform"}'
            )
            continue
        if sessions and session not in sessions:
            problems.add(
                f'{o.path}.session names session "{session}", which is not declared in pipeline.sessions '
                f"(declared: {one_of(sessions)}).{did_you_mean(session, sessions)}"
            )
        kind = o.choice("as", OUTPUT_KINDS, "tensor", what="output kind (as)")
        outputs.append(
            OutputSpec(session, name, kind, _sampling_rate(o, kind), _pooling(o, kind), _normalize(o, kind))
        )
    names = [o.name for o in outputs]
    for name in sorted({n for n in names if names.count(n) > 1}):
        problems.add(f'pipeline.output names "{name}" twice: a request returns its outputs by name')
    return tuple(outputs)


def _sampling_rate(o: Section, kind: str) -> int | None:
    rate = o.number("sampling_rate", int, None, 1, 1_000_000)
    if kind == "audio" and rate is None and "sampling_rate" not in o.raw:
        o.problems.add(
            f'{o.path} is audio ("as": "audio") but has no "sampling_rate": give the samples per second'
        )
    elif kind != "audio" and "sampling_rate" in o.raw:
        o.problems.add(f'{o.path}.sampling_rate is for audio outputs ("as": "audio"); this one is "{kind}"')
    return rate


def _pooling(o: Section, kind: str) -> str | None:
    if kind != "embedding":
        for key in ("pooling", "normalize"):
            if key in o.raw:
                o.problems.add(
                    f'{o.path}.{key} is for embedding outputs ("as": "embedding"); this one is "{kind}"'
                )
        return None
    return o.choice("pooling", POOLING_MODES, "mean", what="pooling")


def _normalize(o: Section, kind: str) -> bool:
    return bool(o.get("normalize", bool, False)) if kind == "embedding" else False


def _check_loop(pipeline: PipelineSpec, generation: Generation, problems: Problems) -> None:
    """What each generation loop needs of the pipeline: named outputs for the loops that make no tokens, one
    denoising session run per step, codebooks for the autoregressive loop's final steps."""
    loop = generation.loop
    steps = [s.run for s in pipeline.flow if s.when == "step"]
    if loop != "autoregressive" and not pipeline.outputs:
        problems.add(
            f'generation.loop "{loop}" makes no tokens: name what a request returns in pipeline.output, '
            'e.g. {"session": "vocoder", "name": "waveform", "as": "audio", "sampling_rate": 16000}'
        )
    if loop == "single_pass" and steps:
        problems.add(
            f'generation.loop "single_pass" runs the init and final phases once; flow steps with '
            f'"when": "step" ({one_of(steps)}) would never run: make them "init"'
        )
    finished = [o.name for o in pipeline.outputs if o.kind in ("image", "embedding")]
    if loop == "autoregressive" and finished:
        problems.add(
            f"pipeline.output {one_of(finished)}: an autoregressive request returns its outputs as the "
            'sessions give them: "as" must be "tensor" or "audio"'
        )
    kept = [s.run for s in pipeline.flow if s.accumulate]
    if loop != "autoregressive" and kept:
        problems.add(
            f'flow steps {one_of(kept)} accumulate outputs over the decode steps, which the "{loop}" loop '
            'does not have: drop "accumulate"'
        )
    final = [s.run for s in pipeline.flow if s.when == "final"]
    if loop == "autoregressive" and final and not pipeline.outputs:
        problems.add(
            f'flow steps with "when": "final" ({one_of(final)}) run after the autoregressive loop to make '
            'named outputs: name them in pipeline.output (e.g. {"session": "vocoder", "name": "waveform", '
            '"as": "audio", "sampling_rate": 24000}), or drop the steps'
        )
    if generation.codebooks is not None:
        if len(steps) != 1:
            problems.add(
                f"generation.codebooks runs one session per step (the decoder), found {len(steps)} "
                f'("when": "step": {one_of(steps) or "none"})'
            )
        if not pipeline.outputs:
            problems.add(
                "generation.codebooks returns its codes and named outputs: name what a request returns in "
                'pipeline.output, e.g. {"session": "audio_decoder", "name": "audio_values", "as": "audio", '
                '"sampling_rate": 32000}'
            )
        if any(o.name == "codes" for o in pipeline.outputs):
            problems.add('pipeline.output names "codes", which generation.codebooks returns itself (the '
                         "generated codes): rename the output")
    if loop == "denoising" and len(steps) != 1:
        problems.add(
            f'generation.loop "denoising" runs one session per step (the UNet), found {len(steps)} '
            f'("when": "step": {one_of(steps) or "none"})'
        )


def _sessions(sec: Section, folder: Folder, problems: Problems) -> dict[str, SessionSpec]:
    if not sec.raw:
        problems.add(
            'Pipeline config requires at least one session. Add "sessions": '
            '{"decoder": {"file": "model.onnx"}} to pipeline'
        )
        return {}
    sessions = {}
    for name in sec.raw:
        s = sec.sub(name)
        s.allow(
            "file",
            "execution_provider",
            "provider_options",
            "session_options",
            "optional",
            "inputs",
            "outputs",
            "dtype",
            "tokenizer",
            "max_length",
        )
        file = s.get("file", str)
        if file is None:
            problems.add(f'{s.path} has no "file". Add "file": "model.onnx" (a path inside the model folder)')
            continue
        optional = s.get("optional", bool, False)
        _check_file(s.path, file, folder, optional, problems)
        sessions[name] = SessionSpec(
            name=name,
            file=file,
            providers=_providers(s),
            provider_options=_provider_options(s),
            session_options=_session_options(s),
            optional=optional,
            inputs=_role_map(s, "inputs"),
            outputs=_role_map(s, "outputs"),
            dtype=_dtype(s),
            tokenizer=_tokenizer_folder(s, "tokenizer"),
            max_length=_session_length(s),
        )
    return sessions


def _session_length(s: Section) -> int | None:
    length = s.number("max_length", int, None, 1, 1 << 20)
    if length is not None and "tokenizer" not in s.raw:
        s.problems.add(f"{s.path}.max_length pads and truncates the rows of the session's own tokenizer: "
                       "name it in tokenizer, or set preprocessing.text.max_length for every session")
    return length


def _tokenizer_folder(s: Section, key: str) -> str | None:
    """A folder inside the model folder holding tokenizer files ("" or ".": the model folder itself)."""
    where = s.get(key, str)
    if where is None or where in ("", "."):
        return None if where is None else ""
    from ..folder import inside

    if not inside(where):
        s.problems.add(f'{s.path}.{key} "{where}" is not a folder inside the model folder')
        return None
    return where.strip("/")  # its files are read through the folder, which refuses links out of it


def _dtype(s: Section) -> str | None:
    """The session's model variant (variants.py), when the config picks one."""
    value = s.raw.get("dtype")
    try:
        if isinstance(value, dict):
            raise ConfigError(
                f"{s.path}.dtype is one dtype ({', '.join(variants.SUFFIXES)}), found {quote(value)}"
            )
        return variants.check_dtype(value, f"{s.path}.dtype")
    except ConfigError as e:
        s.problems.add(str(e))
        return None


def _providers(s: Section) -> tuple[str, ...]:
    """`execution_provider`: a name or an ordered fallback list, as provider keys (config/ep.py)."""
    if "execution_provider" not in s.raw:
        return ("cpu",)
    providers = ep.provider_names(s.raw["execution_provider"], f"{s.path}.execution_provider", s.problems)
    return providers or ("cpu",)


def _provider_options(s: Section) -> dict[str, dict[str, str]]:
    """`provider_options`: options per provider, keyed by provider key, values as onnxruntime takes them."""
    if "provider_options" not in s.raw:
        return {}
    return ep.check_provider_options(s.raw["provider_options"], f"{s.path}.provider_options", s.problems)


def _session_options(s: Section) -> dict[str, Any]:
    """`session_options`: onnxruntime-genai's keys, a provider's own under its key (config/ep.py)."""
    if "session_options" not in s.raw:
        return {}
    return ep.check_session_options(s.raw["session_options"], f"{s.path}.session_options", s.problems)


def _role_map(sec: Section, key: str) -> dict[str, str]:
    value = sec.get(key, dict, {})
    if not all(isinstance(v, str) for v in value.values()):
        sec.problems.add(f"{sec.path}.{key} maps roles to tensor names (strings), found {quote(value)}")
        return {}
    return dict(value)


def _check_file(path: str, file: str, folder: Folder, optional: bool, problems: Problems) -> None:
    from ..errors import ConfigError
    from ..folder import inside

    if not inside(file):
        problems.add(
            f'{path}.file "{file}" points outside the model folder. Session files must be '
            'relative paths inside it, like "model.onnx" or "decoder/model.onnx"'
        )
        return
    try:
        found = folder.exists(file) or bool(variants.present(folder, file))
    except ConfigError as e:  # a link leading out of the folder
        problems.add(f"{path}.file: {e}")
        return
    if not optional and not found:
        problems.add(
            f'{path}.file "{file}" does not exist (looked for {folder.describe(file)}). '
            'Fix the path, or mark the session "optional": true'
        )


def _flow(
    raw: list[Any] | None, sessions: dict[str, SessionSpec], problems: Problems
) -> tuple[FlowStep, ...]:
    if raw is None:
        problems.add(
            'pipeline has no "flow". Add "flow": [{"run": "decoder", "when": "step"}] '
            'or "extends": "autoregressive-decoder"'
        )
        return ()
    if len(raw) > MAX_FLOW_STEPS:
        problems.add(
            f"pipeline.flow has {len(raw)} steps; at most {MAX_FLOW_STEPS} are allowed. "
            "Merge steps, or use a plugin for longer pipelines"
        )
        raw = raw[:MAX_FLOW_STEPS]
    steps = []
    for i, item in enumerate(raw):
        s = Section(item, f"pipeline.flow[{i}]", problems, nulls=False)
        s.allow(
            "run",
            "when",
            "loop",
            "loop_over",
            "dynamic_shape",
            "repeat",
            "counter",
            "optional",
            "after",
            "cross_attention_from",
            "accumulate",
        )
        run = s.get("run", str)
        if run is None:
            problems.add(f'{s.path} has no "run": name the session this step runs')
            continue
        if sessions and run not in sessions:
            problems.add(
                f'Flow step {i} ({s.path}) references session "{quote(run)[1:-1]}" but no such session is '
                f"declared in pipeline.sessions (declared: {one_of(sessions)}).{did_you_mean(run, sessions)}"
            )
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
            s.problems.add(
                f'{d.path} needs "source": the input holding each item\'s sizes, e.g. "image_sizes"'
            )
        dims = d.int_list("apply_to_dims") or ()
        if any(x < 0 for x in dims):
            s.problems.add(
                f"{d.path}.apply_to_dims must be dimension indices (0 or more), found {list(dims)}"
            )
            dims = ()
        dyn = DynamicShape(source or "", dims)
    loop = s.choice("loop", LOOP_MODES, "batched", what="loop mode")
    repeat = s.number("repeat", int, 1, 1, MAX_REPEAT)
    if loop == "per_image" and not s.get("loop_over", str):
        s.problems.add(
            f'{s.path} has loop "per_image" but no "loop_over": name the input to iterate '
            'over, e.g. "loop_over": "pixel_values"'
        )
    return FlowStep(
        run=run,
        when=s.choice("when", WHEN, "step", WHEN_ALIASES, what="flow phase (when)"),
        loop=loop,
        loop_over=s.get("loop_over", str),
        dynamic_shape=dyn,
        repeat=repeat,
        counter=s.get("counter", str),
        optional=s.get("optional", bool, False),
        after=s.str_list("after"),
        cross_attention_from=s.get("cross_attention_from", str),
        accumulate=_accumulate(s),
    )


def _accumulate(s: Section) -> tuple[str, ...]:
    """The step's outputs kept over the loop (the plan checks they exist and have a sequence axis)."""
    names = s.str_list("accumulate")
    if names and s.choice("when", WHEN, "step", WHEN_ALIASES, what="flow phase (when)") != "step":
        s.problems.add(f'{s.path}.accumulate keeps outputs over the decode steps: only a "when": "step" '
                       "step has them; drop it")
        return ()
    for name in sorted({n for n in names if names.count(n) > 1}):
        s.problems.add(f'{s.path}.accumulate names "{name}" twice')
    return tuple(dict.fromkeys(names))


def _check_flow_refs(steps: list[FlowStep], problems: Problems) -> None:
    names = [s.run for s in steps]
    for i, step in enumerate(steps):
        for dep in step.after:
            if dep not in names:
                problems.add(
                    f'pipeline.flow[{i}].after names "{dep}", which no flow step runs '
                    f"(steps run: {one_of(names)}).{did_you_mean(dep, names)}"
                )
    seen: set[str] = set()
    for step in steps:
        if step.run in seen:
            problems.add(
                f'pipeline.flow runs session "{step.run}" twice; a session runs once per phase '
                '(use "repeat" to run it several times in a row)'
            )
        seen.add(step.run)


def _dataflow(raw: list[Any], sessions: dict[str, SessionSpec], problems: Problems) -> tuple[Wire, ...]:
    wires = []
    for i, item in enumerate(raw):
        s = Section(item, f"pipeline.dataflow[{i}]", problems, nulls=False)
        s.allow("from", "to", "stream")
        joined = isinstance(s.raw, dict) and isinstance(s.raw.get("from"), list)
        groups: tuple[int, ...] = ()
        zeros: tuple[int, ...] = ()
        if joined:  # several sources joined along the last axis, or groups of them along the sequence
            values = s.raw["from"]
            rows = [_zero_rows(v) for v in values]
            runs = [[] if n else v if isinstance(v, list) else [v] for v, n in zip(values, rows, strict=True)]
            flat = [v for run in runs for v in run]
            grouped = any(isinstance(v, list) for v in values) or any(rows)
            if (len(flat) < (1 if any(rows) else 2) or not all(isinstance(v, str) for v in flat)
                    or not all(run or n for run, n in zip(runs, rows, strict=True)) or -1 in rows
                    or (grouped and len(values) < 2)):
                problems.add(f'{s.path}.from must be "session.tensor", a list of two or more of them (joined '
                             "along the last axis), or a list of two or more such lists, names and "
                             '{"zeros": ROWS} (each list joined so, then all joined along the sequence axis, '
                             "zero-padded to the input's width; ROWS rows of zeros standing for a text "
                             f"encoder left out), found {quote(values)}")
                continue
            if grouped:
                groups = tuple(len(run) for run in runs)
                zeros = tuple(rows) if any(rows) else ()
            sources = [_endpoint(s, "from", sessions, v) for v in flat]
        else:
            sources = [_endpoint(s, "from", sessions)]
        to = _endpoint(s, "to", sessions)
        if all(sources) and to:
            stream = bool(s.get("stream", bool, False))
            if joined and any(session == GENERATED for session, _ in sources):
                problems.add(f'{s.path}.from: "{GENERATED}.ids" cannot be joined with other sources')
                continue
            if joined and stream:
                problems.add(f"{s.path}: a wire of joined sources cannot stream: drop stream")
                continue
            (first, output), *rest = sources
            more = tuple(f"{a}.{b}" for a, b in rest)
            wires.append(Wire(first, output, to[0], to[1], stream, more, groups, zeros))
    return tuple(wires)


def _zero_rows(value: Any) -> int:
    """The rows of a `{"zeros": ROWS}` item of a grouped wire's `from`; 0 for any other item, -1 for a
    malformed one."""
    if not isinstance(value, dict):
        return 0
    rows = value.get("zeros")
    if set(value) != {"zeros"} or not isinstance(rows, int) or isinstance(rows, bool) or rows < 1:
        return -1
    return rows


def _endpoint(s: Section, key: str, sessions: dict[str, SessionSpec], given: Any = None
              ) -> tuple[str, str] | None:
    """A wire's end as (session, tensor): `key` of the wire, or `given` (one source of a joined wire)."""
    value = s.get(key, str) if given is None else given
    if value is None or "." not in value:
        s.problems.add(f'{s.path}.{key} must be "session.tensor", found {quote(value)}')
        return None
    session, tensor = value.split(".", 1)
    if key == "from" and session == GENERATED:
        if tensor != "ids":
            s.problems.add(f'{s.path}.from "{value}": the generated tokens are "{GENERATED}.ids"')
            return None
        return session, tensor
    if sessions and session not in sessions:
        s.problems.add(
            f'{s.path}.{key} names session "{session}", which is not declared in '
            f"pipeline.sessions (declared: {one_of(sessions)}).{did_you_mean(session, sessions)}"
        )
        return None
    return session, tensor


def _check_cycles(flow: tuple[FlowStep, ...], wires: tuple[Wire, ...], problems: Problems) -> None:
    """Refuse cycles through dataflow and `after` (a session feeding itself is a carried state)."""
    edges: dict[str, set[str]] = {}
    for w in wires:
        for source in w.sources:
            producer = source.split(".", 1)[0]
            if producer != w.to_session:
                edges.setdefault(producer, set()).add(w.to_session)
    for step in flow:
        for dep in step.after:
            edges.setdefault(dep, set()).add(step.run)
    cycle = find_cycle(edges)
    if cycle:
        problems.add(
            f"Circular dependency detected in dataflow/after: {' → '.join(cycle)}. "
            "Remove one of these wires or dependencies"
        )


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One cycle as [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1 on the stack, 2 done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for start in sorted(edges):
        if start not in state and (found := visit(start)):
            return found
    return None


PATTERN_KEYS = (
    "past_key_pattern",
    "present_key_pattern",
    "past_value_pattern",
    "present_value_pattern",
    "past_pattern",
    "present_pattern",
)


def _state(sec: Section) -> StateSpec:
    sec.allow("kv_cache", "position_ids", "cross_cache")
    kv = sec.sub("kv_cache")
    kv.allow("format", *PATTERN_KEYS, "share_buffer", "sliding_window")
    pos = sec.sub("position_ids")
    pos.allow("strategy", "input_name", "grid_source", "spatial_merge_size")
    cross = None
    if "cross_cache" in sec.raw:
        c = sec.sub("cross_cache")
        c.allow("source", "frozen")
        cross = CrossCacheSpec(source=c.get("source", str, "encoder"), frozen=c.get("frozen", bool, True))
    patterns = {k: kv.get(k, str) for k in PATTERN_KEYS}
    for key, pattern in patterns.items():
        if pattern is not None and pattern.count("{layer}") != 1:
            kv.problems.add(
                f'{kv.path}.{key} must hold "{{layer}}" once, where the layer number stands, '
                f"found {quote(pattern)}"
            )
            patterns[key] = None
    return StateSpec(
        kv_cache=KVCacheSpec(
            format=kv.choice("format", KV_FORMATS, "auto", what="kv_cache format"),
            **patterns,
            share_buffer=kv.get("share_buffer", bool),
            sliding_window=_sliding(kv),
        ),
        position_ids=PositionIdsSpec(
            strategy=pos.choice("strategy", POSITION_STRATEGIES, "auto", what="position_ids strategy"),
            input_name=pos.get("input_name", str, "position_ids"),
            grid_source=pos.get("grid_source", str),
            spatial_merge_size=pos.number("spatial_merge_size", int, 2, 1, 64),
        ),
        cross_cache=cross,
    )


def _cross_attention(
    state: StateSpec, flow: tuple[FlowStep, ...], sessions: dict[str, SessionSpec], problems: Problems
) -> StateSpec:
    """A flow step's `cross_attention_from` names the session whose cross cache it reads: the same as
    state.cross_cache.source (seed 000, section 4.3), which it sets when state leaves it out."""
    for i, step in enumerate(flow):
        source = step.cross_attention_from
        if source is None:
            continue
        if sessions and source not in sessions:
            problems.add(
                f'pipeline.flow[{i}].cross_attention_from names session "{source}", which is not declared '
                f"(declared: {one_of(sessions)}).{did_you_mean(source, sessions)}"
            )
        elif state.cross_cache is None:
            state = dataclasses.replace(state, cross_cache=CrossCacheSpec(source=source))
        elif state.cross_cache.source != source:
            problems.add(
                f'pipeline.flow[{i}].cross_attention_from is "{source}" but state.cross_cache.source is '
                f'"{state.cross_cache.source}": name the same session in both, or leave one out'
            )
    return state


def _sliding(kv: Section) -> SlidingWindow | None:
    if "sliding_window" not in kv.raw:
        return None
    sw = kv.sub("sliding_window")
    sw.allow("window_size", "layers")
    size = sw.get("window_size", int)
    if size is None or size < 1:
        sw.problems.add(f"{sw.path}.window_size must be a positive integer, found {quote(size)}")
        return None
    return SlidingWindow(window_size=size, layers=sw.int_list("layers"))


def _preprocessing(sec: Section, folder: Folder) -> dict[str, Any]:
    sec.allow("image", "audio", "text")
    found = {}
    if "text" in sec.raw:
        found["text"] = _text_preprocessing(sec.sub("text"), folder)
    for kind in ("image", "audio"):
        if kind not in sec.raw:
            continue
        s = sec.sub(kind)
        s.allow("config")
        name = s.get("config", str)
        if name is not None:
            from ..errors import ConfigError

            try:
                folder.exists(name)  # the containment check: a path or link out of the folder is refused
            except ConfigError as e:
                s.problems.add(f"{s.path}.config: {e}")
                continue
        found[kind] = dict(s.raw)
    return found


def _text_preprocessing(s: Section, folder: Folder) -> dict[str, Any]:
    """`tokenizer`: the folder (inside the model folder) holding the tokenizer files; `max_length`: texts are
    truncated to this many tokens, special tokens included (single_pass and denoising loops)."""
    s.allow("tokenizer", "max_length")
    text: dict[str, Any] = {}
    where = _tokenizer_folder(s, "tokenizer")
    if where is not None:
        text["tokenizer"] = where
    length = s.number("max_length", int, None, 1, 1 << 20)
    if length is not None:
        text["max_length"] = length
    return text


# metadata is for people and logs, but for the sizes the runtime reads when a graph leaves them symbolic
METADATA_SIZES = ("context_length", "head_size", "num_key_value_heads", "num_attention_heads", "vocab_size")


def _metadata(sec: Section) -> dict[str, Any]:
    for key in METADATA_SIZES:
        if key in sec.raw:
            sec.number(key, int, None, 1)
    return dict(sec.raw)


def _tokens(sec: Section) -> Tokens:
    sec.allow("eos", "pad", "bos", "image_token", "audio_token", "decoder_start", "languages", "tasks")
    eos = sec.raw.get("eos", [])
    eos = [eos] if isinstance(eos, int) and not isinstance(eos, bool) else eos
    if not isinstance(eos, list) or not all(
        isinstance(e, int) and not isinstance(e, bool) and e >= 0 for e in eos
    ):
        sec.problems.add(f"{sec.path}.eos must be a token id or a list of token ids, found {quote(eos)}")
        eos = []
    names = ("pad", "bos", "image_token", "audio_token")
    values = {k: sec.number(k, int, None, 0) for k in names}
    named = {key: _named_ids(sec, key) for key in ("languages", "tasks")}
    start = sec.raw.get("decoder_start")
    if isinstance(start, list):  # the decoder's first ids, the start token first; null: the language's place
        ok = bool(start) and all(i is None or _token_id(i) for i in start) and start[0] is not None
        if not ok:
            sec.problems.add(f"{sec.path}.decoder_start must be a token id or a non-empty list of token ids "
                             f"(null after the first: the language's place), found {quote(start)}")
        elif start.count(None) > 1 or (None in start and not named["languages"]):
            how = "more than once" if start.count(None) > 1 else "and tokens.languages names none"
            sec.problems.add(f"{sec.path}.decoder_start holds null, the place of a language id, {how}: give "
                             "one null and tokens.languages ({code: id}), or the ids alone")
            ok = False
        prompt = tuple(start) if ok else ()
    else:
        one = sec.number("decoder_start", int, None, 0)
        prompt = () if one is None else (one,)
    return Tokens(eos=tuple(eos), decoder_prompt=prompt, **named, **values)


def _token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _named_ids(sec: Section, key: str) -> tuple[tuple[str, int], ...]:
    """tokens.languages or tokens.tasks: {name: token id}, as (name, id) pairs."""
    raw = sec.raw.get(key)
    if raw is None:
        return ()
    if not isinstance(raw, dict) or not raw or not all(
            isinstance(k, str) and k and _token_id(v) for k, v in raw.items()):
        sec.problems.add(f"{sec.path}.{key} must map names to token ids ({{\"en\": 50259, ...}}), "
                         f"found {quote(raw)}")
        return ()
    return tuple(raw.items())


def _generation(sec: Section, folder: Folder) -> Generation:
    samp, spec = sec.sub("sampling"), sec.sub("speculative")
    top_keys = [key for key, _ in by_v2()]
    sec.allow("loop", "sampling", "speculative", "scheduler", "codebooks", *top_keys)
    samp.allow(*(key for key, _ in by_v2("sampling")))
    spec.allow(*(key for key, _ in by_v2("speculative")))
    values: dict[str, Any] = {}
    for section, where in ((sec, ""), (samp, "sampling"), (spec, "speculative")):
        for key, setting in by_v2(where):
            if key not in section.raw:
                continue
            checked, problem = setting.check(section.raw[key])
            if problem:
                sec.problems.add(f"{section.path}.{key} {problem}")
            elif checked is not None:
                values[setting.name] = checked
    max_length = values.pop("max_length", None)
    draft = values.get("draft_model")
    if draft is not None:
        tokenizer = posixpath.join(draft, "tokenizer.json")
        try:
            if not folder.exists(tokenizer):  # the containment check too: a folder inside the model folder
                sec.problems.add(f"{spec.path}.draft_model: {folder.describe(tokenizer)} does not exist; the "
                                 "draft model is a folder inside the model folder, with its tokenizer")
        except ConfigError as e:
            sec.problems.add(f"{spec.path}.draft_model: {e}")
    loop = sec.choice("loop", GENERATION_LOOPS, "autoregressive", what="generation loop")
    by_key = {s.v2: s for s in SETTINGS if s.v2}
    given = [k for k in sec.raw if k not in ("sampling", "speculative")]
    for key in given + [f"sampling.{k}" for k in samp.raw] + [f"speculative.{k}" for k in spec.raw]:
        setting = by_key.get(key)
        if setting is not None and loop not in setting.loops:
            sec.problems.add(
                f"generation.{key} is a setting of the {_loops(setting.loops)} loop; this config's "
                f'loop is "{loop}": drop it'
            )
    if "scheduler" in sec.raw and loop != "denoising":
        sec.problems.add(
            f'generation.scheduler is a setting of the "denoising" loop; this config\'s loop is '
            f'"{loop}": drop it'
        )
    return Generation(
        loop=loop,
        max_length=max_length,
        settings=SearchSettings(**values),
        scheduler=sec.get("scheduler", str),
        codebooks=_codebooks(sec, loop, values),
    )


def _codebooks(sec: Section, loop: str, values: dict[str, Any]) -> Codebooks | None:
    """generation.codebooks: {count, delay, guidance_scale} (one row of codes per request; greedy unless the
    request samples)."""
    if "codebooks" not in sec.raw:
        return None
    c = sec.sub("codebooks")
    if not isinstance(c.raw, dict):
        sec.problems.add(f'{c.path} must be an object like {{"count": 4, "delay": [0, 1, 2, 3]}}, '
                         f"found {quote(c.raw)}")
        return None
    c.allow("count", "delay", "guidance_scale")
    if loop != "autoregressive":
        sec.problems.add(f'{c.path} is for the "autoregressive" loop; this config\'s loop is "{loop}": '
                         "drop it")
    count = c.number("count", int, None, 1, 64)
    if count is None:
        sec.problems.add(f'{c.path} needs "count": the codebooks each step samples (MusicGen: 4)')
        return None
    delay = c.int_list("delay")
    if delay is None and "delay" not in c.raw:
        delay = tuple(range(count))  # MusicGen's delay pattern
    elif delay is not None and (len(delay) != count or any(d < 0 or d > 4096 for d in delay)):
        sec.problems.add(f"{c.path}.delay must list {count} delays (steps, 0 to 4096), one per codebook, "
                         f"found {quote(list(delay))}")
    unread = sorted(k for k in values if k not in CODEBOOK_SAMPLING)  # max_length was taken out
    if unread:
        sec.problems.add(
            f"generation.codebooks reads only max_length, {', '.join(CODEBOOK_SAMPLING)} (and its "
            f"own guidance_scale) from the config: drop {', '.join(unread)}"
        )
    scale = c.number("guidance_scale", float, 1.0, 0.0, 1e6)
    if delay is None or scale is None:
        return None
    return Codebooks(count, tuple(delay), float(scale))


def _loops(loops: tuple[str, ...]) -> str:
    return " and ".join(f'"{loop}"' for loop in loops)
