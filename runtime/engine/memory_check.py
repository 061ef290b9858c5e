"""Before loading: does what loading needs fit the memory this process may use?

A load that does not fit is killed by the kernel's OOM killer part way (status -9, no
message). So the engine first adds up the host RAM the run will hold and compares it with the
room it has, refusing in one line with both numbers:

  need = dense weights (when the model runs on the CPU: no GPU, or -ngl 0)
       + KV cache (f16, n_ctx tokens over all layers; with a sliding window, half the layers
         hold only the window: gpt-oss's alternation, the fewest full layers of our models)
       + compute buffers (a lower estimate: four f32 activations of n_embd per ubatch token)
       + the RAM tier's expert budget, at most every expert, when it locks them
         (MOE_OFFLOAD_RAMTIER_MLOCK=1; else they are page cache the kernel may reclaim)
  room = the memory cgroup's limit (v1 memory.limit_in_bytes or v2 memory.max, the smallest
         over the process's group and its ancestors) less the anonymous memory its group
         already holds; and the available memory (MemAvailable + free swap)

Conservative on purpose (no false refusals): experts read through mmap need not be resident
(the kernel pages them, and reclaims the RAM tier's unlocked ones under pressure), so they
count only when locked; the estimates are lower bounds. ``MOE_OFFLOAD_SKIP_MEMORY_CHECK=1`` loads anyway.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from runtime.errors import UserError
from runtime.units import format_size

SKIP_ENV = "MOE_OFFLOAD_SKIP_MEMORY_CHECK"
COMPUTE_ACTIVATIONS = 4        # f32 vectors of n_embd per ubatch token (lower estimate)


@dataclass(frozen=True)
class LoadNeed:
    """Host RAM bytes a load will hold, by part."""

    dense_bytes: int          # dense weights in RAM (0 when they go to a GPU)
    kv_bytes: int             # KV cache
    n_ctx: int                # its tokens
    compute_bytes: int        # compute buffers (lower estimate)
    ram_tier_bytes: int       # the RAM tier's budget, at most every expert

    @property
    def total(self) -> int:
        return self.dense_bytes + self.kv_bytes + self.compute_bytes + self.ram_tier_bytes

    def describe(self) -> str:
        parts = [f"dense weights {format_size(self.dense_bytes)}" if self.dense_bytes else "",
                 f"KV cache {format_size(self.kv_bytes)} (ctx {self.n_ctx})",
                 f"compute buffers {format_size(self.compute_bytes)}",
                 f"RAM-tier budget {format_size(self.ram_tier_bytes)}"
                 if self.ram_tier_bytes else ""]
        return " + ".join(p for p in parts if p)


@dataclass(frozen=True)
class Room:
    """Host RAM bytes this process may still take, and what bounds it."""

    bytes: int
    why: str


def load_need(settings, facts, *, on_gpu: bool, ram_tier_bytes: int) -> LoadNeed:
    """What loading ``facts``' model with ``settings`` holds in host RAM."""
    n_ctx = settings.n_ctx or facts.context_length
    ubatch = min(settings.n_ubatch, settings.n_batch, n_ctx or settings.n_ubatch)
    window = facts.sliding_window
    kv_tokens = n_ctx if not window else (n_ctx + min(n_ctx, window)) // 2
    return LoadNeed(
        dense_bytes=0 if on_gpu else facts.dense_bytes,
        kv_bytes=facts.kv_bytes_per_token * kv_tokens, n_ctx=n_ctx,
        compute_bytes=ubatch * facts.n_embd * 4 * COMPUTE_ACTIVATIONS,
        ram_tier_bytes=min(max(ram_tier_bytes, 0), facts.total_expert_bytes))


def memory_room() -> Room | None:
    """The smaller of the cgroup's room and the available memory; None when unknown."""
    from runtime.ramtier.cgroup import group_memory  # noqa: PLC0415

    rooms = []
    group = group_memory()
    if group is not None:
        rooms.append(Room(group.limit_bytes - group.anon_bytes,
                          f"the memory cgroup's limit {format_size(group.limit_bytes)} "
                          f"({group.source}) less {format_size(group.anon_bytes)} its "
                          "processes hold"))
    try:
        import psutil  # noqa: PLC0415

        available = int(psutil.virtual_memory().available) + int(psutil.swap_memory().free)
        rooms.append(Room(available, f"{format_size(available)} of available memory "
                                     "(RAM and swap)"))
    except (ImportError, OSError):
        pass
    return min(rooms, key=lambda r: r.bytes) if rooms else None


def check_fits(path: str, need: LoadNeed, room: Room | None) -> None:
    """UserError (one line, both numbers) when ``need`` does not fit ``room``."""
    if room is None or need.total <= room.bytes or os.environ.get(SKIP_ENV) == "1":
        return
    raise UserError(f"{path}: loading needs about {format_size(need.total)} of RAM "
                    f"({need.describe()}), more than the {format_size(max(room.bytes, 0))} "
                    f"this process may use: {room.why}. Lower -c or the cpu budget, use a "
                    f"GPU (-ngl), or set {SKIP_ENV}=1 to load anyway")
