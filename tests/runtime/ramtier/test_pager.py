"""The pager over a mapping this test makes itself (llama.cpp's at run time): exact page-in,
eviction from the page cache, mincore truth, and mlock limits."""
from __future__ import annotations

import ctypes
import mmap
import os
import subprocess
import sys

import numpy as np
import pytest

from runtime.ramtier import vm
from runtime.ramtier.mapping import FileMapping
from runtime.ramtier.pager import CHUNK_BYTES, Pager

PS = vm.PAGE_SIZE


@pytest.fixture()
def mapped_file(tmp_path):
    path = tmp_path / "blob.bin"
    data = np.random.default_rng(0).integers(0, 256, size=16 << 20, dtype=np.uint8)
    path.write_bytes(data.tobytes())
    with open(path, "rb") as fh:
        mm = mmap.mmap(fh.fileno(), 0, prot=mmap.PROT_READ)
        yield path, data, mm
        mm.close()


def _drop_everything(mapping: FileMapping, pager: Pager) -> None:
    pager.drop([(0, -(-mapping.file_bytes // PS) * PS)])


def test_find_locates_our_mapping_by_inode(mapped_file):
    path, data, mm = mapped_file
    mapping = FileMapping.find(path)
    assert mapping.n_copies == 1
    (addr, n), = mapping.address_spans(123_457, 10_000)
    assert n == 10_000
    seen = np.frombuffer((ctypes.c_ubyte * n).from_address(addr), dtype=np.uint8)
    np.testing.assert_array_equal(seen, data[123_457:133_457])
    assert mapping.covers(0, len(data)) and not mapping.covers(len(data) - 10, 20)


def test_unmapped_file_has_no_mapping(tmp_path):
    path = tmp_path / "plain.bin"
    path.write_bytes(b"x" * 8192)
    assert not FileMapping.find(path)


def test_page_in_brings_exactly_the_ranges_and_drop_removes_them(mapped_file):
    path, data, mm = mapped_file
    mapping = FileMapping.find(path)
    pager = Pager(mapping, threads=4)
    try:
        _drop_everything(mapping, pager)
        assert mapping.resident_pages().sum() == 0
        spans = [(5 * PS + 100, 3 * CHUNK_BYTES + 17), (12 << 20, 2 * PS)]
        stats = pager.page_in(spans)
        assert stats.error is None and stats.bytes == sum(n for _, n in spans)
        want = np.zeros(len(data) // PS, dtype=bool)
        for o, n in spans:
            want[o // PS:(o + n - 1) // PS + 1] = True
        np.testing.assert_array_equal(mapping.resident_pages(), want)   # no readahead beyond
        pager.drop([(12 << 20, 2 * PS)])
        want[(12 << 20) // PS:(12 << 20) // PS + 2] = False
        np.testing.assert_array_equal(mapping.resident_pages(), want)
        # eviction removes pages even when this process has them mapped and touched
        assert mm[5 * PS + 100] == data[5 * PS + 100]
        pager.drop([(5 * PS, 4 * PS)])
        want[5:9] = False
        np.testing.assert_array_equal(mapping.resident_pages(), want)
    finally:
        pager.close()


def test_page_in_without_a_mapping_still_reads(mapped_file, tmp_path):
    # a copy of the file nobody maps: WILLNEED has nothing to advise, the preads do the work
    path, data, mm = mapped_file
    other = tmp_path / "copy.bin"
    other.write_bytes(data.tobytes())
    mapping = FileMapping.find(other)
    assert not mapping
    pager = Pager(mapping, threads=4)
    try:
        stats = pager.page_in([(0, 3 * CHUNK_BYTES)])
        assert stats.error is None and stats.bytes == 3 * CHUNK_BYTES
    finally:
        pager.close()


def test_mlock_pins_and_drop_unlocks(mapped_file):
    path, data, mm = mapped_file
    mapping = FileMapping.find(path)
    pager = Pager(mapping, threads=4)
    try:
        if not vm.memlock_limits().allows(64 * PS):
            pytest.skip("this process may not mlock 256 KiB")
        _drop_everything(mapping, pager)
        pager.lock(64 * PS, 64 * PS)
        assert pager.locked_bytes == 64 * PS
        assert mapping.resident_pages()[64:128].all()
        pager.drop([(64 * PS, 64 * PS)])
        assert pager.locked_bytes == 0
        assert not mapping.resident_pages()[64:128].any()
    finally:
        pager.close()


def test_memlock_limit_is_reported_in_words():
    limits = vm.MemlockLimits(soft_bytes=64 << 10, cap_ipc_lock=False)
    assert limits.allows(64 << 10) and not limits.allows(1 << 20)
    assert "RLIMIT_MEMLOCK 64 KiB" in limits.describe()
    assert vm.MemlockLimits(None, False).allows(1 << 40)


@pytest.mark.skipif(not os.path.exists("/usr/bin/setpriv") or os.geteuid() != 0,
                    reason="needs root and setpriv to drop CAP_IPC_LOCK")
def test_mlock_over_the_real_limit_raises_oserror(mapped_file):
    # a child without CAP_IPC_LOCK and with a 64 KiB RLIMIT_MEMLOCK: mlock of 1 MiB must fail
    # with an OSError (the tier turns it into a message), and the limit is read back right
    path, _, _ = mapped_file
    code = (
        "import mmap, resource, sys\n"
        "resource.setrlimit(resource.RLIMIT_MEMLOCK, (65536, 65536))\n"
        "from runtime.ramtier import vm\n"
        "from runtime.ramtier.mapping import FileMapping\n"
        "from runtime.ramtier.pager import Pager\n"
        f"fh = open({str(path)!r}, 'rb'); mm = mmap.mmap(fh.fileno(), 0, prot=mmap.PROT_READ)\n"
        f"limits = vm.memlock_limits(); print(limits.describe())\n"
        "assert not limits.cap_ipc_lock and not limits.allows(1 << 20)\n"
        f"pager = Pager(FileMapping.find({str(path)!r}))\n"
        "try:\n    pager.lock(0, 1 << 20)\nexcept OSError as err:\n    print('refused', err.errno)\n"
        "else:\n    sys.exit('mlock unexpectedly succeeded')\n"
        "pager.close()\n"
    )
    out = subprocess.run(
        ["setpriv", "--inh-caps=-ipc_lock", "--bounding-set=-ipc_lock", sys.executable, "-c", code],
        capture_output=True, text=True, timeout=60, cwd=os.getcwd())
    assert out.returncode == 0, out.stderr
    assert "RLIMIT_MEMLOCK 64 KiB" in out.stdout and "refused" in out.stdout
