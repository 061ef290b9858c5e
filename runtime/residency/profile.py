"""Routing profiles: what earlier runs of a model routed, to warm-start the learned policies.

A profile holds, from the decode tokens of one or more traces of the same model:
  frequency (n_layer, n_expert) float64   the share of decode tokens routed to each expert
  pair      (n_moe - 1, E, E) int32       tokens routed to e at MoE layer i and e' at i + 1
  count     (n_moe - 1, E) int32          tokens routed to e at MoE layer i (with layer i + 1)
  (e: one of the token's first AFFINITY_SOURCES distinct experts at i in routing order, the
  sources prefetch affinity learns from)
  history   (T, n_moe, n_expert_used) int16 the last T <= NEIGHBOUR_HISTORY decode tokens'
                                        distinct experts at each MoE layer, routing order,
                                        -1 pad (prefetch affinity's token neighbours)
Eviction next-visit starts its frequency estimates at ``frequency`` and prefetch affinity its
table at ``pair`` / ``count`` and its token neighbours at ``history``
(``ExpertResidencyManager.warm_start``), instead of from nothing: the first decode tokens of a
cold start miss most of their experts.

File: a NumPy ``.npz`` (no pickles) with those arrays and ``header``, the UTF-8 JSON of
{"format": "moe-offload routing profile", "version": 2, "model", "arch", "n_layer",
"n_expert", "n_expert_used", "expert_bytes", "decode_tokens", "traces"}. A version 1 file (no
``history``) is read with an empty one.

    prof = build_profile([read_trace("a.rtb"), read_trace("b.rtb")])
    write_profile("model.profile.npz", prof)
    prof = read_profile("model.profile.npz"); prof.check_model(n_layer, n_expert, bytes, where)
"""
from __future__ import annotations

import json
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from runtime.atomic_write import atomic_write
from runtime.errors import UserError
from runtime.residency.core import AFFINITY_SOURCES, NEIGHBOUR_HISTORY, history_ok

FORMAT, VERSION = "moe-offload routing profile", 2
INT32_MAX = 2**31 - 1            # pair and count are int32 in the core


@dataclass(frozen=True)
class RoutingProfile:
    model: str
    arch: str
    n_layer: int
    n_expert: int
    n_expert_used: int
    expert_bytes: tuple[int, ...]   # (n_layer,) 0: dense
    decode_tokens: int
    traces: tuple[str, ...]
    frequency: np.ndarray           # (n_layer, n_expert) float64
    pair: np.ndarray                # (n_moe - 1, n_expert, n_expert) int32
    count: np.ndarray               # (n_moe - 1, n_expert) int32
    history: np.ndarray             # (T, n_moe, n_expert_used) int16, -1 pad

    @property
    def moe_layers(self) -> tuple[int, ...]:
        return tuple(i for i, b in enumerate(self.expert_bytes) if b > 0)

    def check_model(self, n_layer: int, n_expert: int, expert_bytes, where: str) -> None:
        """UserError (one line) unless the profile was made for this model shape."""
        mine = (self.n_layer, self.n_expert, tuple(int(b) for b in self.expert_bytes))
        theirs = (int(n_layer), int(n_expert), tuple(int(b) for b in expert_bytes))
        if mine[:2] != theirs[:2]:
            raise UserError(f"{where}: the profile is of a model with {self.n_layer} layers x "
                            f"{self.n_expert} experts ({self.model}), not {n_layer} x "
                            f"{n_expert}")
        if mine[2] != theirs[2]:
            layer = next(i for i, (a, b) in enumerate(zip(mine[2], theirs[2])) if a != b)
            raise UserError(f"{where}: the profile is of another model ({self.model}): layer "
                            f"{layer} experts are {mine[2][layer]} bytes there, "
                            f"{theirs[2][layer]} here")


