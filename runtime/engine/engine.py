"""Engine: one GGUF model on llama.cpp, generating token by token, with its routing feeding
the residency manager live.

    engine = Engine(EngineSettings(model_path="model.gguf"))
    for chunk in engine.generate("Once upon a time", SamplingParams(max_tokens=32)):
        print(chunk.text, end="")
    engine.close()

Load order: model facts and residency config (cheap checks first), then the manager and the
placement it implies (``tensor_buft_overrides``), then the model, the context (with the routing
hook as ``cb_eval`` when residency is managed or routes are recorded), then the optional tiers
(``runtime.ramtier``, ``runtime.native.device_cache``) attach, then the manager's live feed.
"""
from __future__ import annotations

import dataclasses

import os
import sys
import threading
import time
from collections.abc import Callable, Iterator

from gguf_tools.facts import read_model_facts
from runtime.native import interrupt, llama_lib
from runtime.engine import residency_setup as wiring
from runtime.engine.batch import TokenBatch
from runtime.engine.context_shift import shift, shift_plan
from runtime.engine.chat import ChatTemplate
from runtime.engine.model_text import ModelText
from runtime.engine.loading import (load_with_progress, make_context_params, thread_counts,
                                    thread_tuner)
from runtime.engine.placement import Placement
from runtime.engine.projector import MediaPrompt
from runtime.engine.prompt_cache import common_prefix
from runtime.engine.hook.imposed_routing import imposed_for
from runtime.engine.hook.c_hook import CHook
from runtime.engine.hook.config import HookConfig
from runtime.engine.hook.events import RouteObserver
from runtime.engine.decode import Generation, decode, max_new_tokens
from runtime.engine.model_file import ModelFileWatch
from runtime.engine.sampling import SamplingParams
from runtime.engine.types import (ContextLengthError, EngineBusyError, EngineSettings, Fault,
                                  GenerationChunk, NonFiniteLogits, PromptProgress, Timings,
                                  Usage, check_token_ids)
from runtime.errors import UserError
from runtime.residency.types import Phase

__all__ = ["Engine", "EngineSettings", "SamplingParams", "GenerationChunk"]


