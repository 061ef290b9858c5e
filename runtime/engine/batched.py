"""Continuous batching: up to ``n_slots`` generations share each ``llama_decode``.

One scheduler thread owns the engine's context (created with ``n_parallel`` sequences, one
KV sequence per slot, llama.cpp's per-sequence KV streams so a slot's attention sees only its
own tokens). Each step it builds one batch: the next prompt chunk of every slot still in
prefill, and one token of every slot generating; a request that arrives joins at the next
step. While some slot generates, the prompt chunks are paced (prefill_pace.py: a step costs
about two decode steps), so a long prompt does not hold the others for its whole prefill.
The routing hook sees the whole batch's routing (phase PREFILL, DECODE, or MIXED when
the batch holds both). After the decode each slot samples from its own output row with its
own sampler chain, exactly as ``Engine.generate`` does for one sequence.

What a shared batch guarantees: each request's tokens attend only to its own KV and are
sampled by its own chain, but llama.cpp evaluates a batch of several sequences in another
order than one sequence alone, so the same request's logits differ in their last digits
(measured: bit-identical for most tokens, then up to 0.01 in a token's logprob; with
``--kv-unified``, whose cells interleave the requests, more). Greedy answers are therefore
equal to the same request alone until a step where the two best tokens nearly tie, and may
part there. ``batch_invariant`` decodes each slot in its own ``llama_decode``, shaped as it is
alone (the prompt in chunks of up to ``n_batch`` from the reused prefix, then one row per
step): the answers then equal the same request alone bit for bit (per-slot KV only), and the
slots still take turns every step, at about one stream's aggregate rate.

    scheduler = BatchScheduler(engine)       # engine: EngineSettings(n_parallel=4)
    for index, chunk in scheduler.generate_many([(tokens, params)], cancel):
        ...
    scheduler.close()
"""
from __future__ import annotations

import logging
import queue
import threading
from concurrent.futures import Future
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from runtime.engine import slot_state
from runtime.engine.batch import MultiBatch
from runtime.engine.context_shift import shift, shift_plan
from runtime.engine.decode import Generation, decode, max_new_tokens
from runtime.engine.prefill_pace import PrefillPacer
from runtime.engine.projector import MediaPrompt
from runtime.engine.prompt_cache import PromptCache
from runtime.engine.sampling import GrammarDeadEnd, Sampler, SamplingParams
from runtime.engine.slot_choice import best_slot, shared_prefix
from runtime.engine.types import (ContextLengthError, GenerationChunk, NonFiniteLogits,
                                  PromptProgress, Timings, Usage, check_token_ids)
from runtime.errors import UserError
from runtime.residency.types import Phase

_END = object()
PROMPT_THREADS_MIN_ROWS = 32     # a prompt step of fewer rows runs on the decode threads
log = logging.getLogger("moe_offload.server.slots")


@dataclass
class _Slot:
    seq: int
    tokens: list[int]                      # the prompt
    params: SamplingParams
    out: queue.SimpleQueue
    index: int
    cancel: threading.Event | None
    sampler: Sampler | None = None         # built on the caller's thread; the Generation's
    gen: Generation | None = None          # the sampling side (sampler, stream, counts)
    fed: int = 0                           # prompt tokens in the KV so far (reused or decoded)
    reused: int = 0                        # prompt tokens found in the slot's KV (prefix)
    decoded: list[int] = field(default_factory=list)   # generated tokens decoded into the KV
    pos: int = 0                           # next position in the sequence
    next_token: int | None = None          # sampled, to decode in the next step
    t0: float = field(default_factory=time.perf_counter)
    t_prefill: float = 0.0
    progress: bool = False                 # report the prompt's progress (PromptProgress)
    reuse_prefix: bool = True              # start from the slot's cached KV prefix
    shifted: bool = False                  # a context shift moved the KV: not a prefix now
    want_seq: int = -1                     # the slot asked for (id_slot); -1: any
    media: MediaPrompt | None = None       # the prompt's images (runtime.engine.projector)

    @property
    def prefilling(self) -> bool:
        return self.fed < len(self.tokens)


