#!/usr/bin/env python3
"""Benchmark: the residency manager's cost per decode token, live configuration, against a bare
OrderedDict LRU.

A Qwen3-30B-A3B-shaped decode stream (48 MoE layers, 128 experts, top-8, skewed routing) runs
through ``ExpertResidencyManager`` as the live hooks drive it: a transport attached to the
device, driven two ways: from C as the routing hook's consumers step it (``rc_step`` per
layer-step: a lease the core mints, the previous one released in the same call; no Python per
step), and from Python as ResidencyObserver does for the reference core (an inline transport
attached, as the device cache and the RAM tier are: every eviction is a ``drop`` call and
every admission a ``submit``; it moves nothing here, so what is timed is the manager; one
``manager.step`` per layer-step, the previous step's lease handed back to end it). The same arrays also
run through a bare ``OrderedDict`` LRU loop, in the same run. Prints µs/token for each, the ratio
to the bare loop, the hit rates (which must agree closely) and the command line.

The C row's arrays are built before its timer starts (the live hook has them in C; building
them from the rows' small numpy arrays costs about as much as the core's LRU itself).

Timing: the runs alternate every ``--chunk`` tokens; each chunk's time is the best of
``--repeat`` passes over the whole stream (every pass starts from an empty cache, so a chunk
sees the same state each time), and a run's time is the sum of its chunks' best. A noisy
shared machine thus slows neither side more than the other.

    python scripts/bench_manager.py [--tokens 1000] [--capacity 0.3] [--repeat 5]
        [--policy NAME | --config FILE]

``--policy NAME`` is replay's preset (eviction NAME, demand admission, no prefetch);
``--config FILE`` a residency TOML's policies instead (configs/best-replay.toml: next-visit
with the affinity prefetch).
"""
from __future__ import annotations

import argparse
import gc
import sys
import time
from collections import OrderedDict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from runtime.residency.config import load_config, preset_config  # noqa: E402
from runtime.residency.manager import ExpertResidencyManager  # noqa: E402
from runtime.residency.types import Phase  # noqa: E402


class InlineTransport:
    """What a live transport sees (drops, then submits), without moving bytes."""

    def __init__(self) -> None:
        self.submitted = self.dropped = 0

    def bind(self, manager) -> None:
        self.manager = manager

    def submit(self, ticket) -> None:
        self.submitted += 1

    def drop(self, device, key) -> None:
        self.dropped += 1


TOP_K = 8   # experts per token (bind_model's n_expert_used, as the live setup passes it)


def decode_stream(tokens: int, layers: int, experts: int, top_k: int, seed: int) -> np.ndarray:
    """(tokens, layers, top_k) int32 expert ids: Zipf-like popularity per layer, distinct per
    token (Gumbel top-k)."""
    rng = np.random.default_rng(seed)
    ranks = np.argsort(rng.random((layers, experts)), axis=1)            # (L, E) permutation
    log_p = -1.1 * np.log1p(ranks.astype(np.float64))                   # Zipf s=1.1
    gumbel = rng.gumbel(size=(tokens, layers, experts))
    scores = log_p[None] + gumbel                                         # (T, L, E)
    top = np.argpartition(-scores, top_k, axis=2)[:, :, :top_k]
    order = np.take_along_axis(scores, top, axis=2).argsort(axis=2)[:, :, ::-1]
    return np.take_along_axis(top, order, axis=2).astype(np.int32)


def _config(policy: str):
    """``policy``: a preset name, or a residency TOML's path (ends with .toml)."""
    return load_config(policy) if policy.endswith(".toml") else preset_config(policy)


class ManagerRun:
    """The stream through the manager as the live hooks call it (a transport attached)."""

    def __init__(self, layers: int, capacity_experts: int, policy: str, expert_bytes: int = 1):
        self.transport = InlineTransport()
        self.m = ExpertResidencyManager(_config(policy), transport=self.transport)
        self.m.bind_model([expert_bytes] * layers, 128, TOP_K)   # as the live setup does
        self.m.reconfigure("cuda:0", capacity_experts * expert_bytes)
        self.layers = layers
        self.held = 0          # the previous layer-step's lease (core's step), 0: none
        self.token = 0

    def run(self, rows: list) -> None:
        step, decode = self.m.step, Phase.DECODE
        held, token = self.held, self.token
        for row in rows:
            for layer in range(self.layers):
                held = step("cuda:0", held, layer, row[layer], decode).lease_id
            token += 1
        self.held, self.token = held, token

    def hits(self) -> int:
        self.m.step_end("cuda:0", self.held)
        self.held = 0
        self.m.verify()
        return self.m.snapshot().device("cuda:0").phase(Phase.DECODE).hits