class Engine(ModelText):
    """A loaded model and its context; one generation at a time (see contracts.md)."""

    def __init__(self, settings: EngineSettings, *, progress: bool = True,
                 placement: Placement | None = None):
        """``placement``: fixed load-time override rules instead of the planned ones (the
        static ``--n-cpu-moe`` baselines, runtime.engine.placement.cpu_moe_placement)."""
        self.settings = settings
        self._progress = progress
        self.model_ptr = self.ctx_ptr = 0
        self.lora = None                    # runtime.engine.lora.LoraAdapters with --lora
        self.projector = None               # runtime.engine.projector.Projector with --mmproj
        self.decode_calls = 0               # llama_decode calls so far (metrics)
        self._batch = None
        self._attached: list[object] = []
        self.model_file: ModelFileWatch | None = None   # checked before each batch (decode.py)
        self._fault_sources: list[Callable[[], Fault | None]] = []
        path = settings.model_path
        check_model_path(path)
        self.facts = read_model_facts(path)
        self.model_name = os.path.basename(path)
        self.config = wiring.residency_config(settings)
        lib_dir = wiring.library_dir(settings, self.config)
        llama_lib.select_library_dir(lib_dir)
        self._ll = llama_lib.bindings()
        llama_lib.set_logging(settings.verbose)
        has_gpu = bool(wiring.gpu_devices())
        self.remote = None                   # runtime.rpc.setup.RemoteSetup: rpc devices
        remote_config = wiring.remote_config(settings, self.config)
        if remote_config is not None:
            from runtime.rpc.setup import setup_remotes  # noqa: PLC0415

            self.remote = setup_remotes(remote_config, self.facts, settings)
        self.manager, self.residency_devices = wiring.build_manager(
            self.config, self.facts, has_gpu=has_gpu, profile_path=settings.profile_path,
            remote=self.remote)
        device_cache = settings.manage_residency and wiring.device_cache_ready(self.config, lib_dir)
        self.placement = placement if placement is not None else wiring.plan(
            settings, self.config, self.facts, self.manager, has_gpu=has_gpu,
            device_cache=device_cache)
        remote_rules = list(self.remote.rules) if self.remote is not None else []
        self._overrides = llama_lib.BuftOverrides(remote_rules + [
            (pattern, wiring.buffer_type(target)) for pattern, target in self.placement.rules])
        self.lazy_experts = wiring.lazy_experts(settings, self.config, self.placement, lib_dir)
        # with lazy experts the RAM tier budgets host memory: dense weights stay in the mapping
        # (read once) rather than also copied into repacked anonymous buffers
        repack = settings.repack if settings.repack is not None else \
            not (device_cache or self.lazy_experts)
        self._check_memory(has_gpu)
        llama_lib.set_logging(settings.verbose).buffers.clear()   # this load's buffer lines only
        if settings.use_mmap:     # the weights are read through a mapping of the file: watched
            self.model_file = ModelFileWatch(path, guard=True)   # leased where serve can
            self._fault_sources.append(self.model_file.fault)
        try:
            self.model_ptr = load_with_progress(settings, self._overrides, progress=progress,
                                                repack=repack, remote=self.remote,
                                                lazy_experts=self.lazy_experts)
            self.lora = self._load_lora()
            self._init_context()
            self.projector = self._load_projector()
            if self.remote is not None:     # what llama.cpp really put on each remote
                self.remote.verify_buffers(llama_lib.set_logging(settings.verbose).buffers)
        except BaseException:
            self.close()
            raise

    def _load_lora(self):
        """The --lora adapters (runtime.engine.lora), or None without any."""
        if not self.settings.lora:
            return None
        from runtime.engine.lora import LoraAdapters  # noqa: PLC0415

        log = llama_lib.set_logging(self.settings.verbose)
        return LoraAdapters.load(self._ll, self.model_ptr, self.settings.lora,
                                 without_apply=self.settings.lora_init_without_apply,
                                 last_error=log.last_error)

    def _load_projector(self):
        """The --mmproj projector (runtime.engine.projector), or None without one."""
        if not self.settings.mmproj:
            return None
        from runtime.engine.projector import Projector  # noqa: PLC0415

        return Projector.load(self.model_ptr, self.settings.mmproj,
                              n_threads=thread_counts(self.settings)[1],
                              use_gpu=self.settings.n_gpu_layers != 0,
                              verbose=self.settings.verbose)

    def _use_lora(self, request: dict[int, float] | None) -> None:
        """Put a request's LoRA scales (None: the global ones) on the context; the KV cache
        was computed with other weights when they change, so it is forgotten."""
        if self.lora is not None and self.lora.apply(self.ctx_ptr, self.lora.scales_for(request)):
            self._forget_from(0)

    def _check_memory(self, has_gpu: bool) -> None:
        """Refuse in one line a load that does not fit the memory cgroup / available memory
        (runtime.engine.memory_check), instead of the OOM killer's silent -9 part way."""
        from runtime.engine import memory_check  # noqa: PLC0415

        tier = 0          # the RAM tier's experts are page cache the kernel may reclaim ...
        if self.manager is not None and "cpu" in {b.device for b in self.config.devices}:
            from runtime.ramtier import RamTierOptions  # noqa: PLC0415

            if RamTierOptions.from_env().mlock:            # ... unless it locks them
                tier = self.manager.capacity("cpu") or 0
        on_gpu = (has_gpu or self.remote is not None) and self.settings.n_gpu_layers != 0
        need = memory_check.load_need(self.settings, self.facts, on_gpu=on_gpu,
                                      ram_tier_bytes=tier)
        memory_check.check_fits(self.settings.model_path, need, memory_check.memory_room())

    def _init_context(self) -> None:
        settings = self.settings
        self.hook = None
        self.imposed = imposed_for(settings.route_trace, self.facts)
        if settings.manage_residency or settings.capture_all_tokens or self.imposed:
            moe_layers = self.facts.moe_layers
            if self.remote is not None:    # whole layers remote: reading their routing would
                remote = self.remote.remote_whole_layers()   # cost a round trip each
                moe_layers = tuple(layer for layer in moe_layers if layer not in remote)
            self.hook = CHook(HookConfig(self.facts.n_layer, tuple(moe_layers),
                                         self.facts.n_expert_used,
                                         strict=settings.capture_all_tokens))
            if self.imposed is not None:
                self.hook.impose(self.imposed, self.facts.n_expert)
        params = make_context_params(settings, self.hook)
        try:
            with interrupt.deferred():
                self.ctx_ptr = llama_lib.new_context(self.model_ptr, params)
        except RuntimeError as exc:
            raise UserError(f"{settings.model_path}: cannot create a context ({exc})") from None
        # the threads each llama_decode runs on (decode.py sets them per call), in pools that
        # live as long as the context
        self.threads = thread_tuner(settings)
        self.threads_now = thread_counts(settings)[1]
        self._threadpools = llama_lib.Threadpools(self.ctx_ptr, *thread_counts(settings))
        # Ctrl-C inside a decode stops the graph at the next node (see interrupt.py)
        self._ll.llama_set_abort_callback(self.ctx_ptr, *interrupt.abort_callback(self._ll))
        self._vocab = self._ll.llama_model_get_vocab(self.model_ptr)
        self.vocab_ptr = self._vocab          # llama_vocab * (grammar checks)
        # tokens one sequence can hold (the whole context unless it is split into slots; a
        # unified pool lets each slot fill it all, the slots together too): the requested -c
        # (llama.cpp pads its context up, per sequence too; llama-server's slots keep -c / -np)
        n_ctx = int(self._ll.llama_n_ctx(self.ctx_ptr))
        if settings.n_ctx > 0:
            n_ctx = min(n_ctx, settings.n_ctx)
        self.n_ctx = n_ctx // (1 if settings.kv_unified else max(1, settings.n_parallel))
        self.n_batch = int(self._ll.llama_n_batch(self.ctx_ptr))
        self.n_ubatch = int(self._ll.llama_n_ubatch(self.ctx_ptr))
        self.n_vocab = int(self._ll.llama_vocab_n_tokens(self._vocab))
        self._batch = TokenBatch(self.n_batch)
        self._kv: list[int] = []            # tokens in the KV cache, sequence 0, in order
        self._busy = threading.Lock()
        self._turn = 0
        self._template: ChatTemplate | None = None
        self._attached = wiring.attach_tiers(self)

    # -- public API -------------------------------------------------------------------------

    @property
    def tiers(self) -> tuple[object, ...]:
        """The residency tiers attached to this engine (RAM tier, device caches)."""
        return tuple(self._attached)

    def add_fault_source(self, source: Callable[[], Fault | None]) -> None:
        """Report ``source()`` (a broken part, or None) in ``faults()``: /health asks."""
        self._fault_sources.append(source)

    def faults(self) -> list[Fault]:
        """What is broken now: the model file changed, a writer stopped ..."""
        return [f for f in (source() for source in self._fault_sources) if f is not None]

    def add_route_observer(self, observer: RouteObserver) -> None:
        """Receive every route event (requires the hook: residency on, or recording)."""
        if self.hook is None:
            raise RuntimeError("routing hook is off (manage_residency=False): no route events")
        self.hook.add_observer(observer)

    def generate(self, prompt: str | list[int] | MediaPrompt, params: SamplingParams, *,
                 cancel: threading.Event | None = None, progress: bool = False,
                 reuse_prefix: bool = True) -> Iterator[GenerationChunk]:
        """Stream the completion of ``prompt``. Raises ContextLengthError at once when the
        prompt does not fit; the iterator raises EngineBusyError if another one is running.
        ``progress``: chunks with ``progress`` before the prompt's first batch and after each;
        ``reuse_prefix=False`` evaluates the whole prompt (llama-server's cache_prompt=false);
        a MediaPrompt (``self.projector.prompt``) carries images."""
        media = prompt if isinstance(prompt, MediaPrompt) else None
        if media is not None:
            check_token_ids(media.text_ids(), self.n_vocab, "prompt")
            if len(media) >= self.n_ctx:
                raise ContextLengthError(len(media), self.n_ctx)
            return self._run(list(media.tokens), params, cancel, progress, reuse_prefix, media)
        tokens = self.tokenize(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        if not tokens:
            bos = self._ll.llama_vocab_bos(self._vocab)
            if bos < 0:
                raise UserError("prompt: empty, and the model has no BOS token")
            tokens = [bos]
        check_token_ids(tokens, self.n_vocab, "prompt")
        if len(tokens) >= self.n_ctx:
            raise ContextLengthError(len(tokens), self.n_ctx)
        return self._run(tokens, params, cancel, progress, reuse_prefix)

    def reset(self) -> None:
        """Forget the KV cache: the next prompt is evaluated from its first token."""
        with self._busy:
            self._forget_from(0)

    def close(self) -> None:
        """Free the context and model (idempotent)."""
        for part in reversed(self._attached):
            close = getattr(part, "close", None)
            if close is not None:
                close()
        self._attached.clear()
        if self.projector is not None:
            self.projector.close()
        if self._batch is not None:
            self._batch.close()
            self._batch = None
        if self.ctx_ptr:
            self._ll.llama_free(self.ctx_ptr)
            self.ctx_ptr = 0
        pools = getattr(self, "_threadpools", None)
        if pools is not None:          # after the context: it no longer uses them
            pools.forget_context()
            pools.close()
            self._threadpools = None
        if self.model_ptr:
            self._ll.llama_model_free(self.model_ptr)
            self.model_ptr = 0
        if self.model_file is not None:
            self.model_file.close()             # its leases: nothing reads the file now

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- generation -------------------------------------------------------------------------

    def _run(self, tokens: list[int], params: SamplingParams, cancel: threading.Event | None,
             progress: bool = False, reuse_prefix: bool = True,
             media: MediaPrompt | None = None) -> Iterator[GenerationChunk]:
        if not self._busy.acquire(blocking=False):
            raise EngineBusyError("the engine is already generating")
        gen = None
        try:
            if self.hook is not None:
                self.hook.turn = self._turn
            self._turn += 1
            if self.imposed is not None:
                params = self._imposed_params(len(tokens), params)
            self._use_lora(params.lora)
            before = self._counters()
            t0 = time.perf_counter()
            steps = self._prefill(tokens, cancel, reuse_prefix, media)
            while True:                        # the prefill's progress, then its result
                try:
                    report = next(steps)
                except StopIteration as done:
                    evaluated = done.value
                    break
                if progress:
                    yield GenerationChunk(text="", token=None, progress=report)
            t1 = time.perf_counter()
            max_new = max_new_tokens(params, len(tokens), self.n_ctx, self.settings.context_shift)
            if self.imposed is not None:             # no token past the trace's positions
                max_new = min(max_new, self.imposed.n_positions - len(tokens) + 1)
            gen = Generation(self, params, max_new)
            while gen.finish is None:
                if cancel is not None and cancel.is_set():
                    gen.finish = "cancelled"
                    break
                chunk = gen.sample(-1)
                if chunk is None:
                    break
                yield chunk
                if gen.finish is None:
                    if len(self._kv) >= self.n_ctx:
                        keep, drop = shift_plan(len(self._kv), params.n_keep, len(tokens))
                        shift(self._ll, self.ctx_ptr, 0, len(self._kv), keep, drop)
                        del self._kv[keep:keep + drop]
                    self._decode([chunk.token], len(self._kv), Phase.DECODE)
            finish = "cancelled" if evaluated is None else gen.finish
            generated = gen.generated
            t2 = time.perf_counter()
            hits, accesses = self._counters_since(before)
            timings = Timings(prompt_tokens=evaluated or 0, prompt_s=t1 - t0,
                              completion_tokens=generated, generation_s=t2 - t1,
                              expert_hits=hits, expert_accesses=accesses)
            yield GenerationChunk(text=gen.stream.finish(), token=None, finish_reason=finish,
                                  usage=Usage(len(tokens), generated), timings=timings)
        except NonFiniteLogits:
            self._forget_from(0)           # NaN/Inf in the KV too: the next prompt starts clean
            raise
        finally:
            if gen is not None:
                gen.close()
            self._busy.release()

    def _imposed_params(self, n_prompt: int, params: SamplingParams) -> SamplingParams:
        """Imposed routing plays the trace to its end (or -n): the request must fit in the
        trace's positions, and end-of-generation tokens are suppressed (llama.cpp's
        --ignore-eos), so a random model's early EOS cannot cut the trace short."""
        self.imposed.check_request(n_prompt, params.max_tokens if params.max_tokens > 0
                                   else self.imposed.max_new_tokens)
        bias = dict(params.logit_bias)
        bias.update({t: float("-inf") for t in self.eog_tokens() if t >= 0})
        return dataclasses.replace(params, logit_bias=bias)

    def _prefill(self, tokens: list[int], cancel: threading.Event | None,
                 reuse_prefix: bool = True,
                 media: MediaPrompt | None = None) -> Iterator[PromptProgress]:
        """Bring the KV cache to ``tokens`` (reusing the longest common prefix), yielding the
        progress before the first batch and after each; returns (StopIteration's value) the
        number of tokens evaluated, or None when cancelled. ``media``: the images among the
        tokens, each evaluated whole in its place (runtime.engine.projector)."""
        keep = common_prefix(self._kv, tokens)
        keep = min(keep, len(tokens) - 1) if reuse_prefix else 0   # the last one: always
        if media is not None:
            keep = media.snap(keep)
        self._forget_from(keep)
        bar = None
        if self._progress and len(tokens) - keep > self.n_batch:   # a bar once a long prompt
            from tqdm import tqdm  # noqa: PLC0415                  # passes 2 s

            bar = tqdm(total=len(tokens) - keep, desc="prompt", unit="tok", delay=2.0,
                       leave=False, file=sys.stderr, disable=None)
        t0 = time.perf_counter()
        report = lambda done: PromptProgress(  # noqa: E731 - nothing evaluated yet: 0 s
            len(tokens), keep, done, time.perf_counter() - t0 if done > keep else 0.0)
        try:
            yield report(keep)
            start = keep
            while start < len(tokens):
                if cancel is not None and cancel.is_set():
                    return None
                if media is not None and start in media.images:
                    end = self._decode_image(media.images[start], tokens)
                else:
                    end = min(start + self.n_batch,
                              media.next_image(start) if media is not None else len(tokens))
                    self._decode(tokens[start:end], start, Phase.PREFILL)
                if bar is not None:
                    bar.update(end - start)
                start = end
                yield report(start)
        finally:
            if bar is not None:
                bar.close()
        return len(tokens) - keep

    def _decode_image(self, span, tokens: list[int]) -> int:
        """Evaluate the image ``span`` into sequence 0 at its place; the index after it."""
        from runtime.engine.projector import decode_image  # noqa: PLC0415

        try:
            decode_image(self, span, span.start, 0)
        except BaseException:
            self._forget_from(span.start, failed=True)
            raise
        end = span.start + span.n_pos
        self._kv.extend(tokens[span.start:end])
        return end

    def _decode(self, tokens: list[int], first_pos: int, phase: Phase) -> None:
        all_outputs = self.settings.capture_all_tokens and phase == Phase.PREFILL
        n_outputs = self._batch.fill(tokens, first_pos, all_outputs=all_outputs)
        try:
            decode(self, self._batch, phase, first_pos, len(tokens), n_outputs,
                   f"at position {first_pos}")
        except BaseException:
            self._forget_from(first_pos, failed=True)
            raise
        self._kv.extend(tokens)

    def _forget_from(self, pos: int, *, failed: bool = False) -> None:
        # failed: a decode that stopped part-way may have written cells at pos.. already
        if failed or pos < len(self._kv) or pos == 0:
            memory = self._ll.llama_get_memory(self.ctx_ptr)
            self._ll.llama_memory_seq_rm(memory, 0, pos, -1)
            del self._kv[pos:]

    def _counters(self) -> tuple[int, int] | None:
        """(hits, accesses) on the fastest managed device, or None when unmanaged."""
        if self.manager is None or not self.residency_devices:
            return None
        total = self.manager.snapshot().device(self.residency_devices[0]).total
        return total.hits, total.accesses

    def _counters_since(self, before: tuple[int, int] | None) -> tuple[int | None, int | None]:
        after = self._counters()
        if before is None or after is None:
            return None, None
        return after[0] - before[0], after[1] - before[1]


def check_model_path(path: str) -> None:
    """UserError unless ``path`` is an existing file (a directory is named as such)."""
    if os.path.isdir(path):
        raise UserError(f"{path}: is a directory; -m wants a GGUF model file")
    if not os.path.isfile(path):
        raise UserError(f"{path}: no such model file")

