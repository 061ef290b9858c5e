"""Policies by name: the one place that knows every policy, its parameters and defaults."""
from __future__ import annotations

from dataclasses import dataclass

from runtime.errors import UserError
from runtime.residency.policies import admission, eviction, prefetch

ROLES = ("admission", "prefetch", "eviction")

# role -> name -> (class, {param: default})
_REGISTRY: dict[str, dict[str, tuple[type, dict[str, float]]]] = {
    "eviction": {
        "lru": (eviction.Lru, {}),
        "lfu": (eviction.Lfu, {}),
        "lfu-decay": (eviction.LfuDecay, {"half_life": 4096.0}),
        "phase-weighted": (eviction.PhaseWeighted, {"w_prefill": 1.0, "w_decode": 4.0}),
        "belady": (eviction.Belady, {}),
    },
    "admission": {
        "always": (admission.AlwaysAdmit, {}),
        "reuse-threshold": (admission.ReuseThreshold, {"break_even": 2.0}),
        "transient-on-pressure": (admission.TransientOnPressure, {"window": 4096.0}),
        "belady-bypass": (admission.BeladyBypass, {}),
    },
    "prefetch": {
        "none": (prefetch.NoPrefetch, {}),
        "chunk-plan": (prefetch.ChunkPlan, {"depth": 1.0}),
        "popularity": (prefetch.Popularity, {"top_n": 4.0}),
        "belady": (prefetch.BeladyPrefetch, {}),
    },
}
# parameters that must be > 0 (the rest must be >= 0)
_POSITIVE = {"half_life", "depth"}
OFFLINE_ONLY = {("eviction", "belady"), ("admission", "belady-bypass"), ("prefetch", "belady")}


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
    return tuple(sorted({p for _, defaults in _REGISTRY[role].values() for p in defaults}))


def param_defaults(role: str, name: str) -> dict[str, float]:
    return dict(_REGISTRY[role][name][1])


def make_spec(role: str, name: object, params: dict | None = None, *,
              where: str = "") -> PolicySpec:
    """Validate a name and its parameters into a PolicySpec; UserError naming ``where``."""
    prefix = f"{where}: " if where else ""
    table = _REGISTRY[role]
    if not isinstance(name, str) or name not in table:
        raise UserError(f"{prefix}unknown {role} policy {name!r} "
                        f"(valid: {', '.join(table)})")
    defaults = table[name][1]
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


def build(role: str, spec: PolicySpec):
    """The policy object for a spec (raises UserError for an unknown name)."""
    checked = make_spec(role, spec.name, spec.kwargs())
    cls = _REGISTRY[role][checked.name][0]
    return cls(**checked.kwargs())


def build_eviction(spec: PolicySpec):
    return build("eviction", spec)


def build_admission(spec: PolicySpec):
    return build("admission", spec)


def build_prefetch(spec: PolicySpec):
    return build("prefetch", spec)
