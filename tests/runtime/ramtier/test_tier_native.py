"""The RAM tier's per-layer work in C (tier_io.c): with the tier attached the routing hook runs
native (no Python call on a layer-step) and gives the tokens plain mmap gives; a failed read
fails the decode loudly; the C rules equal their Python references (ExpertLayout.droppable,
Pager.page_in)."""
from __future__ import annotations

import mmap

import numpy as np
import pytest

from gguf_tools.synth import SynthSpec
from runtime.engine.hook.events import RouteCaptureError
from runtime.ramtier import RamTier
from runtime.ramtier.layout import ExpertLayout
from runtime.ramtier.mapping import FileMapping
from runtime.ramtier.pager import CHUNK_BYTES, Pager, drop_file_cache
from runtime.ramtier.tier_io import TierIO, TierReadError
from runtime.ramtier.vm import PAGE_SIZE
from runtime.residency.config import parse_config
from runtime.residency.manager import ExpertResidencyManager
from runtime.residency.types import ExpertKey
from tests.runtime.ramtier.conftest import greedy, tier_engine

# 4 layers x 16 experts x 384 KiB (f32 gate/up/down 128 x 256), top-2
SPEC = SynthSpec(arch="qwen3moe", layers=4, experts=16, top_k=2, embd=128, ff=256,
                 dtype="f32", seed=4, skew=1.0)
PROMPT = "Once upon a time in a land far away"
N_TOKENS = 12


@pytest.fixture(scope="module")
def model(synth_model_factory):
    return str(synth_model_factory(SPEC))


def _count_python_calls(hook) -> list[int]:
    """Count the Python calls the hook makes on a layer-step (its observer adapter's)."""
    calls = [0]
    on_event = hook._on_event

    def counting(*args):
        calls[0] += 1
        return on_event(*args)

    hook._on_event_c = hook.ffi.callback("rh_event_cb", counting)   # kept alive with the hook
    hook._observing = False                 # the next batch registers it
    return calls


class _Synchronous:
    """A Python observer that must run between router and experts: the observer adapter."""

    def __init__(self):
        self.events = 0

    def on_route(self, event) -> None:
        self.events += 1

    def on_batch_end(self, phase, n_tokens) -> None:
        pass


def test_tier_runs_native_with_no_python_call_per_layer_step(model):
    with tier_engine(model) as plain:
        want = greedy(plain, PROMPT, N_TOKENS)
    # a third of the 24 MiB of experts: 2 MiB kept, one layer's 6 MiB for one-use reads
    with tier_engine(model, "8MiB") as engine:
        tier = next(p for p in engine.tiers if isinstance(p, RamTier))
        calls = _count_python_calls(engine.hook)
        decodes = engine.decode_calls
        got = greedy(engine, PROMPT, N_TOKENS)
        stats = tier.stats()
        n_decodes = engine.decode_calls - decodes
        assert calls[0] == 0                              # no Python call on any layer-step
        assert stats.routes == 4 * n_decodes               # every MoE layer-step was stepped
        assert stats.dropped_experts > 0 and stats.paged_in_bytes > 0
        assert engine.manager.snapshot().device("cpu").resident_bytes <= 2 << 20

        # a synchronous observer: one Python call per event, the same C stepping the tier
        sync = _Synchronous()
        engine.add_route_observer(sync)
        again = greedy(engine, PROMPT, N_TOKENS)
        assert calls[0] > 0 and sync.events > 0
        assert tier.stats().routes > stats.routes
    assert got == want and again == want


def test_a_failed_read_fails_the_decode_with_route_capture_error(model, tmp_path):
    truncated = tmp_path / "truncated.gguf"
    with open(model, "rb") as fh:
        truncated.write_bytes(fh.read(1 << 20))            # the file as if cut short
    with tier_engine(model, "2MiB") as engine:
        tier = next(p for p in engine.tiers if isinstance(p, RamTier))
        assert len(greedy(engine, PROMPT, 2)) == 2
        drop_file_cache(model)                             # held experts must be read again
        with open(truncated, "rb") as short:
            tier.io.set_fd(short.fileno())
            with pytest.raises(RouteCaptureError, match="ram tier: short read at offset"):
                greedy(engine, PROMPT, 2)
            tier.io.set_fd(tier.pager.fileno())
        assert len(greedy(engine, PROMPT, 2)) == 2        # the real file reads again


