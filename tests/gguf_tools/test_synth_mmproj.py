"""The synthetic mmproj: a small, deterministic GGUF with the keys and tensors clip.cpp's
LLaVA projector needs (llama.cpp loading it and answering with it: tests/runtime/server/
test_images.py)."""
from __future__ import annotations

import pytest
from gguf import GGUFReader

from gguf_tools.synth_mmproj import MmprojSpec, write_synthetic_mmproj


def test_same_spec_same_bytes_and_small(tmp_path):
    a = write_synthetic_mmproj(tmp_path / "a.gguf", text_embd=64)
    b = write_synthetic_mmproj(tmp_path / "b.gguf", MmprojSpec(text_embd=64))
    assert a.read_bytes() == b.read_bytes()
    assert a.stat().st_size < 512 << 10
    assert write_synthetic_mmproj(tmp_path / "c.gguf", MmprojSpec(seed=1)).read_bytes() != \
        a.read_bytes()


def test_projects_into_the_text_models_width(tmp_path):
    reader = GGUFReader(write_synthetic_mmproj(tmp_path / "m.gguf", text_embd=96))
    fields = {f.name: f for f in reader.fields.values()}
    assert bytes(fields["clip.projector_type"].parts[-1]).decode() == "mlp"
    assert int(fields["clip.vision.projection_dim"].parts[-1][0]) == 96
    tensors = {t.name: tuple(int(n) for n in t.shape) for t in reader.tensors}
    assert tensors["mm.2.weight"] == (64, 96)                 # ggml (ne0, ne1): in, out
    assert tensors["v.patch_embd.weight"] == (14, 14, 3, 32)
    assert MmprojSpec().n_patches == 4


def test_a_spec_clip_cannot_run_is_refused():
    with pytest.raises(ValueError, match="patch_size"):
        MmprojSpec(image_size=30)
    with pytest.raises(ValueError, match="layers"):
        MmprojSpec(layers=1)
