#!/usr/bin/env python3
"""Router mode at scale: several models in one ``moe-offload serve`` under one cpu budget,
each answering in turn, then asleep, then woken; what each step cost in time, bytes read from
storage and memory, sampled the whole time.

    python scripts/bench_router.py --models-preset two.ini --cpu 8GiB [--models-max 2]
        [--sleep 20] [-n 32] [--json OUT.json] [-- EXTRA SERVE FLAGS]

Steps: start the server (``--models-preset``, ``--devices.cpu``, ``--sleep-idle-seconds``);
ask every model in turn (its first answer loads it: ``timings.wake_ms``), then every model
again (warm); wait until each is asleep; ask each once more (the wake). Meanwhile, every
0.5 s: the server's RSS (anonymous and file-backed), its storage reads (``/proc/PID/io``
``read_bytes``) and, per model, the bytes of its routed experts the page cache holds
(``mincore`` through a mapping of this script's own: it reads nothing). Prints a table per
model and the peaks, with the budget pool beside them; ``--json`` writes them too.
"""
from __future__ import annotations

import argparse
import json
import mmap
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from runtime.ramtier.pager import drop_file_cache  # noqa: E402
from runtime.units import parse_size  # noqa: E402

MIB = 1 << 20
_LISTENING = re.compile(r"listening on (http://[^\s]+)")


def expert_residency(path: Path):
    """(a function giving the bytes of ``path``'s routed experts in the page cache now, the
    open file and mapping it reads through: keep them while it is used)."""
    from gguf_tools.expert_index import ExpertIndex
    from runtime.ramtier.layout import ExpertLayout
    from runtime.ramtier.mapping import FileMapping

    layout = ExpertLayout.from_index(ExpertIndex.open(str(path)))
    handle = open(path, "rb")
    view = mmap.mmap(handle.fileno(), 0, prot=mmap.PROT_READ)      # mincore's window
    mapping = FileMapping.find(str(path))
    return (lambda: int(layout.resident_bytes(mapping.resident_pages()).sum())), \
        (handle, view)


def proc_numbers(pid: int) -> dict[str, int]:
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "RssAnon", "RssFile"):
            out[key] = int(value.split()[0]) * 1024
    for line in Path(f"/proc/{pid}/io").read_text().splitlines():
        key, _, value = line.partition(":")
        if key == "read_bytes":
            out["read_bytes"] = int(value)
    return out


class Sampler(threading.Thread):
    """Every ``period`` s: the server's memory and reads, each model's experts in RAM."""

    def __init__(self, pid: int, residency: dict, period: float = 0.5) -> None:
        super().__init__(daemon=True)
        self.pid, self.residency, self.period = pid, residency, period
        self.peak: dict[str, int] = {}
        self.stop = threading.Event()

    def sample(self) -> dict[str, int]:
        now = proc_numbers(self.pid)
        experts = {name: f() for name, f in self.residency.items()}
        now["experts_total"] = sum(experts.values())
        for name, n in experts.items():
            now[f"experts:{name}"] = n
        for key, value in now.items():
            self.peak[key] = max(self.peak.get(key, 0), value)
        return now

    def run(self) -> None:
        while not self.stop.wait(self.period):
            try:
                self.sample()
            except OSError:            # the server is gone
                return


def ask(http: httpx.Client, model: str, n: int) -> dict:
    t0 = time.perf_counter()
    r = http.post("/v1/chat/completions", json={
        "model": model, "max_tokens": n, "temperature": 0,
        "messages": [{"role": "user", "content": "Tell me about rivers and old houses."}]})
    r.raise_for_status()
    body = r.json()
    timings = body.get("timings", {})
    return {"seconds": time.perf_counter() - t0, "wake_ms": timings.get("wake_ms"),
            "tokens": body["usage"]["completion_tokens"],
            "tokens_per_second": timings.get("predicted_per_second")}


def tier_metrics(http: httpx.Client, model: str) -> dict[str, float]:
    """The model's RAM tier as its ``/metrics`` says: budget, one-use peak, drop waits."""
    wanted = {"moe_ramtier_budget_bytes": "budget_bytes",
              "moe_ramtier_one_use_peak_bytes": "one_use_peak_bytes",
              "moe_ramtier_drop_wait_seconds_total": "drop_wait_s"}
    out = {}
    for line in http.get("/metrics", params={"model": model}).text.splitlines():
        name, _, value = line.partition(" ")
        if name in wanted:
            out[wanted[name]] = float(value)
    return out


