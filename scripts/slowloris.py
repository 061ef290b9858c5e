#!/usr/bin/env python3
"""Slowloris against ``moe-offload serve``: many connections held half-open while a client
checks that ``/health`` and a chat completion still answer.

    python scripts/slowloris.py [-m MODEL] [--connections 20000] [--attackers 2] [--seconds 60]
                                [--trickle 15] [--reconnect-at-once] [--split-cpus] [--json]
                                [-- SERVE_FLAGS...]

The server is started as ``soak.py`` starts it (``-np 1``; extra ``serve`` flags after
``--``). Each attacker is a separate process that raises its own open-file soft limit to its
hard limit (the server's is left as it is), opens its share of the connections, sends the
start of a request head (``GET / HTTP/1.1``, ``Host``), then one more header line every
``--trickle`` seconds on each, and reopens every connection the server closes (the classic
tool's behaviour: a dropped socket is reopened at the next round; ``--reconnect-at-once``
makes it a connection flood instead, each dropped socket reopened at once). Meanwhile this process asks ``/health`` every 0.5 s and for a chat
completion every 5 s, each on a new connection, as a load balancer and a client would.

Report: the latency of ``/health`` (p50, p99, max; and of its connect alone: past 1 s, the
kernel dropped the SYN) and of the chats, their failures, the attackers' connections (opened,
closed by the server, failed to connect, open at the end), the CPU seconds the server and the
attackers used and the load average (on a shared machine the attackers take the server's CPU
time; ``--split-cpus`` gives them CPUs of their own, as if they ran elsewhere), the server's
peak open descriptors and RSS, and its log: bytes written and the limit notices.
Exit status 0 when every ``/health`` answered 200 within 1 s and every chat completed.
Default model: the built-in demo model (moe-offload demo's).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil

REPO = Path(__file__).resolve().parents[1]
HEAD = b"GET / HTTP/1.1\r\nHost: victim\r\n"
CONNECTS_IN_FLIGHT = 512         # per attacker: connects not yet answered


def attack(port: int, connections: int, seconds: float, trickle_s: float,
           at_once: bool) -> dict:
    """One attacker process's work (run with --attacker): its counts as a dict."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    counts = {"opened": 0, "closed_by_server": 0, "connect_failed": 0, "open_now": 0}
    stop_at = time.monotonic() + seconds

    async def hold(gate: asyncio.Semaphore) -> None:
        while time.monotonic() < stop_at:
            if not at_once and counts["opened"] >= connections:     # a dropped socket is
                await asyncio.sleep(trickle_s)                       # reopened next round
            try:
                async with gate:
                    reader, writer = await asyncio.wait_for(
                        asyncio.open_connection("127.0.0.1", port), 10)
            except (OSError, asyncio.TimeoutError):
                counts["connect_failed"] += 1
                await asyncio.sleep(1)
                continue
            counts["opened"] += 1
            counts["open_now"] += 1
            try:
                writer.write(HEAD)
                while time.monotonic() < stop_at:
                    try:
                        if not await asyncio.wait_for(reader.read(1024), trickle_s):
                            counts["closed_by_server"] += 1
                            break
                    except asyncio.TimeoutError:
                        writer.write(b"X-Slow: 1\r\n")     # one more line, never the end
                        await writer.drain()
            except OSError:
                counts["closed_by_server"] += 1
            finally:
                counts["open_now"] -= 1
                writer.close()

    async def main() -> None:
        gate = asyncio.Semaphore(CONNECTS_IN_FLIGHT)
        await asyncio.gather(*(hold(gate) for _ in range(connections)))

    asyncio.run(main())
    counts["open_file_limit"] = hard
    return counts


def ask_health(port: int, timeout_s: float = 30.0) -> tuple[int, float, float]:
    """GET /health on a new connection: (status, s to connect, s from connected to the whole
    answer). A connect past 1 s is the kernel's accept queue full (the SYN dropped and sent
    again 1 s later); the answer's time is the wait in that queue and on the event loop."""
    start = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as sock:
        connected = time.monotonic()
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: probe\r\nConnection: close\r\n\r\n")
        answer = b""
        while chunk := sock.recv(4096):
            answer += chunk
        done = time.monotonic()
    if not answer.startswith(b"HTTP/1.1 "):
        raise ConnectionError(f"not an HTTP answer: {answer[:80]!r}")
    return int(answer[9:12]), connected - start, done - connected


