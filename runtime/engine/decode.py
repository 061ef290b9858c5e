"""One decode loop for the single-request engine (engine.py) and continuous batching
(batched.py): the framing of one ``llama_decode`` for the routing hook and its errors
(``decode``), and one sequence's sampling side, token by token (``Generation``).

    gen = Generation(engine, params, n_prompt, n_ctx)
    while not gen.finish:
        decode(engine, batch, phase, first_pos, n_tokens, n_outputs, where)
        chunk = gen.sample(index)          # None: an end-of-generation token
        ...                                # gen.finish: "stop", "length" or None
"""
from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

from runtime.native import interrupt
from runtime.engine.logprobs import sample_token
from runtime.engine.sampling import Sampler, SamplingParams, TextStream
from runtime.engine.types import GenerationChunk, KVCacheFullError
from runtime.residency.types import Phase


def decode(engine, batch, phase: Phase, first_pos: int, n_tokens: int, n_outputs: int,
           where: str, *, threads_phase: Phase | None = None) -> None:
    """Run ``batch`` (a ``runtime.engine.batch`` batch) through ``engine``'s context, framed
    for its routing hook. ``first_pos``: the context position of the batch's first token as
    the hook reports it; ``where``: the batch in a failure's message ("at position 7").
    Raises ModelFileChanged (the model file is not the one loaded: nothing decoded),
    RemoteDeviceLost (a lost remote: its outputs are zeros), KVCacheFullError (a unified KV
    pool is full), RuntimeError (another llama_decode failure), the hook's RouteCaptureError;
    the hook's batch is ended or aborted either way. ``threads_phase``: the phase whose
    thread count the call runs on (engine.threads: runtime/engine/threads.py), when not
    ``phase`` (a mixed step, a short prompt step: the generation's)."""
    tuner = getattr(engine, "threads", None)
    kind = threads_phase or (Phase.DECODE if phase == Phase.MIXED else phase)
    if tuner is not None:
        n = tuner.threads(kind)
        if n != engine.threads_now:         # within each pool's size (engine._threadpools)
            most = tuner.most
            engine._ll.llama_set_n_threads(engine.ctx_ptr, min(n, most[0]),  # noqa: SLF001
                                           min(n, most[1]))
            engine.threads_now = n
    started, waited = time.perf_counter(), _read_wait_s(engine)
    with framed_call(engine, phase, first_pos, n_tokens, n_outputs, where) as frame:
        rc = engine._ll.llama_decode(engine.ctx_ptr, batch.batch)  # noqa: SLF001
        frame.check(rc)
    if tuner is not None:                  # the time the threads change: not the reads' waits
        busy = time.perf_counter() - started - (_read_wait_s(engine) - waited)
        tuner.record(kind, engine.threads_now, busy, n_tokens)


def _read_wait_s(engine) -> float:
    """Seconds the engine's RAM tier has waited for reads so far (0 without one)."""
    return sum(t.read_wait_s() for t in engine.tiers if hasattr(t, "read_wait_s"))


class _Frame:
    """What runs inside ``framed_call``: ``check`` the call's status; ``next_piece`` when
    one call decodes several batches (mtmd's image helper: ends the hook's batch, begins the
    next; returns 0, or 1 with the error kept for ``check``)."""

    def __init__(self, engine, phase: Phase, n_outputs: int, where: str):
        self.engine, self.phase, self.n_outputs, self.where = engine, phase, n_outputs, where
        self.piece = 0
        self.error: BaseException | None = None

    def next_piece(self, first_pos: int, n_tokens: int) -> int:
        hook = self.engine.hook
        try:
            if hook is not None:
                hook.end_batch()
                hook.begin_batch(self.phase, first_pos, n_tokens, self.n_outputs)
            self.piece += 1
            return 0
        except BaseException as exc:  # noqa: BLE001 - raised by check(), not in C's callback
            self.error = exc
            return 1

    def check(self, rc: int) -> None:
        """Raise what the call's status (and a lost remote) means; nothing when it is 0."""
        engine = self.engine
        if self.error is not None:
            raise self.error
        if engine.remote is not None:
            engine.remote.check()          # its outputs are zeros: never sample from them
        if rc == 1 and engine.settings.kv_unified:      # no KV cell left in the pool
            raise KVCacheFullError(f"Context size has been exceeded: the slots' shared KV "
                                   f"pool of {engine._ll.llama_n_ctx(engine.ctx_ptr)} tokens "  # noqa: SLF001
                                   "is full")
        if rc != 0:
            raise RuntimeError(f"llama_decode failed (status {rc}) {self.where}")


