"""lru_step: the C version against its Python reference, directly and through the manager."""
from __future__ import annotations

import shutil
import sysconfig
from array import array
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as hst

from runtime.cache import cache_dir
from runtime.errors import UserError
from runtime.residency import lru_step as reference
from runtime.residency import native_step
from runtime.residency.manager import ExpertResidencyManager
from runtime.residency.types import ExpertKey, Phase

CAN_BUILD = shutil.which("cc") is not None and (
    Path(sysconfig.get_paths()["include"]) / "Python.h").exists()
needs_cc = pytest.mark.skipif(not CAN_BUILD, reason="no C compiler or no Python.h here")


@pytest.fixture(scope="module")
def native():
    fn = native_step.load_lru_step(native=True)
    if native_step.step_impl(fn) != "c":
        pytest.fail(f"the C lru_step did not load: {native_step.why_not_native()}")
    return fn


@needs_cc
def test_builds_from_scratch(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    target = cache_dir("residency") / "fresh.so"
    native_step._build(target)
    assert target.stat().st_size > 0 and not list(target.parent.glob("tmp*"))


def test_reference_when_disabled(monkeypatch):
    monkeypatch.setenv("MOE_OFFLOAD_NATIVE_STEP", "0")
    assert native_step.load_lru_step() is reference.lru_step
    assert native_step.step_impl(reference.lru_step) == "python"


# ---- the function itself, on random device states ------------------------------------------
N_LAYER, N_EXPERT = 3, 6


def make_core(resident: list[int], phases: list[int], sizes: list[int]):
    """A core with ``resident`` flat keys in lru order (oldest first), last seqs 0..r-1."""
    n_flat = N_LAYER * N_EXPERT
    state = bytearray([8]) * n_flat
    last = array("q", [-1]) * n_flat
    od: OrderedDict = OrderedDict()
    for seq, (f, ph) in enumerate(zip(resident, phases)):
        state[f] = ph
        last[f] = seq
        od[f] = None
    keys = [ExpertKey(f // N_EXPERT, f % N_EXPERT) for f in range(n_flat)]
    nbytes = [sizes[f // N_EXPERT] for f in range(n_flat)]
    return (state, last, od, od.move_to_end, od.popitem, keys, nbytes)


def outcome(fn, resident, phases, sizes, layer, el, phase, free):
    core = make_core(resident, phases, sizes)
    flat_of = {e: layer * N_EXPERT + e for e in range(N_EXPERT)}
    try:
        out = fn(core, flat_of, list(el), 1000, phase, sizes[layer], free)
    except LookupError as exc:
        out = ("LookupError", exc.args)
    state, last, od = core[0], core[1], core[2]
    return out, bytes(state), list(last), list(od)


@given(
    resident=hst.lists(hst.integers(0, N_LAYER * N_EXPERT - 1), unique=True, max_size=12),
    phase_seed=hst.integers(0, 2**16),
    sizes=hst.lists(hst.integers(1, 5), min_size=N_LAYER, max_size=N_LAYER),
    layer=hst.integers(0, N_LAYER - 1),
    el=hst.lists(hst.integers(0, N_EXPERT - 1), max_size=10),
    bad=hst.sampled_from([None, None, None, None, -1, N_EXPERT]),   # an id out of range
    bad_at=hst.integers(0, 10),
    phase=hst.sampled_from([0, 1, 2]),
    free=hst.integers(0, 12))
@settings(max_examples=400, deadline=None)
def test_c_equals_reference_on_random_states(resident, phase_seed, sizes, layer, el, bad,
                                             bad_at, phase, free):
    if bad is not None:
        el = el[:bad_at] + [bad] + el[bad_at:]
    if not CAN_BUILD:
        pytest.skip("no C compiler or no Python.h here")
    native = native_step.load_lru_step(native=True)
    assert native_step.step_impl(native) == "c", native_step.why_not_native()
    rng = np.random.default_rng(phase_seed)
    phases = rng.integers(0, 3, size=len(resident)).tolist()
    args = (resident, phases, sizes, layer, el, phase, free)
    assert outcome(native, *args) == outcome(reference.lru_step, *args)


@needs_cc
def test_c_rejects_non_int_ids_like_the_reference(native):
    for bad in (["x"], [[1]], [1, None]):
        got = outcome(native, [0, 1], [1, 1], [1, 1, 1], 0, bad, 1, 0)
        want = outcome(reference.lru_step, [0, 1], [1, 1], [1, 1, 1], 0, bad, 1, 0)
        assert got == want and got[0][0] == "LookupError"


# ---- through the manager: every decision and counter -------------------------------------
def drive(step_fn, zipf_stream, capacity: int, sizes: list[int]):
    m = ExpertResidencyManager.create_simulated(expert_bytes=sizes, n_expert=16,
                                                capacity_bytes=capacity, policy="lru")
    m._lru_step = step_fn
    s = zipf_stream(80, len(sizes), 16, 4, seed=9)
    rng = np.random.default_rng(4)
    out = []
    held = None
    for t in range(80):
        for layer in range(len(sizes)):
            phase = Phase.PREFILL if t % 25 < 3 else Phase.DECODE
            experts = (rng.integers(0, 16, size=10) if phase == Phase.PREFILL
                       else s[t, layer])             # prefill chunks repeat experts
            if t % 17 == 5:                           # a bad id: nothing but touches change
                with pytest.raises(UserError, match="out of range"):
                    m.access_layer("sim", layer, np.append(experts, 16), phase)
            if t % 11 == 3:                           # a lease held across: general path
                held = m.access_layer("sim", layer, experts, phase)
                out.append(held[:-1])
                continue
            a = m.access_layer("sim", layer, experts, phase, release=held, step=t)
            held = None
            out.append(a[:-1])
            m.release(a)
        m.verify()
    st = m._devices["sim"]
    return out, m.snapshot(), bytes(st.state), list(st.stats.last_seq), list(st.lru_od)


@needs_cc
@pytest.mark.parametrize("capacity", [150, 400, 1200, 5000])
def test_manager_with_c_equals_manager_with_reference(native, zipf_stream, capacity):
    sizes = [100, 170, 100, 240]
    assert drive(native, zipf_stream, capacity, sizes) == \
        drive(reference.lru_step, zipf_stream, capacity, sizes)
