"""Model facts from a GGUF file: shapes, MoE layers, and where every routed expert's bytes are.

Files are opened read-only (``np.memmap`` mode ``"r"``: ``mmap.ACCESS_READ``). Every problem
with the input becomes a one-line ``UserError`` naming the file.

Routed-expert tensors are ``blk.N.ffn_{gate,up,down,gate_up}_{exps,chexps}.{weight,bias,scale}``
with the expert as the outermost ggml dimension, so expert ``e`` of a tensor is the byte range
``[offset + e * expert_stride, + expert_stride)``. Shared experts (``*_shexp``), routers
(``ffn_gate_inp``) and everything else count as dense bytes.
"""
from __future__ import annotations

import math
import os
import re
import struct

import numpy as np
from dataclasses import dataclass
from pathlib import Path

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFValueType

from runtime.errors import UserError

GGUF_MAGIC = b"GGUF"
EXPERT_TENSOR_RE = re.compile(
    r"^blk\.(?P<layer>\d+)\.ffn_(?P<proj>gate_up|gate|up|down)_(?:ch)?exps\.(?P<kind>weight|bias|scale)$")
_SHARED_RE = re.compile(r"^blk\.\d+\.ffn_(gate|up|down)_shexp\.weight$")


@dataclass(frozen=True)
class ModelFacts:
    """What the runtime needs to know about a MoE GGUF model (see docs/design/contracts.md)."""

    path: str
    arch: str                      # general.architecture, e.g. "qwen3moe"
    n_layer: int
    n_expert: int
    n_expert_used: int
    n_embd: int
    n_ff_exp: int                  # expert feed-forward length
    n_shared_experts: int          # 0 when none
    context_length: int
    moe_layers: tuple[int, ...]    # layer ids that have routed experts
    expert_bytes: tuple[int, ...]  # len n_layer: bytes of ONE expert (all projections), 0 dense
    total_expert_bytes: int        # sum(expert_bytes[l] * n_expert)
    dense_bytes: int               # every other tensor byte
    file_bytes: int
    tensor_types: dict[str, str]   # tensor name -> ggml type name
    kv_bytes_per_token: int = 0    # K and V bytes per context token, all layers (f16 cache)
    sliding_window: int = 0        # attention.sliding_window in tokens; 0 none

    def to_json(self) -> dict[str, object]:
        """A JSON-ready dict of every field (lists for tuples)."""
        return {
            "path": self.path, "arch": self.arch, "n_layer": self.n_layer,
            "n_expert": self.n_expert, "n_expert_used": self.n_expert_used,
            "n_embd": self.n_embd, "n_ff_exp": self.n_ff_exp,
            "n_shared_experts": self.n_shared_experts, "context_length": self.context_length,
            "moe_layers": list(self.moe_layers), "expert_bytes": list(self.expert_bytes),
            "total_expert_bytes": self.total_expert_bytes, "dense_bytes": self.dense_bytes,
            "file_bytes": self.file_bytes, "tensor_types": dict(self.tensor_types),
            "kv_bytes_per_token": self.kv_bytes_per_token, "sliding_window": self.sliding_window,
        }


@dataclass(frozen=True)
class ExpertTensor:
    """One routed-expert tensor: ``n_expert`` equal slices along its outermost dimension."""

    name: str
    layer: int
    projection: str          # "gate" | "up" | "down" | "gate_up"
    kind: str                # "weight" | "bias" | "scale"
    ggml_type: str
    shape: tuple[int, ...]   # ggml order (ne0 first); shape[-1] == n_expert
    offset: int              # absolute file offset of expert 0, bytes
    expert_stride: int       # bytes of one expert's slice


def open_gguf(path: str | os.PathLike[str]) -> GGUFReader:
    """A read-only ``GGUFReader`` for ``path``; ``UserError`` (one line) on any bad input."""
    p = Path(path)
    if not p.exists():
        raise UserError(f"{p}: no such file")
    if p.is_dir():
        raise UserError(f"{p}: is a directory, not a GGUF file")
    try:
        with open(p, "rb") as f:
            head = f.read(24)
    except OSError as exc:
        raise UserError(f"{p}: cannot read ({exc.strerror or exc})") from None
    if len(head) < 4 or head[:4] != GGUF_MAGIC:
        raise UserError(f"{p}: not a GGUF file (starts with {head[:4]!r}, expected b'GGUF')")
    if len(head) < 24:
        raise UserError(f"{p}: truncated GGUF file ({len(head)} bytes, header needs 24)")
    version = struct.unpack_from("<I", head, 4)[0]
    if version not in (2, 3):
        raise UserError(f"{p}: unsupported GGUF version {version} (this reads 2 and 3)")
    size = p.stat().st_size
    try:
        reader = _CheckedReader(p, "r")
    except _TensorPastEnd as exc:
        raise UserError(f"{p}: truncated GGUF file (tensor {exc.name} ends at byte {exc.end:,}, "
                        f"the file has {size:,})") from None
    except (ValueError, IndexError, KeyError, OverflowError, UnicodeDecodeError,
            struct.error, TypeError):
        # numpy's reasons ("cannot reshape...") do not help a user; the file size does
        raise UserError(f"{p}: truncated or corrupt GGUF file: its metadata ends early or does "
                        f"not parse ({size:,} bytes)") from None
    return reader


