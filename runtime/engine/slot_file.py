"""Slot files: one slot's KV state on disk (llama-server's ``/slots/N?action=save|restore``),
in a versioned format of ours around llama.cpp's sequence state, checked whole before llama.cpp
reads any of it.

    offset  bytes  field (little-endian)
    0       8      magic b"MOESLOT\\0"
    8       4      version: 1
    12      4      header bytes: 48
    16      8      n_tokens: the tokens the KV holds
    24      8      state bytes
    32      16     BLAKE2b-128 of everything after the header
    48      4 n    the tokens (int32)
    48+4n   state  llama_state_seq_get_data's bytes (the KV cells' metadata, then their K and V)

Why checked: llama.cpp takes a sequence state's cell positions as they are. One corrupted int32
there (a negative position) leaves cells that no ``llama_memory_seq_rm`` removes (it clamps
the range to positions >= 0): every later decode of that slot fails, and erasing it does not
help. So a restore reads the file (into memory once: its size), checks the magic, the version
(another is "unsupported state version N"), the sizes, the checksum, the token ids and every KV
cell's position (each within the slot's tokens, no two alike, contiguous up to the last token),
and only then hands the state to llama.cpp. A file in llama.cpp's own format (magic ``ggsq``:
what this server wrote before slot files had a version, and what llama-server writes) has no
checksum to trust: it is refused as version 0 (save the slot again).

    image = read("slot.bin", n_vocab, n_ctx)      # SlotImage(tokens, state) or SlotFileError
    write("slot.bin", tokens, state)              # atomically (runtime.atomic_write)
"""
from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass

import numpy as np

from runtime.atomic_write import atomic_write
from runtime.engine.types import check_token_ids
from runtime.errors import UserError

MAGIC = b"MOESLOT\0"
VERSION = 1
HEADER = struct.Struct("<8sIIQQ16s")        # magic, version, header bytes, n_tokens, state, digest
LLAMA_MAGIC = struct.pack("<I", 0x67677371)  # LLAMA_FILE_MAGIC_GGSQ: llama.cpp's own format
STATE_MAGIC = 0xAF143CD8                    # llama_state_seq_get_data's first uint32 (io_magic)
CELL_EXT_BYTES = 12                         # llama_kv_cell_ext (M-RoPE x, y; token), when used


class SlotFileError(UserError):
    """A slot file that is not one this server wrote whole: the message names the problem."""


@dataclass(frozen=True)
class SlotImage:
    """A checked slot file: its tokens and the sequence state llama.cpp gets."""

    tokens: list[int]
    state: memoryview        # llama_state_seq_set_data's bytes (a view of the file's buffer)
    file_bytes: int


def _digest(data: memoryview) -> bytes:
    return hashlib.blake2b(data, digest_size=16).digest()


def image(tokens: list[int], state_size: int) -> tuple[bytearray, memoryview]:
    """A file's buffer for ``tokens`` and a state of ``state_size`` bytes, and the view of its
    state part for llama.cpp to fill (``seal`` it after)."""
    buf = bytearray(HEADER.size + 4 * len(tokens) + state_size)
    buf[HEADER.size:HEADER.size + 4 * len(tokens)] = np.asarray(tokens, "<i4").tobytes()
    return buf, memoryview(buf)[HEADER.size + 4 * len(tokens):]


def seal(buf: bytearray, n_tokens: int) -> None:
    """Write the header of a filled ``image`` buffer (the checksum last)."""
    body = memoryview(buf)[HEADER.size:]
    state_bytes = len(body) - 4 * n_tokens
    HEADER.pack_into(buf, 0, MAGIC, VERSION, HEADER.size, n_tokens, state_bytes, _digest(body))


def write(path: str, buf: bytearray) -> None:
    """Publish a sealed buffer at ``path`` atomically: a failed or killed write leaves the
    previous file as it was."""
    with atomic_write(path, "wb") as f:
        f.write(buf)


def read(path: str, n_vocab: int, n_ctx: int) -> SlotImage:
    """The checked contents of the slot file at ``path`` (see the module docstring);
    ``SlotFileError`` naming the problem. ``n_ctx``: the tokens a slot holds."""
    name = path.rsplit("/", 1)[-1]
    try:
        with open(path, "rb") as f:
            data = bytearray(f.read())
    except OSError as exc:
        raise SlotFileError(f"{name}: cannot read it ({exc.strerror})") from None
    view = memoryview(data)
    if data[:4] == LLAMA_MAGIC:
        raise SlotFileError(f"{name}: unsupported state version 0 (llama.cpp's own format, "
                            "without moe-offload's header and checksum); save the slot again")
    if not data or not (data[:8] == MAGIC or MAGIC.startswith(bytes(data[:8]))):
        raise SlotFileError(f"{name}: not a slot file (no {MAGIC[:7].decode()} header)")
    if len(data) < HEADER.size:
        raise SlotFileError(f"{name}: {len(data)} bytes, less than a slot file's header: cut "
                            "short")
    _, version, header, n_tokens, state_bytes, digest = HEADER.unpack_from(data)
    if version != VERSION:
        raise SlotFileError(f"{name}: unsupported state version {version} (this server "
                            f"reads version {VERSION})")
    if header != HEADER.size or len(data) != header + 4 * n_tokens + state_bytes:
        raise SlotFileError(f"{name}: {len(data)} bytes where its header says "
                            f"{header + 4 * n_tokens + state_bytes}: cut short or corrupted")
    if _digest(view[header:]) != digest:
        raise SlotFileError(f"{name}: checksum mismatch: the file is corrupted")
    if n_tokens > n_ctx:
        raise SlotFileError(f"{name}: holds {n_tokens} tokens; a slot holds {n_ctx}")
    tokens = np.frombuffer(view, "<i4", n_tokens, header).tolist()
    check_token_ids(tokens, n_vocab, f"{name}")
    state = view[header + 4 * n_tokens:]
    for positions in kv_cell_positions(state, name):
        check_positions(positions, n_tokens, name)
    return SlotImage(tokens, state, len(data))


