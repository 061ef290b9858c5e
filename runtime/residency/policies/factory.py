"""Policies by name: the one place that knows every policy, its parameters and defaults.

The policies themselves run in the residency core (runtime/residency/core: the C core and its
Python reference); what each one does:
  eviction (a score per resident expert; the lowest (score, last access, layer, expert) goes)
    lru             score = last access sequence number
    lfu             routed count over the device's whole history
    lfu-decay       exponentially decayed count: a use ``half_life`` accesses ago counts half
    phase-weighted  w_prefill * prefill uses + w_decode * (decode + mixed) uses
    belady          offline: -(next use)
    next-visit      -(expected layer-steps to the next use) of each layer's lowest p: the
                    layer's distance in the cycle + n_moe_layers * wait, p = P(routed at its
                    layer's next visit) from a logistic model over age and frequency at
                    three time scales, learned online at decode layer-steps from the
                    resident experts (the keys it ranks), wait = the visits after the next
                    before it is routed, p rolled forward as its features decay (1/p - 1
                    if p stayed) (core/models/next_visit.h); ``learning_rate``
  admission (a demand miss is admitted, or used transiently)
    always                 admit whenever victims exist
    reuse-threshold        decode: admit once routed >= break_even times (prefill: always)
    transient-on-pressure  admit unless the first victim was used within ``window`` accesses
    belady-bypass          offline: admit only if used again before the first victim
  prefetch (after a layer's access: keys to bring in while victims rank below them)
    chunk-plan   prefill: the next ``depth`` layers' experts of the previous chunk
    popularity   the next layer's ``top_n`` most routed experts
    belady       offline: the next layer-step's experts
    affinity     decode: the experts of the MoE layer ``lead`` ahead most often routed after
                 this layer's for the same token (an online cross-layer table, learned from
                 decode and, when the model's experts per token are bound, from the
                 prompt's tokens too), the top ``top_n`` among those that need a
                 transfer, each predicted (its q calibrated by the measured hits per
                 predicted hit) at >= ``min_precision``; ``lead`` is what the largest expert
                 needs to cross the link in time (ceil(2 x its transfer / the bytes the link
                 carries in ``layer_us``, a typical layer-step's compute, at [cost]
                 link_gbps)); prefetches queue on the link, which carries what it can while
                 each layer-step's experts compute on the [cost] rates, and one is issued
                 only while it would cross before its layer's experts start; ranked against
                 victims by its expected next use (core/models/affinity.h)
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from runtime.errors import UserError
from runtime.residency.policies import admission, eviction, prefetch

ROLES = ("admission", "prefetch", "eviction")


@dataclass(frozen=True)
class Policy:
    """One registry line: a policy's parameters with their defaults, its Python reference
    class (policies/eviction.py, admission.py, prefetch.py), and its C parameter block: the
    values the core's policy file reads, in order, from its row of rc_policy (its own
    parameter block, named in that file). Its C twin is the file in core/policies/ that
    registers the same name (the core's kind is looked up by it: CCore).

    ``offline``: it reads the future (eviction, admission: each access's next use; prefetch:
    the upcoming layer-step), so only replay can run it. ``one_model``: it keeps one state of
    its own per core (a learned model, a decayed count) whatever phases use it, so every
    phase that uses it must give the same parameters."""

    params: dict[str, float]
    reference: type
    # the C parameter block: parameter names, or a function of the parameters and the [cost]
    # section (at most RC_MAX_PARAMS, 8, values)
    c_params: tuple[str, ...] | Callable[[dict[str, float], object], tuple[float, ...]] = ()
    offline: bool = False
    one_model: bool = False


def _affinity_block(kw: dict[str, float], cost) -> tuple[float, ...]:
    """prefetch affinity's block (prefetch_affinity.c's af_params): top_n, min_precision, the
    link's bytes per layer-step, and the [cost] rates: link bytes/s, link latency s, GPU and
    CPU expert-compute bytes/s"""
    return (kw["top_n"], kw["min_precision"], cost.link_gbps * 1e9 * kw["layer_us"] * 1e-6,
            cost.link_gbps * 1e9, cost.link_latency_us * 1e-6, cost.gpu_mem_gbps * 1e9,
            cost.cpu_mem_gbps * 1e9)


# role -> name -> Policy: the one registry. A new policy is one line here, one reference
# class and one C file (core/policies/, registering the same name; core/core_impl.h); what
# the runtime needs to know of it beyond that (offline, a state of its own) is a field of
# its line, never a name tested elsewhere.
_REGISTRY: dict[str, dict[str, Policy]] = {
    "eviction": {
        "lru": Policy({}, eviction.Lru),
        "lfu": Policy({}, eviction.Lfu),
        "lfu-decay": Policy({"half_life": 4096.0}, eviction.LfuDecay,
                            lambda kw, _: (math.log(2.0) / kw["half_life"],), one_model=True),
        "phase-weighted": Policy({"w_prefill": 1.0, "w_decode": 4.0},
                              eviction.PhaseWeighted, ("w_prefill", "w_decode")),
        "belady": Policy({}, eviction.Belady, offline=True),
        "next-visit": Policy({"learning_rate": 0.016}, eviction.NextVisit, ("learning_rate",),
                             one_model=True),
    },
    "admission": {
        "always": Policy({}, admission.Always),
        "reuse-threshold": Policy({"break_even": 2.0}, admission.ReuseThreshold,
                               ("break_even",)),
        "transient-on-pressure": Policy({"window": 4096.0}, admission.TransientOnPressure,
                                     ("window",)),
        "belady-bypass": Policy({}, admission.BeladyBypass, offline=True),
    },
    "prefetch": {
        "none": Policy({}, prefetch.NoPrefetch),
        "chunk-plan": Policy({"depth": 1.0}, prefetch.ChunkPlan, ("depth",)),
        "popularity": Policy({"top_n": 4.0}, prefetch.Popularity, ("top_n",)),
        "belady": Policy({}, prefetch.BeladyPrefetch, offline=True),
        "affinity": Policy({"top_n": 2.0, "min_precision": 0.3, "layer_us": 250.0},
                           prefetch.Affinity, _affinity_block, one_model=True),
    },
}


def policy_entry(role: str, name: str) -> Policy:
    """The registry line of a valid policy name (KeyError otherwise: names are validated by
    make_spec first)."""
    return _REGISTRY[role][name]


def offline_needs(phases) -> tuple[bool, bool]:
    """(accesses need next_use, accesses need the upcoming step) for ``phases``' policies
    (PhasePolicies, one per phase that runs them)."""
    nxt = any(policy_entry("eviction", pp.eviction.name).offline
              or policy_entry("admission", pp.admission.name).offline for pp in phases)
    return nxt, any(policy_entry("prefetch", pp.prefetch.name).offline for pp in phases)


# parameters that must be > 0 (the rest must be >= 0)
_POSITIVE = {"half_life", "depth", "learning_rate", "layer_us"}


@dataclass(frozen=True)
class PolicySpec:
    """A policy name and its parameters (sorted, defaults filled in)."""

    name: str
    params: tuple[tuple[str, float], ...] = ()

    def kwargs(self) -> dict[str, float]:
        return dict(self.params)


def policy_names(role: str) -> tuple[str, ...]:
    """Valid names for a role, in documentation order."""
    return tuple(_REGISTRY[role])


def param_names(role: str) -> tuple[str, ...]:
    """Every parameter any policy of ``role`` takes (sorted)."""
    return tuple(sorted({p for entry in _REGISTRY[role].values() for p in entry.params}))


def param_defaults(role: str, name: str) -> dict[str, float]:
    return dict(_REGISTRY[role][name].params)


def make_spec(role: str, name: object, params: dict | None = None, *,
              where: str = "") -> PolicySpec:
    """Validate a name and its parameters into a PolicySpec; UserError naming ``where``."""
    prefix = f"{where}: " if where else ""
    table = _REGISTRY[role]
    if not isinstance(name, str) or name not in table:
        raise UserError(f"{prefix}unknown {role} policy {name!r} "
                        f"(valid: {', '.join(table)})")
    defaults = table[name].params
    values = dict(defaults)
    for key, value in (params or {}).items():
        if key not in defaults:
            valid = ", ".join(defaults) or "none"
            raise UserError(f"{prefix}{role} policy {name!r} has no parameter {key!r} "
                            f"(valid: {valid})")
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise UserError(f"{prefix}{key} must be a number, got {value!r}")
        value = float(value)
        if value != value or value in (float("inf"), float("-inf")):
            raise UserError(f"{prefix}{key} must be finite, got {value!r}")
        if key in _POSITIVE and value <= 0:
            raise UserError(f"{prefix}{key} must be > 0, got {value:g}")
        if value < 0:
            raise UserError(f"{prefix}{key} must be >= 0, got {value:g}")
        values[key] = value
    return PolicySpec(name, tuple(sorted(values.items())))