def build_profile(traces, names: list[str] | None = None) -> RoutingProfile:
    """A profile from the decode tokens of ``traces`` (RouteTrace, the same model); UserError
    when they disagree on the model or hold no decode token."""
    if not traces:
        raise UserError("profile: give at least one trace")
    h = traces[0].header
    names = names or [t.source for t in traces]
    for t, name in zip(traces[1:], names[1:]):
        o = t.header
        if (o.n_layer, o.n_expert, tuple(o.expert_bytes)) != (h.n_layer, h.n_expert,
                                                             tuple(h.expert_bytes)):
            raise UserError(f"{name}: a trace of another model than {names[0]} "
                            f"({o.n_layer} x {o.n_expert} against {h.n_layer} x {h.n_expert})")
    moe = [i for i, b in enumerate(h.expert_bytes) if b > 0]
    index = np.full(h.n_layer, -1, dtype=np.int64)
    index[moe] = np.arange(len(moe))
    n_pair = max(len(moe) - 1, 0)
    routed = np.zeros((h.n_layer, h.n_expert), dtype=np.int64)
    pair = np.zeros((n_pair, h.n_expert, h.n_expert), dtype=np.int64)
    count = np.zeros((n_pair, h.n_expert), dtype=np.int64)
    tokens = 0
    k_used = max(int(h.n_expert_used), 1)
    history: list[np.ndarray] = []                 # the last tokens of each trace, in order
    for t in traces:
        dec = np.flatnonzero(t.phase == 1)
        if not len(dec):
            continue
        turn, step = t.turn[dec].astype(np.int64), t.step[dec].astype(np.int64)
        layer, expert = t.layer[dec].astype(np.int64), t.expert[dec].astype(np.int64)
        token = np.unique(turn * (1 << 32) + step, return_inverse=True)[1]
        tokens += int(token.max()) + 1
        # distinct (token, layer, expert): one routing each
        key = np.unique((token * h.n_layer + layer) * h.n_expert + expert)
        tok, rest = np.divmod(key, h.n_layer * h.n_expert)
        lay, exp = np.divmod(rest, h.n_expert)
        np.add.at(routed, (lay, exp), 1)
        # pairs: the same token at MoE layers i and i + 1, from its first AFFINITY_SOURCES
        # distinct experts at i in routing order (the rows' order), as the core learns them
        by: dict[tuple[int, int], dict[int, None]] = {}
        for a, i, e in zip(token.tolist(), index[layer].tolist(), expert.tolist()):
            by.setdefault((a, i), {})[e] = None
        for (a, i), experts in by.items():
            nxt = by.get((a, i + 1))
            if nxt is None or i + 1 >= len(moe):
                continue
            src = list(experts)[:AFFINITY_SOURCES]
            count[i, src] += 1
            pair[i][np.ix_(src, list(nxt))] += 1
        n_tok = int(token.max()) + 1
        last = np.full((min(n_tok, NEIGHBOUR_HISTORY), len(moe), k_used), -1, dtype=np.int16)
        for (a, i), experts in by.items():
            if a >= n_tok - len(last) and i >= 0:
                row = list(experts)[:k_used]
                last[a - (n_tok - len(last)), i, :len(row)] = row
        history.append(last)
    if tokens == 0:
        raise UserError(f"{names[0]}: no decode tokens to build a profile from")
    return RoutingProfile(model=h.model, arch=h.arch, n_layer=h.n_layer, n_expert=h.n_expert,
                          n_expert_used=h.n_expert_used, expert_bytes=tuple(h.expert_bytes),
                          decode_tokens=tokens, traces=tuple(str(n) for n in names),
                          frequency=routed / float(tokens), pair=pair.astype(np.int32),
                          count=count.astype(np.int32),
                          history=np.concatenate(history)[-NEIGHBOUR_HISTORY:])


