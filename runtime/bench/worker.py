"""``python -m runtime.bench.worker``: run one benchmark config in a fresh process.

Reads a JSON job on stdin (model, config, p, n, reps, cold, threads), writes progress lines
``@@ <step>`` on stderr and the result as one JSON object on stdout. A fresh process per config
gives each its own llama.cpp load and lets the parent put it in a memory cgroup.
"""
from __future__ import annotations

import json
import os
import sys


def main() -> int:
    job = json.loads(sys.stdin.read())
    os.environ.update(job["config"].get("env") or {})
    from runtime.errors import UserError
    from runtime.bench.run import BenchConfig, run_config

    def step(text: str) -> None:
        sys.stderr.write(f"@@ {text}\n")
        sys.stderr.flush()

    try:
        result = run_config(job["model"], BenchConfig(**job["config"]), p=job["p"], n=job["n"],
                            reps=job["reps"], cold=job["cold"], threads=job["threads"],
                            step=step, gpu_layers=job.get("gpu_layers", 0),
                            route_trace=job.get("route_trace"))
    except UserError as err:
        sys.stdout.write(json.dumps({"error": str(err)}) + "\n")
        return 2
    sys.stdout.write(json.dumps(result) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
