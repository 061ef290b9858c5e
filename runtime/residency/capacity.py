"""Late capacity resolution: a budget becomes bytes once the device's memory is known."""
from __future__ import annotations

from typing import Callable

from runtime.errors import UserError
from runtime.residency.config import DeviceBudget, is_gpu

GpuProbe = Callable[[int], "tuple[int, int] | None"]
_gpu_probe: GpuProbe | None = None


def register_gpu_memory_probe(probe: GpuProbe | None) -> None:
    """Install the GPU backend's memory query: ``probe(index) -> (free, total) | None``.

    The engine / native side registers one once its backend is loaded; until then cuda
    devices report no memory and percentage or auto budgets on them are a UserError.
    """
    global _gpu_probe
    _gpu_probe = probe


def probe_device_memory(device: str) -> tuple[int, int] | None:
    """(free, total) bytes of ``device``; None when nothing can answer (e.g. no GPU).

    cpu and cpu-slots: psutil's available and total RAM.
    """
    if device in ("cpu", "cpu-slots"):
        import psutil
        vm = psutil.virtual_memory()
        return int(vm.available), int(vm.total)
    if is_gpu(device):
        if _gpu_probe is None:
            return None
        return _gpu_probe(int(device.split(":", 1)[1]))
    return None


def resolve_budget(budget: DeviceBudget, *, free_bytes: int | None, total_bytes: int | None,
                   largest_expert: int | None = None, source: str = "config") -> int:
    """The capacity in bytes for ``budget``; UserError naming ``source`` and the key.

    ``free_bytes``/``total_bytes`` None means the device's memory is unknown: fixed budgets
    then resolve unchecked, shares cannot resolve. A budget smaller than ``largest_expert``
    (bytes of the model's largest single expert) could never hold anything and is refused.
    """
    where = f"{source}: devices.{budget.device}"
    if budget.bytes is not None:
        capacity = budget.bytes
        if total_bytes is not None and capacity > total_bytes:
            raise UserError(f"{where}: budget {budget.text} ({capacity} bytes) is above the "
                            f"device's total memory ({total_bytes} bytes)")
    else:
        if free_bytes is None:
            raise UserError(f"{where}: budget {budget.text!r} is a share of free memory, but "
                            f"no backend reports {budget.device}'s memory (no such device?); "
                            "give a size such as 6GiB")
        capacity = int(free_bytes * budget.share)
    if largest_expert is not None and capacity < largest_expert:
        raise UserError(f"{where}: budget {budget.text} ({capacity} bytes) is smaller than the "
                        f"model's largest expert ({largest_expert} bytes)")
    if capacity <= 0:
        raise UserError(f"{where}: budget {budget.text} resolves to {capacity} bytes")
    return capacity
