"""Continuous batching: up to ``n_slots`` generations share each ``llama_decode``.

One scheduler thread owns the engine's context (created with ``n_parallel`` sequences, one
KV sequence per slot, llama.cpp's per-sequence KV streams so a slot's attention sees only its
own tokens). Each step it builds one batch: the next prompt chunk of every slot still in
prefill, and one token of every slot generating; a request that arrives joins at the next
step. The routing hook sees the whole batch's routing (phase PREFILL, DECODE, or MIXED when
the batch holds both). After the decode each slot samples from its own output row with its
own sampler chain, exactly as ``Engine.generate`` does for one sequence.

    scheduler = BatchScheduler(engine)       # engine: EngineSettings(n_parallel=4)
    for index, chunk in scheduler.generate_many([(tokens, params)], cancel):
        ...
    scheduler.close()
"""
from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from runtime.engine.batch import MultiBatch
from runtime.engine.sampling import Sampler, SamplingParams, TextStream
from runtime.engine.types import ContextLengthError, GenerationChunk, Timings, Usage
from runtime.residency.types import Phase

_END = object()


@dataclass
class _Slot:
    seq: int
    tokens: list[int]                      # the prompt
    params: SamplingParams
    out: queue.SimpleQueue
    index: int
    cancel: threading.Event | None
    sampler: Sampler | None = None
    stream: TextStream | None = None
    fed: int = 0                           # prompt tokens decoded so far
    pos: int = 0                           # next position in the sequence
    next_token: int | None = None          # sampled, to decode in the next step
    generated: int = 0
    max_new: int = 0
    t0: float = field(default_factory=time.perf_counter)
    t_prefill: float = 0.0

    @property
    def prefilling(self) -> bool:
        return self.fed < len(self.tokens)