class BatchScheduler:
    """Runs ``engine``'s generations in shared batches (see the module docstring)."""

    def __init__(self, engine, prompt_cache: PromptCache | None = None,
                 cache_idle_slots: bool = True, batch_invariant: bool = False):
        """``prompt_cache``: host-memory copies of slots' KV (llama-server's ``--cache-ram``);
        ``cache_idle_slots``: copy every idle slot there when a request starts;
        ``batch_invariant``: each slot decoded in its own ``llama_decode`` (module docstring)."""
        self.engine = engine
        self.batch_invariant = batch_invariant
        self.prompt_cache = prompt_cache
        self.cache_idle_slots = cache_idle_slots and prompt_cache is not None
        self.n_slots = int(engine.settings.n_parallel)
        self.n_ctx_slot = int(engine.n_ctx)        # the engine reports the per-slot context
        self._ll = engine._ll  # noqa: SLF001 - the scheduler is the engine's other driver
        self._batch = MultiBatch(engine.n_batch)
        self._pacer = PrefillPacer()              # prompt tokens per step beside generation
        self._waiting: queue.SimpleQueue = queue.SimpleQueue()
        self._pending: list[_Slot] = []           # arrived, not admitted yet (FIFO)
        self._wake = threading.Event()
        self._free = list(range(self.n_slots))
        # seq -> the tokens its KV holds, kept after a request ends so that the next one
        # with the same prefix evaluates only the rest (llama-server's cache_prompt)
        self._cached: dict[int, list[int]] = {seq: [] for seq in range(self.n_slots)}
        self._active: list[_Slot] = []
        self._closed = False
        self._calls: list[tuple[int, object, Future]] = []    # slot actions waiting (seq, fn)
        self._calls_lock = threading.Lock()
        self.steps = 0
        self.max_rows = 0                          # most sequences seen in one batch
        self._rows_total = 0                       # sequences summed over steps
        self._thread = threading.Thread(target=self._run, name="moe-offload-batch",
                                        daemon=True)
        self._thread.start()

    # -- callers' side ------------------------------------------------------------------------

    def generate_many(self, requests: Sequence[tuple[list[int], SamplingParams]],
                      cancel: threading.Event | None = None, progress: bool = False,
                      reuse_prefix: bool = True,
                      id_slot: int = -1) -> Iterator[tuple[int, GenerationChunk]]:
        """Run every ``(prompt tokens, params)`` at once (each in its own slot as slots come
        free); yields ``(request index, chunk)`` as they are produced. ``progress``: chunks
        with the prompt's progress too, as ``Engine.generate`` gives them; ``reuse_prefix``
        false: the whole prompt is evaluated; ``id_slot`` >= 0: in that slot (one after
        another), else the free one sharing the longest prefix."""
        if not -1 <= id_slot < self.n_slots:
            raise UserError(f"id_slot: {id_slot} is not a slot (0..{self.n_slots - 1})")
        out: queue.SimpleQueue = queue.SimpleQueue()
        slots = []
        for index, (tokens, params) in enumerate(requests):
            media = tokens if isinstance(tokens, MediaPrompt) else None
            if media is not None:          # its images: negative ids (projector.py)
                tokens = media.tokens
            if not tokens:
                raise UserError("prompt: no tokens")
            check_token_ids(media.text_ids() if media is not None else tokens,
                            self.engine.n_vocab, "prompt")
            if len(tokens) >= self.n_ctx_slot:
                raise ContextLengthError(len(tokens), self.n_ctx_slot)
            # the sampler (a grammar's parse: milliseconds) is built here, not on the
            # scheduler thread, where it would hold every slot's next step
            slots.append(_Slot(-1, list(tokens), params, out, index, cancel,
                               Sampler(params, self.engine.n_vocab, self.engine.vocab_ptr),
                               progress=progress, reuse_prefix=reuse_prefix, want_seq=id_slot,
                               media=media))
        for slot in slots:
            self._waiting.put(slot)
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

    def call_on_slot(self, seq: int, action):
        """Run ``action(seq, the tokens its KV holds) -> (result, tokens after)`` on the
        scheduler thread once slot ``seq`` is idle (slot save/restore/erase); its result."""
        if not 0 <= seq < self.n_slots:
            raise UserError("Invalid slot ID")
        done: Future = Future()
        with self._calls_lock:
            self._calls.append((seq, action, done))
        self._wake.set()
        return done.result()

    def _run_calls(self) -> None:
        with self._calls_lock:
            ready = [c for c in self._calls if c[0] in self._free]
            self._calls = [c for c in self._calls if c[0] not in self._free]
        for seq, action, done in ready:
            try:
                result, self._cached[seq] = action(seq, list(self._cached[seq]))
            except BaseException as exc:  # noqa: BLE001 - the caller gets it
                self._cached[seq] = []
                done.set_exception(exc)
            else:
                done.set_result(result)

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
            self._run_calls()
            self._admit()
            if not self._active:
                self._wake.wait(0.5)
                self._wake.clear()
                continue
            try:
                self._step()
            except BaseException as exc:  # noqa: BLE001 - every waiting caller learns of it
                for slot in self._active:
                    self._release(slot, keep_cache=False)
                    slot.out.put(exc)
                    slot.out.put(_END)
                self._active.clear()

    def _admit(self) -> None:
        while not self._waiting.empty():
            self._pending.append(self._waiting.get())
        waiting, self._pending = self._pending, []
        for slot in waiting:      # in arrival order; one that wants a busy slot waits for it
            if not self._free or (slot.want_seq >= 0 and slot.want_seq not in self._free):
                self._pending.append(slot)
                continue
            self._start(slot)

    def _start(self, slot: _Slot) -> None:
        slot.seq, keep = best_slot(self._free, self._cached, slot.tokens) \
            if slot.want_seq < 0 else (slot.want_seq, shared_prefix(
                self._cached[slot.want_seq], slot.tokens))
        self._free.remove(slot.seq)
        memory = self._ll.llama_get_memory(self.engine.ctx_ptr)
        for seq in self._free:         # before the swap-in: a unified pool needs their cells
            if not self._cached[seq]:
                continue
            if self.cache_idle_slots and self._save(seq):
                # llama-server's debug line (its tests read it)
                log.debug("slot %d: idle slot saved to the prompt cache "
                          "(__TEST_TAG_CACHE_IDLE_SLOT__)", seq)
            if self.engine.settings.kv_unified:   # one pool: idle slots' caches give way
                self._ll.llama_memory_seq_rm(memory, seq, -1, -1)
                self._cached[seq] = []
        if self.prompt_cache is not None and slot.reuse_prefix:
            keep = self._swap_in(slot.seq, slot.tokens, keep)
        keep = keep if slot.reuse_prefix else 0
        if slot.media is not None:     # an image is in the KV whole or not at all
            keep = slot.media.snap(keep)
        if not self._ll.llama_memory_seq_rm(memory, slot.seq, keep, -1):
            keep = 0                   # a memory that cannot drop a tail: start afresh
            self._ll.llama_memory_seq_rm(memory, slot.seq, -1, -1)
        self._cached[slot.seq] = []    # known again once the request ends
        slot.fed = slot.pos = slot.reused = keep
        slot.gen = Generation(self.engine, slot.params, max_new_tokens(
            slot.params, len(slot.tokens), self.n_ctx_slot, self.engine.settings.context_shift),
            sampler=slot.sampler)
        slot.sampler = None                     # the generation's now (it closes it)
        slot.t0 = time.perf_counter()
        self._active.append(slot)
        self._report(slot)

    def _save(self, seq: int) -> bool:
        """Copy slot ``seq``'s KV into the prompt cache; False if it was not stored."""
        tokens = self._cached[seq]
        cache = self.prompt_cache
        if not tokens or not cache.can_store(tokens, 0):
            return False
        state = slot_state.read_state(self._ll, self.engine.ctx_ptr, seq)
        if not state or not cache.can_store(tokens, len(state)):
            return False
        cache.store(tokens, state)
        log.debug("prompt cache: %d prompts, %.1f MiB", len(cache), cache.size_bytes / 2**20)
        return True

    def _swap_in(self, seq: int, tokens: list[int], keep: int) -> int:
        """llama-server's prompt cache update: when the request would throw away most of
        slot ``seq``'s KV (or the slot is empty), save that KV to the cache, then load the
        cached prompt that serves ``tokens`` best; the tokens of it to keep."""
        held = self._cached[seq]
        if held and 2 * shared_prefix(held, tokens, cap=False) >= len(held):
            return keep                         # the slot keeps most of what it holds
        log.debug("slot %d: updating prompt cache", seq)
        self._save(seq)
        best = self.prompt_cache.best_for(tokens, held)
        if best is None:
            return keep
        entry = self.prompt_cache.take(best)
        self._ll.llama_memory_seq_rm(self._ll.llama_get_memory(self.engine.ctx_ptr), seq, -1, -1)
        if not slot_state.write_state(self._ll, self.engine.ctx_ptr, seq, entry.state):
            log.debug("slot %d: the cached prompt did not fit in the KV; starting afresh", seq)
            self._cached[seq] = []
            return 0
        self._cached[seq] = list(entry.tokens)
        log.debug("slot %d: loaded a cached prompt of %d tokens", seq, len(entry.tokens))
        return shared_prefix(self._cached[seq], tokens)

    def _step(self) -> None:
        for slot in list(self._active):
            if slot.cancel is not None and slot.cancel.is_set():
                self._finish(slot, "cancelled")
        if self.batch_invariant:     # each slot alone in its llama_decode, as when it runs alone
            for slot in list(self._active):
                self._decode_rows([slot], paced=False)
        else:
            self._decode_rows(list(self._active), paced=True)

    def _decode_rows(self, slots: list[_Slot], paced: bool) -> None:
        """One ``llama_decode`` of ``slots``' next rows (a prompt chunk each in prefill, the
        sampled token each generating), then their progress reports and samples. ``paced``:
        the prompt chunks are sized by the pacer while some slot generates."""
        batch = self._batch
        batch.clear()
        rows: list[tuple[_Slot, int]] = []        # (slot, output index) for slots to sample
        prefilled: list[_Slot] = []
        kinds = set()
        for slot in slots:            # images: each in its own llama_decode(s), before the batch
            while slot.prefilling and slot.media is not None and slot.fed in slot.media.images:
                self._feed_image(slot)
        generating = sum(1 for s in slots if s.next_token is not None)
        budget = self._pacer.budget(generating > 0, batch.room - generating) if paced else \
            batch.room
        prompt_rows = 0
        for slot in slots:
            if slot.prefilling:
                end = slot.media.next_image(slot.fed) if slot.media is not None else \
                    len(slot.tokens)           # text up to the next image
                take = min(end - slot.fed, batch.room, budget - prompt_rows)
                prompt_rows += max(take, 0)
                if take <= 0:
                    continue
                for j in range(take):
                    last = slot.fed + j == len(slot.tokens) - 1
                    i = batch.add(slot.tokens[slot.fed + j], slot.pos + j, slot.seq, last)
                    if last:
                        rows.append((slot, i))
                slot.fed += take
                slot.pos += take
                prefilled.append(slot)
                kinds.add(Phase.PREFILL)
            elif slot.next_token is not None and batch.room:
                if slot.pos >= self.n_ctx_slot:            # full: context shift
                    keep, drop = shift_plan(slot.pos, slot.params.n_keep, len(slot.tokens))
                    slot.pos = shift(self._ll, self.engine.ctx_ptr, slot.seq, slot.pos, keep,
                                     drop)
                    slot.shifted = True
                rows.append((slot, batch.add(slot.next_token, slot.pos, slot.seq, True)))
                slot.decoded.append(slot.next_token)
                slot.pos += 1
                slot.next_token = None
                kinds.add(Phase.DECODE)
        if batch.n == 0:
            return
        phase = kinds.pop() if len(kinds) == 1 else Phase.MIXED
        t0 = time.perf_counter()
        self._decode(phase)
        if paced:
            self._pacer.observe(time.perf_counter() - t0, prompt_rows, batch.n - prompt_rows)
        self.steps += 1
        busy = len({s.seq for s, _ in rows})
        self._rows_total += busy
        self.max_rows = max(self.max_rows, busy)
        for slot in prefilled:
            self._report(slot)
        for slot, index in rows:
            self._sample(slot, index)

    def _feed_image(self, slot: _Slot) -> None:
        """Evaluate the image at ``slot.fed`` into the slot's sequence (a prompt never ends
        with one: the slot is still prefilling after it)."""
        from runtime.engine.projector import decode_image  # noqa: PLC0415

        span = slot.media.images[slot.fed]
        decode_image(self.engine, span, slot.pos, slot.seq)
        slot.fed += span.n_pos
        slot.pos += span.n_pos
        self._report(slot)

    def _decode(self, phase: Phase) -> None:
        engine, batch = self.engine, self._batch
        # llama.cpp takes its prompt thread count for any batch of more than one token, so a
        # step of N decode rows would run on every core; decode rows run on the decode count
        # (a thread pool woken per graph piece on all of a small machine's cores cost 3-5x).
        # A MIXED step too: its prompt chunk is paced to about a decode step's cost, and the
        # prompt count's threads spin-wait on each other, so on a loaded machine MIXED steps
        # on them stalled every stream (4 streams at once: 0.12-0.65x the sequential rate,
        # first tokens up to 3.5 s; on the decode count 0.76-1.64x, first tokens <= 0.09 s:
        # docs/benchmarks/2026-12-06-parallel-slots.md). A short prompt step likewise: under
        # PROMPT_THREADS_MIN_ROWS rows its compute is about that of starting the thread pool
        # (4 short prompts admitted at once stalled 0.37 s on a loaded machine).
        threads_phase = Phase.PREFILL if phase == Phase.PREFILL and \
            batch.n >= PROMPT_THREADS_MIN_ROWS else Phase.DECODE
        # the hook reports rows, not positions: the batch's sequences each have their own
        decode(engine, batch, phase, 0, batch.n, batch.n_outputs, f"on a batch of {batch.n}",
               threads_phase=threads_phase)

    def _report(self, slot: _Slot) -> None:
        if slot.progress:
            report = PromptProgress(len(slot.tokens), slot.reused, slot.fed,  # first: 0 s
                                    time.perf_counter() - slot.t0 if slot.fed > slot.reused
                                    else 0.0)
            slot.out.put((slot.index, GenerationChunk(text="", token=None, progress=report)))

    def _sample(self, slot: _Slot, index: int) -> None:
        gen = slot.gen
        if gen.generated == 0 and slot.t_prefill == 0.0:
            slot.t_prefill = time.perf_counter()
        try:
            chunk = gen.sample(index)
        except (GrammarDeadEnd, NonFiniteLogits) as exc:   # this request's own: others go on
            slot.out.put(exc)
            slot.out.put(_END)
            # NaN/Inf logits: the slot's KV may hold NaN too, and is dropped
            self._release(slot, keep_cache=isinstance(exc, GrammarDeadEnd))
            self._active.remove(slot)
            return
        if chunk is not None:
            slot.out.put((slot.index, chunk))
        if gen.finish is not None:
            self._finish(slot, gen.finish)
        else:
            slot.next_token = chunk.token

    def _finish(self, slot: _Slot, reason: str) -> None:
        now = time.perf_counter()
        prefill_end = slot.t_prefill or now
        generated = slot.gen.generated if slot.gen else 0
        timings = Timings(prompt_tokens=slot.fed - slot.reused, prompt_s=prefill_end - slot.t0,
                          completion_tokens=generated, generation_s=now - prefill_end)
        slot.out.put((slot.index, GenerationChunk(
            text=slot.gen.stream.finish() if slot.gen else "", token=None, finish_reason=reason,
            usage=Usage(len(slot.tokens), generated), timings=timings)))
        slot.out.put(_END)
        self._release(slot)
        self._active.remove(slot)

    def _release(self, slot: _Slot, keep_cache: bool = True) -> None:
        """Free the slot; its KV stays for the next request's prefix unless ``keep_cache``
        is false (a failed decode: what the KV holds is unknown)."""
        if slot.gen is not None:
            slot.gen.close()
            slot.gen = None
        if slot.sampler is not None:            # never started
            slot.sampler.close()
            slot.sampler = None
        if slot.seq >= 0:
            if keep_cache and not slot.shifted:
                self._cached[slot.seq] = slot.tokens[:slot.fed] + slot.decoded
            else:                          # unknown or shifted: start the slot afresh
                memory = self._ll.llama_get_memory(self.engine.ctx_ptr)
                self._ll.llama_memory_seq_rm(memory, slot.seq, -1, -1)
                self._cached[slot.seq] = []
            self._free.append(slot.seq)
            self._free.sort()
            slot.seq = -1
