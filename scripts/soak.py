#!/usr/bin/env python3
"""Soak ``moe-offload serve -np 4`` on 127.0.0.1 with mixed, hostile traffic for a while.

Clients send OpenAI chat and text completions, llama-server ``/completion``s, streamed and
not, structured (json_schema) and tool-call requests, drop some of them mid-answer or while
they wait, send invalid ones (from the error contract's corpus and issue 32's attacks:
scripts/soak_attacks.py), bursts of costly requests (big-enum schemas, saves of one slot) and
half-open connections, and break slots (``SLOT_BREAKS``: save a slot, corrupt the file, restore
it; or erase it) then use them. Every answer is checked: a 2xx must be well formed strict JSON
(no NaN; a stream ends properly, a structured answer that stopped is JSON, a forced tool call is
a call), an invalid request or a broken slot file must get a 4xx in the route's shape and the
slot must serve the next request, a burst's answers are 200 or 429, and nothing may be a
5xx. At the end: requests by outcome, p50/p99 latency of whole answers, the
server's RSS after warm-up and at the end and its slope in between (scripts/soak_memory.py),
the validation failures, and /metrics' request totals against the client's own counts (they
must be equal, path by path).

    python scripts/soak.py [-m MODEL] [--minutes 30] [--clients 8] [--json]

Exit status 0 when there was no 5xx, no malformed answer, the counts agree and the RSS at the
end is within ±5% of its level after the warm-up (a fifth of the run, at most 2 minutes; each
level the median of a minute's samples); 1 otherwise.
Default model: the built-in demo model (moe-offload demo's).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "scripts")]   # runtime, and the attacks beside this file
from runtime.server.metrics import COUNTED_PATHS  # noqa: E402
from soak_attacks import (BURST, INVALID, SCHEMA_BURST, SERVE_FLAGS, SLOT_BREAKS,  # noqa: E402
                          SLOT_BURST, Malformed, broken_slot_file, burst, check_error,
                          half_open, send_invalid, strict_json)
from soak_memory import RssWatch, warmup_s  # noqa: E402

PROMPTS = ["Once upon a time", "The king saw a river", "hello world", "In the morning",
           "A story about the sea", "The old house by the road", "Water and fire"]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "n": {"type": "integer"}}, "required": ["name", "n"]}
TOOL = {"type": "function", "function": {"name": "lookup", "parameters": {
    "type": "object", "properties": {"q": {"type": "string", "maxLength": 10}},
    "required": ["q"]}}}

@dataclass
class Tally:
    lock: threading.Lock = field(default_factory=threading.Lock)
    outcomes: Counter = field(default_factory=Counter)
    sent: Counter = field(default_factory=Counter)          # requests sent, by path
    latencies: list[float] = field(default_factory=list)    # s, whole answers
    failures: list[str] = field(default_factory=list)

    def add(self, outcome: str, latency: float | None = None, failure: str | None = None):
        with self.lock:
            self.outcomes[outcome] += 1
            if latency is not None:
                self.latencies.append(latency)
            if failure is not None and len(self.failures) < 50:
                self.failures.append(failure)


def _sse(lines) -> list[dict | str]:
    events = []
    for line in lines:
        if line.startswith("data: "):
            data = line[6:]
            events.append(data if data == "[DONE]" else strict_json(data))
    return events


def _check_ok(kind: str, path: str, r: httpx.Response, stream: bool) -> None:
    if stream:
        events = _sse(r.iter_lines())
        errors = [e for e in events if isinstance(e, dict) and "error" in e]
        if errors:
            raise Malformed(f"{kind}: in-band error {errors[0]}")
        if path == "/completion":
            if not events or not events[-1].get("stop"):
                raise Malformed(f"{kind}: stream did not end with stop: true")
        elif not events or events[-1] != "[DONE]":
            raise Malformed(f"{kind}: stream did not end with [DONE]")
        return
    body = strict_json(r.text)
    if path == "/completion":
        if not isinstance(body.get("content"), str) or body.get("stop") is not True:
            raise Malformed(f"{kind}: {str(body)[:200]}")
        return
    choice = body["choices"][0]
    if kind == "structured" and choice["finish_reason"] == "stop":
        json.loads(choice["message"]["content"])
    if kind == "tool":
        calls = choice["message"].get("tool_calls") or []
        if choice["finish_reason"] == "tool_calls" and not calls:
            raise Malformed(f"{kind}: finish tool_calls without calls")
        for call in calls:
            json.loads(call["function"]["arguments"])


def _request(rng: random.Random) -> tuple[str, str, dict, bool]:
    """(kind, path, body, stream) of one valid request."""
    prompt, n = rng.choice(PROMPTS), rng.randint(1, 24)
    chat = [{"role": "user", "content": prompt}]
    kind = rng.choice(["chat", "chat", "text", "native", "native", "structured", "tool"])
    stream = rng.random() < 0.5 and kind not in ("structured", "tool")
    if kind == "chat":
        return kind, "/v1/chat/completions", {"messages": chat, "max_tokens": n,
                                              "stream": stream}, stream
    if kind == "text":
        return kind, "/v1/completions", {"prompt": prompt, "max_tokens": n,
                                         "stream": stream}, stream
    if kind == "native":
        return kind, "/completion", {"prompt": prompt, "n_predict": n, "stream": stream}, stream
    if kind == "structured":
        fmt = {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA}}
        return kind, "/v1/chat/completions", {"messages": chat, "max_tokens": 48,
                                              "response_format": fmt}, False
    return kind, "/v1/chat/completions", {"messages": chat, "max_tokens": 48, "tools": [TOOL],
                                          "tool_choice": "required"}, False


def slot_attack(http: httpx.Client, rng: random.Random, slots: Path, parallel: int,
                tally: Tally) -> None:
    """Break one slot (``SLOT_BREAKS``), then a request on it must be served."""
    seq, how = rng.randrange(parallel), rng.choice(sorted(SLOT_BREAKS))
    name = f"soak-{seq}-{rng.randrange(1 << 30):08x}.bin"
    try:
        with tally.lock:
            tally.sent["other"] += 1 if how == "erase" else 2     # /slots/N: "other" in /metrics
            tally.sent["/completion"] += 1
        if how == "erase":
            r = http.post(f"/slots/{seq}?action=erase")
            if r.status_code != 200 or strict_json(r.text).get("id_slot") != seq:
                raise Malformed(f"erase: {r.status_code} {r.text[:150]}")
        else:
            r = http.post(f"/slots/{seq}?action=save", json={"filename": name})
            if r.status_code != 200:
                raise Malformed(f"save: {r.status_code} {r.text[:150]}")
            (slots / name).write_bytes(broken_slot_file((slots / name).read_bytes(), how, rng))
            r = http.post(f"/slots/{seq}?action=restore", json={"filename": name})
            if r.status_code != 400:
                tally.add(f"slot_attack_got_{r.status_code}",
                          failure=f"restore of a {how} slot file: {r.status_code} {r.text[:150]}")
                return
            check_error("/completion", r)             # llama-server's shape there too
            message = strict_json(r.text)["error"]["message"]
            if SLOT_BREAKS[how] not in message or name not in message:
                raise Malformed(f"restore of a {how} slot file said: {message}")
        r = http.post("/completion", json={"prompt": rng.choice(PROMPTS), "n_predict": 2,
                                           "id_slot": seq})
        if r.status_code != 200:
            tally.add(f"slot_attack_got_{r.status_code}",
                      failure=f"after a {how} slot: {r.status_code} {r.text[:150]}")
            return
        _check_ok("native", "/completion", r, False)
        tally.add("slot_attack_refused")
    except Malformed as exc:
        tally.add("malformed", failure=str(exc))
    except httpx.TransportError as exc:
        tally.add("transport_error", failure=f"slot attack: {exc!r}")
    finally:
        (slots / name).unlink(missing_ok=True)


def _label(path: str) -> str:
    """The path as /metrics counts it."""
    path = path.split("?")[0]
    return path if path in COUNTED_PATHS else "other"


def _hostile(http: httpx.Client, base: str, rng: random.Random, tally: Tally,
             held: list) -> None:
    """One burst (a 200 or 429 each) or a batch of half-open connections."""
    kind = rng.choice(["schema_burst", "slot_burst", "half_open"])
    try:
        if kind == "half_open":
            held.extend(half_open(base))
            tally.add("half_open_sent")
            return
        path, body = SCHEMA_BURST if kind == "schema_burst" else SLOT_BURST
        with tally.lock:
            tally.sent[_label(path)] += BURST
        answers = burst(http, path, body)
        tally.add(f"{kind}_ok")
        with tally.lock:
            tally.outcomes["burst_429"] += sum(r.status_code == 429 for r in answers)
    except Malformed as exc:
        tally.add("malformed", failure=str(exc))
    except (httpx.TransportError, OSError) as exc:
        tally.add("transport_error", failure=f"{kind}: {exc!r}")


def client(base: str, seed: int, stop_at: float, tally: Tally, slots: Path | None = None,
           parallel: int = 1) -> None:
    rng = random.Random(seed)
    held: list = []                                   # half-open sockets sent by this client
    with httpx.Client(base_url=base, timeout=120) as http:
        while time.monotonic() < stop_at:
            if slots is not None and rng.random() < 0.05:     # a broken slot, then a request
                slot_attack(http, rng, slots, parallel, tally)
                continue
            roll = rng.random()
            if roll < 0.13:                                  # an invalid request
                method, path, raw = rng.choice(INVALID)
                with tally.lock:
                    tally.sent[_label(path)] += 1
                try:
                    r = send_invalid(http, method, path, raw)
                    if r.status_code >= 500 or r.status_code < 400:
                        tally.add(f"invalid_got_{r.status_code}", failure=f"{method} {path} "
                                  f"{(raw or b'')[:60]!r}: {r.status_code} {r.text[:150]}")
                    else:
                        check_error(path, r)
                        tally.add("invalid_refused")
                except (Malformed, ValueError) as exc:
                    tally.add("malformed", failure=f"{method} {path}: {exc}")
                except httpx.TransportError as exc:
                    tally.add("transport_error", failure=f"{path}: {exc!r}")
                continue
            if roll < 0.16:                                  # a burst, or half-open sockets
                _hostile(http, base, rng, tally, held)
                continue
            kind, path, body, stream = _request(rng)
            drop = roll < 0.30                               # a client that leaves early
            with tally.lock:
                tally.sent[_label(path)] += 1
            t0 = time.monotonic()
            try:
                if drop and not stream:                      # gives up while waiting/generating
                    try:
                        # only the wait for the answer times out: the request is sent
                        http.post(path, json=body, timeout=httpx.Timeout(
                            10, read=rng.uniform(0.01, 0.3)))
                        tally.add("finished_before_drop")
                    except httpx.TimeoutException:
                        tally.add("dropped_waiting")
                    continue
                with http.stream("POST", path, json=body) as r:
                    if r.status_code == 429:
                        r.read()
                        check_error(path, r)
                        tally.add("queue_full_429")
                        continue
                    if r.status_code != 200:
                        r.read()
                        tally.add(f"status_{r.status_code}", failure=f"{kind} {path}: "
                                  f"{r.status_code} {r.text[:200]}")
                        continue
                    if drop:                                 # read a little, then hang up
                        for i, _ in enumerate(r.iter_lines()):
                            if i >= rng.randint(0, 6):
                                break
                        tally.add("dropped_streaming")
                        continue
                    if not stream:
                        r.read()
                    _check_ok(kind, path, r, stream)
                    tally.add(f"ok_{kind}", latency=time.monotonic() - t0)
            except (Malformed, ValueError, KeyError, IndexError, TypeError) as exc:
                tally.add("malformed", failure=f"{kind} {path}: {type(exc).__name__}: {exc}")
            except httpx.TransportError as exc:
                tally.add("transport_error", failure=f"{kind} {path}: {exc!r}")
    for sock in held:
        sock.close()


def start_server(model: str, parallel: int, extra: list[str]) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "runtime.cli", "serve", "-m", model, "--host", "127.0.0.1",
           "--port", "0", "-np", str(parallel), "-c", str(1024 * parallel),
           "--queue-size", "32", *extra]
    proc = subprocess.Popen(cmd, cwd=REPO, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL,
                            text=True, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    url, log = None, []
    for line in proc.stderr:
        log.append(line)
        match = re.search(r"listening on (http://\S+)", line)
        url = url or (match.group(1) if match else None)
        if "serving" in line or "Error" in line:
            break
    if url is None or proc.poll() is not None:
        raise SystemExit("soak: the server did not start:\n" + "".join(log))
    threading.Thread(target=lambda: log.extend(proc.stderr), daemon=True).start()
    proc.log = log                                               # type: ignore[attr-defined]
    return proc, url


def metrics_totals(page: str) -> tuple[Counter, dict[str, float]]:
    by_path: Counter = Counter()
    for path, _, n in re.findall(r'^moe_server_requests_total\{path="([^"]+)",status="(\d+)"\} '
                                 r"(\S+)$", page, re.M):
        by_path[path] += int(float(n))
    scalars = {name: float(v) for name, v in re.findall(r"^(moe_server_\w+) (\S+)$", page, re.M)}
    return by_path, scalars


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def soak(model: str, minutes: float, clients: int, parallel: int = 4, seed: int = 0,
         extra: list[str] = (), check_rss: bool = True) -> dict:
    """Run the soak; the report as a dict (``ok``: the pass verdict, which includes the RSS
    check unless ``check_rss`` is false: a run of a minute or so ends inside the warm-up's
    climb)."""
    slots = Path(tempfile.mkdtemp(prefix="moe-offload-soak-slots-"))
    proc, base = start_server(model, parallel, [*SERVE_FLAGS, *extra, "--slot-save-path",
                                                str(slots)])
    rss = RssWatch(proc.pid).start()
    tally = Tally()
    t0 = time.monotonic()
    stop_at = t0 + minutes * 60
    threads = [threading.Thread(target=client, args=(base, seed + i, stop_at, tally, slots,
                                                     parallel),
                                daemon=True) for i in range(clients)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        with httpx.Client(base_url=base, timeout=30) as http:
            deadline = time.monotonic() + 30                 # dropped answers wind down
            while True:
                _, scalars = metrics_totals(http.get("/metrics").text)
                idle = scalars.get("moe_server_requests_running", 1) == 0 and \
                    scalars.get("moe_server_requests_waiting", 1) == 0
                if idle or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
            time.sleep(0.5)                                  # their counts land after the end
            by_path, scalars = metrics_totals(http.get("/metrics").text)
            health = http.get("/health").status_code
        memory = rss.stop(warmup_s(minutes))       # the end: the server idle, every client gone
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
        shutil.rmtree(slots, ignore_errors=True)
    mismatched = {p: {"client": tally.sent[p], "metrics": by_path.get(p, 0)}
                  for p in tally.sent if tally.sent[p] != by_path.get(p, 0)}
    fivexx = sum(n for k, n in tally.outcomes.items()
                 if re.search(r"_5\d\d$", k))
    log = "".join(proc.log)                                  # type: ignore[attr-defined]
    report = {
        "minutes": round((time.monotonic() - t0) / 60, 2), "clients": clients,
        "parallel": parallel, "outcomes": dict(sorted(tally.outcomes.items())),
        "requests": sum(tally.sent.values()),
        "latency_s": {"p50": percentile(tally.latencies, 0.5),
                      "p99": percentile(tally.latencies, 0.99), "n": len(tally.latencies)},
        "rss_mib": memory,
        "validation_failures": tally.failures,
        "metrics": {"by_path": dict(by_path), "client_sent": dict(tally.sent),
                    "mismatched": mismatched,
                    "cancelled_total": scalars.get("moe_server_requests_cancelled_total"),
                    "client_dropped": tally.outcomes["dropped_waiting"]
                    + tally.outcomes["dropped_streaming"]},
        "health_after": health, "traceback_in_log": "Traceback" in log,
        # a limit hit over and over is said once, then at most once a minute
        "limit_notices": sum("(--header-timeout)" in line or "(--max-connections)" in line
                             for line in log.splitlines()),
    }
    report["ok"] = (fivexx == 0 and tally.outcomes["malformed"] == 0 and not mismatched
                    and tally.outcomes["transport_error"] == 0 and health == 200
                    and not report["traceback_in_log"]
                    and report["limit_notices"] <= 2 * (minutes + 1) and (memory["ok"] or not check_rss)
                    and not any(k.startswith(("invalid_got_", "status_", "slot_attack_got_"))
                                for k in tally.outcomes))
    return report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-m", "--model", default=None, help="GGUF (default: the demo model)")
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--clients", type=int, default=8, help="concurrent clients")
    parser.add_argument("-np", "--parallel", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="the report as JSON")
    args = parser.parse_args()
    model = args.model
    if model is None:
        from runtime.cache import cached_model  # noqa: PLC0415
        from runtime.commands.demo import default_spec  # noqa: PLC0415
        model = str(cached_model(default_spec()))
    report = soak(model, args.minutes, args.clients, args.parallel, args.seed)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(f"soak: {report['requests']} requests in {report['minutes']} min, "
              f"{args.clients} clients, -np {args.parallel}: "
              f"{'PASS' if report['ok'] else 'FAIL'}")
        for name, n in report["outcomes"].items():
            print(f"  {name:24s} {n}")
        lat = report["latency_s"]
        if lat["n"]:
            print(f"  latency of whole answers: p50 {lat['p50']:.3f} s, p99 {lat['p99']:.3f} s "
                  f"({lat['n']})")
        rss = report["rss_mib"]
        slope = rss["slope_mib_per_min"]
        print(f"  server RSS (medians of {rss['window_s']:g} s): {rss['after_warmup']} MiB after "
              f"the {rss['warmup_s']:g} s warm-up, {rss['end']} MiB at the end "
              f"({rss['growth']:+.1%}, within ±5%: {rss['ok']}), slope "
              f"{slope if slope is not None else '-'} MiB/min, peak {rss['peak']} MiB; by minute: "
              + " ".join(f"{m:g}" for m in rss["by_minute"]))
        m = report["metrics"]
        print(f"  /metrics request totals equal the client's: {not m['mismatched']}"
              + (f" (differ: {m['mismatched']})" if m["mismatched"] else ""))
        print(f"  cancelled in /metrics: {m['cancelled_total']:.0f}; clients that hung up: "
              f"{m['client_dropped']}")
        print(f"  limit notices in the log: {report['limit_notices']} (said once, then at most "
              "once a minute)")
        for failure in report["validation_failures"]:
            print(f"  FAILED: {failure}")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
