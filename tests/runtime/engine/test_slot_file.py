"""Slot files (runtime/engine/slot_file.py) written and read through a real engine: the
layout check accounts for every byte of llama.cpp's sequence state (one KV cache, or two with
sliding-window layers), a saved slot restores, and a file whose checksum was made to match an
edit is still refused where a KV cell's position is wrong."""
from __future__ import annotations

import struct

import numpy as np
import pytest

from gguf_tools.synth import SynthSpec
from runtime.engine import slot_file, slot_state
from runtime.engine.engine import Engine
from runtime.engine.sampling import SamplingParams
from runtime.errors import UserError
from tests.runtime.engine.conftest import settings

SPECS = {"qwen3moe": SynthSpec(arch="qwen3moe", layers=2, experts=4, top_k=2, embd=64, ff=32,
                               dtype="f32", seed=0),
         "gpt-oss": SynthSpec(arch="gpt-oss", layers=2, experts=4, top_k=2, embd=64, ff=32,
                              dtype="f32", seed=0)}       # SWA layers: a second KV cache


@pytest.mark.parametrize("arch, caches", [("qwen3moe", 1), ("gpt-oss", 2)])
def test_a_saved_slot_reads_back_checked_and_restores(synth_model_factory, tmp_path, arch,
                                                      caches):
    engine = Engine(settings(synth_model_factory(SPECS[arch]), n_ctx=1024, n_parallel=2),
                    progress=False)
    try:
        list(engine.generate("the quick brown fox " * 40, SamplingParams(max_tokens=4,
                                                                           temperature=0)))
        held = list(engine._kv)                                   # noqa: SLF001
        path = str(tmp_path / "s.bin")
        saved = slot_state.save(engine, 0, path)
        image = slot_file.read(path, engine.n_vocab, engine.n_ctx)
        assert image.tokens == held and saved.n_bytes == image.file_bytes
        positions = slot_file.kv_cell_positions(image.state, "s.bin")
        assert len(positions) == caches
        assert np.array_equal(np.sort(positions[0]), np.arange(len(held)))   # every token
        assert all(int(p.max()) == len(held) - 1 for p in positions)
        slot_state.erase(engine, 0)
        assert slot_state.restore(engine, 0, path).n_tokens == len(held)
        assert engine._kv == held                                 # noqa: SLF001

        # an edited position under a checksum made to match: refused, the slot left empty
        data = bytearray(open(path, "rb").read())
        first_cell = slot_file.HEADER.size + 4 * len(held) + 16   # magic, seq, n_stream, count
        struct.pack_into("<i", data, first_cell, len(held) + 7)
        slot_file.seal(data, len(held))
        (tmp_path / "edited.bin").write_bytes(data)
        with pytest.raises(UserError, match=f"KV cell at position {len(held) + 7}"):
            slot_state.restore(engine, 0, str(tmp_path / "edited.bin"))
        assert engine._kv == [] and slot_state.erase(engine, 0) == 0   # noqa: SLF001
    finally:
        engine.close()
