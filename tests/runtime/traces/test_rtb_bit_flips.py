"""Every single-bit flip and every truncation of a small .rtb is refused in one line, or is
harmless (the same replay JSON) — never a traceback or a silently different result."""
from __future__ import annotations

import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from runtime.cli import main
from runtime.errors import UserError
from runtime.traces.files import read_trace, write_trace
from runtime.traces.synthetic import SynthTraceSpec, synthesize

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def small_rtb(tmp_path_factory) -> Path:
    """2 layers x 4 experts, top-2, 4 prompt + 4 decode tokens: about 1.4 KB, 11k bits."""
    path = tmp_path_factory.mktemp("flips") / "t.rtb"
    write_trace(synthesize(SynthTraceSpec(n_layer=2, n_expert=4, top_k=2, prompt_tokens=4,
                                          decode_tokens=4, chunk=2, seed=3)), path)
    return path


def _replay_json(path: Path, capsys) -> str:
    capsys.readouterr()
    assert main(["replay", str(path), "--capacity", "50%", "--policy", "lru", "--json"]) == 0
    return capsys.readouterr().out


def _outcome(path: Path) -> str | None:
    """None when the file is read, else the one-line refusal."""
    try:
        read_trace(path)
    except UserError as err:
        assert "\n" not in str(err) and str(err).startswith(str(path)), str(err)
        return str(err)
    return None


def test_every_bit_flip_is_refused_or_harmless(small_rtb, tmp_path, capsys):
    good = small_rtb.read_bytes()
    reference = _replay_json(small_rtb, capsys)
    path = tmp_path / "t.rtb"
    path.write_bytes(good)
    accepted = 0
    fd = os.open(path, os.O_RDWR)       # flipped in place: rewriting the file is 10x slower
    try:
        for byte in range(len(good)):
            for bit in range(8):
                os.pwrite(fd, bytes([good[byte] ^ (1 << bit)]), byte)
                if _outcome(path) is None:                  # read: must replay the same
                    accepted += 1
                    assert _replay_json(path, capsys).replace(str(path), str(small_rtb)) \
                        == reference, f"bit {bit} of byte {byte}"
            os.pwrite(fd, good[byte:byte + 1], byte)
    finally:
        os.close(fd)
    assert path.read_bytes() == good
    assert accepted == 0          # the CRC-32 catches every single-bit flip


def test_every_truncation_is_refused(small_rtb, tmp_path):
    good = small_rtb.read_bytes()
    path = tmp_path / "t.rtb"
    path.write_bytes(good)
    for n in reversed(range(len(good))):
        os.truncate(path, n)
        assert _outcome(path) is not None, f"truncated to {n} bytes"


@pytest.mark.parametrize("command", [["trace", "info"], ["replay", "--capacity", "50%",
                                                          "--policy", "lru"]])
def test_the_cli_refuses_a_flipped_file_in_one_line(small_rtb, tmp_path, command):
    data = bytearray(small_rtb.read_bytes())
    data[200] ^= 0x04
    bad = tmp_path / "bad.rtb"
    bad.write_bytes(bytes(data))
    argv = [*command[:2], str(bad), *command[2:]] if command[0] == "trace" else \
        [command[0], str(bad), *command[1:]]
    proc = subprocess.run([sys.executable, "-m", "runtime.cli", *argv], capture_output=True,
                          text=True, cwd=REPO, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "bad.rtb: corrupt (CRC-32" in proc.stderr, \
        proc.stderr


def test_version_1_flips_never_give_a_traceback(small_rtb, tmp_path):
    """A version 1 file has no checksum: a flip may read as other rows (``trace info`` says
    "no checksum"), but a refusal is still one line, never an exception of another kind."""
    good = bytearray(small_rtb.read_bytes()[:-20])
    good[8:12] = struct.pack("<I", 1)
    path = tmp_path / "v1.rtb"
    path.write_bytes(bytes(good))
    fd = os.open(path, os.O_RDWR)
    try:
        for byte in range(len(good)):
            for bit in range(8):
                os.pwrite(fd, bytes([good[byte] ^ (1 << bit)]), byte)
                _outcome(path)
            os.pwrite(fd, bytes(good[byte:byte + 1]), byte)
    finally:
        os.close(fd)
