#!/usr/bin/env python3
"""Digests of every residency decision, per policy config: the check that a redesign of the
manager or the core changed no decision (run it on both trees and diff the output).

    PYTHONPATH=TREE python scripts/decision_digest.py > digests.txt

A stream of 3 prompt chunks (32 tokens each) and 200 decode tokens (every 50th a MIXED batch)
of bench_manager.py's skewed routing (48 layers, 128 experts, top-8, Qwen3-30B-A3B's expert
bytes) runs, at two capacities, through
  live:   access_layer with a lease per layer-step, the previous released, and a transport
          that records every drop and transfer notice (key, bytes, victims, phase, prefetch);
  replay: the core's batch loop (manager.replay): each row's miss kind and the prefetch log.
Each line: config, capacity in experts, the live digest, the replay digest (SHA-256, 16 hex);
the per-phase counters are part of both.
"""
from __future__ import annotations

import hashlib
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))
from bench_manager import _config, decode_stream  # noqa: E402
from runtime.residency.config import parse_config  # noqa: E402
from runtime.residency.manager import ExpertResidencyManager  # noqa: E402
from runtime.residency.types import Phase  # noqa: E402

LAYERS, EXPERTS, TOP_K, EXPERT_BYTES = 48, 128, 8, 3059712
# policy mixes beyond the presets and the shipped configs: every admission and planner
MIXES = {
    "mix-decay-reuse-popularity": {"policy": {"phase_specific": True, "prefill": {
        "prefetch": "chunk-plan", "prefetch_params": {"depth": 2}, "eviction": "lfu-decay",
        "eviction_params": {"half_life": 1024}}, "decode": {
        "admission": "reuse-threshold", "prefetch": "popularity", "eviction": "lfu-decay",
        "eviction_params": {"half_life": 1024}}}},
    "mix-lru-pressure-weighted": {"policy": {"phase_specific": True, "prefill": {
        "eviction": "lru"}, "decode": {"admission": "transient-on-pressure",
                                       "admission_params": {"window": 2000},
                                       "prefetch": "popularity",
                                       "eviction": "phase-weighted"}}},
    "mix-nextvisit-affinity-lfu": {"policy": {"phase_specific": True, "prefill": {
        "prefetch": "chunk-plan", "eviction": "next-visit"}, "decode": {
        "admission": "reuse-threshold", "prefetch": "affinity", "eviction": "lfu"}}},
}
CONFIGS = ("lru", "lfu", "lfu-decay", "phase-weighted", "next-visit",
           "configs/best-replay.toml", "configs/example.toml", *MIXES)


class Recorder:
    """A transport that hashes what the manager tells it (ids left out: who mints them is
    mechanism, not decision)."""

    inline = True   # what a tree before the one-mode core reads (its live mode)

    def __init__(self, digest) -> None:
        self.digest = digest

    def bind(self, manager) -> None:
        self.manager = manager

    def submit(self, t) -> None:
        self.digest.update(repr(("S", t.device, t.key, t.bytes, t.victims, int(t.phase),
                                 t.prefetch)).encode())

    def drop(self, device, key) -> None:
        self.digest.update(repr(("D", device, key)).encode())


def stream() -> list[tuple[int, np.ndarray, Phase]]:
    """(layer, experts in routing order, phase) of every layer-step, in order."""
    decode = decode_stream(200, LAYERS, EXPERTS, TOP_K, 3)            # (T, L, k)
    prompt = decode_stream(96, LAYERS, EXPERTS, TOP_K, 4)
    steps = [(layer, prompt[c * 32:(c + 1) * 32, layer].reshape(-1), Phase.PREFILL)
             for c in range(3) for layer in range(LAYERS)]
    for t in range(200):
        phase = Phase.MIXED if t % 50 == 7 else Phase.DECODE
        steps += [(layer, decode[t, layer], phase) for layer in range(LAYERS)]
    return steps


def config(name: str):
    if name in MIXES:
        return parse_config(MIXES[name], source=name)
    return _config(str(ROOT / name) if name.endswith(".toml") else name)


def digests(name: str, capacity: int, steps) -> tuple[str, str]:
    live = hashlib.sha256()
    m = ExpertResidencyManager(config(name), transport=Recorder(live))
    m.bind_model([EXPERT_BYTES] * LAYERS, EXPERTS, TOP_K)
    m.reconfigure("cuda:0", capacity * EXPERT_BYTES)
    held = None
    for layer, experts, phase in steps:
        a = m.access_layer("cuda:0", layer, experts, phase, release=held)
        live.update(repr((a.hits, a.misses, a.demand_miss_bytes, a.admitted, a.evicted,
                          a.transient, a.transition_hits)).encode())
        held = a
    m.release(held)
    m.verify()
    live.update(repr([m.snapshot().devices[0].phase(p) for p in Phase]).encode())
    replay = hashlib.sha256()
    r = ExpertResidencyManager.create_simulated(
        expert_bytes=[EXPERT_BYTES] * LAYERS, n_expert=EXPERTS,
        capacity_bytes=capacity * EXPERT_BYTES, config=config(name), n_expert_used=TOP_K)
    bounds = np.cumsum([0] + [len(e) for _, e, _ in steps]).astype(np.int64)
    out = r.replay("sim", bounds, np.array([s[0] for s in steps], dtype=np.int32),
                   np.array([int(s[2]) for s in steps], dtype=np.int8),
                   np.concatenate([e for _, e, _ in steps]).astype(np.int32))
    for arr in (out.miss_kind, out.prefetch_event, out.prefetch_batch, out.prefetch_flat):
        replay.update(arr.tobytes())
    replay.update(repr([r.snapshot().devices[0].phase(p) for p in Phase]).encode())
    return live.hexdigest()[:16], replay.hexdigest()[:16]


def main() -> int:
    steps = stream()
    for name in CONFIGS:
        for capacity in (600, 1800):
            print(name, capacity, *digests(name, capacity, steps), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
