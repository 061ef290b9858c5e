#!/usr/bin/env python3
"""Aggregate generation rate of ``moe-offload serve -np N`` at 1, 2 and 4 concurrent streams.

Starts the real server (default: the built-in demo model, q8_0) with ``-np 4``, then for each
concurrency streams that many greedy completions at once through the official ``openai``
client and prints tokens/s summed over the streams, and the ratio to one stream.

    python scripts/bench_parallel.py [-m MODEL] [-n 128] [--streams 1,2,4] [-t THREADS]
"""
from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
import soak  # noqa: E402  (scripts/soak.py: its server start)

PROMPTS = ["Once upon a time", "The king saw a river", "hello world", "In the morning the sun",
           "A story about", "The old house", "Water and fire", "Far away there"]


def run(client, streams: int, n: int) -> float:
    counts = [0] * streams

    def one(i: int) -> None:
        r = client.completions.create(model="m", prompt=PROMPTS[i % len(PROMPTS)], max_tokens=n,
                                      temperature=0)
        counts[i] = r.usage.completion_tokens

    threads = [threading.Thread(target=one, args=(i,)) for i in range(streams)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(counts) / (time.perf_counter() - t0)


def main() -> int:
    import openai

    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument("-m", "--model", default=None)
    parser.add_argument("-n", type=int, default=128)
    parser.add_argument("--streams", default="1,2,4")
    parser.add_argument("-t", "--threads", default=None)
    parser.add_argument("-r", "--repetitions", type=int, default=2)
    args = parser.parse_args()
    sys.path.insert(0, str(REPO))
    if args.model is None:
        from runtime.cache import cached_model
        from runtime.commands.demo import default_spec
        args.model = str(cached_model(default_spec()))
    levels = [int(s) for s in args.streams.split(",")]
    proc, url = soak.start_server(args.model, max(levels),
                                  ["-t", args.threads] if args.threads else [])
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=600)
        # warm up at full length: the first generation of a fresh server runs at about a third
        # of the later ones' rate (measured), which would flatter every ratio to one stream
        run(client, 1, args.n)
        run(client, max(levels), args.n)
        rates = {k: max(run(client, k, args.n) for _ in range(args.repetitions)) for k in levels}
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    print(f"model {args.model}, -np {max(levels)}, {args.n} tokens per stream, best of "
          f"{args.repetitions}")
    for k, rate in rates.items():
        print(f"  {k} stream(s): {rate:7.1f} tok/s aggregate ({rate / rates[levels[0]]:.2f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
