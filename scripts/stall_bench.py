#!/usr/bin/env python3
"""How long the heaviest requests the limits allow stall another slot's stream.

Starts ``moe-offload serve -np 2`` on a synthetic model (or ``-m MODEL``), runs one streamed
``/completion`` (the victim) and, while it streams, sends one heavy request at a time on the
other slot: the largest schema and grammar the limits let through (``--max-grammar-repeat``
repetitions, 16x that in all), the longest prompt the slot holds, ``n_probs`` at its maximum
with ``post_sampling_probs``. For each, the victim's inter-token gaps while it ran: the
largest, against the victim's median gap when alone (one decode step).

    python scripts/stall_bench.py [-m MODEL] [--tokens 2000] [--json]

Issue 23's bound: no single request stalls other slots by more than one decode step.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import soak  # noqa: E402  (scripts/soak.py: its server start)

REPO = Path(__file__).resolve().parents[1]
# a decode step of several ms on a small CPU: well above the noise of the HTTP stream
SPEC = dict(arch="qwen3moe", layers=8, experts=16, top_k=4, embd=768, ff=768, dtype="f16",
            seed=0)
N_CTX = 4096                     # two slots of 2048
REPEAT = 1000                    # the default --max-grammar-repeat


def heavy_requests(prompt_tokens: int) -> dict[str, dict]:
    """The heaviest request of each kind the default limits accept."""
    schema = {"type": "object", "properties": {
        f"p{i}": {"type": "string", "minLength": REPEAT - 1, "maxLength": REPEAT}
        for i in range(8)}, "required": [f"p{i}" for i in range(8)]}
    grammar = "root ::= " + " ".join(f'[a-z]{{0,{REPEAT}}} "{i}"' for i in range(16))
    base = {"n_predict": 16, "temperature": 0, "cache_prompt": False}
    return {
        "json_schema (8 x minLength 999 / maxLength 1000)":
            dict(base, prompt="name:", json_schema=schema),
        "grammar (16 x [a-z]{0,1000})": dict(base, prompt="word:", grammar=grammar),
        "n_probs 20, post_sampling_probs": dict(base, prompt="hello", n_probs=20,
                                                post_sampling_probs=True, temperature=1.0),
        f"prompt of {prompt_tokens} tokens": dict(base, prompt=[5 + i % 1000 for i in
                                                                range(prompt_tokens)]),
    }


def victim(base: str, tokens: int, arrivals: list[float], done: threading.Event) -> None:
    body = {"prompt": "Once upon a time", "n_predict": tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "cache_prompt": False}
    with httpx.stream("POST", f"{base}/completion", json=body, timeout=600) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and '"content"' in line:
                arrivals.append(time.perf_counter())
    done.set()


def gaps_within(arrivals: list[float], t0: float, t1: float) -> list[float]:
    """Gaps between consecutive tokens that overlap [t0, t1]."""
    return [b - a for a, b in zip(arrivals, arrivals[1:]) if b >= t0 and a <= t1]


def run(model: str, tokens: int) -> dict:
    proc, base = soak.start_server(model, 2, ["-c", str(N_CTX)])
    try:
        with httpx.Client(base_url=base, timeout=600) as http:
            http.post("/completion", json={"prompt": "warm up", "n_predict": 4})
            n_slot = http.get("/props").json()["default_generation_settings"]["n_ctx"]
            arrivals: list[float] = []
            done = threading.Event()
            t = threading.Thread(target=victim, args=(base, tokens, arrivals, done))
            t.start()
            while len(arrivals) < 60:
                time.sleep(0.01)
            alone = statistics.median(b - a for a, b in zip(arrivals[10:], arrivals[11:]))
            results = {}
            for name, body in heavy_requests(n_slot - 40).items():
                time.sleep(0.3)                  # a few alone steps between requests
                if done.is_set():
                    break
                t0 = time.perf_counter()
                r = http.post("/completion", json=body)
                t1 = time.perf_counter()
                gaps = gaps_within(arrivals, t0, t1)
                results[name] = {"status": r.status_code, "seconds": round(t1 - t0, 3),
                                 "victim_tokens": len(gaps),
                                 "max_gap_ms": round(max(gaps, default=0) * 1e3, 1),
                                 "median_gap_ms": round(statistics.median(gaps) * 1e3, 1)
                                 if gaps else None}
            t.join()
            return {"model": model, "slot_context": n_slot,
                    "decode_step_alone_ms": round(alone * 1e3, 2), "heavy": results}
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-m", "--model", help="GGUF model (default: a synthetic one)")
    parser.add_argument("--tokens", type=int, default=2000, help="the victim's tokens")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            sys.path.insert(0, str(REPO))
            from gguf_tools.synth import SynthSpec, write_synthetic_model  # noqa: PLC0415
            model = str(write_synthetic_model(Path(tmp) / "stall.gguf", SynthSpec(**SPEC)))
        report = run(model, args.tokens)
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"command: python scripts/stall_bench.py {' '.join(sys.argv[1:])}".rstrip())
    print(f"model: {args.model or 'synthetic ' + str(SPEC)}; slot context "
          f"{report['slot_context']}")
    step = report["decode_step_alone_ms"]
    print(f"victim's decode step alone (median gap): {step} ms")
    for name, r in report["heavy"].items():
        print(f"  {name}: {r['status']} in {r['seconds']} s; victim's max gap "
              f"{r['max_gap_ms']} ms = {r['max_gap_ms'] / step:.1f} steps (median "
              f"{r['median_gap_ms']} ms over {r['victim_tokens']} tokens)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