def write_profile(path: str | Path, prof: RoutingProfile) -> None:
    header = {"format": FORMAT, "version": VERSION, "model": prof.model, "arch": prof.arch,
              "n_layer": prof.n_layer, "n_expert": prof.n_expert,
              "n_expert_used": prof.n_expert_used, "expert_bytes": list(prof.expert_bytes),
              "decode_tokens": prof.decode_tokens, "traces": list(prof.traces)}
    raw = np.frombuffer(json.dumps(header).encode(), dtype=np.uint8)
    with atomic_write(path, "wb") as f:     # a killed or failed write keeps the old file
        np.savez_compressed(f, header=raw, frequency=prof.frequency, pair=prof.pair,
                            count=prof.count, history=prof.history)


def read_profile(path: str | Path) -> RoutingProfile:
    """The profile in ``path``; UserError (one line) for a missing, corrupt or foreign file."""
    bad = f"{path}: not a routing profile (moe-offload profile writes them)"
    try:
        with np.load(path, allow_pickle=False) as z:
            arrays = {k: z[k] for k in ("header", "frequency", "pair", "count")}
            if "history" in z.files:
                arrays["history"] = z["history"]
    except FileNotFoundError:
        raise UserError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise UserError(f"{path}: is a directory, not a profile") from None
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile, zlib.error):
        raise UserError(bad) from None
    try:
        head = json.loads(arrays["header"].tobytes().decode())
        if not isinstance(head, dict) or head.get("format") != FORMAT \
                or head.get("version") not in (1, VERSION):
            raise ValueError
        n_moe = sum(1 for b in head["expert_bytes"] if int(b) > 0)
        if head["version"] == 1:                  # (before the neighbour history)
            arrays["history"] = np.full((0, n_moe, max(int(head["n_expert_used"]), 1)), -1,
                                        np.int16)
        prof = RoutingProfile(
            model=str(head["model"]), arch=str(head["arch"]), n_layer=int(head["n_layer"]),
            n_expert=int(head["n_expert"]), n_expert_used=int(head["n_expert_used"]),
            expert_bytes=tuple(int(b) for b in head["expert_bytes"]),
            decode_tokens=int(head["decode_tokens"]), traces=tuple(head["traces"]),
            frequency=arrays["frequency"].astype(np.float64), pair=arrays["pair"],
            count=arrays["count"], history=arrays["history"])
    except (ValueError, KeyError, TypeError, UnicodeDecodeError, OverflowError, AttributeError):
        raise UserError(bad) from None
    n_pair = max(len(prof.moe_layers) - 1, 0)
    if (len(prof.expert_bytes) != prof.n_layer
            or not 1 <= prof.n_expert_used <= prof.n_expert
            or not np.issubdtype(arrays["frequency"].dtype, np.floating)
            or not all(np.issubdtype(a.dtype, np.integer) for a in (prof.pair, prof.count))
            or (prof.pair.size and prof.pair.max() > INT32_MAX)
            or (prof.count.size and prof.count.max() > INT32_MAX)
            or prof.frequency.shape != (prof.n_layer, prof.n_expert)
            or prof.pair.shape != (n_pair, prof.n_expert, prof.n_expert)
            or prof.count.shape != (n_pair, prof.n_expert)
            or not np.isfinite(prof.frequency).all() or (prof.frequency < 0).any()
            or (prof.frequency > 1).any() or (prof.pair < 0).any() or (prof.count < 0).any()
            or (n_pair and (prof.pair > prof.count[:, :, None]).any())
            or not _history_ok(prof)):
        raise UserError(f"{path}: a corrupt routing profile (arrays do not match its header)")
    return prof


def _history_ok(prof: RoutingProfile) -> bool:
    """history is (T <= NEIGHBOUR_HISTORY, n_moe, n_expert_used) int16 the core can take."""
    h = prof.history
    return (h.dtype == np.int16 and h.ndim == 3 and len(h) <= NEIGHBOUR_HISTORY
            and h.shape[2] == max(prof.n_expert_used, 1)
            and history_ok(h, len(prof.moe_layers), prof.n_expert))