_BIG_ARRAY = 4096      # elements: metadata arrays larger than this are skimmed


class _TensorPastEnd(ValueError):
    def __init__(self, name: str, end: int):
        super().__init__(name)
        self.name, self.end = name, end


class _CheckedReader(GGUFReader):
    """``GGUFReader`` that names the first tensor whose data lies past the end of the file
    (the stock reader fails later with a numpy reshape error), and skims vocabulary-sized
    metadata arrays: the stock reader makes a numpy view per element (a 151,936-token
    vocabulary took ~6 s to parse, four times per engine load). An array of more than
    ``_BIG_ARRAY`` scalars is one view (``contents()`` returns the same list); an array of more
    strings is stepped over and its ``contents()`` is empty (nothing here reads the
    tokenizer's tokens or merges: llama.cpp does)."""

    def _get_field_parts(self, orig_offs: int, raw_type: int):
        if raw_type == GGUFValueType.ARRAY:
            raw_itype = self._get(orig_offs, np.uint32)
            alen = self._get(orig_offs + 4, np.uint64)
            if int(alen[0]) > _BIG_ARRAY:
                return self._skim_array(orig_offs, raw_itype, alen)
        return super()._get_field_parts(orig_offs, raw_type)

    def _skim_array(self, orig_offs: int, raw_itype, alen):
        item, count = GGUFValueType(int(raw_itype[0])), int(alen[0])
        offs = orig_offs + 12
        nptype = self.gguf_scalar_to_np.get(item)
        if nptype is not None:
            values = self._get(offs, nptype, count)
            return 12 + int(values.nbytes), [raw_itype, alen, values], [2], \
                [GGUFValueType.ARRAY, item]
        if item != GGUFValueType.STRING:
            raise ValueError(f"unhandled array of {item!r}")
        view, at = memoryview(self.data), offs
        for _ in range(count):                     # each string: uint64 length, then bytes
            at += 8 + struct.unpack_from("<Q", view, at)[0]
        if at > len(self.data):
            raise ValueError("string array past the end of the file")
        return at - orig_offs, [raw_itype, alen], [], [GGUFValueType.ARRAY, item]

    def _build_tensors(self, start_offs: int, fields: list) -> None:
        size = len(self.data)
        for field in fields:
            try:
                _, name, _, dims, raw_type, offset = field.parts
                block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(int(raw_type[0]))]
                n_elements = math.prod(int(d) for d in dims)
                end = start_offs + int(offset[0]) + n_elements // block * type_size
                label = bytes(name).decode("utf-8", "replace")
            except (ValueError, KeyError, TypeError):
                continue  # let the stock reader report it
            if end > size:
                raise _TensorPastEnd(label, end)
        super()._build_tensors(start_offs, fields)


def field_value(reader: GGUFReader, key: str, default: object = None) -> object:
    """A metadata value (str, int, float, bool or list), or ``default`` when absent."""
    field = reader.get_field(key)
    if field is None:
        return default
    return field.contents()


def _as_int(value: object, default: int = 0) -> int:
    if value is None:
        return default
    if isinstance(value, list):  # per-layer arrays (e.g. expert_used_count): the largest
        return int(max(value)) if value else default
    return int(value)


