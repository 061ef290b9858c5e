"""ModelFileWatch (runtime/engine/model_file.py) on plain files: what it calls a change, that
it says each change once as new, that a file put back as loaded passes again, and that a
guarded (leased) batch holds another process's truncation off until it ends."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from runtime.engine import file_lease
from runtime.engine.model_file import ModelFileWatch, model_parts
from runtime.engine.types import ModelFileChanged


def _file(path, size=4096):
    path.write_bytes(bytes(range(256)) * (size // 256))
    return path


def _change(watch) -> ModelFileChanged:
    with pytest.raises(ModelFileChanged) as err:
        watch.check()
    return err.value


def test_an_unchanged_file_passes(tmp_path):
    watch = ModelFileWatch(str(_file(tmp_path / "m.gguf")))
    watch.check()
    assert watch.fault() is None


def test_truncation_is_seen_once_as_new_and_passes_once_restored(tmp_path):
    path = _file(tmp_path / "m.gguf")
    loaded = path.stat()
    watch = ModelFileWatch(str(path))
    data = path.read_bytes()
    os.truncate(path, 1000)
    first, again = _change(watch), _change(watch)
    assert first.first and not again.first
    assert "truncated to 1000 bytes from 4096" in str(first) and str(path) in str(first)
    fault = watch.fault()
    assert fault.component == "model_file" and not fault.serving and "truncated" in fault.message
    with open(path, "r+b") as f:                  # the same bytes in the same file (cp -p)
        f.write(data)
    os.utime(path, ns=(loaded.st_atime_ns, loaded.st_mtime_ns))
    watch.check()
    assert watch.fault() is None
    os.truncate(path, 10)                         # a new change is new again
    assert _change(watch).first


@pytest.mark.parametrize("how, words", [
    ("replace", "replaced"), ("remove", "removed"), ("grow", "rewritten: 4097 bytes"),
    ("touch", "rewritten in place")])
def test_each_kind_of_change(tmp_path, how, words):
    path = _file(tmp_path / "m.gguf")
    watch = ModelFileWatch(str(path))
    if how == "replace":
        os.replace(_file(tmp_path / "other.gguf"), path)
    elif how == "remove":
        path.unlink()
    elif how == "grow":
        with open(path, "ab") as f:
            f.write(b"x")
    else:
        st = path.stat()
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1))
    assert words in str(_change(watch))


def test_every_part_of_a_split_model_is_watched(tmp_path):
    parts = [_file(tmp_path / f"big-{i:05d}-of-00003.gguf") for i in (1, 2, 3)]
    assert model_parts(str(parts[0])) == [str(p) for p in parts]
    assert model_parts(str(tmp_path / "one.gguf")) == [str(tmp_path / "one.gguf")]
    watch = ModelFileWatch(str(parts[0]))
    os.truncate(parts[1], 5)
    err = _change(watch)
    assert err.path == str(parts[1]) and "truncated" in err.change


@pytest.fixture
def lease_breaks():
    """SIGIO handled as ``serve`` handles it, for one test."""
    assert file_lease.handle_breaks()
    yield
    file_lease.handle_breaks(False)


def test_a_guarded_batch_holds_a_truncation_off_until_it_ends(tmp_path, lease_breaks):
    """A check alone misses a cut that lands during a batch (llama.cpp then reads past the
    end: SIGBUS). Leased, the other process's truncate waits for the batch to end."""
    path = _file(tmp_path / "m.gguf")
    watch = ModelFileWatch(str(path), guard=True)
    try:
        with watch.batch():
            cut = subprocess.Popen([sys.executable, "-c",
                                    f"import os; os.truncate({str(path)!r}, 10)"])
            deadline = time.monotonic() + 60
            while not watch._breaking.is_set():      # noqa: SLF001 - the lease's break came
                assert time.monotonic() < deadline and cut.poll() is None, "no lease break"
                time.sleep(0.01)
            assert cut.poll() is None and path.stat().st_size == 4096   # it waits on us
        assert cut.wait(timeout=60) == 0 and path.stat().st_size == 10
        with pytest.raises(ModelFileChanged, match="truncated to 10 bytes"):
            with watch.batch():
                pass
    finally:
        watch.close()


def test_a_file_held_open_for_writing_fails_guarded_batches(tmp_path, lease_breaks):
    path = _file(tmp_path / "m.gguf")
    watch = ModelFileWatch(str(path), guard=True)
    try:
        with open(path, "r+b"):                      # this process: no lease break, but no lease
            with pytest.raises(ModelFileChanged, match="being written"):
                with watch.batch():
                    pass
            assert "being written" in watch.fault().message
        with watch.batch():                          # closed again, unchanged: served
            pass
        assert watch.fault() is None
    finally:
        watch.close()
