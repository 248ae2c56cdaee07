"""Execution providers for one session, on onnxruntime: pick, open, and check where the nodes went.

`open_session(path, spec, override)` walks the session's `execution_provider` list (or the override)
in order. A provider that is not installed is passed over; a plugin EP package (onnxruntime-qnn 2.x,
onnxruntime-ep-openvino) is registered with onnxruntime from its own `get_library_path()` first. A
provider that fails to compile the graph is passed over too, with a warning, and the next one is
tried. When none is left, a ConfigError says what each one lacked and which extra installs it.

After the session is created, onnxruntime reports the nodes it placed on each provider (the session
config entry `session.record_ep_graph_assignment_info`, onnxruntime 1.24 and later; recording costs
nothing measurable at creation and reading it about 0.1 ms for a few hundred nodes). Nodes on a
provider the session did not list (the implicit CPU fallback) are a visible warning, and so is a
provider that onnxruntime dropped while creating the session (a missing device, a plugin that found
none). `Assignment` carries the outcome for `ortpipe inspect --ep`.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import re
import warnings
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import onnxruntime as ort

from ...config import ep
from ...config.schema import SessionSpec
from ...errors import ConfigError, Problems, did_you_mean
from ...variants import optimized_ahead

RECORD_ASSIGNMENT = "session.record_ep_graph_assignment_info"
# genai's boolean session_options that onnxruntime takes as session config entries
_CONFIG_ENTRIES = {"disable_cpu_ep_fallback": "session.disable_cpu_ep_fallback",
                   "disable_quant_qdq": "session.disable_quant_qdq",
                   "enable_quant_qdq_cleanup": "session.enable_quant_qdq_cleanup",
                   "ep_context_enable": "ep.context_enable", "ep_context_embed_mode": "ep.context_embed_mode"}
_ATTRIBUTES = {"intra_op_num_threads": "intra_op_num_threads", "inter_op_num_threads": "inter_op_num_threads",
               "enable_cpu_mem_arena": "enable_cpu_mem_arena", "enable_mem_pattern": "enable_mem_pattern",
               "enable_mem_reuse": "enable_mem_reuse", "log_severity_level": "log_severity_level",
               "log_id": "logid"}
_ENUMS = {"graph_optimization_level": ort.GraphOptimizationLevel, "execution_mode": ort.ExecutionMode}
# what a provider needs whatever the config says, beneath the config's own settings
_PROVIDER_DEFAULTS = {"dml": {"enable_mem_pattern": False, "execution_mode": "ORT_SEQUENTIAL"}}
# the provider option that picks a device, for plugin EPs that list one OrtEpDevice per device
_DEVICE_OPTION = {"openvino": "device_type"}
_ORT_ERROR = re.compile(r"\[ONNXRuntimeError\] : \d+ : \w+ : ")
_registered: dict[str, str] = {}  # provider key -> the plugin library registered for it in this process


class ProviderWarning(UserWarning):
    """A session placed (partly) on a provider it did not ask for, or a provider passed over."""


@dataclass(frozen=True)
class Skipped:
    provider: str
    reason: str


@dataclass(frozen=True)
class Assignment:
    """Where one session runs: the provider it was opened with and the nodes onnxruntime placed on each."""

    session: str
    requested: tuple[str, ...]  # provider keys asked for, in order
    provider: str  # the one the session was opened with
    options: dict[str, str] = field(default_factory=dict)  # its provider options
    nodes: dict[str, int] = field(default_factory=dict)  # provider -> nodes on it; {} when not recorded
    op_types: dict[str, tuple[str, ...]] = field(default_factory=dict)  # provider -> op types placed on it
    skipped: tuple[Skipped, ...] = ()  # providers passed over, and why
    warnings: tuple[str, ...] = ()
    optimized_ahead: bool = False  # the graph was optimized for this provider ahead: not again here

    @property
    def total(self) -> int:
        return sum(self.nodes.values())

    def share(self, provider: str) -> float:
        return self.nodes.get(provider, 0) / self.total if self.total else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {"provider": self.provider, "requested": list(self.requested), "options": dict(self.options),
                "nodes": dict(self.nodes), "total_nodes": self.total,
                "shares": {p: round(self.share(p), 4) for p in self.nodes},
                "op_types": {p: list(ops) for p, ops in self.op_types.items()},
                "skipped": [{"provider": s.provider, "reason": s.reason} for s in self.skipped],
                "warnings": list(self.warnings), "optimized_ahead": self.optimized_ahead}

    def describe(self) -> str:
        """One line for people: 'vision: openvino (device_type CPU), 8 of 8 nodes (100%) on openvino'."""
        device = "".join(f" ({k} {self.options[k]})" for k in ("device_type", "backend_type")
                         if k in self.options)
        if not self.nodes:
            placed = "node placement not recorded (onnxruntime 1.24 or later reports it)"
        else:
            placed = ", ".join(f"{n} of {self.total} nodes ({self.share(p):.0%}) on {p}"
                               for p, n in sorted(self.nodes.items(), key=lambda item: -item[1]))
        return f"{self.session}: {self.provider}{device}, {placed}"


# --- what is installed -------------------------------------------------------------------------


def installed() -> dict[str, str]:
    """Provider key -> how this environment has it ("built in" or the plugin package's module)."""
    have = {ep.provider_key(name): "built in" for name in ort.get_available_providers()}
    for key, info in ep.PROVIDERS.items():
        if key not in have and info.plugin and importlib.util.find_spec(info.plugin) is not None:
            have[key] = info.plugin
    return {k: v for k, v in have.items() if k is not None}


def _install_hint(key: str) -> str:
    info = ep.PROVIDERS[key]
    if info.extra is None:
        carried = f" ({' or '.join(info.packages)} has it)" if info.packages else ""
        return f"ortpipe has no extra that installs it{carried}"
    return f'pip install "ortpipe[{info.extra}]" installs it (package {" or ".join(info.packages)})'


def register_plugin(key: str) -> str | None:
    """Register a plugin EP package's library with onnxruntime (once); the reason it cannot be, or None."""
    info = ep.PROVIDERS[key]
    if key in _registered:
        return None
    if not hasattr(ort, "register_execution_provider_library"):
        return f"onnxruntime {ort.__version__} cannot load plugin execution providers (1.23 or later can)"
    try:
        module = importlib.import_module(info.plugin or "")
        library = module.get_library_path()
        ort.register_execution_provider_library(info.ort_name, library)
    except Exception as e:  # a broken package or library: passed over with its own words
        if "already registered" not in str(e):
            return f"its plugin package {info.plugin} could not be registered: {_last_line(e)}"
        library = "(registered before)"
    _registered[key] = library
    return None


def _plugin_devices(key: str, options: dict[str, str]) -> list[Any]:
    name = ep.PROVIDERS[key].ort_name
    devices = [d for d in ort.get_ep_devices() if d.ep_name == name]
    wanted = options.get(_DEVICE_OPTION.get(key, ""), "").split(".")[0]
    if wanted in ("CPU", "GPU", "NPU"):
        devices = [d for d in devices if d.device.type.name == wanted]
    return devices


# --- session options ---------------------------------------------------------------------------


def session_options(settings: dict[str, Any], threads: int | None = None,
                    record: bool = True) -> ort.SessionOptions:
    """onnxruntime SessionOptions from validated session_options (genai's keys) for one provider."""
    options = ort.SessionOptions()
    options.log_severity_level = 3  # failures reach the user as ortpipe errors with context, once
    for key, attribute in _ATTRIBUTES.items():
        if key in settings:
            setattr(options, attribute, settings[key])
    for key, enum in _ENUMS.items():
        if key in settings:
            setattr(options, key, getattr(enum, settings[key]))
    if "enable_profiling" in settings:
        options.enable_profiling = True
        options.profile_file_prefix = settings["enable_profiling"]
    for key, entry in _CONFIG_ENTRIES.items():
        if key in settings:
            options.add_session_config_entry(entry, "1" if settings[key] else "0")
    if "ep_context_file_path" in settings:
        options.add_session_config_entry("ep.context_file_path", settings["ep_context_file_path"])
    for key, value in settings.get("config_entries", {}).items():
        options.add_session_config_entry(key, value)
    if threads:
        options.intra_op_num_threads = threads
    if record:
        options.add_session_config_entry(RECORD_ASSIGNMENT, "1")
    return options


# --- opening a session -------------------------------------------------------------------------


@dataclass(frozen=True)
class SessionRequest:
    """A session's provider settings, validated: what `open_session` works from."""

    name: str
    providers: tuple[str, ...]
    provider_options: dict[str, dict[str, str]]
    session_options: dict[str, Any]


def request_for(spec: SessionSpec, override: str | Sequence[str] | None = None) -> SessionRequest:
    """The session's providers (or the override's), provider options and session options, checked."""
    problems = Problems()
    where = f"pipeline.sessions.{spec.name}"
    wanted = override if override else list(spec.providers)
    label = "the override (--ep, load(provider=))" if override else f"{where}.execution_provider"
    providers = ep.provider_names(list(wanted) if not isinstance(wanted, str) else wanted, label, problems)
    provider_options = ep.check_provider_options(spec.provider_options, f"{where}.provider_options", problems)
    settings = ep.check_session_options(spec.session_options, f"{where}.session_options", problems)
    problems.raise_if_any()
    return SessionRequest(spec.name, providers, provider_options, settings)


def open_session(path: str | Path, spec: SessionSpec, override: str | Sequence[str] | None = None, *,
                 threads: int | None = None, record: bool = True,
                 optimized_for: str | None = None) -> tuple[ort.InferenceSession, Assignment]:
    """Open `path` on the first provider of the session's list that is installed and compiles it.

    `override` (the CLI's --provider / --ep) replaces the session's list. `threads` sets
    intra_op_num_threads over the config's. `record=False` skips recording node placement.
    `optimized_for`: the provider the graph was optimized for ahead (variants.py OPTIMIZED_FOR); a
    session on it is created without optimizing the graph again, unless the config sets the level.
    """
    request = request_for(spec, override)
    have = installed()
    skipped: list[Skipped] = []
    for i, key in enumerate(request.providers):
        options = request.provider_options.get(key, {})
        reason = _unavailable(key, have, options)
        if reason:
            skipped.append(Skipped(key, reason))
            continue
        chain = [key] + [k for k in request.providers[i + 1:] if have.get(k) == "built in"]
        ahead = (optimized_ahead(optimized_for, ep.PROVIDERS[key].ort_name)
                 and "graph_optimization_level" not in ep.options_for(request.session_options, key))
        try:
            session = _create(Path(path), request, chain, have, threads, record, ahead)
        except Exception as e:  # onnxruntime's own error types; the next provider is tried
            skipped.append(Skipped(key, f"it failed to create the session: {_last_line(e)}"))
            continue
        assignment = _assignment(session, request, key, options, skipped, record, ahead)
        for message in assignment.warnings:
            warnings.warn(message, ProviderWarning, stacklevel=2)
        return session, assignment
    raise ConfigError(_none_left(request, skipped, have, spec.file))


def _unavailable(key: str, have: dict[str, str], options: dict[str, str]) -> str | None:
    where = have.get(key)
    if where is None:
        return f"it is not installed here: {_install_hint(key)}"
    if where != "built in":
        reason = register_plugin(key)
        if reason:
            return reason
        if not _plugin_devices(key, options):
            device = options.get(_DEVICE_OPTION.get(key, ""), "")
            return f"its plugin ({where}) found no {device + ' ' if device else ''}device on this machine"
    return None


def _create(path: Path, request: SessionRequest, chain: list[str], have: dict[str, str], threads: int | None,
            record: bool, ahead: bool = False) -> ort.InferenceSession:
    """`ahead`: the graph was optimized for this provider ahead (and the config sets no level): the
    session does not optimize it again."""
    key = chain[0]
    settings = {**_PROVIDER_DEFAULTS.get(key, {}), **ep.options_for(request.session_options, key)}
    if ahead:
        settings["graph_optimization_level"] = "ORT_DISABLE_ALL"
    options = session_options(settings, threads, record)
    if have[key] != "built in":  # a plugin EP is added by its devices; onnxruntime adds the CPU fallback
        provider_options = dict(request.provider_options.get(key, {}))
        devices = _plugin_devices(key, provider_options)
        provider_options.pop(_DEVICE_OPTION.get(key, ""), None)  # the device is chosen by `devices`
        options.add_provider_for_devices(devices, provider_options)
        return ort.InferenceSession(str(path), options)
    names = [ep.PROVIDERS[k].ort_name for k in chain]
    return ort.InferenceSession(str(path), options, providers=names,
                                provider_options=[request.provider_options.get(k, {}) for k in chain])


def _none_left(request: SessionRequest, skipped: list[Skipped], have: dict[str, str], file: str) -> str:
    asked = " or ".join(request.providers)
    reasons = "; ".join(f"{s.provider}: {s.reason}" for s in skipped)
    if all(s.provider in have for s in skipped):  # installed, and each failed: the graph, not the setup
        return f'session "{request.name}" could not be created from {file} on {asked}: {reasons}'
    example = json.dumps([request.providers[0], "cpu"])
    return (f'session "{request.name}" ({file}) asks for {asked}, and none could run it. {reasons}. '
            f"Installed here: {', '.join(sorted(have)) or 'none'}. Install the provider it asks for (one "
            f"onnxruntime flavour per environment), or add an installed one to its execution_provider list "
            f"(e.g. {example})")


# --- where the nodes went ----------------------------------------------------------------------


def placement(session: ort.InferenceSession) -> tuple[dict[str, int], dict[str, tuple[str, ...]]]:
    """Nodes and op types per provider key, as onnxruntime assigned them ({} where it was not recorded)."""
    read = getattr(session, "get_provider_graph_assignment_info", None)
    if read is None:
        return {}, {}
    try:
        subgraphs = read()
    except Exception:  # recording was off for this session
        return {}, {}
    nodes: Counter[str] = Counter()
    ops: dict[str, set[str]] = {}
    for subgraph in subgraphs:
        key = ep.provider_key(subgraph.ep_name) or subgraph.ep_name
        placed = subgraph.get_nodes()
        nodes[key] += len(placed)
        ops.setdefault(key, set()).update(n.op_type for n in placed)
    return dict(nodes), {k: tuple(sorted(v)) for k, v in ops.items()}


def _assignment(session: ort.InferenceSession, request: SessionRequest, key: str, options: dict[str, str],
                skipped: list[Skipped], record: bool, ahead: bool = False) -> Assignment:
    nodes, ops = placement(session) if record else ({}, {})
    accepted = request.providers[request.providers.index(key):]
    name = f'session "{request.name}"'
    messages = [f"{name}: {s.provider} was passed over: {s.reason}; using {key}, next in its "
                "execution_provider list" for s in skipped]
    total = sum(nodes.values())
    if ep.PROVIDERS[key].ort_name not in session.get_providers():  # one message for both causes
        messages.append(f"{name}: onnxruntime created the session without {key} (it claimed none of the "
                        "nodes, or its device or driver is missing: its log above says which); it runs on "
                        f"{', '.join(session.get_providers())}")
    elif nodes and key not in nodes:
        messages.append(f"{name}: {key} took none of its {total} nodes; they run on {', '.join(nodes)}")
    for provider, count in nodes.items():
        if provider not in accepted:
            messages.append(f"{name}: {count} of {total} nodes ({count / total:.0%}) run on "
                            f"{provider}, which the session did not ask for ({', '.join(ops[provider][:8])}"
                            f"{', ...' if len(ops[provider]) > 8 else ''}). Add \"{provider}\" to its "
                            "execution_provider list to accept this")
    return Assignment(request.name, request.providers, key, dict(options), nodes, ops, tuple(skipped),
                      tuple(messages), ahead)


def _last_line(error: BaseException) -> str:
    """The cause in an onnxruntime message: after its last "[ONNXRuntimeError] : N : CODE :", the last line
    (what comes before is C++ context)."""
    text = _ORT_ERROR.split(str(error))[-1]
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return (lines[-1] if lines else type(error).__name__)[:300]


# --- overrides: the CLI's --ep, load(provider=) ------------------------------------------------

Overrides = dict[str | None, tuple[str, ...]]  # session name, or None for every session -> provider keys


def overrides_from(provider: str | Sequence[str] | Mapping[str | None, str | Sequence[str]] | None
                   ) -> Overrides:
    """`load(provider=...)`: a name or a fallback list for every session, or {session: name or list}
    (the key None: every session, as `parse_overrides` gives)."""
    if provider is None:
        return {}
    items = provider.items() if isinstance(provider, Mapping) else [(None, provider)]
    problems = Problems()
    out: Overrides = {}
    for session, names in items:
        label = "provider" if session is None else f"provider[{session!r}]"
        value = names if isinstance(names, str) else list(names) if isinstance(names, Sequence) else names
        out[session] = ep.provider_names(value, label, problems)
    problems.raise_if_any()
    return out


def check_overrides(overrides: Overrides, sessions: Iterable[str]) -> None:
    """Every session an override names must be one of the pipeline's."""
    names = list(sessions)
    unknown = [s for s in overrides if s is not None and s not in names]
    if unknown:
        raise ConfigError([f'The execution provider override (--ep {s}=...) names session "{s}", which '
                           f"this pipeline does not have. Its sessions: {', '.join(names)}."
                           f"{did_you_mean(s, names)}" for s in unknown])


def parse_overrides(values: Iterable[str]) -> Overrides:
    """`--ep openvino` (every session) and `--ep vision=openvino,cpu` (one session) -> {None | name: keys}."""
    problems = Problems()
    out: Overrides = {}
    for value in values:
        session, _, providers = value.rpartition("=")
        keys = ep.provider_names(providers.split(","), f"--ep {value}", problems)
        out[session or None] = keys
    problems.raise_if_any()
    return out


def override_for(overrides: Overrides, session: str) -> tuple[str, ...] | None:
    """The providers `--ep` gives one session: its own entry, else the entry for every session."""
    return overrides.get(session) or overrides.get(None)


def report(assignments: Iterable[Assignment]) -> str:
    """`ortpipe inspect --ep`: a line per session, then the warnings."""
    items = list(assignments)
    return "\n".join([a.describe() for a in items] + [f"warning: {w}" for a in items for w in a.warnings])
