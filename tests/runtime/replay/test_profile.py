"""Routing profiles: built from traces, refused when corrupt or of another model, and a warm
start that pays: a profile of a trace's first decode half lowers the second half's misses."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from runtime.errors import UserError
from runtime.replay.harness import prepare, replay_cell
from runtime.residency.config import PhasePolicies, ResidencyConfig
from runtime.residency.core import AFFINITY_SOURCES, NEIGHBOUR_HISTORY
from runtime.residency.policies.factory import make_spec
from runtime.residency.profile import build_profile, read_profile, write_profile

DATA = Path(__file__).parents[1] / "traces" / "data"
REAL_TRACES = sorted(DATA.glob("*.route.csv"))


def _halves(trace):
    """(rows of the first half of the decode tokens, rows of the second half)."""
    dec = trace.phase == 1
    steps = np.unique(trace.step[dec])
    mid = steps[len(steps) // 2]
    return np.flatnonzero(dec & (trace.step < mid)), np.flatnonzero(dec & (trace.step >= mid))


def _learned() -> ResidencyConfig:
    pp = PhasePolicies(admission=make_spec("admission", "always"),
                       prefetch=make_spec("prefetch", "affinity"),
                       eviction=make_spec("eviction", "next-visit"))
    return ResidencyConfig(phase_specific=False, prefill=pp, decode=pp)


def test_profile_of_the_first_half_lowers_the_second_halfs_misses(real_prep):
    """At 5 and 10 % of the expert bytes: never more misses, fewer in all (at 10 % gpt-oss's
    second half nearly fits: cold misses dominate and the warm start may tie; above ~20 % it
    fits)."""
    trace = real_prep.trace
    first, second = _halves(trace)
    prof = build_profile([trace.take(first)])
    later = prepare(trace.take(second), name="second half")
    total = {"cold": 0, "warm": 0}
    for share in (0.05, 0.1):
        cap = int(share * trace.header.total_expert_bytes)
        cold = replay_cell(later, cap, _learned(), label="cold", with_belady=False)
        warm = replay_cell(later, cap, _learned(), label="warm", with_belady=False,
                           profile=prof)
        print(f"{real_prep.name} at {share:.0%}: second-half decode demand-miss MiB cold "
              f"{cold.decode.demand_miss_bytes / 2**20:,.0f}, warm "
              f"{warm.decode.demand_miss_bytes / 2**20:,.0f}")
        assert warm.decode.demand_miss_bytes <= cold.decode.demand_miss_bytes
        total["cold"] += cold.decode.demand_miss_bytes
        total["warm"] += warm.decode.demand_miss_bytes
    assert total["warm"] < total["cold"]


def test_profile_round_trips_and_counts_the_decode_routing(tmp_path):
    from runtime.traces.files import read_trace

    trace = read_trace(next(p for p in REAL_TRACES if "qwen" in p.name))
    prof = build_profile([trace])
    path = tmp_path / "p.npz"
    write_profile(path, prof)
    back = read_profile(path)
    assert back.decode_tokens == trace.token_count(1) == prof.decode_tokens
    assert np.array_equal(back.frequency, prof.frequency) and np.array_equal(back.pair, prof.pair)
    assert np.array_equal(back.history, prof.history)
    # each decode token routes top-k distinct experts per MoE layer; the table's sources are
    # the first AFFINITY_SOURCES of them (routing order), paired with all k of the next layer
    k, n_moe = trace.header.n_expert_used, len(prof.moe_layers)
    assert k > AFFINITY_SOURCES                    # (qwen3: 6 per token, so the cut shows)
    assert np.isclose(prof.frequency.sum(), k * n_moe)
    assert prof.count.sum() == prof.decode_tokens * (n_moe - 1) * AFFINITY_SOURCES
    assert prof.pair.sum() == prof.decode_tokens * (n_moe - 1) * AFFINITY_SOURCES * k
    # the neighbour history: the last decode tokens, each layer's experts in routing order
    assert prof.history.shape == (min(prof.decode_tokens, NEIGHBOUR_HISTORY), n_moe, k)
    dec = np.flatnonzero(trace.phase == 1)
    last = dec[trace.step[dec] == trace.step[dec].max()]
    layer0 = last[trace.layer[last] == prof.moe_layers[0]]
    assert prof.history[-1, 0].tolist() == trace.expert[layer0].tolist()


def test_profile_with_a_bad_history_is_refused(tmp_path):
    """The neighbour history must hold distinct expert ids per token and layer, then only the
    pad -1, in the model's shape: anything else is a corrupt profile, refused in one line."""
    import dataclasses

    from runtime.traces.files import read_trace

    prof = build_profile([read_trace(next(p for p in REAL_TRACES if "qwen" in p.name))])
    h = prof.history
    dup, gap, big = h.copy(), h.copy(), h.copy()
    dup[3, 2, 1] = dup[3, 2, 0]
    gap[3, 2, 0] = -1
    big[0, 0, 0] = prof.n_expert
    for name, bad in (("dup", dup), ("gap", gap), ("range", big), ("shape", h[:, :-1]),
                      ("dtype", h.astype(np.int32))):
        path = tmp_path / f"{name}.npz"
        write_profile(path, dataclasses.replace(prof, history=bad))
        with pytest.raises(UserError, match="a corrupt routing profile"):
            read_profile(path)


def _cli(*argv):
    return subprocess.run([sys.executable, "-m", "runtime.cli", *map(str, argv)],
                          capture_output=True, text=True, timeout=300)


