"""Per-request traces: a span per session run, per phase and per step, as a Chrome trace
(opens in Perfetto or chrome://tracing), and a one-line summary per phase."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Span:
    name: str  # the session (or kernel) that ran
    label: str  # the phase or step it ran in: "init", "step 3", "final"
    start_us: float
    end_us: float
    thread: int
    shapes: dict[str, list[int]] = field(default_factory=dict)


class Trace:
    def __init__(self) -> None:
        self.spans: list[Span] = []

    def add(self, span: Span) -> None:
        self.spans.append(span)

    def phases(self) -> dict[str, list[Span]]:
        """Spans by phase ("init", "step", "final"), in time order."""
        grouped: dict[str, list[Span]] = {}
        for s in sorted(self.spans, key=lambda s: s.start_us):
            grouped.setdefault(s.label.split(" ")[0] or "other", []).append(s)
        return grouped

    def to_chrome(self) -> dict[str, Any]:
        origin = min((s.start_us for s in self.spans), default=0.0)
        threads = {t: i + 1 for i, t in enumerate(dict.fromkeys(s.thread for s in self.spans))}
        events: list[dict[str, Any]] = [
            {"ph": "X", "name": s.name, "cat": "run", "ts": s.start_us - origin, "dur": s.end_us - s.start_us,
             "pid": 1, "tid": threads[s.thread], "args": {"label": s.label, **s.shapes}} for s in self.spans]
        envelopes: dict[str, list[float]] = {}
        for s in self.spans:
            for key in {s.label, s.label.split(" ")[0]}:
                lo_hi = envelopes.setdefault(key, [s.start_us, s.end_us])
                lo_hi[0], lo_hi[1] = min(lo_hi[0], s.start_us), max(lo_hi[1], s.end_us)
        for name, (lo, hi) in envelopes.items():
            track = 0 if " " not in name else -1  # phases on one track, steps on the next
            events.append({"ph": "X", "name": name, "cat": "phase" if track == 0 else "step",
                           "ts": lo - origin, "dur": hi - lo, "pid": 1, "tid": track})
        meta = [{"ph": "M", "name": "thread_name", "pid": 1, "tid": tid, "args": {"name": f"runs {tid}"}}
                for tid in threads.values()]
        meta += [{"ph": "M", "name": "thread_name", "pid": 1, "tid": 0, "args": {"name": "phases"}},
                 {"ph": "M", "name": "thread_name", "pid": 1, "tid": -1, "args": {"name": "steps"}}]
        return {"traceEvents": meta + events, "displayTimeUnit": "ms"}

    def write(self, path: str) -> None:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.to_chrome(), f)

    def summary(self) -> list[str]:
        lines = []
        for phase, spans in self.phases().items():
            wall = (max(s.end_us for s in spans) - min(s.start_us for s in spans)) / 1000
            by_session: dict[str, float] = {}
            for s in spans:
                by_session[s.name] = by_session.get(s.name, 0.0) + (s.end_us - s.start_us) / 1000
            steps = len({s.label for s in spans})
            parts = ", ".join(f"{n} {ms:.1f} ms" for n, ms in sorted(by_session.items(), key=lambda x: -x[1]))
            extra = f", {steps} steps" if phase == "step" else ""
            lines.append(f"{phase}: {len(spans)} runs{extra} in {wall:.1f} ms ({parts})")
        return lines
