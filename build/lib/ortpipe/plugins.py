"""Plugins: a loop the config's vocabulary cannot express, supplied by a Python package.

`pipeline.plugin: {"module": "package.module:factory", "wheel": "file.whl"}` names a factory; ortpipe
calls it with a `Context` and gets a `Loop` whose `run(prompt)` is written against the same sans-IO
work protocol as ortpipe's own loops: it yields `Run` / `RunAll` work items (model sessions by their
name in `pipeline.sessions`, ortpipe's kernels by `kernel(name, dtype)`) and returns the generated
token ids. Both targets drive it unchanged. A plugin is code: it runs only when the caller opts in
(`allow_plugins=True`, `--allow-plugins`, `{allowPlugins: true}`); otherwise loading the folder is a
ConfigError that names the opt-in. The factory's `settings` attribute names the generation settings
its loop reads (Context.settings); a request or config that sets any other is refused. `wheel`
(optional) is a pure-Python wheel in the model folder,

put on the import path at load (CPython imports it from the file, the browser from a copy in
Pyodide's file system), so a folder can carry its plugin.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from .config.settings import SearchSettings
from .errors import ConfigError
from .execute.work import Backend, Handle, Work
from .plan import Plan


@dataclass(frozen=True)
class Context:
    """What a plugin's loop gets for one request."""

    plan: Plan  # the config, and every session's signature (plan.signatures)
    backend: Backend  # tensors: tensor(), full(), shape(), dtype(), to_list()
    settings: SearchSettings
    max_length: int  # prompt and generated tokens together, at most
    eos: frozenset[int]
    inputs: dict[str, Handle] = field(default_factory=dict)  # the request's own inputs


class Loop(Protocol):
    def run(self, prompt: list[int]) -> Work:
        """Yield work items; return the generated token ids (the prompt excluded)."""
        ...


Factory = Callable[[Context], Loop]


def unread_settings(factory: Factory, given: list[str]) -> list[str]:
    """Of the generation settings `given`, those the plugin's loop does not read: a factory names the
    ones it reads in its `settings` attribute (a collection of names; none when it has no such
    attribute), and ortpipe refuses the others rather than pass on what nothing applies."""
    reads = set(getattr(factory, "settings", ()))
    return sorted(name for name in given if name not in reads)



def load_factory(spec: dict[str, Any], allowed: bool, wheel_path: str | None) -> Factory:
    """The factory `spec["module"]` names ("package.module:factory"), imported only when `allowed`."""
    module_name, _, attribute = spec["module"].partition(":")
    if not allowed:
        raise ConfigError(
            f'pipeline.plugin runs code from "{module_name}": load the folder with '
            "allow_plugins=True (the CLI's --allow-plugins, the browser's {allowPlugins: true}) "
            "if you trust it"
        )
    if wheel_path and wheel_path not in sys.path:
        sys.path.insert(0, wheel_path)  # a pure-Python wheel is a zip that Python imports from
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # the plugin's own import errors, whatever their type
        where = "the folder's wheel" if wheel_path else "the installed packages"
        raise ConfigError(
            f'pipeline.plugin: module "{module_name}" cannot be imported from {where}: '
            f"{type(e).__name__}: {str(e)[:200]}"
        ) from None
    factory = getattr(module, attribute or "factory", None)
    if not callable(factory):
        raise ConfigError(f'pipeline.plugin: "{module_name}" has no callable "{attribute or "factory"}"')
    return factory
