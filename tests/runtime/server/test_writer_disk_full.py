"""``serve --write-profile`` on a disk that fills up (issue 32): before, the first failed write
made every later generation a 500 ("routing.rtb: writer already closed"), even after space
came back. Now the real writer, on a really full file system (a small tmpfs; where this
process may not mount one, a file-size limit on the server: EFBIG instead of ENOSPC), stops
with one log line, its scratch files removed; every generation is served; /health says which
part is degraded; no profile is written at exit, and the log says why."""
from __future__ import annotations

import os
import resource
import signal

import httpx

from tests.runtime.server.broken_files import small_filesystem

PROMPT = "the quick brown fox jumps over the lazy dog " * 30     # ~300 tokens: rows to write
STOPPED = "the routing profile stopped recording"


def _generate(server) -> None:
    r = httpx.post(f"{server.base_url}/completion", timeout=60, json={
        "prompt": PROMPT, "n_predict": 4, "cache_prompt": False})
    assert r.status_code == 200, r.text
    assert r.json()["tokens_predicted"] > 0


def _health(server) -> dict:
    r = httpx.get(f"{server.base_url}/health", timeout=10)
    assert r.status_code == 200, r.text            # degraded, but serving
    return r.json()


def test_a_full_disk_stops_the_profile_writer_not_the_server(start_server, tiny_model,
                                                             tmp_path):
    with small_filesystem(tmp_path / "fs", 256 << 10) as fs:
        where = fs or tmp_path
        target = where / "served.profile.npz"
        server = start_server(tiny_model, "-c", "2048", "--write-profile", str(target))
        _generate(server)
        assert _health(server) == {"status": "ok"}
        if fs is not None:                         # leave 8 KiB: a request's rows overflow
            free = os.statvfs(fs).f_bavail * os.statvfs(fs).f_frsize
            (fs / "filler").write_bytes(b"\0" * (free - (8 << 10)))
        else:                                      # the soft limit: raised again below
            hard = resource.prlimit(server.proc.pid, resource.RLIMIT_FSIZE)[1]
            resource.prlimit(server.proc.pid, resource.RLIMIT_FSIZE, (16 << 10, hard))
        for _ in range(8):                         # every request served while it fills
            _generate(server)
            if _health(server)["status"] == "degraded":
                break
        health = _health(server)
        assert health["status"] == "degraded", health
        assert str(target) in health["degraded"]["profile_writer"]
        why = "No space left on device" if fs is not None else "File too large"
        assert why in health["degraded"]["profile_writer"]
        assert [n for n in os.listdir(where) if ".routing.rtb" in n] == []   # scratch gone
        if fs is not None:                         # the space comes back
            (fs / "filler").unlink()
        else:
            resource.prlimit(server.proc.pid, resource.RLIMIT_FSIZE, (hard, hard))
        _generate(server)
        assert _health(server)["status"] == "degraded"     # stopped until the next start
        server.proc.send_signal(signal.SIGTERM)
        server.proc.wait(timeout=60)
        log = server.log()
        assert len([line for line in log.splitlines() if STOPPED in line]) == 1, log
        assert f"{target}: not written (recording stopped:" in log
        assert " 500 " not in log and not target.exists()
        assert "Traceback" not in log
