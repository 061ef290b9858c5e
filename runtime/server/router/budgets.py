"""One residency budget shared by the models of a router: each device's pool, split into
fixed reservations.

The rule (docs/serving.md, "Several models"):

- The server's own budget for a device (``--devices.cpu 24GiB``, or ``--config``; a share
  or ``auto`` is resolved once, at start, from the memory then free) is that device's *pool*.
- A loaded model holds a *reservation* of each pooled device, fixed from its load to its
  unload (sleeping keeps it, so a wake never needs room): its own budget for the device (a
  size; ``N%`` is N% of the pool; ``auto``, or none given, is the pool / ``--models-max``).
  Its residency manager runs with exactly that budget, and its RAM tier evicts only its own
  experts, so no model's load ever evicts another model's experts.
- Reservations never sum past the pool. A load that does not fit first unloads idle models
  (least recently used first; each unload is logged and sent on ``/models/sse`` with the
  reason), waits for busy ones to become idle, and is refused when even an empty pool could
  not hold it.
- A device the server's budget does not name is not pooled: a model's own budget for it
  stands alone, as with one model.

Check, then change: ``fits`` / ``shortfall`` change nothing; ``reserve`` asserts the pool
holds. ``settle`` records what a loaded model's manager really got (the RAM tier raises a
budget below one layer's working set), so the accounting follows the authority.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class Ask:
    """A model's own budget for a pooled device, as configured."""

    device: str
    bytes: int | None = None      # a fixed size
    share: float | None = None    # a share of the pool (N%)

    def resolve(self, pool_bytes: int, default_share: float) -> int:
        """Bytes this ask reserves from a pool of ``pool_bytes``."""
        if self.bytes is not None:
            return self.bytes
        share = self.share if self.share is not None else default_share
        return int(pool_bytes * share)


class BudgetPool:
    """Bookkeeping of pools and reservations (bytes per device); no policy, no I/O."""

    def __init__(self, pools: Mapping[str, int]) -> None:
        for device, size in pools.items():
            if size <= 0:
                raise ValueError(f"{device}: pool must be positive, got {size}")
        self.pools = dict(pools)                         # device -> bytes
        self._held: dict[str, dict[str, int]] = {}       # model -> device -> bytes

    def reserved(self, device: str) -> int:
        return sum(h.get(device, 0) for h in self._held.values())

    def free(self, device: str) -> int:
        return self.pools[device] - self.reserved(device)

    def held(self, model: str) -> dict[str, int]:
        return dict(self._held.get(model, {}))

    def held_models(self) -> frozenset[str]:
        return frozenset(self._held)

    def shortfall(self, wants: Mapping[str, int]) -> dict[str, int]:
        """Bytes missing per device for ``wants`` (empty: it fits now)."""
        return {d: n - self.free(d) for d, n in wants.items()
                if d in self.pools and n > self.free(d)}

    def fits(self, wants: Mapping[str, int]) -> bool:
        return not self.shortfall(wants)

    def never_fits(self, wants: Mapping[str, int]) -> dict[str, int]:
        """Devices where ``wants`` is more than the whole pool: (device, bytes asked)."""
        return {d: n for d, n in wants.items() if d in self.pools and n > self.pools[d]}

    def reserve(self, model: str, wants: Mapping[str, int]) -> None:
        assert model not in self._held, f"{model} already holds a reservation"
        assert self.fits(wants), f"{model}: {self.shortfall(wants)} bytes short"
        self._held[model] = {d: n for d, n in wants.items() if d in self.pools}

    def settle(self, model: str, actual: Mapping[str, int]) -> None:
        """The loaded model's real capacities (its manager's); may pass the pool by the
        RAM tier's working-set floor, which the pool then shows as negative free room."""
        held = self._held.get(model)
        if held is not None:
            held.update({d: n for d, n in actual.items() if d in held})

    def release(self, model: str) -> None:
        self._held.pop(model, None)

    def to_dict(self) -> dict[str, dict]:
        """Per device: the pool, what is reserved, by whom (bytes)."""
        return {d: {"pool_bytes": size, "reserved_bytes": self.reserved(d),
                    "models": {m: h[d] for m, h in self._held.items() if d in h}}
                for d, size in self.pools.items()}
