"""Atomic writes (runtime.atomic_write), for every writer of the product.

Each writer runs in a forked child that is SIGKILLed at 10 random moments after its temp file
appeared: the target keeps its previous bytes (or, if the rename already happened, holds the
complete new file), and the next writer of the target removes every temp file the kills left.
Through the CLI, under a file-size limit (RLIMIT_FSIZE, SIGXFSZ ignored: writes fail with
EFBIG as on a full disk), the command exits non-zero with one line and the old file is intact.
"""
from __future__ import annotations

import dataclasses
import os
import random
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import numpy as np
import pytest

from gguf_tools.synth import SynthSpec, write_synthetic_model
from runtime.atomic_write import (AtomicTarget, atomic_write, remove_stale_temps, temp_of,
                                  write_text)
from runtime.errors import UserError
from runtime.residency.profile import RoutingProfile, read_profile, write_profile
from runtime.traces.files import read_trace
from runtime.traces.route_bin import write_route_bin
from runtime.traces.route_csv import write_route_csv
from runtime.traces.synthetic import SynthTraceSpec, synthesize
from runtime.traces.writer import TraceWriter

REPO = Path(__file__).resolve().parents[2]
KILLS = 10


def temps(target: Path, pid: int | None = None) -> list[str]:
    """The temp files of ``target`` in its directory (of process ``pid`` only, if given)."""
    found = [(n, t) for n in os.listdir(target.parent) if (t := temp_of(target.name, n))]
    return sorted(n for n, (writer, ours) in found if pid is None or ours and writer == pid)


def _fork(write: Callable[[], None]) -> int:
    pid = os.fork()
    if pid == 0:                                   # the child: write, then leave at once
        code = 1
        try:
            write()
            code = 0
        finally:
            os._exit(code)
    return pid


def _write_seconds(write: Callable[[], None], target: Path, whole_run: bool) -> float:
    """How long a forked write's temp files exist (the window to kill in); ``whole_run``:
    until the child exits (a child that writes several times)."""
    pid = _fork(write)
    while not temps(target, pid):
        if os.waitpid(pid, os.WNOHANG)[0]:
            pytest.fail("the writer finished before its temp file was seen")
        time.sleep(0.0001)
    t0 = time.monotonic()
    while temps(target, pid) and not whole_run:
        time.sleep(0.0001)
    seconds = time.monotonic() - t0
    _, status = os.waitpid(pid, 0)
    seconds = time.monotonic() - t0 if whole_run else seconds
    assert os.waitstatus_to_exitcode(status) == 0
    return seconds


def kill_mid_write(target: Path, write_old: Callable[[], None], write_new: Callable[[], None],
                   is_new: Callable[[Path], bool], *, whole_run: bool = False,
                   seed: int = 0) -> None:
    """``write_old`` then 10 SIGKILLed runs of ``write_new``: the old bytes stay (or the whole
    new file is there), and the next ``write_new`` removes the temp files the kills left."""
    rng = random.Random(seed)
    write_old()
    old = target.read_bytes()
    # the window: one uninterrupted write's length; the file is then rewritten as old
    window = _write_seconds(write_new, target, whole_run)
    write_old()
    old = target.read_bytes()
    interrupted = 0
    # the moments: the first as soon as the temp file is seen, the others random in the window
    delays = [0.0] + [rng.uniform(0, window) for _ in range(KILLS - 1)]
    for delay in delays:
        pid = _fork(write_new)
        deadline = time.monotonic() + 30
        while not temps(target, pid) and time.monotonic() < deadline:
            time.sleep(0.0001)
        time.sleep(delay)
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        interrupted += bool(temps(target, pid))    # (before write_old removes them)
        if target.read_bytes() != old:             # only once the rename happened
            assert is_new(target), "a killed write left a partial file"
            write_old()
            old = target.read_bytes()
    assert interrupted >= 1, "no kill landed mid-write (the writer is too fast for the test)"
    write_new()                                    # the next writer cleans up
    assert is_new(target)
    assert temps(target) == []


# -- the helper ------------------------------------------------------------------------------

def test_atomic_write_publishes_or_discards(tmp_path):
    target = tmp_path / "out.txt"
    write_text(target, "old\n")
    with pytest.raises(RuntimeError):
        with atomic_write(target, "w") as f:
            f.write("new, half")
            raise RuntimeError("writer failed")
    assert target.read_text() == "old\n" and temps(target) == []
    write_text(target, "new\n")
    assert target.read_text() == "new\n" and temps(target) == []


