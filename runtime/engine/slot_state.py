"""A slot's KV state to a file and back (llama-server's ``/slots/{id}?action=save|restore``,
and ``erase``), with llama.cpp's ``llama_state_seq_get_data`` / ``_set_data`` inside a slot
file of ours (runtime/engine/slot_file.py: versioned, checksummed, checked before a restore):
the file holds the sequence's KV cells and its tokens, so a restored slot serves the next
request's prefix.

The context is driven by one thread at a time: with ``-np`` the batch scheduler runs the
action between steps once the slot is idle (``BatchScheduler.call_on_slot``); a single
engine runs it under its generation lock.
"""
from __future__ import annotations

import ctypes
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from runtime.engine import slot_file
from runtime.errors import UserError

SlotAction = Callable[[int, list[int]], tuple[Any, list[int]]]  # (seq, its tokens) -> (result, tokens after)


@dataclass(frozen=True, slots=True)
class SlotFile:
    """What a save or restore moved: tokens, bytes and seconds."""

    n_tokens: int
    n_bytes: int
    seconds: float


def on_slot(engine: Any, seq: int, action: SlotAction) -> Any:
    """Run ``action`` on sequence ``seq`` when nothing else drives the context."""
    batcher = getattr(engine, "batcher", None)
    if batcher is not None:
        return batcher.call_on_slot(seq, action)
    if seq != 0:
        raise UserError("Invalid slot ID")
    with engine._busy:  # noqa: SLF001 - the engine's own lock: no generation meanwhile
        try:
            result, tokens = action(0, list(engine._kv))  # noqa: SLF001
        except BaseException:
            engine._kv[:] = []  # noqa: SLF001 - a failed action leaves the KV empty (as batched)
            raise
        engine._kv[:] = tokens  # noqa: SLF001
        return result


def save(engine: Any, seq: int, path: str) -> SlotFile:
    """Save sequence ``seq`` to ``path`` as a slot file (runtime.engine.slot_file: a header
    with its version and checksum, the tokens, llama.cpp's sequence state), atomically: a
    failed or killed save keeps the previous file. The state passes through memory once."""
    ll, ctx = engine._ll, engine.ctx_ptr  # noqa: SLF001

    def action(seq: int, tokens: list[int]) -> tuple[SlotFile, list[int]]:
        if any(t < 0 for t in tokens):     # runtime/engine/projector.py: ids of this process
            raise UserError("the slot holds an image, whose KV cannot be saved to a file "
                            "(an image's id lives only in this server process)")
        t0 = time.perf_counter()
        size = int(ll.llama_state_seq_get_size(ctx, seq))
        buf, state = slot_file.image(tokens, size)
        target = (ctypes.c_uint8 * size).from_buffer(state) if size else None
        n = int(ll.llama_state_seq_get_data(ctx, target, size, seq)) if size else 0
        del target                       # the buffer's export ends here
        if n != size:
            raise UserError(f"cannot save the slot's state to {path} (llama.cpp gave {n} of "
                            f"its {size} bytes)")
        slot_file.seal(buf, len(tokens))
        slot_file.write(path, buf)
        return SlotFile(len(tokens), len(buf), time.perf_counter() - t0), tokens
    return on_slot(engine, seq, action)


def restore(engine: Any, seq: int, path: str) -> SlotFile:
    """Load the slot file at ``path`` into sequence ``seq`` once it is checked whole
    (runtime.engine.slot_file.read: version, checksum, token ids, KV cell positions); a file
    that fails a check is a ``UserError`` naming the problem, the slot left empty."""
    ll, ctx = engine._ll, engine.ctx_ptr  # noqa: SLF001

    def action(seq: int, tokens: list[int]) -> tuple[SlotFile, list[int]]:
        t0 = time.perf_counter()
        memory = ll.llama_get_memory(ctx)
        ll.llama_memory_seq_rm(memory, seq, -1, -1)
        checked = slot_file.read(path, int(engine.n_vocab), int(engine.n_ctx))
        size = len(checked.state)
        source = (ctypes.c_uint8 * size).from_buffer(checked.state)
        n = int(ll.llama_state_seq_set_data(ctx, source, size, seq))
        del source
        last = int(ll.llama_memory_seq_pos_max(memory, seq))
        if n != size or last != len(checked.tokens) - 1:   # the slot stays empty and usable
            ll.llama_memory_seq_rm(memory, seq, -1, -1)
            raise UserError("Unable to restore slot, no available space in KV cache or "
                            "invalid slot save file")
        return SlotFile(len(checked.tokens), checked.file_bytes,
                        time.perf_counter() - t0), checked.tokens
    return on_slot(engine, seq, action)


def erase(engine: Any, seq: int) -> int:
    """Empty the slot's KV; returns how many tokens it held."""
    ll, ctx = engine._ll, engine.ctx_ptr  # noqa: SLF001

    def action(seq: int, tokens: list[int]) -> tuple[int, list[int]]:
        ll.llama_memory_seq_rm(ll.llama_get_memory(ctx), seq, -1, -1)
        return len(tokens), []
    return on_slot(engine, seq, action)


def read_state(ll: Any, ctx: Any, seq: int) -> bytes:
    """Sequence ``seq``'s KV state as bytes (llama_state_seq_get_data); b"" when empty."""
    size = int(ll.llama_state_seq_get_size(ctx, seq))
    if size == 0:
        return b""
    buffer = (ctypes.c_uint8 * size)()
    n = int(ll.llama_state_seq_get_data(ctx, buffer, size, seq))
    return bytes(buffer[:n])


def write_state(ll: Any, ctx: Any, seq: int, state: bytes) -> bool:
    """Load ``state`` (from ``read_state``) into the empty sequence ``seq``; False if it did
    not fit (the sequence is left empty)."""
    buffer = (ctypes.c_uint8 * len(state)).from_buffer_copy(state)
    if int(ll.llama_state_seq_set_data(ctx, buffer, len(state), seq)) == len(state):
        return True
    ll.llama_memory_seq_rm(ll.llama_get_memory(ctx), seq, -1, -1)
    return False
