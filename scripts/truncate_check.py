"""A model file cut short under a running server, at full size with the RAM tier (issue 32).

Copies MODEL beside itself (the copy is the one cut; MODEL is only read), serves the copy with
a cpu budget below its experts (so the RAM tier reads experts from the file as the model runs),
generates once, then truncates the copy while a longer generation is in flight and checks: the
request in flight and the next one answer a clean error in the route's shape, ``/health`` says
degraded, other routes still answer, and the server is alive and stops on Ctrl-C. The copy is
deleted at the end. Needs MODEL's size free on its disk, e.g.

    moe-offload synth --preset qwen3-30b-a3b ~/.cache/moe-offload/realscale/q.gguf
    python scripts/truncate_check.py ~/.cache/moe-offload/realscale/q.gguf --budget 4GiB
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

LISTENING = re.compile(r"listening on (http://\S+)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="a GGUF file (copied; the copy is cut)")
    parser.add_argument("--budget", default="4GiB", help="--devices.cpu of the server")
    parser.add_argument("--cut-to", default=8 << 30, type=int, help="bytes the copy keeps")
    args = parser.parse_args()
    copy = args.model + ".cut-copy"
    free = shutil.disk_usage(os.path.dirname(os.path.abspath(copy))).free
    if free < os.path.getsize(args.model) * 1.05:
        print("truncate_check: not enough free disk for a copy of the model", file=sys.stderr)
        return 1
    start = time.time()
    subprocess.run(["cp", args.model, copy], check=True)
    log = tempfile.NamedTemporaryFile("w", prefix="truncate_check-", suffix=".log", delete=False)
    print(f"the server's log: {log.name}")
    print(f"copied {os.path.getsize(copy) / 2**30:.2f} GiB in {time.time() - start:.0f} s")
    server = subprocess.Popen([sys.executable, "-m", "runtime.cli", "serve", "-m", copy,
                               "--devices.cpu", args.budget, "-c", "1024", "--port", "0"],
                              stdout=subprocess.DEVNULL, stderr=log)
    client, ok = httpx.Client(timeout=600), True
    try:
        base = None
        while server.poll() is None:      # the URL first, then /health 200 once loaded
            if base is None and (found := LISTENING.search(Path(log.name).read_text(
                    errors="replace"))):
                base = found.group(1)
            try:
                if base and client.get(base + "/health").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        if server.poll() is not None:
            raise SystemExit(f"truncate_check: the server exited; its log: {log.name}")
        print(f"serving after {time.time() - start:.0f} s")

        def chat(n: int) -> tuple[int, str]:
            r = client.post(base + "/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "Hello"}], "max_tokens": n,
                "temperature": 0})
            return r.status_code, r.text

        def check(what: str, got: tuple[int, str], status: int, needle: str = "") -> None:
            nonlocal ok
            held = got[0] == status and needle in got[1]
            ok &= held
            print(f"{'ok ' if held else 'BAD'} {what}: {got[0]} {got[1][:160]}")

        check("before the cut", chat(8), 200)
        metrics = client.get(base + "/metrics")
        check("the RAM tier serves the experts", (metrics.status_code, next(
            (line for line in metrics.text.splitlines()
             if line.startswith("moe_ramtier_resident_bytes")), "no RAM tier metrics")),
            200, "moe_ramtier")
        in_flight: dict = {}
        thread = threading.Thread(target=lambda: in_flight.update(r=chat(64)))
        thread.start()
        time.sleep(3)
        cut = time.time()
        os.truncate(copy, args.cut_to)
        print(f"cut to {args.cut_to} bytes during a generation (the truncate waited "
              f"{time.time() - cut:.1f} s for the batch in flight)")
        thread.join()
        check("the generation in flight", in_flight["r"], 503, "model_file_changed")
        check("the next generation", chat(8), 503, "truncated")
        health = client.get(base + "/health")
        check("/health", (health.status_code, health.text), 503, "degraded")
        tokenize = client.post(base + "/tokenize", json={"content": "hi"})
        check("/tokenize", (tokenize.status_code, tokenize.text), 200)
        alive = server.poll() is None
        ok &= alive
        print(f"{'ok ' if alive else 'BAD'} server alive")
    finally:
        server.send_signal(signal.SIGINT)
        try:
            rc = server.wait(60)
            print(f"server stopped on Ctrl-C (exit {rc})")
        except subprocess.TimeoutExpired:
            server.kill()
            ok = False
            print("BAD server did not stop on Ctrl-C")
        os.unlink(copy)
    print("held" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
