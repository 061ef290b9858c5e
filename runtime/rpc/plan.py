"""What lives on each remote device: a pure plan from byte budgets and a link cost model.

Two shapes (llama.cpp's own mechanisms carry either out; runtime/rpc/setup.py):
- ``layers``: contiguous whole-layer ranges on the remotes (weights and KV cache there), the
  first layers and the output local. A token crosses each link once per range: the hidden
  state goes there and comes back (one round trip per remote range).
- ``experts``: only the routed-expert tensors (``*_exps``) of chosen layers on a remote; dense
  weights and KV stay local. One round trip per remote layer per token (hidden state, ids and
  weights go, the expert output comes back), but the local device keeps every dense weight.

Each remote is filled up to its budget from the end of the model backwards (the last remote
takes the last layers), so a bigger budget moves more layers. The cost model (seconds per
decoded token) is link time plus weight streaming:
``sum over remote crossings (rtt + bytes / bandwidth) + sum over layers bytes read / rate``,
with a layer's bytes read per token = dense bytes + n_expert_used * one expert's bytes.
``auto`` picks the cheaper shape among those that take at least ``RELIEF_SHARE`` of the
bytes the best shape takes off the local machine (the budgets are there to be used: a shape
that fits one small layer where the other fits eight expert sets is not chosen for being
"fast"); ties go to ``layers``.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Sequence

from runtime.errors import UserError
from runtime.units import format_ranges

# llama: llama.cpp's own split (free memory); cache: the device cache's slots on
# the remote (every weight loads locally; the manager fills the slots as on a local GPU)
MODES = ("auto", "layers", "experts", "llama", "cache")
RELIEF_SHARE = 0.75      # a shape must move >= this share of the best shape's bytes remote
# ggml-rpc remembers ONE graph per device for GRAPH_RECOMPUTE: a device with several splits per
# token (experts shape, two or more remote layers) gets every split's serialized graph again
# each token. Measured (synthetic qwen3moe, embd 256): 8.5 KB/token with one remote expert
# layer, 141 KB/token with two on the same device, so ~66 KB per split.
GRAPH_RESEND_BYTES = 66_000


@dataclass(frozen=True)
class LayerBytes:
    """Bytes of one repeating layer: its routed-expert tensors, the rest, its KV cache."""

    experts: int        # all *_exps tensors (n_expert experts)
    dense: int          # every other tensor of blk.N
    kv: int             # K and V cache of this layer at the context size, bytes
    one_expert: int     # one expert (all projections)


@dataclass(frozen=True)
class Link:
    """A remote device with its resolved budget and measured link."""

    device: str
    capacity: int               # bytes it may hold
    rtt_s: float                # seconds per round trip
    bandwidth_bps: float        # bytes / s
    mem_bps: float              # weight bytes its compute streams per second


@dataclass(frozen=True)
class RemoteShare:
    device: str
    layers: tuple[int, ...]     # ascending, contiguous
    bytes: int                  # what the plan puts there (weights [+ KV]); <= capacity
    capacity: int

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class RemotePlan:
    """The plan: ``mode`` and each remote's share; ``costs``: seconds per token per shape."""

    mode: str
    shares: tuple[RemoteShare, ...]
    local_layers: tuple[int, ...]
    costs: tuple[tuple[str, float], ...] = ()
    reason: str = ""
    link: tuple[tuple[str, float, float], ...] = field(default=())  # (device, rtt s, B/s)

    @property
    def remote_layers(self) -> int:
        return sum(len(s.layers) for s in self.shares)

    def describe(self) -> str:
        """One line per remote, for the load message."""
        parts = []
        for s in self.shares:
            if self.mode == "cache":
                parts.append(f"{s.device}: expert slots of {s.bytes / 2**20:.1f} MiB "
                             f"(of {s.capacity / 2**20:.1f} MiB; the rest for compute)")
                continue
            what = "layers" if self.mode == "layers" else "experts of layers"
            parts.append(f"{s.device}: {what} {format_ranges(s.layers) or 'none'} "
                         f"({s.bytes / 2**20:.1f} of {s.capacity / 2**20:.1f} MiB)")
        costs = ", ".join(f"{m} {c * 1e3:.2f} ms/token" for m, c in self.costs)
        return (f"remote plan [{self.mode}]: " + "; ".join(parts) +
                (f"; model cost {costs}" if costs else "") +
                (f" ({self.reason})" if self.reason else ""))

    def to_dict(self) -> dict:
        return {"mode": self.mode, "shares": [s.to_dict() for s in self.shares],
                "local_layers": list(self.local_layers), "reason": self.reason,
                "cost_s_per_token": dict(self.costs),
                "links": [{"device": d, "rtt_s": r, "bandwidth_bps": b} for d, r, b in self.link]}


def _fill(sizes: Sequence[int], links: Sequence[Link], reserve: int) -> list[tuple[int, ...]]:
    """Contiguous ranges from the end backwards: the last link takes the last layers that fit
    its capacity (minus ``reserve``), the one before it continues below, and so on."""
    ranges: list[tuple[int, ...]] = [()] * len(links)
    top = len(sizes)                     # layers [top, n) are taken
    for i in range(len(links) - 1, -1, -1):
        room = links[i].capacity - reserve
        start = top
        while start > 0 and sizes[start - 1] <= room:
            room -= sizes[start - 1]
            start -= 1
        ranges[i] = tuple(range(start, top))
        top = start
    return ranges