class NativeRun:
    """The same stream as the C routing hook and device cache drive the core in the runtime
    (rc_access per layer-step with a lease, the previous released; no Python per step)."""

    def __init__(self, layers: int, capacity_experts: int, policy: str, expert_bytes: int = 1):
        self.m = ExpertResidencyManager(_config(policy), transport=InlineTransport())
        self.m.bind_model([expert_bytes] * layers, 128, TOP_K)   # as the live setup does
        self.m.reconfigure("cuda:0", capacity_experts * expert_bytes)
        self.core = self.m.core_handle("cuda:0")
        from runtime.clib import load_library
        self.lib, self.ffi = load_library()
        self.layers = layers
        self.n_hits = 0

    def prepare(self, rows: list) -> tuple:
        """The chunk as the C loop's arrays (untimed: the live hook has them in C already)."""
        experts = np.ascontiguousarray(np.stack([np.stack(r) for r in rows]), dtype=np.int32)
        layers = np.tile(np.arange(self.layers, dtype=np.int32), len(rows))
        return layers, experts

    def run(self, prepared: tuple) -> None:
        layers, experts = prepared
        self.n_hits += int(self.lib.rc_bench_live(
            self.core, len(layers), self.ffi.from_buffer("int32_t[]", layers),
            self.ffi.from_buffer("int32_t[]", experts), experts.shape[-1], int(Phase.DECODE)))

    def hits(self) -> int:
        self.m.verify()
        return self.n_hits


class BareRun:
    """The same (k,) int32 arrays through a bare OrderedDict LRU loop."""

    def __init__(self, layers: int, capacity_experts: int):
        self.cache: OrderedDict = OrderedDict()
        self.capacity = capacity_experts
        self.layers = layers
        self.n_hits = 0

    def run(self, rows: list) -> None:
        cache, capacity, hits = self.cache, self.capacity, 0
        for row in rows:
            for layer in range(self.layers):
                base = layer * 128
                for e in row[layer].tolist():
                    key = base + e
                    if key in cache:
                        cache.move_to_end(key)
                        hits += 1
                    else:
                        if len(cache) >= capacity:
                            cache.popitem(last=False)
                        cache[key] = True
        self.n_hits += hits

    def hits(self) -> int:
        return self.n_hits


def timed(stream: np.ndarray, capacity: int, policy: str, chunk: int, repeat: int,
          variants: dict) -> tuple[dict, dict]:
    """Seconds per variant (sum over chunks of the best of ``repeat`` passes) and hits."""
    tokens, layers, _ = stream.shape
    rows = [[stream[t, layer] for layer in range(layers)] for t in range(tokens)]  # (k,) int32
    starts = range(0, tokens, chunk)
    best = {name: [float("inf")] * len(starts) for name in variants}
    hits: dict = {}
    for _ in range(repeat):
        runs = {name: make(layers, capacity, policy) for name, make in variants.items()}
        gc.collect()
        for i, start in enumerate(starts):
            part = rows[start:start + chunk]
            for name, run in runs.items():
                chunk_in = run.prepare(part) if hasattr(run, "prepare") else part
                t0 = time.perf_counter()
                run.run(chunk_in)
                dt = time.perf_counter() - t0
                if dt < best[name][i]:
                    best[name][i] = dt
        hits = {name: run.hits() for name, run in runs.items()}
    return {name: sum(b) for name, b in best.items()}, hits


def main() -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=1000)
    ap.add_argument("--capacity", type=float, default=0.3, help="share of all experts")
    ap.add_argument("--policy", default="lru", help="replay's preset policy name")
    ap.add_argument("--config", default=None, metavar="FILE",
                    help="a residency TOML's policies instead of --policy")
    ap.add_argument("--repeat", type=int, default=5, help="best of N per chunk")
    ap.add_argument("--chunk", type=int, default=10, help="tokens per timed chunk")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--expert-bytes", type=int, default=1, metavar="B",
                    help="bytes of one expert (default 1: no prefetch ever crosses the [cost] "
                         "link in time, so prefetch affinity never plans; 3059712, "
                         "Qwen3-30B-A3B Q4_K_M's, makes it plan and issue real prefetches)")
    args = ap.parse_args()
    if args.expert_bytes < 1:
        ap.error(f"--expert-bytes: {args.expert_bytes} must be >= 1")
    layers, experts, top_k = 48, 128, TOP_K
    stream = decode_stream(args.tokens, layers, experts, top_k, args.seed)
    capacity = int(args.capacity * layers * experts)
    b = args.expert_bytes
    variants = {"bare": lambda L, c, p: BareRun(L, c),
                "native": lambda L, c, p: NativeRun(L, c, p, b),
                "manager": lambda L, c, p: ManagerRun(L, c, p, b)}
    policy = args.config or args.policy
    secs, hits = timed(stream, capacity, policy, args.chunk, args.repeat, variants)
    accesses = args.tokens * layers * top_k
    print(f"command: {' '.join(sys.argv)}")
    print(f"stream: {args.tokens} decode tokens x {layers} layers x top-{top_k} "
          f"= {accesses} accesses; capacity {capacity} experts ({args.capacity:.0%}) of "
          f"{b} bytes; "
          f"best of {args.repeat} per {args.chunk}-token chunk")
    bare_us = secs["bare"] / args.tokens * 1e6
    for name, s in secs.items():
        us = s / args.tokens * 1e6
        label = {"bare": "bare OrderedDict LRU",
                 "native": f"live, C hook -> core ({policy})",
                 "manager": f"live, Python manager.step ({policy})"}[name]
        ratio = "" if name == "bare" else f"  ratio {us / bare_us:.2f}x"
        print(f"{label:34s} {us:8.1f} us/token  ({accesses / s / 1e3:.0f}k accesses/s)  "
              f"hit rate {hits[name] / accesses:.4f}{ratio}")
    print("must: the live manager <= 100 us/token. The C row is the path the runtime takes for "
          "bookkeeping, device-cache and RAM-tier devices (the routing hook's consumers); the "
          "Python row is ResidencyObserver's (the reference core, the reference hook)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