def statuses(http: httpx.Client) -> dict[str, dict]:
    return {m["id"]: m for m in http.get("/models").json()["data"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models-preset", required=True, type=Path)
    parser.add_argument("--cpu", required=True, help="the server's cpu budget (--devices.cpu)")
    parser.add_argument("--models-max", type=int, default=2)
    parser.add_argument("--sleep", type=float, default=20.0, help="--sleep-idle-seconds")
    parser.add_argument("-n", type=int, default=32, help="tokens per answer")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("extra", nargs=argparse.REMAINDER, help="more serve flags, after --")
    args = parser.parse_args()
    extra = [a for a in args.extra if a != "--"]

    from runtime.server.router.presets import catalogue

    specs = catalogue(None, str(args.models_preset))
    paths = {s.name: Path(dict(s.options)["model"]).expanduser() for s in specs}
    residency, keep = {}, []
    for name, path in paths.items():
        drop_file_cache(str(path))   # what an earlier run or a copy left cached is not ours
        residency[name], handles = expert_residency(path)
        keep.append(handles)
    log = Path(tempfile.mkdtemp(prefix="bench-router-")) / "server.log"
    cmd = [sys.executable, "-m", "runtime.cli", "serve", "--models-preset",
           str(args.models_preset), "--devices.cpu", args.cpu, "--models-max",
           str(args.models_max), "--sleep-idle-seconds", str(args.sleep), "--port", "0", *extra]
    print("$", " ".join(cmd), flush=True)
    with open(log, "wb") as out:
        server = subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
    try:
        while not (found := _LISTENING.search(log.read_text(errors="replace"))):
            if server.poll() is not None:
                raise SystemExit(f"server exited:\n{log.read_text()}")
            time.sleep(0.1)
        sampler = Sampler(server.pid, residency)
        sampler.start()
        result: dict = {"pool_bytes": parse_size(args.cpu), "models": {}, "command": cmd}
        with httpx.Client(base_url=found.group(1), timeout=None) as http:
            for round_name in ("first", "warm"):
                for name in paths:
                    before = sampler.sample()
                    answer = ask(http, name, args.n)
                    after = sampler.sample()
                    answer["read_bytes"] = after["read_bytes"] - before["read_bytes"]
                    answer["budget_bytes"] = statuses(http)[name]["budgets"].get("cpu")
                    answer["tier"] = tier_metrics(http, name)
                    result["models"].setdefault(name, {})[round_name] = answer
            for name in paths:
                while statuses(http)[name]["status"]["value"] != "sleeping":
                    time.sleep(0.2)
                # "sleeping" is said as the drop begins: wait until the count stops falling
                now, last = sampler.sample(), None
                for _ in range(50):
                    if last is not None and now[f"experts:{name}"] >= last:
                        break
                    time.sleep(0.2)
                    last, now = now[f"experts:{name}"], sampler.sample()
                result["models"][name]["asleep_expert_bytes"] = now[f"experts:{name}"]
            for name in paths:
                before = sampler.sample()
                answer = ask(http, name, args.n)
                answer["read_bytes"] = sampler.sample()["read_bytes"] - before["read_bytes"]
                result["models"][name]["wake"] = answer
        sampler.stop.set()
        result["peak"] = sampler.peak
    finally:
        server.terminate()
        server.wait(30)
    print(report(result))
    print(f"server log: {log}")
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


def report(result: dict) -> str:
    mib = lambda n: f"{n / MIB:,.1f}" if n is not None else "-"  # noqa: E731
    lines = ["| model | budget MiB | first answer s (load ms) | read MiB | warm t/s | "
             "asleep: experts in RAM MiB | wake ms | wake read MiB |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, m in result["models"].items():
        first, warm, wake = m["first"], m["warm"], m["wake"]
        lines.append(f"| {name} | {mib(first['budget_bytes'])} | {first['seconds']:.1f} "
                     f"({first['wake_ms'] or 0:.0f}) | {mib(first['read_bytes'])} | "
                     f"{warm['tokens_per_second'] or 0:.1f} | {mib(m['asleep_expert_bytes'])} "
                     f"| {wake['wake_ms'] or 0:.0f} | {mib(wake['read_bytes'])} |")
    lines.append("")
    for name, m in result["models"].items():     # the tier's own account, after the warm answer
        tier = m["warm"].get("tier", {})
        if "one_use_peak_bytes" in tier:
            lines.append(f"{name}: RAM tier budget {mib(tier.get('budget_bytes'))} MiB; one-use "
                         f"reads + queued drops at most {mib(tier['one_use_peak_bytes'])} MiB; "
                         f"layer-steps waited {tier.get('drop_wait_s', 0):.2f} s for drops")
    peak = result["peak"]
    within = peak.get("experts_total", 0) <= result["pool_bytes"]
    lines += [f"pool {mib(result['pool_bytes'])} MiB; peaks: experts in RAM (all models, "
              f"mincore) {mib(peak.get('experts_total', 0))} MiB "
              f"({'within' if within else 'OVER'} the pool), RSS {mib(peak.get('VmRSS', 0))}"
              f" MiB (anonymous {mib(peak.get('RssAnon', 0))}, file "
              f"{mib(peak.get('RssFile', 0))})"]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