# ---- the C rules against their Python references ------------------------------------------

@pytest.fixture()
def mapped_file(tmp_path):
    path = tmp_path / "blob.bin"
    path.write_bytes(np.random.default_rng(1).integers(0, 256, size=8 << 20,
                                                       dtype=np.uint8).tobytes())
    with open(path, "rb") as fh:
        mm = mmap.mmap(fh.fileno(), 0, prot=mmap.PROT_READ)
        yield path, mm
        mm.close()


def _tier_io(path, layout: ExpertLayout, n_layer: int, n_expert: int):
    manager = ExpertResidencyManager.create_simulated(expert_bytes=[1 << 20] * n_layer,
                                                      n_expert=n_expert,
                                                      capacity_bytes=64 << 20)
    mapping = FileMapping.find(path)
    pager = Pager(mapping, threads=4)
    io = TierIO(manager.core_handle("sim"), layout, mapping, n_layer=n_layer, n_expert=n_expert,
                fd=pager.fileno(), threads=4)
    return io, pager, mapping


def test_droppable_in_c_equals_the_layout_rule(mapped_file):
    path, _ = mapped_file
    rng = np.random.default_rng(7)
    # 2 layers x 6 experts x 3 ranges, unaligned, some sharing pages, dense gaps between some
    ranges, at = {}, 3 * PAGE_SIZE + 40
    for layer in range(2):
        for e in range(6):
            rs = []
            for _ in range(3):
                n = int(rng.integers(100, 3 * PAGE_SIZE))
                rs.append((at, n))
                at += n + (int(rng.integers(0, 2)) * 32 if rng.random() < 0.5 else 0)
            ranges[ExpertKey(layer, e)] = rs
    layout = ExpertLayout(ranges)
    io, pager, _ = _tier_io(path, layout, 2, 6)
    try:
        for _ in range(50):
            io.held[:] = rng.random(12) < 0.4
            io.busy[:] = rng.random(12) < 0.1
            keep = {k for k in layout.keys if io.held[io.flat(k)] or io.busy[io.flat(k)]}
            for key in layout.keys:
                want = layout.droppable(key, keep.__contains__)
                assert io.droppable(io.flat(key)) == want, key
    finally:
        io.close()
        pager.close()


def test_page_in_in_c_equals_pager_page_in_and_a_short_read_raises(mapped_file, tmp_path):
    path, _ = mapped_file
    layout = ExpertLayout({ExpertKey(0, 0): [(0, PAGE_SIZE)]})
    io, pager, mapping = _tier_io(path, layout, 1, 1)
    spans = [(5 * PAGE_SIZE + 100, 3 * CHUNK_BYTES + 17), (7 << 20, 2 * PAGE_SIZE)]
    whole = (0, 8 << 20)
    try:
        seen = []
        for read in (io.page_in, pager.page_in):
            pager.drop([whole])
            assert mapping.resident_pages().sum() == 0
            read(spans)
            seen.append(mapping.resident_pages())
        for offset, length in spans:               # every page of the ranges, both ways
            lo, hi = offset // PAGE_SIZE, (offset + length - 1) // PAGE_SIZE + 1
            assert seen[0][lo:hi].all() and seen[1][lo:hi].all()
        short = tmp_path / "short.bin"
        short.write_bytes(path.read_bytes()[:1 << 20])
        pager.drop([whole])
        with open(short, "rb") as fh:
            io.set_fd(fh.fileno())
            with pytest.raises(TierReadError, match="short read at offset"):
                io.page_in(spans)
    finally:
        io.close()
        pager.close()


def test_a_manager_on_the_reference_core_gets_a_message_and_no_tier(model, caplog):
    import logging

    from gguf_tools.facts import read_model_facts
    from runtime.ramtier import attach_to

    caplog.set_level(logging.WARNING, logger="moe_offload.ramtier")
    facts = read_model_facts(model)
    manager = ExpertResidencyManager(parse_config({"devices": {"cpu": "2MiB"}}, source="t"),
                                     core="reference")
    manager.bind_model(facts.expert_bytes, facts.n_expert)
    with open(model, "rb") as fh, mmap.mmap(fh.fileno(), 0, prot=mmap.PROT_READ):
        assert attach_to(manager, model) is None       # our own mapping stands in for llama's
    assert any("needs the native one" in r.getMessage() for r in caplog.records)