def expert_tensors(reader: GGUFReader, path: str, n_expert: int) -> tuple[ExpertTensor, ...]:
    """Every routed-expert tensor, checked to split evenly into ``n_expert`` slices."""
    found = []
    for t in reader.tensors:
        m = EXPERT_TENSOR_RE.match(t.name)
        if not m:
            continue
        shape = tuple(int(d) for d in t.shape)
        if shape[-1] != n_expert:
            raise UserError(f"{path}: tensor {t.name} has {shape[-1]} experts in its outermost "
                            f"dimension, but the model declares {n_expert}")
        block = GGML_QUANT_SIZES[t.tensor_type][0]
        if len(shape) == 1 and block != 1:
            raise UserError(f"{path}: tensor {t.name} is a quantized per-expert vector "
                            f"({t.tensor_type.name}); its experts do not split on byte boundaries")
        found.append(ExpertTensor(
            name=t.name, layer=int(m["layer"]), projection=m["proj"], kind=m["kind"],
            ggml_type=t.tensor_type.name, shape=shape, offset=int(t.data_offset),
            expert_stride=int(t.n_bytes) // n_expert))
    return tuple(sorted(found, key=lambda e: e.offset))


def scan_model(reader: GGUFReader, path: str | os.PathLike[str], *,
               require_moe: bool = True) -> tuple[ModelFacts, tuple[ExpertTensor, ...]]:
    """``ModelFacts`` and the routed-expert tensors of an open GGUF file."""
    path = str(path)
    arch = field_value(reader, "general.architecture")
    if not isinstance(arch, str) or not arch:
        raise UserError(f"{path}: GGUF has no general.architecture key")
    n_layer = _as_int(field_value(reader, f"{arch}.block_count"))
    tensors_by_name = {t.name for t in reader.tensors}
    n_expert = _as_int(field_value(reader, f"{arch}.expert_count"))
    if n_expert == 0:
        counts = {int(t.shape[-1]) for t in reader.tensors if EXPERT_TENSOR_RE.match(t.name)}
        n_expert = max(counts) if counts else 0
    experts = expert_tensors(reader, path, n_expert) if n_expert else ()
    if require_moe and not experts:
        raise UserError(f"{path}: not a mixture-of-experts model (arch {arch!r} has no "
                        f"routed-expert ffn_*_exps tensors)")
    max_layer = max((e.layer for e in experts), default=-1)
    n_layer = max(n_layer, max_layer + 1)
    per_layer = [0] * n_layer
    for e in experts:
        per_layer[e.layer] += e.expert_stride
    total_bytes = sum(int(t.n_bytes) for t in reader.tensors)
    total_expert = sum(per_layer) * n_expert
    shared = _as_int(field_value(reader, f"{arch}.expert_shared_count"))
    if shared == 0 and any(_SHARED_RE.match(n) for n in tensors_by_name):
        shared = 1
    facts = ModelFacts(
        path=path, arch=arch, n_layer=n_layer, n_expert=n_expert,
        n_expert_used=_as_int(field_value(reader, f"{arch}.expert_used_count")),
        n_embd=_as_int(field_value(reader, f"{arch}.embedding_length")),
        n_ff_exp=_n_ff_exp(reader, arch, experts),
        n_shared_experts=shared,
        context_length=_as_int(field_value(reader, f"{arch}.context_length")),
        moe_layers=tuple(sorted({e.layer for e in experts})),
        expert_bytes=tuple(per_layer), total_expert_bytes=total_expert,
        dense_bytes=total_bytes - total_expert, file_bytes=Path(path).stat().st_size,
        tensor_types={t.name: t.tensor_type.name for t in reader.tensors},
        kv_bytes_per_token=_kv_bytes_per_token(reader, arch),
        sliding_window=max(_as_int(field_value(reader, f"{arch}.attention.sliding_window")), 0))
    return facts, experts


def _n_ff_exp(reader: GGUFReader, arch: str, experts: tuple[ExpertTensor, ...]) -> int:
    # The tensors are the truth (the key is optional and may be per layer); first MoE layer.
    for e in experts:
        if e.kind == "weight" and e.projection == "down":
            return e.shape[0]
    for e in experts:
        if e.kind == "weight" and e.projection in ("gate", "up"):
            return e.shape[1]
        if e.kind == "weight" and e.projection == "gate_up":
            return e.shape[1] // 2
    return _as_int(field_value(reader, f"{arch}.expert_feed_forward_length"))


def read_model_facts(path: str | os.PathLike[str], *, require_moe: bool = True) -> ModelFacts:
    """Facts of the GGUF model at ``path``; ``UserError`` (one line) on bad or non-MoE input."""
    return scan_model(open_gguf(path), path, require_moe=require_moe)[0]


def _kv_bytes_per_token(reader: GGUFReader, arch: str) -> int:
    """K and V bytes per context token over all layers (f16 cache), from the GGUF metadata."""
    def num(key: str, default: int = 0) -> int:
        return _as_int(field_value(reader, f"{arch}.{key}"), default)

    n_layer, embd = num("block_count"), num("embedding_length")
    heads = num("attention.head_count", 1) or 1
    heads_kv = num("attention.head_count_kv", heads) or heads
    k_len = num("attention.key_length", embd // heads) or embd // heads
    v_len = num("attention.value_length", k_len) or k_len
    return n_layer * heads_kv * (k_len + v_len) * 2
