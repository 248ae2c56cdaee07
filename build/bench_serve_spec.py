"""`python -m build.bench_serve_spec`: `ortpipe serve` with and without speculative decoding. Not a test.

Two servers of the same folder, one after the other, each in a process of its own on one intra-op
thread: plain, and with the speculation flags given (default `--prompt-lookup-num-tokens 8 --ngram-size
3`, build/bench_spec.py's lookup settings). Each is sent the extractive prompt of bench_spec's
`demo-code` workload (a code excerpt, a blank line and its start again, as token ids), greedy, 192 new
tokens, by 1 and then 4 clients at once, `--rounds` times after one unmeasured request. Every request's
prompt starts with an id of its own, so that no request continues another's cached prompt. The rate is
all completion tokens over the wall time of the round's requests (HTTP, queueing and prefill included).

    python -m build.bench_serve_spec [--folder models/demo] [--dtype q8] [--rounds 6] [--streams 1,4]
                                     [-- --draft-model DIR ...]
"""

from __future__ import annotations

import argparse
import http.client
import itertools
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

from build import bench_spec

REPO = Path(__file__).resolve().parent.parent
LOOKUP = ["--prompt-lookup-num-tokens", "8", "--ngram-size", "3"]
NEW_TOKENS = 192


def post(port: int, body: dict) -> dict:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    try:
        conn.request("POST", "/v1/completions", json.dumps(body), {"content-type": "application/json"})
        response = conn.getresponse()
        answer = json.loads(response.read())
    finally:
        conn.close()
    if response.status != 200:
        raise SystemExit(f"bench_serve_spec: the server answered {response.status}: {answer}")
    return answer


@contextmanager
def server(folder: Path, dtype: str | None, port: int, flags: Sequence[str]) -> Iterator[None]:
    command = [sys.executable, "-m", "ortpipe.cli", "serve", str(folder), "--port", str(port),
               "--threads", "1", *(["--dtype", dtype] if dtype else []), *flags]
    process = subprocess.Popen(command, cwd=REPO, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            if process.poll() is not None:
                raise SystemExit(f"bench_serve_spec: the server stopped:\n{process.stderr.read()[-2000:]}")
            try:
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
                conn.request("GET", "/health")
                if conn.getresponse().status == 200:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit("bench_serve_spec: the server did not load in 120 s")
            time.sleep(0.1)
        yield
    finally:
        process.terminate()
        process.wait(30)


def measure(port: int, prompt: list[int], streams: int, rounds: int, firsts: Iterator[int]) -> list[float]:
    def body() -> dict:
        return {"model": "m", "prompt": [next(firsts), *prompt], "max_tokens": NEW_TOKENS, "temperature": 0}

    post(port, body())  # unmeasured
    rates = []
    for _ in range(rounds):
        bodies = [body() for _ in range(streams)]
        start = time.perf_counter()
        with ThreadPoolExecutor(streams) as pool:
            answers = list(pool.map(lambda b: post(port, b), bodies))
        rates.append(sum(a["usage"]["completion_tokens"] for a in answers) / (time.perf_counter() - start))
    return rates


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--folder", type=Path, default=REPO / "models" / "demo")
    p.add_argument("--dtype", default=None, help="the variant both servers run (default: the CPU's)")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--streams", default="1,4", help="comma-separated numbers of clients at once")
    p.add_argument("--port", type=int, default=18650)
    p.add_argument("flags", nargs="*", help=f"the speculating server's flags (default: {' '.join(LOOKUP)})")
    args = p.parse_args(argv)
    streams = [int(s) for s in args.streams.split(",")]
    prompt = bench_spec.prompt_of(bench_spec.WORKLOADS["demo-code"])
    firsts = itertools.count(100)  # each request's own first id
    results = {}
    for name, flags in (("plain", []), ("speculative", args.flags or LOOKUP)):
        with server(args.folder, args.dtype, args.port, flags):
            for n in streams:
                results[name, n] = measure(args.port, prompt, n, args.rounds, firsts)
    print(f"{args.folder.name} ({args.dtype or 'default variant'}), {NEW_TOKENS} new tokens, "
          f"{args.rounds} rounds; speculative: {' '.join(args.flags or LOOKUP)}")
    print("| clients | plain tok/s | speculative tok/s | speculative / plain |")
    print("| ---: | ---: | ---: | --- |")
    for n in streams:
        plain, spec = (statistics.median(results[k, n]) for k in ("plain", "speculative"))
        print(f"| {n} | {plain:.0f} | {spec:.0f} | {spec / plain:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
