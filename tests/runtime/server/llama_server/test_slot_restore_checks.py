"""A slot restore checks the whole file before llama.cpp reads it (issue 32): one corrupted
int32 in the KV metadata used to be accepted with 200, then every request on that slot (and
some on the other) got 500 "llama_decode failed" until restart, erase or not. Now each broken
file is a 400 in llama-server's shape naming the problem, the slot is left empty and usable,
erase empties it, and a good file restores as before."""
from __future__ import annotations

import struct
from pathlib import Path

import httpx
import pytest

from runtime.engine import slot_file
from tests.runtime.server.error_shapes import error_of

PROMPT = "the king saw a river near the old house and the sea " * 4
CELL = 12                      # one KV cell's metadata here: pos, n_seq_id, seq_id (int32)


def _cells_offset(data: bytes) -> int:
    """Offset of slot 0's first KV cell: after the header, the tokens, llama.cpp's state
    magic and sequence id, n_stream and stream 0's cell count."""
    n_tokens = slot_file.HEADER.unpack_from(data)[3]
    return slot_file.HEADER.size + 4 * n_tokens + 16


def _broken_files(good: bytes) -> dict[str, tuple[bytes, str]]:
    """name -> (the file's bytes, what the 400 must say)."""
    flipped = bytearray(good)               # one int32 of the KV metadata: a cell's position
    struct.pack_into("<i", flipped, _cells_offset(good) + 3 * CELL, -5)
    negative = bytearray(flipped)           # the same, with a checksum that matches it
    slot_file.seal(negative, slot_file.HEADER.unpack_from(good)[3])
    twice = bytearray(good)                 # two cells at one position, checksum matching
    struct.pack_into("<i", twice, _cells_offset(good) + 3 * CELL, 2)
    slot_file.seal(twice, slot_file.HEADER.unpack_from(good)[3])
    newer = bytearray(good)
    struct.pack_into("<I", newer, 8, 2)
    n_tokens = slot_file.HEADER.unpack_from(good)[3]
    legacy = (struct.pack("<III", 0x67677371, 3, n_tokens)      # llama.cpp's own header
              + good[slot_file.HEADER.size:])
    return {"flipped.bin": (bytes(flipped), "checksum mismatch"),
            "negative.bin": (bytes(negative), "KV cell at position -5"),
            "twice.bin": (bytes(twice), "positions are not the slot's last"),
            "newer.bin": (bytes(newer), "unsupported state version 2"),
            "legacy.bin": (legacy, "unsupported state version 0"),
            "short.bin": (good[:-100], "cut short"),
            "header.bin": (good[:20], "cut short"),
            "empty.bin": (b"", "not a slot file")}


@pytest.mark.parametrize("parallel", ["1", "2"])
def test_broken_slot_files_are_refused_and_the_slot_stays_usable(start_server, tiny_model,
                                                                 tmp_path: Path, parallel):
    server = start_server(tiny_model, "-np", parallel, "-c", str(512 * int(parallel)),
                          "--temp", "0", "--slot-save-path", str(tmp_path))
    with httpx.Client(base_url=server.base_url, timeout=60) as http:
        def complete(**extra) -> dict:
            r = http.post("/completion", json={"prompt": PROMPT, "n_predict": 4, "id_slot": 0,
                                               **extra})
            assert r.status_code == 200, r.text
            return r.json()

        first = complete()
        assert http.post("/slots/0?action=save", json={"filename": "good.bin"}).is_success
        good = (tmp_path / "good.bin").read_bytes()
        assert good[:8] == slot_file.MAGIC
        for name, (data, says) in _broken_files(good).items():
            (tmp_path / name).write_bytes(data)
            r = http.post("/slots/0?action=restore", json={"filename": name})
            err = error_of(r, "/slots/0")
            assert r.status_code == 400 and says in err["message"], (name, err)
            assert name in err["message"]
            # the slot was emptied, not poisoned: the next request on it starts afresh
            again = complete()
            assert again["timings"]["cache_n"] == 0, (name, again["timings"])
            assert again["content"] == first["content"]
            if parallel == "2":
                r = http.post("/completion", json={"prompt": "another", "n_predict": 2,
                                                   "id_slot": 1})
                assert r.status_code == 200, r.text
        assert http.post("/slots/0?action=erase").json()["n_erased"] > 0
        assert http.post("/slots/0?action=erase").json() == {"id_slot": 0, "n_erased": 0}
        restored = http.post("/slots/0?action=restore", json={"filename": "good.bin"}).json()
        assert restored["n_restored"] == slot_file.HEADER.unpack_from(good)[3]
        assert restored["n_read"] == len(good)
        cached = complete()
        assert cached["timings"]["cache_n"] > 0 and cached["content"] == first["content"]
    server.assert_alive()
