"""`moe-offload replay` end to end: JSON keys, the matrix report, the plot, bad input."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from runtime.cli import main
from runtime.traces.files import write_trace
from runtime.traces.synthetic import SynthTraceSpec, synthesize

REAL_TRACES = sorted((Path(__file__).parents[1] / "traces" / "data").glob("*.route.csv"))

PHASE_KEYS = {"accesses", "hits", "misses", "demand_miss_bytes", "prefetch_issued_bytes",
              "prefetch_used_bytes", "prefetch_wasted_bytes"}
CELL_KEYS = {"trace", "policy", "capacity_bytes", "prefill", "decode", "cold_miss_bytes",
             "belady_demand_miss_bytes", "est_ttft_s", "est_tpot_s"}


@pytest.fixture(scope="module")
def synth_trace(tmp_path_factory):
    path = tmp_path_factory.mktemp("replay") / "synth.rtb"
    write_trace(synthesize(SynthTraceSpec(n_layer=6, n_expert=32, top_k=4, prompt_tokens=40,
                                          decode_tokens=60, chunk=16, seed=1,
                                          expert_bytes=(1 << 20,))), path)
    return path


def _run(capsys, *argv):
    code = main(list(map(str, argv)))
    out, err = capsys.readouterr()
    return code, out, err


def test_json_cells_have_the_documented_keys(capsys, synth_trace):
    code, out, err = _run(capsys, "replay", synth_trace, REAL_TRACES[0], "--capacity", "20%",
                          "--capacity", "64MiB", "--policy", "lru", "--policy", "belady",
                          "--json")
    assert code == 0, err
    cells = json.loads(out)
    assert len(cells) == 2 * 2 * 2
    for c in cells:
        assert CELL_KEYS <= set(c)
        assert PHASE_KEYS <= set(c["prefill"]) and PHASE_KEYS <= set(c["decode"])
        assert c["belady_demand_miss_bytes"] >= c["cold_miss_bytes"]
        assert c["prefill"]["demand_miss_bytes"] + c["decode"]["demand_miss_bytes"] >= \
            c["belady_demand_miss_bytes"]
        assert c["est_ttft_s"] > 0 and c["est_tpot_s"] > 0
    synth = [c for c in cells if c["trace"] == str(synth_trace)]
    total = 6 * 32 * (1 << 20)
    assert {c["capacity_bytes"] for c in synth} == {int(0.2 * total), 64 << 20}
    # the synthetic trace has 40 prompt and 60 decode tokens of 6 layers x top-4
    assert all(c["prefill"]["accesses"] == 40 * 24 and c["decode"]["accesses"] == 60 * 24
               for c in synth)
    # the ceiling does not depend on the policy row
    by_cap = {}
    for c in synth:
        by_cap.setdefault(c["capacity_bytes"], set()).add(c["belady_demand_miss_bytes"])
    assert all(len(v) == 1 for v in by_cap.values())


def test_markdown_matrix_and_plot(capsys, synth_trace, tmp_path):
    png = tmp_path / "m.png"
    code, out, err = _run(capsys, "replay", synth_trace, "--capacity", "10%", "--capacity",
                          "30%", "--policy", "lru", "--policy", "lfu", "--plot", png)
    assert code == 0, err
    assert f"### {synth_trace}" in out
    header = next(line for line in out.splitlines() if line.startswith("| policy | 10%"))
    assert "30%" in header
    rows = [line.split(" | ")[0].lstrip("| ") for line in out.splitlines()
            if line.startswith("| ") and "x) |" in line]
    assert rows == ["lru", "lfu", "belady (ceiling)"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert f"plot written to {png}" in err
    assert "<details>" in out                        # not a terminal: markdown for a file


def test_default_policies_and_plain_text_on_a_terminal(synth_trace):
    """Without --policy the default rows; on a terminal no HTML (a real pseudo-terminal)."""
    import os
    import pty

    from runtime.commands.replay import DEFAULT_POLICIES

    leader, follower = pty.openpty()
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[3]))
    proc = subprocess.Popen([sys.executable, "-m", "runtime.cli", "replay", str(synth_trace),
                             "--capacity", "20%"], stdout=follower, stderr=subprocess.PIPE,
                            env=env)
    os.close(follower)
    chunks = []
    while True:
        try:
            data = os.read(leader, 65536)
        except OSError:                     # the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    os.close(leader)
    assert proc.wait(timeout=120) == 0, proc.stderr.read()
    proc.stderr.close()
    out = b"".join(chunks).decode()
    rows = [line.split(" | ")[0].lstrip("| ") for line in out.splitlines()
            if line.startswith("| ") and "x) |" in line]
    assert rows == [*DEFAULT_POLICIES, "belady (ceiling)"]
    assert "<details>" not in out and "</details>" not in out and "All counters:" in out


def test_phase_specific_config(capsys, synth_trace, tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text('[policy]\nphase_specific = true\n'
                   '[policy.prefill]\nprefetch = "chunk-plan"\neviction = "lru"\n'
                   '[policy.decode]\nadmission = "reuse-threshold"\nprefetch = "popularity"\n'
                   'eviction = "phase-weighted"\n[cost]\nlink_gbps = 12.0\n')
    code, out, err = _run(capsys, "replay", synth_trace, "--capacity", "25%", "--config", cfg,
                          "--json")
    assert code == 0, err
    (cell,) = json.loads(out)
    assert cell["policy"] == str(cfg)
    assert cell["decode"]["prefetch_issued_bytes"] > 0   # popularity prefetch ran
    assert cell["decode"]["prefetch_used_bytes"] <= cell["decode"]["prefetch_issued_bytes"]


def _bad_trace(tmp_path):
    lines = REAL_TRACES[1].read_text().split("\n")
    header_at = next(i for i, line in enumerate(lines) if line.startswith("turn,"))
    lines[header_at + 3] = "0,0,0,0,0,128,0.5,0,0"        # expert 128 of 128
    path = tmp_path / "bad.csv"
    path.write_text("\n".join(lines))
    return path, header_at + 4


@pytest.mark.parametrize("case", ["bad-row", "empty", "capacity", "policy", "missing",
                                  "config"])
def test_bad_input_is_one_line_and_exit_2(capsys, tmp_path, case):
    argv = ["replay", REAL_TRACES[0], "--capacity", "20%", "--policy", "lru"]
    if case == "bad-row":
        path, line = _bad_trace(tmp_path)
        argv[1] = path
        expect = f"{path}: line {line}: expert=128 out of range (model has 128 experts)"
    elif case == "empty":
        argv[1] = tmp_path / "empty.csv"
        argv[1].write_text("")
        expect = f"{argv[1]}: empty file"
    elif case == "capacity":
        argv[3] = "20 parsecs"
        expect = "--capacity: unknown unit"
    elif case == "policy":
        argv[5] = "fifo"
        expect = "unknown policy 'fifo'"
    elif case == "missing":
        argv[1] = tmp_path / "nope.csv"
        expect = f"{argv[1]}: no such file"
    else:
        cfg = tmp_path / "c.toml"
        cfg.write_text('[policy.decode]\neviction = "mru"\n')
        argv[4:6] = ["--config", cfg]
        expect = f"{cfg}: policy.decode.eviction: unknown eviction policy 'mru'"
    code, out, err = _run(capsys, *argv)
    assert code == 2
    assert out == ""
    assert err.count("\n") == 1 and expect in err and "Traceback" not in err


def test_console_command_reports_file_and_line(tmp_path):
    path, line = _bad_trace(tmp_path)
    proc = subprocess.run([sys.executable, "-m", "runtime.cli", "replay", str(path),
                           "--capacity", "10%", "--policy", "lru"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip() == (f"moe-offload: error: {path}: line {line}: expert=128 out "
                                   f"of range (model has 128 experts)")


def test_offline_prefetch_gets_the_next_layer_step(capsys, synth_trace, tmp_path):
    cfg = tmp_path / "oracle.toml"
    # an unlimited link: every prefetch arrives in time (replay times them: test_timing.py)
    cfg.write_text('[policy]\nphase_specific = false\n[policy.decode]\neviction = "belady"\n'
                   'admission = "belady-bypass"\nprefetch = "belady"\n'
                   '[cost]\nlink_gbps = 1000000\n')
    code, out, err = _run(capsys, "replay", synth_trace, "--capacity", "25%", "--config", cfg,
                          "--policy", "lru", "--json")
    assert code == 0, err
    oracle, lru = json.loads(out)
    # demand misses drop below the demand-only ceiling; the traffic shows up as prefetch
    assert oracle["decode"]["demand_miss_bytes"] < oracle["belady_demand_miss_bytes"]
    assert oracle["decode"]["prefetch_used_bytes"] > 0
    assert oracle["decode"]["demand_miss_bytes"] < lru["decode"]["demand_miss_bytes"]


def test_cost_file_changes_the_estimates_not_the_misses(capsys, synth_trace, tmp_path):
    slow = tmp_path / "slow.toml"
    slow.write_text("[cost]\nlink_gbps = 2.5\ncpu_mem_gbps = 6.0\n")
    argv = ["replay", synth_trace, "--capacity", "20%", "--policy", "lru", "--json"]
    _, out, _ = _run(capsys, *argv)
    code, out_slow, err = _run(capsys, *argv, "--cost", slow)
    assert code == 0, err
    (fast_cell,), (slow_cell,) = json.loads(out), json.loads(out_slow)
    assert fast_cell["decode"] == slow_cell["decode"]
    assert slow_cell["est_tpot_s"] > 5 * fast_cell["est_tpot_s"]
