"""Estimate TTFT and TPOT of a replayed cell from where each routed expert was served.

The model (all rates from ``CostParams``, the ``[cost]`` table of the residency config):

* An expert of ``b`` bytes holds ``P = 8 b / WEIGHT_BITS`` weights; running it for ``m``
  tokens costs ``max(b / mem_rate, 2 P m / flop_rate)`` seconds on a device (weights streamed
  once, or compute-bound for big prefill batches).
* A fast-tier hit runs on the GPU: ``gpu(b, m)``.
* A demand miss picks the cheaper of fetching and computing in place (the per-miss choice):
  ``fetch = link_latency + b / link + gpu(b, m)`` against ``cpu(b, m)``. In decode (m = 1) the
  CPU usually wins: weights cross the link slower than the CPU streams them from RAM.
* A miss the manager admitted but that ran on the CPU still copies its bytes over the link,
  off the critical path; so do prefetches. A phase takes
  ``max(critical path, link bytes / link rate)``: the link must carry everything it is given.
* Each layer batch also runs the layer's dense weights on the GPU (attention, router, norms):
  ``max(dense_bytes / gpu_mem, 2 P_dense n_tokens / gpu_flops)``.

TTFT = prefill time per turn (the first token comes out of the prefill pass); TPOT = decode
time per decode token. Nothing overlaps compute with compute, so estimates are upper-bound
style, meant for comparing policies, not for predicting a particular machine to the percent.
"""
from __future__ import annotations

import numpy as np

from runtime.residency.config import CostParams

WEIGHT_BITS = 4.5  # effective bits per weight of a Q4_K_M-style file (sets FLOPs per byte)


class PhaseCost:
    """Running sums for one phase (seconds and bytes)."""

    def __init__(self, n_layer: int):
        self.critical_s = 0.0     # compute plus demand fetches, in order
        self.link_bytes = 0.0     # everything over the host->GPU link
        # one-token calls (decode) are summed per layer and priced at the end: (n_layer,)
        self.hit_elems = np.zeros(n_layer)
        self.miss_keys = np.zeros(n_layer)
        self.admitted = np.zeros(n_layer)
        self.calls = np.zeros(n_layer)


class CostModel:
    """Prices the calls of one replay; ``add_*`` while replaying, ``estimate`` at the end."""

    def __init__(self, params: CostParams, expert_bytes, dense_bytes):
        self.p = params
        self.expert_bytes = np.asarray(expert_bytes, dtype=np.float64)   # (n_layer,)
        self.dense_bytes = np.asarray(dense_bytes, dtype=np.float64)     # (n_layer,)
        self.phases = [PhaseCost(len(self.expert_bytes)) for _ in range(3)]

    # -- unit costs (seconds); b bytes, m tokens; numpy-broadcastable -------------------------

    def gpu(self, b, m):
        return np.maximum(b / (self.p.gpu_mem_gbps * 1e9),
                          2 * 8 * b / WEIGHT_BITS * m / (self.p.gpu_gflops * 1e9))

    def cpu(self, b, m):
        return np.maximum(b / (self.p.cpu_mem_gbps * 1e9),
                          2 * 8 * b / WEIGHT_BITS * m / (self.p.cpu_gflops * 1e9))

    def fetch(self, b, m):
        return self.p.link_latency_us * 1e-6 + b / (self.p.link_gbps * 1e9) + self.gpu(b, m)

    # -- accumulation -------------------------------------------------------------------------

    def add_single_token_counts(self, phase: int, hit_elems: np.ndarray, miss_keys: np.ndarray,
                                admitted: np.ndarray, calls: np.ndarray) -> None:
        """Per-layer totals (n_layer,) of one-token calls (decode): priced in ``estimate``."""
        ph = self.phases[phase]
        ph.hit_elems += hit_elems
        ph.miss_keys += miss_keys
        ph.admitted += admitted
        ph.calls += calls

    def add_batch_call(self, phase: int, layer: int, n_tokens: int, key_tokens: np.ndarray,
                       missed: np.ndarray, admitted: np.ndarray) -> None:
        """One multi-token call (prefill chunk): ``key_tokens`` (n_keys,) tokens per distinct
        key; ``missed``/``admitted`` (n_keys,) bool."""
        ph = self.phases[phase]
        b = self.expert_bytes[layer]
        m = key_tokens.astype(np.float64)
        fetch, cpu = self.fetch(b, m), self.cpu(b, m)
        take_fetch = missed & (fetch <= cpu)
        ph.critical_s += float(self.gpu(b, m)[~missed].sum())
        ph.critical_s += float(np.minimum(fetch, cpu)[missed].sum())
        ph.critical_s += float(self.gpu(self.dense_bytes[layer], n_tokens))
        ph.link_bytes += b * float(take_fetch.sum() + (admitted & ~take_fetch).sum())

    def add_prefetch_bytes(self, phase: int, n_bytes: int) -> None:
        self.phases[phase].link_bytes += n_bytes

    # -- results ------------------------------------------------------------------------------

    def phase_seconds(self, phase: int) -> float:
        """Estimated wall time of everything replayed in ``phase``."""
        ph = self.phases[phase]
        b = self.expert_bytes
        fetch, cpu = self.fetch(b, 1.0), self.cpu(b, 1.0)
        take_fetch = fetch <= cpu                                       # (n_layer,)
        critical = ph.critical_s + float(
            (ph.hit_elems * self.gpu(b, 1.0)).sum()
            + (ph.miss_keys * np.minimum(fetch, cpu)).sum()
            + (ph.calls * self.gpu(self.dense_bytes, 1.0)).sum())
        link = ph.link_bytes + float(
            (b * np.where(take_fetch, ph.miss_keys, ph.admitted)).sum())
        return max(critical, link / (self.p.link_gbps * 1e9))

    def estimate(self, *, prefill_turns: int, decode_tokens: int) -> tuple[float, float]:
        """(est_ttft_s, est_tpot_s); 0.0 where the trace has no such phase."""
        ttft = self.phase_seconds(0) / prefill_turns if prefill_turns else 0.0
        decode_s = self.phase_seconds(1) + self.phase_seconds(2)
        tpot = decode_s / decode_tokens if decode_tokens else 0.0
        return ttft, tpot
