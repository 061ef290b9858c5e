"""Ctrl-C on the real CLI: SIGINT mid-generation and at start-up ends the command with
``moe-offload: interrupted`` (one line, no traceback) and exit status 130, and generation
really stops (the text so far is a strict prefix of the whole greedy answer)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from gguf_tools.synth import SynthSpec
from tests.runtime.engine.conftest import REPO_ROOT

# big enough that 1500 greedy tokens take seconds, so a Ctrl-C lands mid-generation (with
# --ignore-eos: this model samples its end of text after ~650 tokens, under a second here)
SPEC = SynthSpec(arch="qwen3moe", layers=8, experts=16, top_k=2, embd=256, ff=256,
                 dtype="f32", seed=5, skew=1.0)
N = 1500
STOP_WITHIN_S = 10.0        # from SIGINT to exit, generous for a loaded 2-core machine
INTERRUPTED = "moe-offload: interrupted\n"


@pytest.fixture(scope="module")
def model(synth_model_factory):
    return str(synth_model_factory(SPEC))


def _start(*args: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    # SIGINT at its default in the child, as in a shell, whatever this process did with it
    # (an ignored SIGINT is inherited, and Python then installs no handler)
    return subprocess.Popen([sys.executable, "-m", "runtime.cli", *args], cwd=REPO_ROOT,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def _interrupt(proc: subprocess.Popen) -> tuple[bytes, str, float]:
    """SIGINT now; (rest of stdout, stderr, seconds until exit)."""
    t0 = time.monotonic()
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    return out, err.decode(errors="replace"), time.monotonic() - t0


def _complete_args(model: str, *extra: str) -> list[str]:
    return ["complete", "-m", model, "-p", "Once upon a time", "-n", str(N), "-c", "2048",
            "--temp", "0", "-t", "1", "--ignore-eos", *extra]


# "ram tier": a cpu budget of a sixth of the 96 MiB of experts (4 MiB kept, one layer's 12 MiB
# for one-use reads), the tier stepped in C per layer
@pytest.mark.parametrize("residency", ["on", "off", "ram tier"])
def test_ctrl_c_mid_generation_stops_complete(model, residency):
    extra = {"on": (), "off": ("--no-residency",), "ram tier": ("--devices.cpu", "16MiB")}[residency]
    whole = subprocess.run([sys.executable, "-m", "runtime.cli", *_complete_args(model, *extra)],
                           cwd=REPO_ROOT, capture_output=True, timeout=300,
                           env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)))
    assert whole.returncode == 0, whole.stderr
    proc = _start(*_complete_args(model, *extra))
    first = proc.stdout.read1(64)             # generation has started
    assert first, proc.stderr.read()
    rest, err, took = _interrupt(proc)
    got = first + rest
    assert proc.returncode == 130, err
    assert err == INTERRUPTED
    assert took < STOP_WITHIN_S
    assert whole.stdout.startswith(got) and len(got) < len(whole.stdout)   # it stopped


def _wait_for_python_sigint_handler(proc: subprocess.Popen, timeout: float = 30.0) -> None:
    """Until the child catches SIGINT (Python installs its handler as it starts; before that
    a SIGINT kills the process outright, which no program can prevent)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            with open(f"/proc/{proc.pid}/status") as fh:
                caught = next(int(line.split()[1], 16) for line in fh
                              if line.startswith("SigCgt:"))
        except (OSError, StopIteration):
            caught = 0
        if caught & (1 << (signal.SIGINT - 1)):
            return
        time.sleep(0.001)


# after the interpreter's own start-up (site imports: ~20 ms, before any of our code runs)
@pytest.mark.parametrize("delay", [0.2, 0.4, 0.8])
def test_ctrl_c_at_start_up_is_one_line(model, delay):
    proc = _start(*_complete_args(model))
    _wait_for_python_sigint_handler(proc)
    time.sleep(delay)                          # imports, argument parsing, model load
    out, err, took = _interrupt(proc)
    assert proc.returncode == 130, err
    assert err == INTERRUPTED
    assert took < STOP_WITHIN_S


def test_ctrl_c_stops_trace_record(model, tmp_path):
    out_file = tmp_path / "run.rtb"
    turns = tmp_path / "turns.txt"          # 40 greedy chat turns: ~20 s uninterrupted
    turns.write_text("".join(f"tell me story number {i} about the river\n" for i in range(40)))
    proc = _start("trace", "record", "-m", model, "--chat", "-f", str(turns), "-n", "2000",
                  "-c", "8192", "--temp", "0", "-o", str(out_file))
    time.sleep(2.0)
    _, err, took = _interrupt(proc)
    assert proc.returncode == 130, err
    assert err == INTERRUPTED
    assert took < STOP_WITHIN_S


def test_ctrl_c_stops_bench_and_replay(model, tmp_path):
    # a replay long enough to be interrupted (the core replays millions of accesses a second):
    # 4.5M accesses x 8 cells, several seconds
    trace = tmp_path / "long.rtb"
    subprocess.run([sys.executable, "-m", "runtime.cli", "trace", "synth", "-o", str(trace),
                    "--prompt", "256", "--decode", "12000"], cwd=REPO_ROOT, check=True,
                   capture_output=True, timeout=120)
    caps = [a for c in ("10%", "20%", "30%", "40%") for a in ("--capacity", c)]
    for args, delay in [(["bench", "-m", model, "-p", "64", "-n", "256", "-r", "3",
                          "--cold", "0", "--no-progress"], 3.0),
                        (["replay", str(trace), *caps, "--policy", "lru", "--policy", "lfu",
                          "--policy", "belady"], 1.5)]:
        proc = _start(*args)
        time.sleep(delay)
        _, err, took = _interrupt(proc)
        assert proc.returncode == 130, (args, err)
        assert err == INTERRUPTED, args
        assert took < STOP_WITHIN_S


# A real SIGINT handled inside a callback whose exceptions Python ignores: a weakref callback
# (as the import system's module locks have: one run in 50 under load lost its Ctrl-C there,
# went on to finish and exited 0) and a ctypes callback (as llama.cpp's log sink is)
_LOST = """
import ctypes, os, signal, sys, time, weakref
from runtime import cli
if sys.argv[1] == "cli":
    cli.main([])                       # any command installs the hook (here: the usage, 2)

def in_callback(*_):
    os.kill(os.getpid(), signal.SIGINT)
    for _ in range(100000):            # the handler runs in here: its exception is ignored
        pass
    return 0

class Owner:
    pass

try:
    if sys.argv[2] == "weakref":
        owner = Owner()
        ref = weakref.ref(owner, in_callback)
        del owner
    else:
        compare = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)(in_callback)
        items = (ctypes.c_int * 2)(2, 1)
        ctypes.CDLL(None).qsort(items, 2, ctypes.sizeof(ctypes.c_int), compare)
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline:
        pass
    print("lost")
except KeyboardInterrupt:
    print("raised")
"""


@pytest.mark.parametrize("where", ["weakref", "ctypes"])
def test_a_ctrl_c_inside_a_callback_python_ignores_is_raised_after_it(where):
    def run(mode: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", _LOST, mode, where], cwd=REPO_ROOT,
                              capture_output=True, text=True, timeout=60,
                              env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)),
                              preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    bare = run("bare")                 # Python's own behaviour: printed, ignored, lost
    assert bare.stdout == "lost\n" and "KeyboardInterrupt" in bare.stderr, bare
    kept = run("cli")
    assert kept.stdout == "raised\n" and "KeyboardInterrupt" not in kept.stderr, kept
