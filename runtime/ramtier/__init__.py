"""Host-RAM expert tier: models larger than RAM, paged from the GGUF file under a byte budget.

llama.cpp memory-maps the model and leaves paging to the kernel (faults served one at a time,
readahead guesses, LRU eviction that knows nothing of routing). With a ``cpu`` budget in the
residency config, ``attach(engine)`` makes the residency manager decide which experts stay in
RAM: between each layer's router and its expert matmul the layer's missing experts are read in
parallel (exact byte ranges, ``threads`` in flight; in C, tier_io.c, stepped by the routing
hook), evicted experts' pages leave llama.cpp's mapping and the page cache, and ``mincore``
reports what really is resident. A budget below every expert is split (``split_budget``): the
core keeps experts within budget - room, and the room holds what the core does not count, a
layer-step's one-use reads and the drops still queued, so the page cache never holds more
of the model's experts than the budget.

Only expert tensors in llama.cpp's mmap-backed CPU buffer are governed (the engine places every
expert there when residency is managed); dense weights stay as llama.cpp keeps them.
"""
from __future__ import annotations

import gc
import logging
import os
from dataclasses import dataclass

from runtime.ramtier.layout import ExpertLayout
from runtime.ramtier.mapping import FileMapping
from runtime.ramtier.pager import Pager
from runtime.ramtier.tier import DEVICE, RamTier, ResidencyTruth, TierStats
from runtime.residency.transport import claim_device

__all__ = ["attach", "attach_to", "BudgetSplit", "RamTier", "RamTierOptions", "ResidencyTruth",
           "TierStats", "model_split", "split_budget"]

log = logging.getLogger("moe_offload.ramtier")


@dataclass(frozen=True)
class RamTierOptions:
    """Knobs of the tier (environment: ``MOE_OFFLOAD_RAMTIER_THREADS=N``, ``..._MLOCK=1``,
    ``..._REFILL=0``)."""

    threads: int = 16         # reads in flight (a virtio disk: 0.8 GB/s at 4, 1.6 at 16)
    mlock: bool = False       # lock resident experts (within the budget) against reclaim
    refill: bool = True       # after a cold cache, read held experts back in the background

    def __post_init__(self) -> None:
        if self.threads < 1:
            raise ValueError(f"ram tier threads must be >= 1, got {self.threads}")

    @classmethod
    def from_env(cls) -> RamTierOptions:
        threads = os.environ.get("MOE_OFFLOAD_RAMTIER_THREADS", "")
        def flag(name: str, default: bool) -> bool:
            value = os.environ.get(f"MOE_OFFLOAD_RAMTIER_{name}", "").strip().lower()
            return default if not value else value in ("1", "true", "yes", "on")

        return cls(threads=int(threads) if threads.strip() else cls.threads,
                   mlock=flag("MLOCK", cls.mlock), refill=flag("REFILL", cls.refill))


def layer_working_set(facts) -> tuple[int, int]:
    """(bytes, layer): the largest decode working set of one layer (top-k experts)."""
    layer = max(facts.moe_layers, key=lambda i: facts.expert_bytes[i])
    return facts.n_expert_used * facts.expert_bytes[layer], layer


def one_use_room(facts) -> tuple[int, int]:
    """(bytes, layer): the most one layer-step can read for one use, every expert of the
    largest layer (a prompt's ubatch can route to all of them; those the core does not keep
    are in the page cache until the layer's matmul is done)."""
    layer = max(facts.moe_layers, key=lambda i: facts.expert_bytes[i])
    return facts.n_expert * facts.expert_bytes[layer], layer


@dataclass(frozen=True)
class BudgetSplit:
    """A cpu budget as the tier spends it (bytes): ``kept`` is the residency core's capacity,
    ``room`` the one-use room (None: no bound needed), ``budget`` = kept + room, all the
    page cache ever holds of the model's experts."""

    budget: int
    kept: int
    room: int | None


def split_budget(budget: int, total: int, working_set: int, room: int) -> BudgetSplit:
    """Where the cpu budget goes. The core fills its capacity with kept experts; beyond it a
    layer-step's transient uses and the queued drops of evicted experts are in the page cache
    too (tier_io.c bounds them by the room). So a budget below every expert keeps ``room``
    (one layer's every expert) aside for them: kept + room <= budget throughout. A budget that
    holds every expert is kept whole (no transient use, nothing to bound: as before). Below
    ``working_set + room`` the budget is raised to that (at most ``total``)."""
    if budget >= total:
        return BudgetSplit(budget, budget, None)
    budget = max(budget, min(working_set + room, total))
    if budget >= total:
        return BudgetSplit(budget, budget, None)
    return BudgetSplit(budget, budget - room, room)