class BatchScheduler:
    """Runs ``engine``'s generations in shared batches (see the module docstring)."""

    def __init__(self, engine):
        self.engine = engine
        self.n_slots = int(engine.settings.n_parallel)
        self.n_ctx_slot = int(engine.n_ctx)        # the engine reports the per-slot context
        self._ll = engine._ll  # noqa: SLF001 - the scheduler is the engine's other driver
        self._batch = MultiBatch(engine.n_batch)
        self._waiting: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._free = list(range(self.n_slots))
        self._active: list[_Slot] = []
        self._closed = False
        self.steps = 0
        self.max_rows = 0                          # most sequences seen in one batch
        self._rows_total = 0                       # sequences summed over steps
        self._thread = threading.Thread(target=self._run, name="moe-offload-batch",
                                        daemon=True)
        self._thread.start()

    # -- callers' side ------------------------------------------------------------------------

    def generate_many(self, requests: Sequence[tuple[list[int], SamplingParams]],
                      cancel: threading.Event | None = None) -> Iterator[tuple[int, GenerationChunk]]:
        """Run every ``(prompt tokens, params)`` at once (each in its own slot as slots come
        free); yields ``(request index, chunk)`` as they are produced."""
        out: queue.SimpleQueue = queue.SimpleQueue()
        for index, (tokens, params) in enumerate(requests):
            if len(tokens) >= self.n_ctx_slot:
                raise ContextLengthError(len(tokens), self.n_ctx_slot)
            self._waiting.put(_Slot(-1, list(tokens), params, out, index, cancel))
        self._wake.set()
        remaining = len(requests)
        while remaining:
            item = out.get()
            if isinstance(item, BaseException):
                raise item
            if item is _END:
                remaining -= 1
                continue
            yield item

    def busy_per_step(self) -> float:
        """Mean sequences sampled per decode step."""
        return self._rows_total / self.steps if self.steps else 0.0

    def close(self) -> None:
        self._closed = True
        self._wake.set()
        self._thread.join(timeout=30)
        self._batch.close()

    # -- the scheduler thread ------------------------------------------------------------------

    def _run(self) -> None:
        while not self._closed:
            self._admit()
            if not self._active:
                self._wake.wait(0.5)
                self._wake.clear()
                continue
            try:
                self._step()
            except BaseException as exc:  # noqa: BLE001 - every waiting caller learns of it
                for slot in self._active:
                    self._release(slot)
                    slot.out.put(exc)
                    slot.out.put(_END)
                self._active.clear()

    def _admit(self) -> None:
        while self._free and not self._waiting.empty():
            slot = self._waiting.get()
            slot.seq = self._free.pop(0)
            memory = self._ll.llama_get_memory(self.engine.ctx_ptr)
            self._ll.llama_memory_seq_rm(memory, slot.seq, -1, -1)
            slot.sampler = Sampler(slot.params, self.engine.n_vocab, self.engine.vocab_ptr)
            slot.stream = TextStream(slot.params.stop)
            room = self.n_ctx_slot - len(slot.tokens)
            slot.max_new = min(slot.params.max_tokens, room) if slot.params.max_tokens > 0 \
                else room
            slot.t0 = time.perf_counter()
            self._active.append(slot)

    def _step(self) -> None:
        batch = self._batch
        batch.clear()
        rows: list[tuple[_Slot, int]] = []        # (slot, output index) for slots to sample
        kinds = set()
        for slot in list(self._active):
            if slot.cancel is not None and slot.cancel.is_set():
                self._finish(slot, "cancelled")
                continue
            if slot.prefilling:
                take = min(len(slot.tokens) - slot.fed, batch.room)
                if take <= 0:
                    continue
                for j in range(take):
                    last = slot.fed + j == len(slot.tokens) - 1
                    i = batch.add(slot.tokens[slot.fed + j], slot.pos + j, slot.seq, last)
                    if last:
                        rows.append((slot, i))
                slot.fed += take
                slot.pos += take
                kinds.add(Phase.PREFILL)
            elif slot.next_token is not None and batch.room:
                rows.append((slot, batch.add(slot.next_token, slot.pos, slot.seq, True)))
                slot.pos += 1
                slot.next_token = None
                kinds.add(Phase.DECODE)
        if batch.n == 0:
            return
        phase = kinds.pop() if len(kinds) == 1 else Phase.MIXED
        self._decode(phase)
        self.steps += 1
        busy = len({s.seq for s, _ in rows})
        self._rows_total += busy
        self.max_rows = max(self.max_rows, busy)
        for slot, index in rows:
            self._sample(slot, index)

    def _decode(self, phase: Phase) -> None:
        engine, batch = self.engine, self._batch
        hook = engine.hook
        remote = getattr(engine, "remote", None)
        if remote is not None:
            remote.check()                 # a lost remote: RemoteDeviceLost, nothing decoded
        if hook is not None:
            hook.begin_batch(phase, 0, batch.n, batch.n_outputs)
        rc = self._ll.llama_decode(engine.ctx_ptr, batch.batch)
        if remote is not None and remote.lost_now():
            if hook is not None:
                hook.abort_batch()
            remote.check()
        if rc != 0:
            if hook is not None:
                hook.abort_batch()
            raise RuntimeError(f"llama_decode failed (status {rc}) on a batch of {batch.n}")
        if hook is not None:
            hook.end_batch()

    def _sample(self, slot: _Slot, index: int) -> None:
        engine = self.engine
        if slot.generated == 0 and slot.t_prefill == 0.0:
            slot.t_prefill = time.perf_counter()
        logits = engine._last_logits(index) if slot.params.logprobs is not None else None  # noqa: SLF001
        token = slot.sampler.sample(engine.ctx_ptr, index)
        if self._ll.llama_vocab_is_eog(engine.vocab_ptr, token):
            self._finish(slot, "stop")
            return
        slot.generated += 1
        piece = engine.token_bytes(token)
        text = slot.stream.feed(piece)
        lp = None if logits is None else engine._logprob(logits, token, piece,  # noqa: SLF001
                                                         slot.params.logprobs)
        slot.out.put((slot.index, GenerationChunk(text=text, token=token, logprob=lp)))
        if slot.stream.stopped:
            self._finish(slot, "stop")
        elif slot.generated >= slot.max_new:
            self._finish(slot, "length")
        else:
            slot.next_token = token

    def _finish(self, slot: _Slot, reason: str) -> None:
        now = time.perf_counter()
        prefill_end = slot.t_prefill or now
        timings = Timings(prompt_tokens=slot.fed, prompt_s=prefill_end - slot.t0,
                          completion_tokens=slot.generated, generation_s=now - prefill_end)
        slot.out.put((slot.index, GenerationChunk(
            text=slot.stream.finish() if slot.stream else "", token=None, finish_reason=reason,
            usage=Usage(len(slot.tokens), slot.generated), timings=timings)))
        slot.out.put(_END)
        self._release(slot)
        self._active.remove(slot)

    def _release(self, slot: _Slot) -> None:
        if slot.sampler is not None:
            slot.sampler.close()
            slot.sampler = None
        if slot.seq >= 0:
            memory = self._ll.llama_get_memory(self.engine.ctx_ptr)
            self._ll.llama_memory_seq_rm(memory, slot.seq, -1, -1)
            self._free.append(slot.seq)
            self._free.sort()
            slot.seq = -1