def test_stale_temps_of_dead_processes_are_removed(tmp_path):
    target = tmp_path / "p.npz"
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    pid = int(dead.stdout)                          # a process that has exited
    stale = [f".p.npz.tmp-{pid}-0a1b2c3d", f".p.npz.tmp-{pid}-0a1b2c3d.turn",
             f"p.npz.tmp{pid}", f"p.npz.tmp{pid}.expert", f".p.npz.{pid}.partial",
             f"..p.npz.tmp-{pid}-0a1b2c3d.routing.rtb.tmp-{pid}-00ff00ff"]
    live = [f".p.npz.tmp-{os.getppid()}-0a1b2c3d"]  # our parent runs: not stale
    other = ["p.npz.bak", ".q.npz.tmp-1-00", "p.npz"]
    for name in stale + live + other:
        (tmp_path / name).write_bytes(b"x")
    removed = remove_stale_temps(target)
    assert sorted(p.name for p in removed) == sorted(stale)
    assert sorted(os.listdir(tmp_path)) == sorted(live + other)


def test_atomic_target_extras_go_with_it(tmp_path):
    target = AtomicTarget(tmp_path / "t.rtb")
    target.extra("turn").write_bytes(b"1")
    target.tmp.write_bytes(b"2")
    target.discard()
    assert os.listdir(tmp_path) == []


# -- each writer, killed ----------------------------------------------------------------------

def _profile(seed: int, n_expert: int = 96, n_layer: int = 12) -> RoutingProfile:
    rng = np.random.default_rng(seed)
    n_pair = n_layer - 1
    count = rng.integers(50, 100, (n_pair, n_expert), dtype=np.int32)
    return RoutingProfile(
        model="m.gguf", arch="qwen3moe", n_layer=n_layer, n_expert=n_expert, n_expert_used=4,
        expert_bytes=(1000,) * n_layer, decode_tokens=100, traces=("t.rtb",),
        frequency=rng.random((n_layer, n_expert)),
        pair=rng.integers(0, 50, (n_pair, n_expert, n_expert), dtype=np.int32), count=count,
        history=np.full((0, n_layer, 4), -1, np.int16))


def test_profile_writer_killed(tmp_path):
    target = tmp_path / "p.npz"
    old, new = _profile(1), _profile(2)

    def is_new(p: Path) -> bool:
        return np.array_equal(read_profile(p).pair, new.pair)
    kill_mid_write(target, lambda: write_profile(target, old), lambda: write_profile(target, new),
                   is_new)


def _trace(seed: int, decode: int = 2000):
    return synthesize(SynthTraceSpec(n_layer=16, n_expert=64, top_k=8, prompt_tokens=64,
                                     decode_tokens=decode, seed=seed))


@pytest.mark.parametrize("suffix", [".rtb", ".csv"])
def test_trace_file_writers_killed(tmp_path, suffix):
    target = tmp_path / f"t{suffix}"
    old, new = _trace(1, 400 if suffix == ".csv" else 2000), \
        _trace(2, 400 if suffix == ".csv" else 2000)
    write = write_route_csv if suffix == ".csv" else write_route_bin
    ref = tmp_path / "ref" / target.name
    ref.parent.mkdir()
    write(new, ref)
    kill_mid_write(target, lambda: write(old, target), lambda: write(new, target),
                   lambda p: p.read_bytes() == ref.read_bytes())


def test_trace_writer_killed(tmp_path):
    """The live-capture writer (trace record, serve --write-profile): spill files and all."""
    target = tmp_path / "rec.rtb"
    new = _trace(2)

    def capture(trace) -> Callable[[], None]:
        def run() -> None:
            with TraceWriter(target, trace.header) as w:
                for rows in np.array_split(np.arange(len(trace)), 64):
                    part = trace.take(rows)
                    w.append_rows(**{c: getattr(part, c) for c in (
                        "turn", "phase", "step", "layer", "slot", "expert", "weight",
                        "residency", "recorded_bytes")})
        return run

    kill_mid_write(target, capture(_trace(1)), capture(new),
                   lambda p: np.array_equal(read_trace(p).expert, new.expert))


def test_synth_model_writer_killed(tmp_path):
    target = tmp_path / "m.gguf"
    spec = SynthSpec(arch="qwen3moe", layers=4, experts=16, top_k=2, embd=128, ff=128,
                     dtype="f32", seed=0)
    new_spec = dataclasses.replace(spec, seed=2)
    ref = write_synthetic_model(tmp_path / "ref.gguf", new_spec)
    kill_mid_write(target, lambda: write_synthetic_model(target, spec),
                   lambda: write_synthetic_model(target, new_spec),
                   lambda p: p.read_bytes() == ref.read_bytes())


