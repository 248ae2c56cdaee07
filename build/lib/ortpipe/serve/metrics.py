"""What /metrics reports, in the Prometheus text format (version 0.0.4).

The engine thread records; the event loop renders. Counters are plain ints (one writer); the recent
tokens window, read by both threads, sits behind a lock.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, deque
from dataclasses import dataclass

WINDOW_SECONDS = 10.0  # tokens/s is measured over this much of the recent past


@dataclass(frozen=True)
class Gauges:
    """Values of the moment, read from the engine when /metrics is asked for."""

    loaded: bool
    queue_length: int
    rows: int
    max_batch: int
    max_queue: int


class Metrics:
    def __init__(self) -> None:
        self.finished: Counter[str] = Counter()  # requests by finish reason (and error)
        self.rejected = 0  # 429s: the queue was full
        self.prompt_tokens = self.cached_tokens = self.completion_tokens = 0
        self.drafted_tokens = self.accepted_tokens = 0  # speculative decoding's, over finished requests
        self.steps = self.row_steps = 0  # engine steps, and rows summed over them (mean occupancy: the ratio)
        self.ttft_seconds = 0.0
        self.ttft_count = 0
        self.mean_request_seconds = 0.0  # a moving average, for Retry-After
        self._recent: deque[tuple[float, int]] = deque()
        self._lock = threading.Lock()

    def tokens(self, n: int) -> None:
        now = time.monotonic()
        self.completion_tokens += n
        with self._lock:
            self._recent.append((now, n))
            while self._recent and self._recent[0][0] < now - WINDOW_SECONDS:
                self._recent.popleft()

    def step(self, rows: int) -> None:
        self.steps += 1
        self.row_steps += rows

    def first_token(self, seconds: float) -> None:
        self.ttft_seconds += seconds
        self.ttft_count += 1

    def finish(self, reason: str, prompt_tokens: int, cached_tokens: int, seconds: float, drafted: int = 0,
               accepted: int = 0) -> None:
        self.finished[reason] += 1
        self.drafted_tokens += drafted
        self.accepted_tokens += accepted
        self.prompt_tokens += prompt_tokens
        self.cached_tokens += cached_tokens
        done = sum(self.finished.values())
        self.mean_request_seconds += (seconds - self.mean_request_seconds) / min(done, 20)

    def tokens_per_second(self) -> float:
        now = time.monotonic()
        with self._lock:
            n = sum(count for t, count in self._recent if t >= now - WINDOW_SECONDS)
        return n / WINDOW_SECONDS

    def retry_after(self, waiting: int, max_batch: int) -> int:
        """Seconds until a place in the queue is likely free: the waiting requests' time over the rows."""
        guess = self.mean_request_seconds * (waiting + 1) / max(max_batch, 1)
        return max(1, min(60, round(guess)))

    def render(self, g: Gauges) -> str:
        lines: list[str] = []

        def metric(name: str, kind: str, help_text: str, samples: list[tuple[str, float]]) -> None:
            lines.append(f"# HELP ortpipe_{name} {help_text}")
            lines.append(f"# TYPE ortpipe_{name} {kind}")
            lines.extend(f"ortpipe_{name}{labels} {value:g}" for labels, value in samples)

        reasons = ("eos", "stop", "length", "interrupt", "done", "error")  # done: an output endpoint answered
        metric("requests_total", "counter", "Requests the engine finished, by finish reason.",
               [(f'{{finish_reason="{r}"}}', self.finished[r]) for r in reasons])
        metric("requests_rejected_total", "counter", "Requests refused with 429 because the queue was full.",
               [("", self.rejected)])
        metric("model_loaded", "gauge", "1 once the model is loaded.", [("", int(g.loaded))])
        metric("queue_length", "gauge", "Requests waiting for a row.", [("", g.queue_length)])
        metric("queue_capacity", "gauge", "Requests that may wait (--max-queue).", [("", g.max_queue)])
        metric("batch_rows", "gauge", "Rows being generated now.", [("", g.rows)])
        metric("batch_capacity", "gauge", "Rows at most (--max-batch).", [("", g.max_batch)])
        metric("batch_occupancy", "gauge", "Mean rows per engine step since the start, over the capacity.",
               [("", self.row_steps / self.steps / max(g.max_batch, 1) if self.steps else 0.0)])
        metric("engine_steps_total", "counter", "Engine steps (each advances every row once).",
               [("", self.steps)])
        metric("prompt_tokens_total", "counter", "Prompt tokens of finished requests.",
               [("", self.prompt_tokens)])
        metric("prompt_cached_tokens_total", "counter", "Prompt tokens served from the prompt cache.",
               [("", self.cached_tokens)])
        metric("generation_tokens_total", "counter", "Tokens generated.", [("", self.completion_tokens)])
        metric("generation_tokens_per_second", "gauge", f"Tokens generated per second over the last "
               f"{WINDOW_SECONDS:g} s, all rows together.", [("", round(self.tokens_per_second(), 3))])
        metric("speculative_drafted_tokens_total", "counter",
               "Drafted tokens checked by speculative decoding (finished requests).",
               [("", self.drafted_tokens)])
        metric("speculative_accepted_tokens_total", "counter",
               "Drafted tokens the model accepted (finished requests).", [("", self.accepted_tokens)])
        metric("time_to_first_token_seconds", "summary", "From arrival (queue included) to the first token.",
               [("_sum", round(self.ttft_seconds, 6)), ("_count", self.ttft_count)])
        return "\n".join(lines) + "\n"