def attach(engine, options: RamTierOptions | None = None) -> RamTier | None:
    """Serve the engine manager's ``cpu`` device from llama.cpp's mapping of the model.

    Called by ``Engine`` after load when the config has a ``cpu`` budget. Returns None (and
    logs why) when the tier cannot govern this model: llama.cpp did not memory-map it.
    """
    tier = attach_to(engine.manager, engine.settings.model_path, options)
    if tier is not None:
        engine.hook.add_tier(tier)     # stepped in C per layer-step (c_hook.py)
    return tier


def attach_to(manager, model_path: str, options: RamTierOptions | None = None
              ) -> RamTier | None:
    """The tier for ``manager``'s ``cpu`` device over this process's mapping of the model
    (without an engine: tests and tools feed ``on_route`` themselves)."""
    from gguf_tools.expert_index import ExpertIndex

    options = options or RamTierOptions.from_env()
    index = ExpertIndex.open(model_path)
    facts = index.facts
    layout = ExpertLayout.from_index(index)
    del index
    gc.collect()        # gguf-py's np.memmap of the file must be gone before we look
    mapping = FileMapping.find(model_path)
    name = os.path.basename(model_path)
    if not mapping or not any(mapping.covers(o, n) for k in layout.keys[:1]
                              for o, n in layout.ranges(k)):
        _notice(f"{name}: llama.cpp has no memory mapping of the model's experts (loaded "
                "without mmap, or a filesystem without mmap support); the cpu budget is not "
                "enforced and experts stay where llama.cpp put them")
        return None
    if manager.core_handle(DEVICE) is None:
        _notice(f"{name}: the residency manager runs its Python reference core; the RAM tier "
                "needs the native one (tier_io.c steps it), so the cpu budget is not enforced")
        return None
    budget = manager.capacity(DEVICE)
    if budget is None:
        _notice(f"{name}: the cpu budget is unresolved ({manager.unresolved_reason(DEVICE)}); "
                "every expert is read on demand and dropped after use")
        budget = 0
    split = BudgetSplit(0, 0, None)           # unresolved: nothing kept, nothing bounded
    if budget:
        split = _split(name, budget, layout.total_bytes, facts)
        if split.kept != budget:
            manager.reconfigure(DEVICE, split.kept)
    pager = Pager(mapping, threads=options.threads)
    tier = RamTier(manager, layout, pager, budget_bytes=split.budget, mlock=options.mlock,
                   refill=options.refill)
    tier.io.set_one_use_room(split.room)
    claim_device(manager, DEVICE, tier)
    pager.no_readahead(layout.merged_spans())
    if split.kept >= layout.total_bytes:
        tier.fill_spare()    # room for every expert: admit them all (llama.cpp populated them)
    else:
        tier.drop_unheld()   # llama.cpp populated every page at load; keep only what is held
    return tier


def model_split(budget: int, total: int, facts) -> BudgetSplit:
    """``split_budget`` with this model's decode working set and one-use room (``total``: its
    expert bytes)."""
    return split_budget(budget, total, layer_working_set(facts)[0], one_use_room(facts)[0])


def _split(name: str, budget: int, total: int, facts) -> BudgetSplit:
    """``model_split``, saying what it changed."""
    working_set, layer = layer_working_set(facts)
    room, room_layer = one_use_room(facts)
    split = model_split(budget, total, facts)
    mib = 2**20
    if split.budget != budget:
        _notice(f"{name}: cpu budget {budget / mib:.1f} MiB is below one layer's working set "
                f"({facts.n_expert_used} experts x {facts.expert_bytes[layer] / mib:.1f} MiB "
                f"= {working_set / mib:.1f} MiB in layer {layer}) plus one layer's one-use "
                f"reads ({facts.n_expert} experts = {room / mib:.1f} MiB); using "
                f"{split.budget / mib:.1f} MiB")
    if split.room is not None:
        log.info("%s: cpu budget %.1f MiB: %.1f MiB of kept experts, %.1f MiB for one-use "
                 "reads (every expert of layer %d)", name, split.budget / mib,
                 split.kept / mib, split.room / mib, room_layer)
    return split


def _notice(message: str) -> None:
    log.warning("%s", message)
