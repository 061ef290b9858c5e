#!/usr/bin/env python3
"""Experts on other machines, measured: tokens/s and bytes sent over the RPC links per token.

Starts two ``moe-offload rpc-server`` processes on 127.0.0.1, writes a synthetic MoE model, and
runs the Engine greedily (residency off: no routing hook) in a child process for each
placement, ``--repeats`` times interleaved (the median tok/s is reported):

- ``local``: everything in this process (no remote);
- ``ours``: the remote plan at the budgets (``--budget-a``, ``--budget-b``; mode auto: the
  link cost model picks whole-layer ranges or expert tensors);
- ``experts``: the same budgets, expert tensors only (``[rpc] mode = "experts"``);
- ``default``: llama.cpp's own split over the same two remotes (``[rpc] mode = "llama"``:
  every layer offloaded, split by the free memory each remote reports; budgets not applied).
- ``cache``, ``cache-all`` (``--cache``): the device cache on remote A
  (``[rpc] mode = "cache"``, residency on: every weight local, hot experts computed in slots
  on the remote, copied there by ``ggml_backend_tensor_set``), at ``--budget-a`` and at a
  budget holding every expert; ``local-res`` is the same residency run with only local
  bookkeeping (experts computed on this CPU), its fair baseline.

Bytes are the servers' socket traffic during generation only (load uploads excluded), both
directions, as the kernel counts it (``ss -ti`` bytes_sent + bytes_received of the servers'
established connections), divided by the generated tokens. ``--delay-ms 0,2`` repeats the remote rows through a
delaying TCP proxy of this script on 127.0.0.1 (each forwarded chunk waits that long, each
way: a round trip gains 2x the delay; 0 = direct, no proxy).

    python scripts/bench_rpc.py [-n 64] [--delay-ms 0,2] [--budget-a 60MiB --budget-b 60MiB]

Needs the RPC build (`moe-offload native build --rpc`; built here if missing).
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


class CountingProxy:
    """127.0.0.1:listen -> 127.0.0.1:target, counting bytes each way, delaying each chunk."""

    def __init__(self, target: int, delay_s: float = 0.0):
        self.target, self.delay_s = target, delay_s
        self.sent = self.received = 0            # client->server, server->client bytes
        self._lock = threading.Lock()
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(4)
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def counters(self) -> int:
        with self._lock:
            return self.sent + self.received

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.target))
            for s in (client, upstream):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=self._pump, args=(client, upstream, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, False), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, upstream: bool) -> None:
        try:
            while True:
                data = src.recv(1 << 20)
                if not data:
                    break
                if self.delay_s:
                    time.sleep(self.delay_s)
                dst.sendall(data)
                with self._lock:
                    if upstream:
                        self.sent += len(data)
                    else:
                        self.received += len(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass


CHILD = r'''
import json, sys, time
args = json.loads(sys.argv[1])
from runtime.engine.engine import Engine
from runtime.engine.sampling import SamplingParams
from runtime.engine.types import EngineSettings
s = EngineSettings(model_path=args["model"], n_ctx=1024, n_threads=args["threads"],
                   n_threads_batch=args["threads"], config_path=args["config"],
                   manage_residency=args["residency"])
e = Engine(s, progress=False)
list(e.generate("warm up", SamplingParams(max_tokens=4, temperature=0.0)))
e.reset()
print("GEN_START", flush=True)
sys.stdin.readline()
t0 = time.perf_counter()
toks = [c.token for c in e.generate(args["prompt"], SamplingParams(max_tokens=args["n"],
        temperature=0.0)) if c.token is not None]
dt = time.perf_counter() - t0
print("GEN_END", flush=True)
sys.stdin.readline()
plan = e.remote.plan.describe() if e.remote is not None else "local"
e.close()
print(json.dumps({"tokens": toks, "seconds": dt, "plan": plan}), flush=True)
'''


def link_bytes(ports: list[int]) -> int:
    """Bytes sent + received on the established TCP connections of the rpc-servers' ports, as
    the kernel counts them (``ss -ti``: bytes_sent, bytes_received of each server socket)."""
    total = 0
    for port in ports:
        out = subprocess.run(["ss", "-tinH", "state", "established", f"( sport = :{port} )"],
                             capture_output=True, text=True, check=True).stdout
        for key in ("bytes_sent:", "bytes_received:"):
            for part in out.split():
                if part.startswith(key):
                    total += int(part[len(key):])
    return total


def run_child(lib: str, model: str, config: str | None, n: int, threads: int,
              ports: list[int], residency: bool = False) -> dict:
    env = dict(os.environ, PYTHONPATH=str(REPO), LLAMA_CPP_LIB_PATH=lib)
    args = {"model": model, "config": config, "n": n, "threads": threads,
            "prompt": "the king saw a river and", "residency": residency}
    proc = subprocess.Popen([sys.executable, "-c", CHILD, json.dumps(args)], cwd=REPO, env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    marks = {}
    for line in proc.stdout:
        if line.startswith("GEN_"):
            marks[line.strip()] = link_bytes(ports)
            proc.stdin.write("\n")
            proc.stdin.flush()
        elif line.startswith("{"):
            out = json.loads(line)
    err = proc.stderr.read()
    if proc.wait() != 0:
        raise SystemExit(f"bench child failed:\n{err[-3000:]}")
    out["bytes"] = marks["GEN_END"] - marks["GEN_START"]
    return out


def start_server(lib: str, port: int, threads: int) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(REPO), LLAMA_CPP_LIB_PATH=lib)
    proc = subprocess.Popen([sys.executable, "-m", "runtime.cli", "rpc-server", "--port",
                             str(port), "--threads", str(threads)], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in proc.stdout:
        if "rpc-server: listening" in line:
            threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()
            return proc
    raise SystemExit("rpc-server did not start")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cache_rows(runs, work: Path, lib: str, model: str, args, ports: list[int], delay: float,
                all_bytes: int) -> None:
    """The device cache on remote A at --budget-a and at every expert (+ 24 MiB compute)."""
    for name, budget in (("cache", args.budget_a), ("cache-all", f"{(all_bytes >> 20) + 24}MiB")):
        proxy = CountingProxy(ports[0], delay / 1e3) if delay else None
        target = proxy.port if proxy else ports[0]
        cfg = work / f"{name}.toml"
        cfg.write_text(f'[devices]\n"rpc:127.0.0.1:{target}" = "{budget}"\n'
                       '[rpc]\nmode = "cache"\n')
        runs.setdefault((name, delay), []).append(
            run_child(lib, model, str(cfg), args.n, args.threads, ports, residency=True))
        if proxy:
            proxy.sock.close()


def main() -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    ap.add_argument("-n", type=int, default=64, help="tokens generated per run (default 64)")
    ap.add_argument("--delay-ms", default="0", help="one-way delays to add, comma-separated")
    ap.add_argument("--budget-a", default="60MiB")
    ap.add_argument("--budget-b", default="60MiB")
    ap.add_argument("-t", "--threads", type=int, default=1, help="threads per process")
    ap.add_argument("-r", "--repeats", type=int, default=3, help="runs per row (median)")
    ap.add_argument("--cache", action="store_true",
                    help="also the device cache on remote A (rows cache, cache-all, "
                         "local-res)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    from gguf_tools.synth import SynthSpec
    from runtime.cache import cached_model
    from runtime.native.build import BuildRequest, build, find_build

    info = find_build(rpc=True) or build(BuildRequest(backend="cpu", rpc=True))
    spec = SynthSpec(arch="qwen3moe", layers=16, experts=32, top_k=4, embd=256, ff=128,
                     dtype="f16", seed=5, skew=1.0)   # q8_0 hit SIGILL/SIGSEGV in ggml-cpu here (AMX CPU; the stock wheel too)
    model = str(cached_model(spec, progress=False))
    from gguf_tools.facts import read_model_facts
    facts = read_model_facts(model)
    all_bytes = sum(facts.expert_bytes[i] * facts.n_expert for i in facts.moe_layers)
    ports = [free_port(), free_port()]
    servers = [start_server(info.lib_dir, p, args.threads) for p in ports]
    runs: dict[tuple[str, float], list[dict]] = {}
    work = Path(os.environ.get("TMPDIR", "/tmp")) / f"bench_rpc_{os.getpid()}"
    work.mkdir(parents=True, exist_ok=True)
    delays = [float(x) for x in args.delay_ms.split(",") if x.strip()]
    try:
        for _ in range(max(1, args.repeats)):        # interleaved: drift hits every row alike
            runs.setdefault(("local", 0.0), []).append(
                run_child(info.lib_dir, model, None, args.n, args.threads, ports))
            if args.cache:      # residency on, no config: local bookkeeping, the hook runs
                runs.setdefault(("local-res", 0.0), []).append(
                    run_child(info.lib_dir, model, None, args.n, args.threads, ports,
                              residency=True))
            for delay in delays:
                for name, mode in (("ours", "auto"), ("experts", "experts"), ("default", "llama")):
                    proxies = [CountingProxy(p, delay / 1e3) for p in ports] if delay else []
                    targets = [p.port for p in proxies] if proxies else ports
                    cfg = work / f"{name}.toml"
                    cfg.write_text(f'[devices]\n"rpc:127.0.0.1:{targets[0]}" = "{args.budget_a}"\n'
                                   f'"rpc:127.0.0.1:{targets[1]}" = "{args.budget_b}"\n'
                                   f'[rpc]\nmode = "{mode}"\n')
                    runs.setdefault((name, delay), []).append(
                        run_child(info.lib_dir, model, str(cfg), args.n, args.threads, ports))
                    for p in proxies:
                        p.sock.close()
                if args.cache:
                    _cache_rows(runs, work, info.lib_dir, model, args, ports, delay, all_bytes)
    finally:
        for s in servers:
            s.kill()
    rows = [(name, delay, outs) for (name, delay), outs in runs.items()]
    result = []
    reference = rows[0][2][0]["tokens"]
    for name, delay, outs in rows:
        n = len(outs[0]["tokens"])
        rates = sorted(len(o["tokens"]) / o["seconds"] for o in outs)
        result.append({"run": name, "delay_ms": delay, "tokens": n,
                       "tok_per_s": rates[len(rates) // 2], "tok_per_s_all": rates,
                       "bytes_per_token": outs[-1]["bytes"] / max(n, 1),
                       "same_tokens_as_local": all(o["tokens"] == reference for o in outs),
                       "plan": outs[0]["plan"]})
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"model: {model} ({spec.layers} layers x {spec.experts} experts, top-{spec.top_k}, "
          f"{spec.dtype}); budgets {args.budget_a} / {args.budget_b}; {args.n} tokens; "
          f"{args.threads} thread(s) per process; median of {args.repeats} runs")
    print(f"{'run':<9}{'delay ms':>9}{'tok/s':>9}{'bytes/token':>13}  same tokens  plan")
    for r in result:
        print(f"{r['run']:<9}{r['delay_ms']:>9g}{r['tok_per_s']:>9.1f}{r['bytes_per_token']:>13.0f}"
              f"  {str(r['same_tokens_as_local']):<11}  {r['plan']}")
    by = {(r["run"], r["delay_ms"]): r for r in result}
    for delay in sorted({r["delay_ms"] for r in result if r["run"] != "local"}):
        ours, default = by[("ours", delay)], by[("default", delay)]
        print(f"delay {delay:g} ms: ours/default tok/s = "
              f"{ours['tok_per_s'] / default['tok_per_s']:.2f}, bytes/token = "
              f"{ours['bytes_per_token'] / max(default['bytes_per_token'], 1):.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
