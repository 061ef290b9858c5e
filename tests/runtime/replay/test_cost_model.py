"""The cost model against hand computations, and `moe-offload calibrate`'s TOML snippet."""
from __future__ import annotations

import tomllib

import numpy as np
import pytest

from runtime.cli import main
from runtime.replay.cost_model import WEIGHT_BITS, CostModel
from runtime.residency.config import CostParams, parse_config

P = CostParams(link_gbps=25.0, link_latency_us=10.0, cpu_mem_gbps=60.0, cpu_gflops=400.0,
               gpu_mem_gbps=900.0, gpu_gflops=50000.0)
B = 3e6      # bytes of one expert
D = 12e6     # dense bytes of the layer


def _decode(hits, misses, admitted, calls=1):
    m = CostModel(P, [B], [D])
    m.add_single_token_counts(1, *(np.array([x], dtype=float) for x in
                                   (hits, misses, admitted, calls)))
    return m


def test_all_hits_decode_streams_weights_on_the_gpu():
    ttft, tpot = _decode(hits=8, misses=0, admitted=0).estimate(prefill_turns=0,
                                                                 decode_tokens=1)
    assert ttft == 0.0
    assert tpot == pytest.approx((D + 8 * B) / 900e9)


def test_decode_miss_computes_in_place_on_the_cpu():
    # one token: CPU streams 3 MB at 60 GB/s (50 us); fetching costs 10 us + 120 us + 3.3 us
    tpot = _decode(hits=0, misses=1, admitted=0).estimate(prefill_turns=0, decode_tokens=1)[1]
    assert tpot == pytest.approx(D / 900e9 + B / 60e9)


def test_admitted_misses_still_cross_the_link():
    # 8 admitted misses: the CPU path takes 400 us, the link must carry 24 MB (960 us)
    tpot = _decode(hits=0, misses=8, admitted=8).estimate(prefill_turns=0, decode_tokens=1)[1]
    assert tpot == pytest.approx(8 * B / 25e9)


def test_prefill_picks_the_gpu_when_compute_bound():
    m = CostModel(P, [B], [D])
    tokens = np.array([500, 2])      # expert 0 routed by 500 tokens, expert 1 by 2
    missed = np.array([True, True])
    m.add_batch_call(0, 0, 502, tokens, missed, admitted=np.array([True, False]))
    flops_per_token = 2 * 8 * B / WEIGHT_BITS
    big_gpu = max(B / 900e9, flops_per_token * 500 / 50000e9)
    big_fetch = 10e-6 + B / 25e9 + big_gpu
    big_cpu = max(B / 60e9, flops_per_token * 500 / 400e9)
    assert big_fetch < big_cpu       # 500 tokens: fetch and run on the GPU
    small_cpu = max(B / 60e9, flops_per_token * 2 / 400e9)
    dense = max(D / 900e9, 2 * 8 * D / WEIGHT_BITS * 502 / 50000e9)
    ttft, _ = m.estimate(prefill_turns=1, decode_tokens=0)
    assert ttft == pytest.approx(big_fetch + small_cpu + dense)


def test_calibrate_prints_a_snippet_the_config_accepts(capsys):
    assert main(["calibrate", "--size", "4MiB", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    snippet = out[out.index("[cost]"):]
    data = tomllib.loads(snippet)
    cost = parse_config(data, source="calibrate").cost
    assert cost.cpu_mem_gbps > 0 and cost.cpu_gflops > 0
    assert "host memcpy" in out


def test_calibrate_bad_size(capsys):
    assert main(["calibrate", "--size", "1KiB"]) == 2
    assert "--size: 1KiB is outside 1MiB..8GiB" in capsys.readouterr().err


def test_calibrate_measures_cold_reads_of_a_file(capsys, tmp_path):
    data = tmp_path / "blob.bin"
    data.write_bytes(np.random.default_rng(0).bytes(24 << 20))
    before = data.read_bytes()
    assert main(["calibrate", "--size", "4MiB", "--repeats", "1", "--storage", str(data)]) == 0
    out = capsys.readouterr().out
    cost = parse_config(tomllib.loads(out[out.index("[cost]"):]), source="calibrate").cost
    assert cost.storage_gbps > 0 and "storage cold reads" in out
    assert data.read_bytes() == before                # opened read-only, untouched


def test_calibrate_storage_refuses_a_missing_or_tiny_file(capsys, tmp_path):
    assert main(["calibrate", "--storage", str(tmp_path / "none")]) == 2
    assert "no such file" in capsys.readouterr().err
    small = tmp_path / "small"
    small.write_bytes(b"x" * 1000)
    assert main(["calibrate", "--storage", str(small)]) == 2
    assert "too small to measure" in capsys.readouterr().err
