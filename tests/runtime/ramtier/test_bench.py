"""The offload benchmark: configs, table, JSON, errors, and the cgroup memory limit."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from gguf_tools.synth import SynthSpec
from runtime.cli import main
from runtime.bench import offload as bench
from runtime.ramtier.cgroup import MemoryLimit
from runtime.residency.config import parse_config

SPEC = SynthSpec(arch="qwen3moe", layers=2, experts=8, top_k=2, embd=64, ff=64, dtype="f32",
                 seed=5, skew=1.0)


def test_default_configs_parse_and_share_one_budget():
    configs = bench.default_configs(100 << 20, 30 << 20, ("lru", "lfu-decay"))
    assert [c.name for c in configs] == ["mmap", "read-ahead", "lru", "lfu-decay",
                                         "best-replay"]
    for c in configs[1:]:
        cfg = parse_config(c.config, source=c.name)
        assert cfg.budget("cpu").bytes >= (30 << 20)
    assert parse_config(configs[3].config, source="x").decode.eviction.name == "lfu-decay"
    best = parse_config(configs[4].config, source="best")
    assert best.decode.eviction.name == "next-visit" and best.decode.prefetch.name == "affinity"
    assert {c.budget_label for c in configs[2:]} == {"30 MiB"}


def test_default_rows_include_next_visit_and_the_best_config():
    names = [c.name for c in bench.default_configs(100 << 20, 30 << 20)]
    assert "next-visit" in names and names[-1] == "best-replay"
    help_text = subprocess.run([sys.executable, "-m", "runtime.cli", "bench", "--help"],
                               capture_output=True, text=True, timeout=60).stdout
    assert "next-visit" in " ".join(help_text.split())


def test_pressure_note_names_mem_limit_only_without_pressure():
    note = bench.pressure_note(100 << 20, 8 << 30, None)
    assert "fits in free memory" in note and "--mem-limit" in note
    assert "no managed tier can gain without memory pressure" in note
    assert bench.pressure_note(100 << 20, 8 << 30, 64 << 20) == ""      # a limit is set
    assert bench.pressure_note(16 << 30, 8 << 30, None) == ""           # it does not fit


def _row(config, test, seconds, tps=10.0):
    return bench.BenchRow(config, "CPU", "1 MiB", test, tps, 0.5, None, None, 0.0, seconds)


def test_table_and_cold_ratio():
    rows = [_row("mmap", "tg8", 1.0), _row("mmap", "cold8", 3.0), _row("lru", "cold8", 1.5)]
    table = bench.format_table(rows).splitlines()
    assert table[0].startswith("| config") and "demand-miss MiB/tok" in table[0]
    assert table[1].startswith("| ---") and table[1].endswith(": |")
    assert len(table) == 2 + len(rows) and "10.00 ± 0.50" in table[2]
    assert bench.cold_ratios(rows, 8) == {"lru": 2.0}


def test_a_tiny_model_at_one_repetition_reads_plainly():
    one = [bench.BenchRow("lru", "CPU", bench.mib(471_859), "tg8", 10.0, 0.0, None, None, 0.0,
                          1.0, (10.0,))]
    table = bench.format_table(one).splitlines()
    assert "t/s ± sd" not in table[0] and "| t/s |" in table[0].replace("  ", "")
    assert "±" not in table[2] and "10.00" in table[2]               # one sample: no spread
    assert "460.80 KiB" in table[2] and bench.mib(30 << 20) == "30 MiB"   # not "0 MiB"
    notes = bench.merged_notes([(f"{c} {t}", "the file was cached") for c in ("lru", "lfu")
                                for t in ("pp16", "tg8")] + [("", "lfu failed")])
    assert notes == ["lru pp16, lru tg8, lfu pp16, lfu tg8: the file was cached", "lfu failed"]


def test_bench_cli_runs_every_config_and_prints_json(synth_model_factory, capsys):
    model = str(synth_model_factory(SPEC))
    rc = main(["bench", "-m", model, "-p", "16", "-n", "4", "-r", "1", "--cold", "4",
               "-t", "1", "--policies", "lru", "--budget", "96KiB", "--json", "--no-progress"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    got = {(r["config"], r["test"]) for r in out["rows"]}
    assert got == {(c, t) for c in ("mmap", "read-ahead", "lru", "best-replay")
                   for t in ("pp16", "tg4", "cold4")}
    for r in out["rows"]:
        assert r["tps"] > 0 and r["seconds"] > 0
        assert (r["hit_pct"] is None) == (r["config"] == "mmap")
    assert set(out["cold_start_ratio_vs_mmap"]) == {"read-ahead", "lru", "best-replay"}
    assert "--mem-limit" in out["meta"]["memory_pressure_note"]      # it fits in memory
    truth = out["details"]["lru"]["tier"]["truth"]
    assert truth["manager_resident_bytes"] <= truth["budget_bytes"]


def test_bench_table_says_when_no_tier_can_gain(synth_model_factory, capsys):
    model = str(synth_model_factory(SPEC))
    rc = main(["bench", "-m", model, "-p", "8", "-n", "2", "-r", "1", "--cold", "2", "-t", "1",
               "--policies", "lru", "--budget", "96KiB", "--no-progress"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "| best-replay" in out                   # the best config is a default row
    assert "no managed tier can gain without memory pressure" in out and "--mem-limit" in out
    cold = next(line for line in out.splitlines() if line.startswith("cold start"))
    assert "slower than" not in cold and "faster than" not in cold
    assert cold.count("x (") == 3                  # read-ahead, lru, best-replay


@pytest.mark.parametrize("argv, message", [
    (["--budget", "lots"], "--budget: not a size"),
    (["--polic", "lru"], "unrecognized arguments: --polic"),
    (["--policies", "belady"], "--policies: 'belady' is not a live eviction policy"),
    (["-r", "0"], "-r: must be >= 1"),
    (["--config", "/nonexistent.toml"], "/nonexistent.toml: no such file"),
])
def test_bad_arguments_give_one_line(synth_model_factory, argv, message):
    model = str(synth_model_factory(SPEC))
    out = subprocess.run([sys.executable, "-m", "runtime.cli", "bench", "-m", model, *argv],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("moe-offload: error: ") and message in lines[0]


@pytest.mark.skipif(not MemoryLimit.supported(), reason="no cgroup v1 memory controller")
def test_memory_limit_group_is_joined_and_removed():
    with MemoryLimit(256 << 20, name="moe-bench-test") as group:
        proc = subprocess.run([sys.executable, "-c", "print(open('/proc/self/cgroup').read())"],
                              capture_output=True, text=True, preexec_fn=group.join, timeout=60)
        assert "moe-bench-test" in proc.stdout
        assert int((group.path / "memory.limit_in_bytes").read_text()) == 256 << 20
    assert not group.path.exists()


def test_bench_with_config_files_runs_mmap_and_each_file(synth_model_factory, tmp_path, capsys):
    model = str(synth_model_factory(SPEC))
    cfg = tmp_path / "small-lfu.toml"
    cfg.write_text('[devices]\ncpu = "128KiB"\n[policy.decode]\neviction = "lfu"\n')
    rc = main(["bench", "-m", model, "--config", str(cfg), "-p", "8", "-n", "2", "-r", "1",
               "--cold", "0", "-t", "1", "--json", "--no-progress"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert [(r["config"], r["budget"], r["test"]) for r in out["rows"]] == [
        ("mmap", "kernel (all)", "pp8"), ("mmap", "kernel (all)", "tg2"),
        ("small-lfu", "128KiB", "pp8"), ("small-lfu", "128KiB", "tg2")]
    assert out["cold_start_ratio_vs_mmap"] == {}


def test_cold_line_never_calls_a_slowdown_faster():
    rows = [_row("mmap", "cold8", 2.0), _row("lru", "cold8", 1.0), _row("lfu", "cold8", 4.0),
            _row("fifo", "cold8", 2.0)]
    result = bench.BenchResult(rows, bench.cold_ratios(rows, 8), [], {})
    line = bench.cold_line(result, 8)
    assert "lru 1.00 s, 2.00x (faster)" in line
    assert "lfu 4.00 s, 0.50x (slower)" in line          # never "2.00x slower than"
    assert "fifo 2.00 s, 1.00x (as fast)" in line
    assert "slower than" not in line and "faster than" not in line