def _cost(mode: str, layers: Sequence[LayerBytes], ranges, links: Sequence[Link], *,
          n_expert_used: int, act_bytes: int, local_bps: float) -> float:
    """Seconds per decoded token (see the module docstring)."""
    where = {}
    for link, rng in zip(links, ranges):
        for layer in rng:
            where[layer] = link
    t = 0.0
    for i, lb in enumerate(layers):
        used = lb.dense + n_expert_used * lb.one_expert
        link = where.get(i)
        if link is None:
            t += used / local_bps
        elif mode == "layers":
            t += used / link.mem_bps
        else:
            t += lb.dense / local_bps + n_expert_used * lb.one_expert / link.mem_bps
            t += link.rtt_s + 2 * act_bytes / link.bandwidth_bps      # one crossing per layer
            if sum(1 for w in where.values() if w is link) > 1:        # graph sent again
                t += GRAPH_RESEND_BYTES / link.bandwidth_bps
    if mode == "layers":
        for link, rng in zip(links, ranges):
            if rng:
                t += link.rtt_s + 2 * act_bytes / link.bandwidth_bps  # one crossing per range
    return t


def plan_remotes(layers: Sequence[LayerBytes], links: Sequence[Link], *, mode: str = "auto",
                 n_expert_used: int, n_embd: int, local_bps: float,
                 reserve_bytes: int | dict[str, int] = 0) -> RemotePlan:
    """The plan for these layers and links (see the module docstring). ``reserve_bytes``: kept
    free on each remote for its compute buffer (one figure, or one per shape: {"layers": ..,
    "experts": ..}). UserError for an unknown mode or when a remote's budget holds nothing."""
    reserves = reserve_bytes if isinstance(reserve_bytes, dict) else {
        "layers": reserve_bytes, "experts": reserve_bytes}
    if mode not in MODES:
        raise UserError(f"rpc.mode {mode!r}: unknown (valid: {', '.join(MODES)})")
    act_bytes = 4 * n_embd                          # one token's hidden state, f32
    link_info = tuple((lk.device, lk.rtt_s, lk.bandwidth_bps) for lk in links)
    if mode == "llama":
        return RemotePlan("llama", (), tuple(range(len(layers))), (),
                          "llama.cpp's own split by free memory; budgets not applied", link_info)
    if mode == "cache":
        slots = tuple(RemoteShare(lk.device, (), max(0, lk.capacity - reserves["experts"]),
                                  lk.capacity) for lk in links)
        return RemotePlan("cache", slots, tuple(range(len(layers))), (),
                          "every weight local; the device cache's slots on the remote, "
                          "filled by the residency manager", link_info)
    candidates = {}
    for shape in ("layers", "experts"):
        sizes = [lb.dense + lb.experts + lb.kv if shape == "layers" else lb.experts
                 for lb in layers]
        ranges = _fill(sizes, links, reserves[shape])
        cost = _cost(shape, layers, ranges, links, n_expert_used=n_expert_used,
                     act_bytes=act_bytes, local_bps=local_bps)
        shares = tuple(RemoteShare(lk.device, rng, sum(sizes[i] for i in rng), lk.capacity)
                       for lk, rng in zip(links, ranges))
        candidates[shape] = (cost, shares)
    if mode == "auto":
        relief = {s: sum(sh.bytes for sh in candidates[s][1]) for s in candidates}
        best = max(relief.values())
        usable = [s for s in ("layers", "experts") if relief[s] > 0
                  and relief[s] >= RELIEF_SHARE * best]
        if not usable:
            usable = ["layers"]
        chosen = min(usable, key=lambda s: (candidates[s][0], s != "layers"))
        fitting = [s for s in ("layers", "experts") if relief[s] > 0]
        if len(usable) == 2:
            reason = "cheaper by the link model"
        elif len(fitting) == 2:
            reason = (f"{chosen} moves {relief[chosen] / 2**20:.1f} MiB remote, the other shape "
                      f"under {RELIEF_SHARE:.0%} of that")
        else:
            reason = f"only {usable[0]} fit the budgets"
    else:
        chosen, reason = mode, "rpc.mode in the config"
    cost, shares = candidates[chosen]
    empty = [s.device for s in shares if not s.layers]
    if empty and len(empty) == len(shares):
        smallest = min(lb.experts for lb in layers) if chosen == "experts" else \
            min(lb.dense + lb.experts + lb.kv for lb in layers)
        raise UserError(f"{empty[0]}: budget {shares[0].capacity} bytes holds no "
                        f"{'layer' if chosen == 'layers' else 'layer of experts'} "
                        f"(the smallest needs {smallest + reserves[chosen]} bytes with the "
                        "compute reserve)")
    remote = {i for s in shares for i in s.layers}
    return RemotePlan(chosen, shares, tuple(i for i in range(len(layers)) if i not in remote),
                      tuple((s, candidates[s][0]) for s in ("layers", "experts")), reason,
                      link_info)
