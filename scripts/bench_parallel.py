#!/usr/bin/env python3
"""``moe-offload serve -np N``: N streams at once against the same N requests one after another.

Starts the real server (default: the built-in demo model, q8_0) with ``-np N``, then, in turns
(sequential, then at once, repeated), sends N greedy completions of ``-n`` tokens through the
official ``openai`` client: one after another (the sequential aggregate rate, and how long one
whole request alone takes), then all N streamed at once (their aggregate rate, and each
stream's first token). Each line carries the machine's load average (os.getloadavg: 1, 5, 15
minutes) as measured then: the machine is shared, so a rate is only worth the load beside it.
The verdict compares the medians with the targets: at once >= 1.2x the sequential aggregate,
every stream's first token before one whole request alone would finish.

    python scripts/bench_parallel.py [-m MODEL] [-np 4] [-n 128] [-r 3] [-t THREADS]
        [--serve-arg=--batch-invariant ...]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
import soak  # noqa: E402  (scripts/soak.py: its server start)

PROMPTS = ["Once upon a time", "The king saw a river", "hello world", "In the morning the sun",
           "A story about", "The old house", "Water and fire", "Far away there"]
TARGET_RATIO = 1.2


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def sequential(client, n_streams: int, n: int) -> tuple[float, float]:
    """(tokens/s over the requests one after another, median seconds of one whole request)."""
    tokens, seconds = 0, []
    for i in range(n_streams):
        t0 = time.perf_counter()
        r = client.completions.create(model="m", prompt=PROMPTS[i % len(PROMPTS)],
                                      max_tokens=n, temperature=0)
        seconds.append(time.perf_counter() - t0)
        tokens += r.usage.completion_tokens
    return tokens / sum(seconds), statistics.median(seconds)


def at_once(client, n_streams: int, n: int) -> tuple[float, list[float]]:
    """(tokens/s over the streams together, each stream's first-token seconds)."""
    counts, firsts = [0] * n_streams, [float("nan")] * n_streams
    start = threading.Barrier(n_streams + 1)

    def one(i: int) -> None:
        start.wait()
        for chunk in client.completions.create(model="m", prompt=PROMPTS[i % len(PROMPTS)],
                                               max_tokens=n, temperature=0, stream=True):
            if chunk.choices and chunk.choices[0].text:
                if counts[i] == 0:
                    firsts[i] = time.perf_counter() - t0
                counts[i] += 1          # a chunk per token (held text comes with a later one)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n_streams)]
    for t in threads:
        t.start()
    t0 = time.perf_counter()
    start.wait()
    for t in threads:
        t.join()
    return sum(counts) / (time.perf_counter() - t0), firsts


def main() -> int:
    import openai

    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument("-m", "--model", default=None)
    parser.add_argument("-np", "--parallel", type=int, default=4, help="streams at once")
    parser.add_argument("-n", type=int, default=128, help="tokens per request")
    parser.add_argument("-r", "--repetitions", type=int, default=3)
    parser.add_argument("-t", "--threads", default=None)
    parser.add_argument("--serve-arg", action="append", default=[], metavar="ARG",
                        help="one more argument for moe-offload serve (repeat it)")
    args = parser.parse_args()
    sys.path.insert(0, str(REPO))
    if args.model is None:
        from runtime.cache import cached_model
        from runtime.commands.demo import default_spec
        args.model = str(cached_model(default_spec()))
    extra = (["-t", args.threads] if args.threads else []) + args.serve_arg
    proc, url = soak.start_server(args.model, args.parallel, extra)
    print(f"model {args.model}, -np {args.parallel} {' '.join(extra)}, {args.n} tokens per "
          f"request; {os.cpu_count()} cores, shared with other work: load average (1 5 15 "
          f"min) {load()}")
    ratios, margins = [], []
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=600)
        # warm up at full length: a fresh server's first generations run slower (measured),
        # which would flatter every ratio
        sequential(client, 1, args.n)
        at_once(client, args.parallel, args.n)
        for rep in range(args.repetitions):
            seq_rate, whole = sequential(client, args.parallel, args.n)
            seq_load = load()
            rate, firsts = at_once(client, args.parallel, args.n)
            ratios.append(rate / seq_rate)
            margins.append(whole - max(firsts))
            print(f"  {rep + 1}: one after another {seq_rate:7.1f} tok/s, one whole request "
                  f"{whole:.3f} s [load {seq_load}] | {args.parallel} at once {rate:7.1f} tok/s "
                  f"({rate / seq_rate:.2f}x), first tokens "
                  f"{' '.join(f'{f:.3f}' for f in sorted(firsts))} s [load {load()}]")
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    ratio, margin = statistics.median(ratios), statistics.median(margins)
    print(f"median: {args.parallel} at once {ratio:.2f}x one after another (target "
          f">= {TARGET_RATIO}x: {'met' if ratio >= TARGET_RATIO else 'NOT met'}); the last "
          f"first token {abs(margin):.3f} s {'before' if margin > 0 else 'AFTER'} one whole "
          f"request alone ends (target: before: {'met' if margin > 0 else 'NOT met'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
