"""LoRA adapters on a loaded model, as llama-server's ``--lora`` / ``--lora-scaled``: each
adapter has an id (its place on the command line), a path and a global scale; a request may
give its own scales (``{id: scale}``, adapters not named at 0, as llama-server's
``construct_lora_list``). The context holds one set of scales at a time; the engine applies a
request's before its prompt (``Engine._use_lora``) and forgets the KV cache when they change
(its entries were computed with other weights).

Adapters on routed-expert weights (``blk.N.ffn_*_exps``) are refused: the residency manager
places those weights (GPU slots, the RAM tier, lazy reads from the file) and nothing here has
checked that an adapter's expert deltas follow them. Adapters on the dense weights (attention,
shared FFN, output head) are llama.cpp's own business.

    adapters = LoraAdapters.load(ll, model_ptr, (("style.gguf", 1.0),))
    scales = adapters.scales_for({0: 0.5})        # a request's; None: the global ones
    changed = adapters.apply(ctx_ptr, scales)
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

from runtime.errors import UserError


@dataclass(frozen=True, slots=True)
class LoraAdapter:
    """One loaded adapter: what GET /lora-adapters lists besides its scale."""

    path: str
    pointer: Any                 # llama_adapter_lora * (the bindings' pointer object)
    task_name: str = ""          # adapter.lora.task_name, if the file has one
    prompt_prefix: str = ""      # adapter.lora.prompt_prefix


def expert_targets(path: str) -> list[str]:
    """The routed-expert weights an adapter file adapts (its ``.lora_a`` names)."""
    from gguf import GGUFReader  # noqa: PLC0415

    from gguf_tools.facts import EXPERT_TENSOR_RE  # noqa: PLC0415

    try:
        reader = GGUFReader(path)
    except (OSError, ValueError) as exc:
        raise UserError(f"--lora {path}: not a readable GGUF file ({exc})") from None
    names = (t.name.removesuffix(".lora_a") for t in reader.tensors
             if t.name.endswith(".lora_a"))
    return [n for n in names if EXPERT_TENSOR_RE.match(n)]


def check_adapter_files(specs: tuple[tuple[str, float], ...]) -> None:
    """Each ``(path, scale)``: a readable GGUF that adapts no routed expert, a finite scale;
    else a one-line UserError (before any model is loaded)."""
    for path, scale in specs:
        check_scale(scale, f"--lora-scaled {path}")
        if not os.path.isfile(path):
            raise UserError(f"--lora {path}: no such file")
        experts = expert_targets(path)
        if experts:
            more = f" and {len(experts) - 1} more" if len(experts) > 1 else ""
            raise UserError(
                f"--lora {path}: adapts routed-expert weights ({experts[0]}{more}); the "
                "residency manager places those weights across GPU, RAM and disk, and LoRA on "
                "them is not supported here (adapters of attention, shared-expert and output "
                "weights are)")


def check_scale(scale: Any, what: str) -> float:
    """A finite number, or a UserError naming ``what``."""
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise UserError(f"{what}: the scale must be a finite number, got {scale!r}")
    return float(scale)


class LoraAdapters:
    """The adapters of one model and their global scales; which scales the context has."""

    def __init__(self, ll: Any, adapters: list[LoraAdapter], scales: list[float]):
        self._ll = ll
        self.adapters = adapters
        self.scales = scales                      # global, by id (POST /lora-adapters)
        self.applied: tuple[float, ...] = ()      # on the context now; () = none yet

    @classmethod
    def load(cls, ll: Any, model_ptr: int, specs: tuple[tuple[str, float], ...], *,
             without_apply: bool = False, last_error=lambda: "") -> LoraAdapters:
        """Load every ``(path, scale)`` onto the model (UserError naming a file llama.cpp
        refuses, or one that adapts routed experts). ``without_apply``: scales start at 0."""
        check_adapter_files(specs)
        adapters = []
        for path, _scale in specs:
            pointer = ll.llama_adapter_lora_init(model_ptr, path.encode())
            if not pointer:
                why = last_error() or "llama.cpp refused it"
                raise UserError(f"--lora {path}: cannot load the adapter ({why})")
            adapters.append(LoraAdapter(path, pointer, _meta(ll, pointer, "task_name"),
                                        _meta(ll, pointer, "prompt_prefix")))
        scales = [0.0 if without_apply else float(s) for _, s in specs]
        return cls(ll, adapters, scales)

    def listing(self) -> list[dict]:
        """GET /lora-adapters: llama-server's entries."""
        return [{"id": i, "path": a.path, "scale": self.scales[i], "task_name": a.task_name,
                 "prompt_prefix": a.prompt_prefix} for i, a in enumerate(self.adapters)]

    def checked(self, request: dict[int, float] | list[Any], what: str) -> dict[int, float]:
        """``[{"id", "scale"}, ...]`` (or a checked dict) as ``{id: scale}``; UserError on an
        id that is not a loaded adapter, a repeated id or a bad scale."""
        if isinstance(request, dict):
            items = list(request.items())
        else:
            items = []
            for i, entry in enumerate(request):
                if not isinstance(entry, dict) or set(entry) - {"id", "scale"} \
                        or "id" not in entry or "scale" not in entry:
                    raise UserError(f"{what}[{i}]: each entry is {{\"id\": N, \"scale\": X}}")
                items.append((entry["id"], entry["scale"]))
        out: dict[int, float] = {}
        for adapter_id, scale in items:
            if isinstance(adapter_id, bool) or not isinstance(adapter_id, int) \
                    or not 0 <= adapter_id < len(self.adapters):
                have = (f"ids 0..{len(self.adapters) - 1}" if self.adapters
                        else "none: start the server with --lora FILE")
                raise UserError(f"{what}: id {adapter_id!r} is not a loaded LoRA adapter "
                                f"({have})")
            if adapter_id in out:
                raise UserError(f"{what}: id {adapter_id} is given twice")
            out[adapter_id] = check_scale(scale, f"{what} id {adapter_id}")
        return out

    def set_global(self, scales: dict[int, float]) -> None:
        """POST /lora-adapters: the named ids get their scales, the others 0 (llama-server)."""
        self.scales = [scales.get(i, 0.0) for i in range(len(self.adapters))]

    def scales_for(self, request: dict[int, float] | None) -> tuple[float, ...]:
        """A request's scales by id (None: the global ones)."""
        if request is None:
            return tuple(self.scales)
        return tuple(request.get(i, 0.0) for i in range(len(self.adapters)))

    def apply(self, ctx: int, scales: tuple[float, ...]) -> bool:
        """Put ``scales`` on the context; True when they differ from what it had. Adapters at
        scale 0 are left out of the graph (so all at 0 is exactly the base model)."""
        if scales == self.applied:
            return False
        import ctypes  # noqa: PLC0415

        used = [(a.pointer, s) for a, s in zip(self.adapters, scales) if s != 0.0]
        pointers = (self._ll.llama_adapter_lora_p_ctypes * max(1, len(used)))(
            *[p for p, _ in used])
        values = (ctypes.c_float * max(1, len(used)))(*[s for _, s in used])
        if self._ll.llama_set_adapters_lora(ctx, pointers, len(used), values) != 0:
            raise RuntimeError("llama.cpp could not set the LoRA adapters on the context")
        had_any = any(self.applied)
        self.applied = scales
        return had_any or bool(used)


def _meta(ll: Any, pointer: Any, key: str) -> str:
    import ctypes  # noqa: PLC0415

    buf = ctypes.create_string_buffer(1024)
    n = ll.llama_adapter_meta_val_str(pointer, f"adapter.lora.{key}".encode(), buf, len(buf))
    return buf.value.decode("utf-8", "replace") if n >= 0 else ""
