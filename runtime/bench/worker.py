"""``python -m runtime.bench.worker``: run one benchmark config in a fresh process.

Reads a JSON job on stdin (model, config, p, n, reps, cold, threads), writes progress lines
``@@ <step>`` on stderr and the result as one JSON object on stdout. A fresh process per config
gives each its own llama.cpp load and lets the parent put it in a memory cgroup.
"""
from __future__ import annotations

import json
import os
import sys


def serve_job(run, env_of=lambda job: {}) -> int:
    """A worker's main: the JSON job from stdin, ``env_of(job)`` into the environment, then
    ``run(job)``'s result as one JSON line on stdout (a UserError as ``{"error": ...}``, exit
    status 2)."""
    job = json.loads(sys.stdin.read())
    os.environ.update(env_of(job) or {})
    from runtime.errors import UserError

    try:
        result = run(job)
    except UserError as err:
        sys.stdout.write(json.dumps({"error": str(err)}) + "\n")
        return 2
    sys.stdout.write(json.dumps(result) + "\n")
    return 0


def main() -> int:
    def run(job: dict) -> dict:
        from runtime.bench.run import BenchConfig, run_config

        def step(text: str) -> None:
            sys.stderr.write(f"@@ {text}\n")
            sys.stderr.flush()

        return run_config(job["model"], BenchConfig(**job["config"]), p=job["p"], n=job["n"],
                          reps=job["reps"], cold=job["cold"], threads=job["threads"],
                          step=step, gpu_layers=job.get("gpu_layers", 0),
                          route_trace=job.get("route_trace"))

    return serve_job(run, lambda job: job["config"].get("env"))


if __name__ == "__main__":
    sys.exit(main())