@contextlib.contextmanager
def framed_call(engine, phase: Phase, first_pos: int, n_tokens: int, n_outputs: int,
                where: str) -> Iterator[_Frame]:
    """Around a call into llama.cpp that runs ``llama_decode`` on ``engine``'s context: the
    model file's watch, a lost remote checked first, the routing hook's batch begun (and
    ended, or aborted on an error), Ctrl-C held. The body calls ``frame.check(status)``."""
    hook, remote = engine.hook, engine.remote
    watch = engine.model_file              # a cut file read through the mapping is a SIGBUS
    with watch.batch() if watch is not None else contextlib.nullcontext():
        if remote is not None:
            remote.check()                 # a lost remote: RemoteDeviceLost, nothing decoded
        if hook is not None:
            hook.begin_batch(phase, first_pos, n_tokens, n_outputs)
        try:
            # Ctrl-C during the call aborts the graph (status 2) and is raised on leaving
            with interrupt.deferred():
                engine.decode_calls += 1
                yield _Frame(engine, phase, n_outputs, where)
                if hook is not None:
                    hook.end_batch()
        except BaseException:
            if hook is not None and hook.in_batch:
                hook.abort_batch()         # leases end, the batch's events are dropped
            raise


def max_new_tokens(params: SamplingParams, n_prompt: int, n_ctx: int,
                   context_shift: bool) -> int:
    """Tokens a request may generate: ``max_tokens`` within the context's room (all of it
    when ``max_tokens`` is 0), or ``max_tokens`` when the context shifts once full."""
    room = n_ctx - n_prompt
    if context_shift and params.max_tokens > 0:
        return params.max_tokens
    return min(params.max_tokens, room) if params.max_tokens > 0 else room


class Generation:
    """One sequence's sampling side: its sampler chain, text stream and the rule that ends it
    (an end-of-generation token or a stop string: "stop"; ``max_new`` tokens: "length")."""

    def __init__(self, engine, params: SamplingParams, max_new: int,
                 sampler: Sampler | None = None):
        """``sampler``: the chain, when built already (off the thread that decodes)."""
        self.engine, self.params, self.max_new = engine, params, max_new
        self.sampler = sampler or Sampler(params, engine.n_vocab, engine.vocab_ptr)
        self.stream = TextStream(params.stop)
        self.generated = 0
        self.finish: str | None = "length" if max_new <= 0 else None

    def sample(self, index: int) -> GenerationChunk | None:
        """Sample from the engine's output row ``index`` (-1: the last): the token's chunk,
        or None at an end-of-generation token; ``finish`` says when this was the last."""
        engine = self.engine
        token, logprob = sample_token(engine, self.sampler, index, self.params)
        if engine._ll.llama_vocab_is_eog(engine.vocab_ptr, token):  # noqa: SLF001
            self.finish = "stop"
            return None
        self.generated += 1
        text = self.stream.feed(engine.token_bytes(token))
        if self.stream.stopped:
            self.finish = "stop"
        elif self.generated >= self.max_new:
            self.finish = "length"
        return GenerationChunk(text=text, token=token, logprob=logprob)

    def close(self) -> None:
        self.sampler.close()