class _Layout(Exception):
    """The state does not parse under the layout tried."""


def kv_cell_positions(state: memoryview, name: str) -> list[np.ndarray]:
    """The KV cells' positions of a sequence state, one int32 array per KV cache in it (a
    model with sliding-window layers has two). llama.cpp's layout (llama_kv_cache::
    state_write): per cache, n_stream, then per stream a cell count, each cell's (pos,
    n_seq_id, [ext], seq_id), then v_trans, n_layer, each layer's K (type, row bytes, rows)
    and V (type, row bytes, rows; or transposed: type, element bytes, n_embd, elements).
    Whether cells carry an ext (M-RoPE) and layers a V (not under MLA) depends on the model:
    the layout that accounts for every byte is the one."""
    if len(state) < 8 or struct.unpack_from("<I", state)[0] != STATE_MAGIC:
        raise SlotFileError(f"{name}: the KV state does not start with llama.cpp's sequence "
                            "state header")
    for ext in (0, CELL_EXT_BYTES):
        for with_v in (True, False):
            try:
                return _parse(state, ext, with_v)
            except _Layout:
                continue
    raise SlotFileError(f"{name}: the KV state's layout does not parse (corrupted, or saved "
                        "by another model)")


def _parse(state: memoryview, ext: int, with_v: bool) -> list[np.ndarray]:
    size, off, caches = len(state), 8, []

    def take(fmt: str) -> tuple:
        nonlocal off
        n = struct.calcsize(fmt)
        if off + n > size:
            raise _Layout
        values = struct.unpack_from(fmt, state, off)
        off += n
        return values

    def skip(n: int) -> None:
        nonlocal off
        if n < 0 or off + n > size:
            raise _Layout
        off += n

    cell = np.dtype([("pos", "<i4"), ("n_seq", "<u4"), ("ext", f"V{ext}"), ("seq", "<i4")]) \
        if ext else np.dtype([("pos", "<i4"), ("n_seq", "<u4"), ("seq", "<i4")])
    while off < size:
        (n_stream,) = take("<I")
        if not 1 <= n_stream <= 4096:
            raise _Layout
        positions = []
        for _ in range(n_stream):
            (count,) = take("<I")
            if count == 0:
                continue
            if off + count * cell.itemsize > size:
                raise _Layout
            cells = np.frombuffer(state, cell, count, off)
            if (cells["n_seq"] != 1).any():    # one sequence's save: one id per cell
                raise _Layout
            positions.append(cells["pos"])
            skip(count * cell.itemsize)
            v_trans, n_layer = take("<II")
            if v_trans > 1 or not 1 <= n_layer <= 4096:
                raise _Layout
            for _ in range(n_layer):                      # K: type, row bytes, rows
                skip(count * take("<iQ")[1])
            for _ in range(n_layer if with_v else 0):     # V
                if v_trans:
                    _, el, n_embd = take("<iII")
                    skip(count * el * n_embd)
                else:
                    skip(count * take("<iQ")[1])
        caches.append(np.concatenate(positions) if positions else np.empty(0, np.int32))
    return caches


def check_positions(positions: np.ndarray, n_tokens: int, name: str) -> None:
    """The cells of one KV cache must be the slot's last ``len(positions)`` token positions,
    once each: a cell outside them is never removed (negative) or breaks the next decode's
    position order."""
    if len(positions) == 0:
        return
    low, high = int(positions.min()), int(positions.max())
    if low < 0 or high >= n_tokens:
        bad = low if low < 0 else high
        raise SlotFileError(f"{name}: a KV cell at position {bad}, outside the slot's "
                            f"{n_tokens} tokens (0..{n_tokens - 1}): corrupted")
    ordered = np.sort(positions)
    if not np.array_equal(ordered, np.arange(n_tokens - len(positions), n_tokens)):
        raise SlotFileError(f"{name}: the KV cells' positions are not the slot's last "
                            f"{len(positions)} tokens once each: corrupted")