def _cpu_s(process: psutil.Process) -> float:
    """CPU seconds ``process`` has used (user and system), 0 once it has gone."""
    try:
        times = process.cpu_times()
    except psutil.Error:
        return 0.0
    return round(times.user + times.system, 1)


def _percentile(values: list[float], q: float) -> float | None:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else None


def split_cpus(server: psutil.Process, attackers: list[subprocess.Popen]) -> dict:
    """The server (and this prober) on the first CPU, the attackers on the others, as if they
    were other machines: on a shared box they otherwise take the server's CPU time."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        raise SystemExit("slowloris: --split-cpus needs 2 CPUs or more")
    server.cpu_affinity(cpus[:1])
    os.sched_setaffinity(0, cpus[:1])
    for p in attackers:
        psutil.Process(p.pid).cpu_affinity(cpus[1:])
    return {"server": cpus[:1], "attackers": cpus[1:]}


def measure(model: str, connections: int, attackers: int, seconds: float, trickle_s: float,
            at_once: bool, serve_flags: list[str], server_open_files: int | None = None,
            split: bool = False) -> dict:
    sys.path.insert(0, str(REPO / "scripts"))
    from soak import start_server  # noqa: PLC0415 - the soak's launcher, shared

    proc, base = start_server(model, 1, serve_flags)
    server = psutil.Process(proc.pid)
    if server_open_files is not None:      # a smaller limit than the shell's (ulimit -n 1024
        _, hard = server.rlimit(psutil.RLIMIT_NOFILE)         # is common): set once it runs
        server.rlimit(psutil.RLIMIT_NOFILE, (server_open_files, hard))
    open_files = server.rlimit(psutil.RLIMIT_NOFILE)[0]
    port = int(base.rsplit(":", 1)[1])
    share = [connections // attackers + (i < connections % attackers) for i in range(attackers)]
    procs = [subprocess.Popen([sys.executable, __file__, "--attacker", str(port), str(n),
                               str(seconds), str(trickle_s), str(int(at_once))],
                              stdout=subprocess.PIPE, text=True) for n in share]
    cpus = split_cpus(server, procs) if split else None
    health: list[float] = []          # s, whole /health exchanges
    health_connect: list[float] = []  # s, their connects
    chats: list[float] = []
    failures: list[str] = []
    peak = {"fds": 0, "rss": 0}
    stop = threading.Event()

    def watch_server() -> None:
        while not stop.is_set():
            peak["fds"] = max(peak["fds"], server.num_fds())
            peak["rss"] = max(peak["rss"], server.memory_info().rss)
            time.sleep(0.2)

    watcher = threading.Thread(target=watch_server, daemon=True)
    watcher.start()
    t0 = time.monotonic()
    next_chat = t0 + 3
    try:
        time.sleep(min(5.0, seconds / 4))                  # the attack ramps up
        while time.monotonic() < t0 + seconds - 1:
            try:
                status, connect_s, answer_s = ask_health(port)
                health.append(connect_s + answer_s)
                health_connect.append(connect_s)
                if status != 200:
                    failures.append(f"/health {status}")
            except OSError as exc:
                failures.append(f"/health {exc!r}")
            if time.monotonic() >= next_chat:
                next_chat = time.monotonic() + 5
                start = time.monotonic()
                try:
                    r = httpx.post(f"{base}/v1/chat/completions", timeout=60, json={
                        "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8})
                    chats.append(time.monotonic() - start)
                    if r.status_code != 200:
                        failures.append(f"chat {r.status_code}")
                except httpx.HTTPError as exc:
                    failures.append(f"chat {exc!r}")
            time.sleep(0.5)
        load = os.getloadavg()[0]
        cpu = {"server": _cpu_s(server), "attackers": sum(_cpu_s(psutil.Process(p.pid))
                                                         for p in procs)}
        counts = [json.loads(p.communicate(timeout=seconds + 60)[0]) for p in procs]
    finally:
        stop.set()
        for p in procs:
            if p.poll() is None:
                p.kill()
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
    log = "".join(proc.log)                                  # type: ignore[attr-defined]
    totals = {k: sum(c[k] for c in counts) for k in counts[0]}
    report = {
        "connections": connections, "attackers": attackers, "seconds": seconds,
        "load_average_1min": round(load, 2),     # the machine's, over the attack's last minute
        "cpu_s": cpu,         # CPU seconds used by then: the server, the attackers
        "cpus": cpus,         # --split-cpus: which CPUs each had (else all shared)
        "reconnect": "at once" if at_once else f"every {trickle_s:g} s",
        "server_open_files": open_files,
        "attack": totals | {"open_file_limit": counts[0]["open_file_limit"]},
        "health_s": {"n": len(health), "p50": _percentile(health, 0.5),
                     "p99": _percentile(health, 0.99), "max": max(health, default=None),
                     "over_1s": sum(h > 1.0 for h in health)},
        "health_connect_s": {"p50": _percentile(health_connect, 0.5),
                             "p99": _percentile(health_connect, 0.99),
                             "max": max(health_connect, default=None)},
        "chat_s": {"n": len(chats), "max": max(chats, default=None)},
        "failures": failures[:20], "failure_count": len(failures),
        "server": {"peak_open_fds": peak["fds"], "peak_rss_mib": round(peak["rss"] / 2**20, 1),
                   "log_bytes": len(log.encode()),
                   "notices": [line for line in log.splitlines() if "limit" in line
                               or "timeout" in line or "resource" in line][:10]},
    }
    report["ok"] = (not failures and bool(health) and max(health) <= 1.0 and bool(chats))
    return report


def main() -> int:
    if len(sys.argv) == 7 and sys.argv[1] == "--attacker":
        port, n, seconds, trickle, at_once = sys.argv[2:]
        print(json.dumps(attack(int(port), int(n), float(seconds), float(trickle),
                                at_once == "1")))
        return 0
    argv = sys.argv[1:]
    serve_flags = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-m", "--model", default=None, help="GGUF (default: the demo model)")
    parser.add_argument("--connections", type=int, default=20000)
    parser.add_argument("--attackers", type=int, default=2,
                        help="attacker processes (each within its own open-file limit)")
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--trickle", type=float, default=15.0,
                        help="seconds between the rounds: a header line on each open "
                             "connection, dropped ones reopened (the classic tool's 15)")
    parser.add_argument("--reconnect-at-once", action="store_true",
                        help="reopen a dropped connection at once (a connection flood)")
    parser.add_argument("--split-cpus", action="store_true",
                        help="the server and the prober on the first CPU, the attackers on the "
                             "others (as if they ran elsewhere); default: all share every CPU")
    parser.add_argument("--server-open-files", type=int, default=None, metavar="N",
                        help="lower the server's open-file soft limit to N once it runs (what "
                             "its --max-connections was fitted to stays as it was)")
    parser.add_argument("--json", action="store_true", help="the report as JSON")
    args = parser.parse_args(argv)
    model = args.model
    if model is None:
        sys.path.insert(0, str(REPO))
        from runtime.cache import cached_model  # noqa: PLC0415
        from runtime.commands.demo import default_spec  # noqa: PLC0415
        model = str(cached_model(default_spec()))
    report = measure(model, args.connections, args.attackers, args.seconds, args.trickle,
                     args.reconnect_at_once, serve_flags, args.server_open_files,
                     args.split_cpus)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        h, a, s = report["health_s"], report["attack"], report["server"]
        print(f"slowloris: {args.connections} connections from {args.attackers} processes for "
              f"{args.seconds:g} s (load average {report['load_average_1min']}): "
              f"{'PASS' if report['ok'] else 'FAIL'}")
        print(f"  CPU used: server {report['cpu_s']['server']} s, attackers "
              f"{report['cpu_s']['attackers']} s ("
              + (f"CPUs {report['cpus']}" if report["cpus"] else "on the same cores") + ")")
        print(f"  attack: {a['opened']} opened, {a['closed_by_server']} closed by the server, "
              f"{a['connect_failed']} connects failed, {a['open_now']} open at the end")
        if h["n"]:
            print(f"  /health: {h['n']} asked, p50 {h['p50']:.3f} s, p99 {h['p99']:.3f} s, "
                  f"max {h['max']:.3f} s, {h['over_1s']} over 1 s")
            c = report["health_connect_s"]
            print(f"    of which connecting: p50 {c['p50']:.3f} s, p99 {c['p99']:.3f} s, "
                  f"max {c['max']:.3f} s")
        print(f"  chats: {report['chat_s']['n']} completed, slowest "
              f"{report['chat_s']['max'] or 0:.3f} s; failures: {report['failure_count']}")
        print(f"  server: peak {s['peak_open_fds']} open descriptors (limit "
              f"{report['server_open_files']}), peak RSS "
              f"{s['peak_rss_mib']} MiB, log {s['log_bytes']} bytes")
        for line in s["notices"]:
            print(f"    {line.strip()}")
        for failure in report["failures"]:
            print(f"  FAILED: {failure}")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
