"""The one error family users see.

Every mistake in a config or a model folder is reported as a ConfigError that names the field,
what was found, what is allowed and, where one is close, a suggestion. Validation collects every
problem it finds and raises them together, so one run of `ortpipe validate` lists them all.
"""

from __future__ import annotations

# typing's TYPE_CHECKING without importing typing, and difflib imported where it is used: the package's own
# import stays small, so `python -m ortpipe.cli` reaches its Ctrl-C handler sooner.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Iterable


class OrtpipeError(Exception):
    """Base of every error ortpipe raises on purpose. `partial`: when a request fails after it
    generated tokens, what it had generated (a Result, finish_reason "error")."""

    partial = None



MAX_PROBLEM = 600  # characters of one problem's text; what a config quotes never makes a message long
MAX_PROBLEMS = 30


def bounded(text: str, limit: int = MAX_PROBLEM) -> str:
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text) - limit} more characters)"


class ConfigError(OrtpipeError, ValueError):
    """A config or model folder that cannot be run; `problems` lists every problem found."""

    def __init__(self, problems: str | Iterable[str]):
        self.problems = [bounded(p) for p in ([problems] if isinstance(problems, str) else problems)]
        if len(self.problems) == 1:
            text = self.problems[0]
        else:
            shown = self.problems[:MAX_PROBLEMS]
            more = len(self.problems) - len(shown)
            text = f"{len(self.problems)} problems:\n" + "\n".join(f"  - {p}" for p in shown)
            text += f"\n  ... and {more} more" if more else ""
        super().__init__(text)


ONE_PROMPT = ("give exactly one of prompt (text) and prompt_ids (token ids); on the command line: "
              'ortpipe run MODEL_DIR "TEXT", --prompt TEXT or --prompt-ids 1,2,3')


class GenerationError(OrtpipeError, ValueError):
    """A request that cannot be served: bad settings or inputs, caught before any model runs. `setting`: the
    generation setting (or "prompt_ids") it refuses, when it is one (a server names it as the parameter)."""

    def __init__(self, message: str, setting: str | None = None):
        super().__init__(bounded(message, 2 * MAX_PROBLEM))
        self.setting = setting



def did_you_mean(name: str, choices: Iterable[str]) -> str:
    """' Did you mean "x"?' when a choice is close to `name`, else ''."""
    import difflib

    close = difflib.get_close_matches(str(name), list(choices), n=1, cutoff=0.6)
    return f' Did you mean "{close[0]}"?' if close else ""


def one_of(choices: Iterable[str]) -> str:
    return ", ".join(choices)


class Problems:
    """Collects problems during validation; `raise_if_any` raises them as one ConfigError."""

    def __init__(self) -> None:
        self.items: list[str] = []

    def add(self, message: str) -> None:
        if message not in self.items:
            self.items.append(message)

    def __bool__(self) -> bool:
        return bool(self.items)

    def raise_if_any(self) -> None:
        if self.items:
            raise ConfigError(self.items)
