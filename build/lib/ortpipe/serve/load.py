"""The serve benchmark's load generator: aggregate tokens/s of `ortpipe serve` at 1, 2, 4, 8 streams.

    ortpipe bench --serve MODEL_DIR [--streams 1,2,4,8] [--prompt-tokens 64] [--new-tokens 128]
    ortpipe bench --serve --url http://127.0.0.1:8000 [--api-key KEY] [--vocab N] ...

Given a model folder it starts `ortpipe serve` in a process of its own (rows enough for the most streams)
and stops it at the end; given a URL it measures a server that is already running (llama.cpp's server
takes the same requests). Each level runs N client threads at once, each sending `--rounds` streaming
/v1/completions requests one after another: greedy, prompt token ids drawn from a seeded generator (a
different prompt per request, so the prompt cache does not help), usage from include_usage. Reported per
level: aggregate completion tokens/s over the level's wall time, time to first token (median and 95th
percentile, from sending the request), and the mean tokens/s one stream sees after its first token.
Standard library only, so it runs wherever the server's clients run.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import re
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from urllib.parse import urlsplit

from ..errors import OrtpipeError


@dataclass(frozen=True)
class Sample:
    ttft_s: float
    seconds: float  # the whole request
    tokens: int


@dataclass(frozen=True)
class Level:
    streams: int
    requests: int
    tokens: int
    seconds: float
    tokens_per_s: float  # all streams together
    ttft_p50_ms: float
    ttft_p95_ms: float
    stream_tokens_per_s: float  # what one stream sees after its first token, mean over requests


def one_request(url: str, prompt: list[int], new_tokens: int, api_key: str | None) -> Sample:
    parts = urlsplit(url)
    body = json.dumps({"model": "bench", "prompt": prompt, "max_tokens": new_tokens, "temperature": 0,
                       "stream": True, "stream_options": {"include_usage": True}})
    headers = {"content-type": "application/json"}
    if api_key:
        headers["authorization"] = f"Bearer {api_key}"
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=600)
    start = time.perf_counter()
    first, tokens = 0.0, 0
    try:
        conn.request("POST", parts.path.rstrip("/") + "/v1/completions", body, headers)
        response = conn.getresponse()
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {response.read().decode(errors='replace')}")
        for line in response:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event.get("choices") and not first:
                first = time.perf_counter()
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
    finally:
        conn.close()
    end = time.perf_counter()
    return Sample((first or end) - start, end - start, tokens)


def run_level(url: str, streams: int, rounds: int, prompt_tokens: int, new_tokens: int, vocab: int,
              api_key: str | None, seed: int = 0) -> Level:
    rng = random.Random(seed * 1000 + streams)
    prompts = [[rng.randrange(3, vocab) for _ in range(prompt_tokens)] for _ in range(streams * rounds)]
    samples: list[Sample] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def client(index: int) -> None:
        for r in range(rounds):
            try:
                sample = one_request(url, prompts[index * rounds + r], new_tokens, api_key)
            except Exception as e:  # reported after the level; the other streams go on
                with lock:
                    errors.append(e)
                return
            with lock:
                samples.append(sample)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(streams)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - start
    if errors:
        raise OrtpipeError(f"{len(errors)} of {streams * rounds} requests failed at {streams} streams: "
                           f"{errors[0]} (is the server running, and does it take these requests?)")
    ttfts = sorted(s.ttft_s * 1000 for s in samples)
    rates = [(s.tokens - 1) / (s.seconds - s.ttft_s) for s in samples
             if s.tokens > 1 and s.seconds > s.ttft_s]
    tokens = sum(s.tokens for s in samples)
    return Level(streams, len(samples), tokens, round(seconds, 3), round(tokens / seconds, 1),
                 round(statistics.median(ttfts), 1), round(ttfts[len(ttfts) * 95 // 100], 1),
                 round(statistics.fmean(rates), 1) if rates else 0.0)


def run_processes(model: str, count: int, prompt_tokens: int, new_tokens: int, vocab: int,
                  threads: int | None) -> float:
    """The comparison without a server: `count` separate `ortpipe run` processes at once (each loading its
    own copy of the model), the sum of their decode tokens/s (each from its own timings)."""
    rng = random.Random(count)
    command = [sys.executable, "-m", "ortpipe.cli", "run", model, "--max-new-tokens", str(new_tokens),
               "--temperature", "0", "--json"] + (["--threads", str(threads)] if threads else [])
    prompts = [",".join(str(rng.randrange(3, vocab)) for _ in range(prompt_tokens)) for _ in range(count)]
    procs = [subprocess.Popen([*command, "--prompt-ids", ids], stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, text=True) for ids in prompts]

    rates = []
    for proc in procs:
        out, _ = proc.communicate(timeout=900)
        if proc.returncode != 0:
            raise OrtpipeError(f"ortpipe run exited with {proc.returncode} on {model}")
        rates.append(json.loads(out)["timings"]["decode_tokens_per_s"])
    return round(sum(rates), 1)


def start_server(model: str, max_batch: int, threads: int | None) -> tuple[subprocess.Popen, str]:
    """`ortpipe serve MODEL --port 0` in a process of its own; returns it and its URL once loaded."""
    command = [
        sys.executable,
        "-m",
        "ortpipe.cli",
        "serve",
        model,
        "--port",
        "0",
        "--max-batch",
        str(max_batch),
        "--max-queue",
        str(4 * max_batch),
    ]
    if threads:
        command += ["--threads", str(threads)]
    proc = subprocess.Popen(
        command, stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"}
    )
    found = re.search(r"http://[^\s/]+", proc.stderr.readline())
    if found is None:
        proc.kill()
        raise OrtpipeError(f"ortpipe serve did not start: {proc.stderr.read().strip()}")
    said: list[str] = []  # the server's log, drained (its last lines say why it stopped)
    threading.Thread(target=lambda: said.extend(proc.stderr), daemon=True).start()
    url = found.group(0)
    parts = urlsplit(url)
    end = time.monotonic() + 300
    while time.monotonic() < end:
        if proc.poll() is not None:
            time.sleep(0.2)  # the rest of its log
            why = "".join(said[-3:]).strip() or "no message"
            raise OrtpipeError(f"ortpipe serve exited with {proc.returncode} while loading {model}: {why}")
        try:
            conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=5)
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                return proc, url
        except OSError:
            pass
        time.sleep(0.1)
    proc.kill()
    raise OrtpipeError(f"{model} did not load within 300 s")


def vocab_size(model: str | None) -> int:
    """Prompt ids stay below the model's vocabulary (genai_config.json's vocab_size; 256 when unknown)."""
    path = os.path.join(model or "", "genai_config.json")
    if model and os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            size = json.load(f).get("model", {}).get("vocab_size")
        if isinstance(size, int):
            return size
    return 256


def bench(args: argparse.Namespace) -> int:
    streams = [int(n) for n in str(args.streams).split(",")]
    proc = None
    url = args.url
    if url is None:
        proc, url = start_server(args.model, max(streams), args.threads)
    try:
        vocab = args.vocab or vocab_size(args.model)
        warm_up = min(8, args.new_tokens)
        run_level(url, 1, 1, args.prompt_tokens, warm_up, vocab, args.api_key, seed=99)
        levels = [
            run_level(url, n, args.rounds, args.prompt_tokens, args.new_tokens, vocab, args.api_key)
            for n in streams
        ]
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)
    processes = {}
    if args.processes and args.model:
        processes = {
            n: run_processes(args.model, n, args.prompt_tokens, args.new_tokens, vocab, args.threads)
            for n in streams
        }
    if args.json:
        print(json.dumps({"levels": [asdict(level) for level in levels], "processes": processes}))
        return 0
    one = levels[0].tokens_per_s or 1.0
    print(
        f"{url}: {args.prompt_tokens} prompt tokens, {args.new_tokens} new, "
        f"{args.rounds} request(s) per stream"
    )
    print("streams  tokens/s  x1     ttft p50 ms  ttft p95 ms  per-stream tokens/s  "
          "N processes: decode tokens/s")

    for level in levels:
        print(
            f"{level.streams:>7}  {level.tokens_per_s:>8.1f}  {level.tokens_per_s / one:>4.2f}  "
            f"{level.ttft_p50_ms:>11.1f}  {level.ttft_p95_ms:>11.1f}  {level.stream_tokens_per_s:>19.1f}  "
            f"{processes.get(level.streams, '-'):>28}"
        )
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The benchmark's arguments (`ortpipe bench --serve` and `python -m ortpipe.serve.load`)."""
    p.add_argument("model", nargs="?", metavar="MODEL_DIR")
    p.add_argument("--streams", default="1,2,4,8", help="concurrent streams per level, comma-separated")
    p.add_argument("--url", help="measure this running server instead of starting one on MODEL_DIR")
    p.add_argument("--api-key", default=os.environ.get("ORTPIPE_API_KEY"))
    p.add_argument("--prompt-tokens", type=int, default=64, help="prompt tokens of each request (default 64)")
    p.add_argument("--new-tokens", type=int, default=128, help="tokens each request generates (default 128)")
    p.add_argument("--threads", type=int, help="intra-op threads of the server it starts")
    p.add_argument("--rounds", type=int, default=3, help="requests each stream sends, one after another")
    p.add_argument("--vocab", type=int, help="prompt ids are drawn below this (default: MODEL_DIR's "
                   "vocab_size; 256 with --url), so that two servers get the same prompts")
    p.add_argument("--json", action="store_true", help="print the levels as JSON")
    p.add_argument(
        "--processes",
        action="store_true",
        help="also run N separate `ortpipe run` processes at once per level, for comparison",
    )


def checked(p: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """Run the benchmark once its arguments are consistent."""
    if (args.model is None) == (args.url is None):
        p.error("give MODEL_DIR (a server is started) or --url (a running server), not both")
    if args.url is not None:
        parts = urlsplit(args.url)
        if parts.scheme != "http" or not parts.hostname:
            p.error(f"--url takes a server's http:// URL, like http://127.0.0.1:8000, found {args.url!r}")
    for name in ("prompt_tokens", "new_tokens", "rounds"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.vocab is not None and args.vocab < 4:
        p.error("--vocab must be at least 4 (prompt ids are drawn from 3 up)")
    try:
        streams = [int(n) for n in str(args.streams).split(",")]
    except ValueError:
        streams = []
    if not streams or min(streams) < 1:
        p.error(f"--streams takes positive counts separated by commas (1,2,4,8), found {args.streams!r}")
    return bench(args)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ortpipe.serve.load", description=__doc__.split("\n\n")[0])
    add_arguments(p)
    return checked(p, p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
