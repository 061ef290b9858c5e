"""``--profile`` on a command that runs a model: record a trace, build its profile, run with it
(the same greedy text, its learned policies warm-started); another model's profile is refused in
one line before anything runs."""
from __future__ import annotations

from pathlib import Path

ARGS = ["-c", "512", "-t", "1", "--temp", "0"]
REAL = Path(__file__).parents[1] / "traces" / "data" / "qwen3-30b-a3b.route.csv"


def test_complete_runs_with_a_profile_of_its_model(tiny_model, prompt, cli, tmp_path):
    trace, prof = tmp_path / "t.rtb", tmp_path / "p.npz"
    rec = cli("trace", "record", "-m", str(tiny_model), "-p", prompt, "-n", "8", "-o",
              str(trace), *ARGS)
    assert rec.returncode == 0, rec.stderr
    built = cli("profile", str(trace), "-o", str(prof))
    assert built.returncode == 0, built.stderr
    again, prof2 = tmp_path / "t2.rtb", tmp_path / "p2.npz"
    rec2 = cli("trace", "record", "-m", str(tiny_model), "-p", prompt, "-n", "8", "-o",
               str(again), "--write-profile", str(prof2), *ARGS)
    assert rec2.returncode == 0, rec2.stderr
    import numpy as np
    from runtime.residency.profile import read_profile
    a, b = read_profile(prof), read_profile(prof2)       # greedy: the same routing
    assert a.decode_tokens == b.decode_tokens == 7 and np.array_equal(a.pair, b.pair)
    plain = cli("complete", "-m", str(tiny_model), "-p", prompt, "-n", "8", *ARGS)
    warm = cli("complete", "-m", str(tiny_model), "-p", prompt, "-n", "8", "--profile",
               str(prof), "--devices.cpu-slots", "20%", *ARGS)
    assert plain.returncode == 0 and warm.returncode == 0, warm.stderr
    assert warm.stdout == plain.stdout            # residency never changes the tokens


def test_another_models_profile_is_one_line(tiny_model, prompt, cli, tmp_path):
    prof = tmp_path / "qwen.npz"
    assert cli("profile", str(REAL), "-o", str(prof)).returncode == 0
    got = cli("complete", "-m", str(tiny_model), "-p", prompt, "-n", "4", "--profile",
              str(prof), *ARGS)
    assert got.returncode == 2
    lines = got.stderr.strip().splitlines()
    assert lines[-1].startswith(f"moe-offload: error: {prof}: the profile is of a model with "
                                "48 layers x 128 experts")
    assert not any("Traceback" in ln for ln in lines)
