"""Reusable ``llama_batch``es with numpy views over their arrays: one sequence
(``TokenBatch``) or rows of several (``MultiBatch``, continuous batching)."""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class _Batch:
    """``llama_batch_init(capacity, 0, 1)`` and numpy views of its per-row arrays."""

    def __init__(self, capacity: int):
        from runtime.native.llama_lib import bindings  # noqa: PLC0415

        self._ll = bindings()
        self.capacity = int(capacity)
        self.batch = self._ll.llama_batch_init(self.capacity, 0, 1)
        b = self.batch
        self._token = np.ctypeslib.as_array(b.token, shape=(self.capacity,))     # int32
        self._pos = np.ctypeslib.as_array(b.pos, shape=(self.capacity,))         # int32
        self._n_seq = np.ctypeslib.as_array(b.n_seq_id, shape=(self.capacity,))  # int32
        self._output = np.ctypeslib.as_array(b.logits, shape=(self.capacity,))   # int8
        self._n_seq[:] = 1

    def close(self) -> None:
        if self.batch is not None:
            self._ll.llama_batch_free(self.batch)
            self.batch = None


class TokenBatch(_Batch):
    """One sequence (id 0) filled in place: tokens, positions, outputs."""

    def __init__(self, capacity: int):
        super().__init__(capacity)
        for i in range(self.capacity):
            self.batch.seq_id[i][0] = 0            # one sequence, id 0, for every slot

    def fill(self, tokens: Sequence[int], first_pos: int, *, all_outputs: bool) -> int:
        """Load ``tokens`` at positions ``first_pos..``; returns how many logits rows are
        requested (the last token's only, unless ``all_outputs``)."""
        n = len(tokens)
        if not 0 < n <= self.capacity:
            raise ValueError(f"batch of {n} tokens (capacity {self.capacity})")
        self._token[:n] = tokens
        self._pos[:n] = np.arange(first_pos, first_pos + n, dtype=np.int32)
        self._output[:n] = 1 if all_outputs else 0
        self._output[n - 1] = 1
        self.batch.n_tokens = n
        return n if all_outputs else 1


class MultiBatch(_Batch):
    """Rows of several sequences (continuous batching): ``add(token, pos, seq, output)`` row
    by row, ``clear()`` between decodes."""

    def __init__(self, capacity: int):
        super().__init__(capacity)
        self.n = 0
        self.n_outputs = 0

    def clear(self) -> None:
        self.n = self.n_outputs = 0
        self.batch.n_tokens = 0

    @property
    def room(self) -> int:
        return self.capacity - self.n

    def add(self, token: int, pos: int, seq: int, output: bool) -> int:
        """Append one row; returns its output index (-1 when it requests no logits)."""
        i = self.n
        self._token[i], self._pos[i], self._output[i] = token, pos, int(output)
        self.batch.seq_id[i][0] = seq
        self.n += 1
        self.batch.n_tokens = self.n
        if not output:
            return -1
        self.n_outputs += 1
        return i
