"""A synthetic multimodal projector (``mmproj``) for a synthetic model: the smallest file
llama.cpp's clip.cpp (0.3.36, tools/mtmd) loads as a vision encoder.

The projector is LLaVA's (``clip.projector_type = mlp``): a CLIP ViT over ``image_size``
pixels in ``patch_size`` patches (a conv2d patch embedding, learned positions, pre-norm
blocks with biased attention and a GELU MLP), then ``mm.0`` -> GELU -> ``mm.2`` into the text
model's ``n_embd``, so it fits any text model whose embedding width is ``text_embd``
(llama.cpp checks that at load). clip.cpp runs blocks ``0 .. n_layer - 2`` for this projector
(LLaVA takes the second-to-last layer), so two blocks run one. An image becomes
``(image_size / patch_size) ** 2`` embeddings (4 by default): tiny, deterministic (seeded
N(0, std) weights), meaningless as vision.

Tensor shapes below are numpy's (outermost first), the reverse of ggml's ``ne``.

    write_synthetic_mmproj("mmproj.gguf", text_embd=64)
"""
from __future__ import annotations

import os
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGUFWriter

from gguf_tools.synth import published_gguf
from runtime.atomic_write import AtomicTarget


@dataclass(frozen=True)
class MmprojSpec:
    """The vision tower's sizes; ``text_embd`` must equal the text model's n_embd."""

    text_embd: int = 64
    image_size: int = 28         # pixels per side the image is resized to
    patch_size: int = 14         # pixels per patch side: (28 / 14) ** 2 = 4 image tokens
    embd: int = 32               # the ViT's width
    heads: int = 2
    ff: int = 64                 # the ViT's MLP width
    layers: int = 2              # blocks written (clip.cpp runs all but the last)
    proj_ff: int = 64            # mm.0's output width
    std: float = 0.2             # weight scale: different images give different answers
    seed: int = 0

    def __post_init__(self) -> None:
        if self.image_size % self.patch_size or self.embd % self.heads or self.layers < 2:
            raise ValueError("image_size must be a multiple of patch_size, embd of heads, "
                             "and layers >= 2")

    @property
    def n_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2


def _tensors(spec: MmprojSpec) -> dict[str, tuple[int, ...] | tuple[tuple[int, ...], float]]:
    """name -> numpy shape (random) or (shape, constant)."""
    e, p = spec.embd, spec.patch_size
    out: dict = {
        "v.patch_embd.weight": (e, 3, p, p),          # conv2d kernel, ggml (p, p, 3, e)
        "v.position_embd.weight": (spec.n_patches, e),
        "v.pre_ln.weight": ((e,), 1.0), "v.pre_ln.bias": ((e,), 0.0),
        "mm.0.weight": (spec.proj_ff, e), "mm.0.bias": (spec.proj_ff,),
        "mm.2.weight": (spec.text_embd, spec.proj_ff), "mm.2.bias": (spec.text_embd,),
    }
    for i in range(spec.layers):
        blk = f"v.blk.{i}"
        for name in ("attn_q", "attn_k", "attn_v", "attn_out"):
            out[f"{blk}.{name}.weight"], out[f"{blk}.{name}.bias"] = (e, e), (e,)
        for name in ("ln1", "ln2"):
            out[f"{blk}.{name}.weight"], out[f"{blk}.{name}.bias"] = ((e,), 1.0), ((e,), 0.0)
        out[f"{blk}.ffn_up.weight"], out[f"{blk}.ffn_up.bias"] = (spec.ff, e), (spec.ff,)
        out[f"{blk}.ffn_down.weight"], out[f"{blk}.ffn_down.bias"] = (e, spec.ff), (e,)
    return out


def write_synthetic_mmproj(path: str | os.PathLike[str], spec: MmprojSpec | None = None, *,
                           text_embd: int | None = None) -> Path:
    """Write the projector ``spec`` describes (``text_embd``: shorthand for the default spec
    with that width) to ``path``, atomically; returns the path."""
    spec = spec or MmprojSpec(**({"text_embd": text_embd} if text_embd else {}))
    out = Path(path)
    target = AtomicTarget(out)
    writer = GGUFWriter(target.tmp, "clip")
    with published_gguf(target, writer):
        writer.add_string("general.name", "moe-offload synthetic mmproj")
        writer.add_string("clip.projector_type", "mlp")
        writer.add_bool("clip.has_vision_encoder", True)
        writer.add_bool("clip.use_gelu", True)
        v = "clip.vision."
        for key, value in (("image_size", spec.image_size), ("patch_size", spec.patch_size),
                           ("embedding_length", spec.embd), ("feed_forward_length", spec.ff),
                           ("block_count", spec.layers), ("projection_dim", spec.text_embd),
                           ("attention.head_count", spec.heads)):
            writer.add_uint32(v + key, value)
        writer.add_float32(v + "attention.layer_norm_epsilon", 1e-5)
        writer.add_array(v + "image_mean", [0.5, 0.5, 0.5])
        writer.add_array(v + "image_std", [0.5, 0.5, 0.5])
        for name, shape in _tensors(spec).items():
            if isinstance(shape[0], tuple):                  # (shape, constant): a norm
                data = np.full(shape[0], shape[1], dtype=np.float32)
            else:
                rng = np.random.default_rng([spec.seed, zlib.crc32(name.encode())])
                data = rng.standard_normal(shape, dtype=np.float32) * spec.std
            writer.add_tensor(name, data)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    return out