def test_text_writer_killed(tmp_path):
    """``write_text``: what ``plan -o``, ``--stats-json`` and ``bench --save-json`` write with
    (their files are too small to kill inside one write, so the child writes in a loop)."""
    target = tmp_path / "stats.json"
    old, new = '{"old": 1}\n' * 200000, '{"new": 2}\n' * 200000

    def loop() -> None:
        for _ in range(20):
            write_text(target, new)
    kill_mid_write(target, lambda: write_text(target, old), loop,
                   lambda p: p.read_text() == new, whole_run=True)


# -- under a file-size limit, through the CLI -------------------------------------------------

def _limited(limit_bytes: int) -> Callable[[], None]:
    def setup() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)   # EFBIG instead of a signal
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit_bytes, limit_bytes))
    return setup


def _cli_limited(argv: list[str], limit_bytes: int) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONDONTWRITEBYTECODE="1")
    return subprocess.run([sys.executable, "-m", "runtime.cli", *argv], capture_output=True,
                          text=True, env=env, preexec_fn=_limited(limit_bytes), timeout=300)


def _assert_refused(proc: subprocess.CompletedProcess, target: Path, old: bytes) -> None:
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "cannot write" in lines[0] and "File too large" in lines[0], \
        proc.stderr
    assert target.read_bytes() == old
    assert temps(target) == []


@pytest.mark.parametrize("what", ["profile", "trace-synth", "trace-convert-csv", "plan",
                                  "synth-model", "stats-json", "trace-record"])
def test_file_size_limit_keeps_the_old_file(tmp_path, what, tiny_model):
    trace = tmp_path / "t.rtb"
    write_route_bin(_trace(3, 300), trace)
    target = {"profile": tmp_path / "p.npz", "trace-synth": tmp_path / "s.rtb",
              "trace-convert-csv": tmp_path / "c.csv", "plan": tmp_path / "plan.toml",
              "synth-model": tmp_path / "m.gguf", "stats-json": tmp_path / "s.json",
              "trace-record": tmp_path / "r.rtb"}[what]
    old = b"the previous file\n" * 10
    target.write_bytes(old)
    argv = {"profile": ["profile", str(trace), "-o", str(target)],
            "trace-synth": ["trace", "synth", "-o", str(target), "--decode", "2000"],
            "trace-convert-csv": ["trace", "convert", str(trace), str(target)],
            "plan": ["plan", "-m", str(tiny_model), "-o", str(target)],
            "synth-model": ["synth", str(target), "--quiet"],
            "stats-json": ["complete", "-m", str(tiny_model), "-p", "hi", "-n", "2", "-c", "256",
                           "-t", "1", "--stats-json", str(target)],
            "trace-record": ["trace", "record", "-m", str(tiny_model), "-p", "hi there", "-n",
                             "4", "-c", "256", "-t", "1", "-o", str(target)]}[what]
    # small files (plan -o's TOML, the stats JSON, a short recording): a limit below their size
    limit = {"plan": 200, "stats-json": 100, "trace-record": 1000}.get(what, 16 << 10)
    proc = _cli_limited(argv, limit)
    _assert_refused(proc, target, old)


def test_write_error_is_one_line(tmp_path):
    with pytest.raises(UserError, match=r"cannot write .*previous file"):
        write_text(tmp_path / "no-such-dir" / "x.json", "{}")


def test_slot_save_killed(tmp_path, tiny_model):
    """``POST /slots/N?action=save``: the slot file goes to a temp file, renamed into place."""
    from runtime.engine import slot_state
    from runtime.engine.engine import Engine, EngineSettings, SamplingParams
    engine = Engine(EngineSettings(model_path=str(tiny_model), n_ctx=512, n_threads=1, seed=0,
                                   manage_residency=False), progress=False)
    try:
        list(engine.generate("the quick brown fox " * 20, SamplingParams(max_tokens=4,
                                                                          temperature=0)))
        target = tmp_path / "slot.bin"
        slot_state.save(engine, 0, str(target))
        saved = target.read_bytes()

        def loop() -> None:
            for _ in range(20):
                slot_state.save(engine, 0, str(target))
        kill_mid_write(target, lambda: None, loop, lambda p: p.read_bytes() == saved,
                       whole_run=True)
    finally:
        engine.close()


def test_a_normal_exit_removes_an_unfinished_temp_file(tmp_path):
    """A writer that never published (an exception caught elsewhere, a bug) leaves nothing
    behind once the interpreter exits."""
    target = tmp_path / "x.bin"
    code = ("from runtime.atomic_write import AtomicTarget\n"
            f"t = AtomicTarget({str(target)!r}); t.tmp.write_bytes(b'half'); "
            "t.extra('col').write_bytes(b'x')\n")
    subprocess.run([sys.executable, "-c", code], check=True,
                   env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert os.listdir(tmp_path) == []