def test_cli_refuses_a_corrupt_or_foreign_profile_in_one_line(tmp_path):
    qwen, gpt = (p for p in sorted(REAL_TRACES, key=lambda p: "qwen" not in p.name))
    prof = tmp_path / "qwen.npz"
    done = _cli("profile", qwen, "-o", prof)
    assert done.returncode == 0, done.stderr
    other = _cli("replay", gpt, "--capacity", "10%", "--policy", "next-visit", "--profile", prof)
    assert other.returncode == 2 and len(other.stderr.strip().splitlines()) == 1
    assert "the profile is of a model with 48 layers" in other.stderr
    bad = tmp_path / "bad.npz"
    bad.write_bytes(b"not a profile")
    got = _cli("replay", qwen, "--capacity", "10%", "--policy", "next-visit", "--profile", bad)
    assert got.returncode == 2
    assert got.stderr.strip() == (f"moe-offload: error: {bad}: not a routing profile "
                                  "(moe-offload profile writes them)")
    ok = _cli("replay", qwen, "--capacity", "10%", "--policy", "next-visit", "--profile", prof)
    assert ok.returncode == 0, ok.stderr


def test_profile_of_traces_of_two_models_is_refused():
    from runtime.traces.files import read_trace

    with pytest.raises(UserError, match="a trace of another model"):
        build_profile([read_trace(p) for p in REAL_TRACES])


def test_profile_of_the_same_shape_with_other_expert_bytes_is_refused(tmp_path):
    """Same layers x experts, another quantization (one layer's experts of another size): the
    profile belongs to another model; replay refuses it in one line."""
    import dataclasses

    from runtime.traces.files import read_trace

    qwen = next(p for p in REAL_TRACES if "qwen" in p.name)
    prof = build_profile([read_trace(qwen)])
    moe = prof.moe_layers
    other = dataclasses.replace(prof, expert_bytes=tuple(
        b + 4096 if i == moe[3] else b for i, b in enumerate(prof.expert_bytes)))
    path = tmp_path / "requant.npz"
    write_profile(path, other)
    with pytest.raises(UserError, match=f"layer {moe[3]} experts are"):
        read_profile(path).check_model(prof.n_layer, prof.n_expert, prof.expert_bytes, "here")
    got = _cli("replay", qwen, "--capacity", "10%", "--policy", "next-visit", "--profile", path)
    assert got.returncode == 2 and len(got.stderr.strip().splitlines()) == 1, got.stderr
    assert f"layer {moe[3]} experts are" in got.stderr and "Traceback" not in got.stderr


def test_profile_with_a_pair_above_its_count_is_refused(tmp_path):
    """A pair can never exceed its count (a token routed to e' after e is a token routed to
    e): a profile where one does is corrupt, refused in one line (the core's 16-bit table
    relies on it)."""
    import dataclasses

    from runtime.traces.files import read_trace

    qwen = next(p for p in REAL_TRACES if "qwen" in p.name)
    prof = build_profile([read_trace(qwen)])
    pair = prof.pair.copy()
    i, e = np.argwhere(prof.count > 0)[0]
    pair[i, e, 0] = prof.count[i, e] + 1
    path = tmp_path / "pair.npz"
    write_profile(path, dataclasses.replace(prof, pair=pair))
    with pytest.raises(UserError, match="a corrupt routing profile"):
        read_profile(path)


def test_profile_of_version_1_reads_with_an_empty_history(tmp_path):
    """A profile written before the neighbour history (format version 1, no ``history``
    array) still reads, with an empty history, and warm-starts a replay."""
    import json

    from runtime.traces.files import read_trace

    qwen = next(p for p in REAL_TRACES if "qwen" in p.name)
    prof = build_profile([read_trace(qwen)])
    path = tmp_path / "v1.npz"
    write_profile(path, prof)
    with np.load(path) as z:
        arrays = {k: z[k] for k in z.files if k != "history"}
    head = json.loads(arrays["header"].tobytes().decode())
    head["version"] = 1
    arrays["header"] = np.frombuffer(json.dumps(head).encode(), dtype=np.uint8)
    np.savez_compressed(path, **arrays)
    back = read_profile(path)
    assert back.history.shape == (0, len(prof.moe_layers), prof.n_expert_used)
    assert np.array_equal(back.pair, prof.pair)
    config = Path(__file__).parents[3] / "configs" / "best-replay.toml"
    ok = _cli("replay", qwen, "--capacity", "10%", "--config", config, "--profile", path)
    assert ok.returncode == 0, ok.stderr


def test_profile_with_a_bad_header_or_arrays_is_refused(tmp_path):
    """A header that is not a JSON object or holds an infinite size, counts of a float type
    or past int32, or experts per token out of range: one line each, never a traceback."""
    import json

    from runtime.traces.files import read_trace

    prof = build_profile([read_trace(next(p for p in REAL_TRACES if "qwen" in p.name))])
    path = tmp_path / "good.npz"
    write_profile(path, prof)
    with np.load(path) as z:
        good = {k: z[k] for k in z.files}
    head = json.loads(good["header"].tobytes().decode())

    def with_header(h):
        return {**good, "header": np.frombuffer(json.dumps(h).encode(), dtype=np.uint8)}

    cases = {
        "list": {**good, "header": np.frombuffer(b"[1, 2]", dtype=np.uint8)},
        "inf": {**good, "header": np.frombuffer(
            json.dumps({**head, "n_layer": 1}).replace('"n_layer": 1', '"n_layer": Infinity')
            .encode(), dtype=np.uint8)},
        "k": with_header({**head, "n_expert_used": -3}),
        "float": {**good, "count": good["count"].astype(np.float64)},
        "big": {**good, "count": good["count"].astype(np.int64) + 2**32},
    }
    for name, arrays in cases.items():
        bad = tmp_path / f"{name}.npz"
        np.savez_compressed(bad, **arrays)
        with pytest.raises(UserError, match="not a routing profile|a corrupt routing profile"):
            read_profile(bad)
