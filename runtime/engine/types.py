"""The records that cross the engine's boundary: settings in, chunks and timings out."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from runtime.errors import UserError


# llama_flash_attn_type: AUTO = -1, DISABLED = 0, ENABLED = 1
FLASH_ATTN = {"auto": -1, "off": 0, "on": 1}


@dataclass
class EngineSettings:
    """How to load and run one model. Defaults follow llama.cpp's tools where they differ
    from llama-cpp-python's ``Llama``."""

    model_path: str
    n_ctx: int = 4096                  # tokens; 0 = the model's training context
    n_threads: int | None = None       # decode threads; None = cpu_count // 2 (as Llama)
    n_gpu_layers: int = 0              # layers whose dense weights go to the GPU; -1 = all
    n_batch: int = 2048                # max tokens per llama_decode call
    n_ubatch: int = 512                # max tokens per graph evaluation
    seed: int = -1                     # default sampling seed; -1 = random
    config_path: str | None = None     # residency TOML; None = defaults
    manage_residency: bool = True      # False: plain llama.cpp placement, no hook
    verbose: bool = False              # show llama.cpp's own log on stderr
    n_threads_batch: int | None = None  # prefill threads; None = n_threads, or cpu_count
    capture_all_tokens: bool = False   # route every prompt token of every layer (recording);
                                       # requests logits for every prompt token
    lib_dir: str | None = None         # directory of a patched libllama.so; None = this install's
    config: Any = None                 # a built ResidencyConfig; wins over config_path
    profile_path: str | None = None    # a routing profile warm-starting the learned policies
    flash_attn: str = "off"            # "on" | "off" | "auto"; off = llama-cpp-python's default
    n_parallel: int = 1                # KV sequences (slots) for runtime.engine.batched;
    #                                    each gets n_ctx / n_parallel tokens, as llama-server
    kv_unified: bool = False           # with n_parallel > 1: one KV pool that every slot may
    #                                    fill up to n_ctx (llama-server's --kv-unified)
    context_shift: bool = False        # a full context drops its oldest half and goes on
    embeddings: bool = False           # a context for embeddings (runtime.engine.embedding)
    pooling: str | None = None         # none | mean | cls | last | rank; None: the model's
    route_trace: Any = None            # a routing trace's path, or its ImposedRouting, whose
    #                                    routing the model takes (imposed_routing.py)
    repack: bool | None = None         # CPU weight repacking (llama.cpp's extra buffer types);
    #                                    None: off when a device cache attaches (its cold
    #                                    path skips resident experts only over plain buffers),
    #                                    else llama.cpp's default (on)
                                       # (same logits as plain Llama(), hence the parity)
    tensor_rules: tuple[tuple[str, str], ...] = ()   # llama.cpp's static placement (-ot,
    #                                    --n-cpu-moe): (regex, buffer type), ahead of ours
    use_mmap: bool = True              # False: read the weights into buffers (--no-mmap)
    use_mlock: bool = False            # lock the model's pages in RAM (--mlock)
    # LoRA adapters (--lora, --lora-scaled): (path, scale) each, in id order; runtime.engine.lora
    lora: tuple[tuple[str, float], ...] = ()
    lora_init_without_apply: bool = False   # the adapters' scales start at 0
    mmproj: str | None = None          # a multimodal projector GGUF (--mmproj): images in
    #                                    prompts (runtime.engine.projector)

    def __post_init__(self) -> None:
        problems = []
        if self.n_ctx < 0:
            problems.append(f"ctx-size {self.n_ctx} must be >= 0")
        if self.n_batch < 1 or self.n_ubatch < 1:
            problems.append("batch-size and ubatch-size must be >= 1")
        for name in ("n_threads", "n_threads_batch"):
            value = getattr(self, name)
            if value is not None and value < 1:
                problems.append(f"{name.replace('n_', '', 1)}={value} must be >= 1")
        if not 1 <= self.n_parallel <= 64:
            problems.append(f"parallel={self.n_parallel} must be in 1..64")
        if self.flash_attn not in FLASH_ATTN:
            problems.append(f"flash-attn {self.flash_attn!r} must be one of {', '.join(FLASH_ATTN)}")
        if problems:
            raise UserError(f"{self.model_path}: " + "; ".join(problems))


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True)
class Timings:
    """One generation's speed, and the residency manager's view of it."""

    prompt_tokens: int          # tokens actually evaluated (a reused KV prefix is not)
    prompt_s: float             # seconds in prefill decode calls
    completion_tokens: int
    generation_s: float         # seconds from the end of prefill to the last token
    expert_hits: int | None = None     # accesses served by the fast tier (None: unmanaged)
    expert_accesses: int | None = None

    @property
    def prompt_tps(self) -> float:
        return self.prompt_tokens / self.prompt_s if self.prompt_s > 0 else 0.0

    @property
    def generation_tps(self) -> float:
        return self.completion_tokens / self.generation_s if self.generation_s > 0 else 0.0

    @property
    def hit_rate(self) -> float | None:
        if not self.expert_accesses:
            return None
        return (self.expert_hits or 0) / self.expert_accesses

    def summary(self) -> str:
        """The closing line the CLI prints on stderr."""
        hit = "n/a (residency off)" if self.expert_accesses is None else (
            "n/a" if self.hit_rate is None else f"{100 * self.hit_rate:.1f}%")
        return (f"prompt: {self.prompt_tokens} tok, {self.prompt_tps:.1f} t/s | "
                f"generation: {self.completion_tokens} tok, {self.generation_tps:.1f} t/s | "
                f"expert hit rate: {hit}")


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token's log-probability under the model (log-softmax of its raw logits,
    before any sampler), and the ``k`` most likely tokens at that step, most likely first."""

    token: int
    piece: bytes                            # the token's bytes (control tokens: b"")
    logprob: float
    top: tuple[tuple[int, bytes, float], ...] = ()   # (token, piece, logprob)


@dataclass(frozen=True, slots=True)
class PromptProgress:
    """How far the prompt's evaluation is (tokens; ``processed`` counts the reused prefix)."""

    total: int
    cached: int             # reused from the KV cache, not evaluated
    processed: int          # cached + evaluated so far
    elapsed_s: float        # seconds since the prompt's evaluation began


@dataclass(frozen=True)
class GenerationChunk:
    """One generated token's text (may be "" while UTF-8 or a possible stop string is held
    back). The last chunk has ``token=None``, ``finish_reason``, ``usage`` and ``timings``.
    finish_reason: "stop" (end-of-generation token or stop string), "length", or
    "cancelled" (the caller's cancel event was set)."""

    text: str
    token: int | None
    finish_reason: str | None = None
    usage: Usage | None = None
    timings: Timings | None = None
    logprob: TokenLogprob | None = None     # with SamplingParams.logprobs (token chunks)
    progress: PromptProgress | None = None  # with generate(progress=True): text "", no token


class ContextLengthError(UserError):
    """The prompt does not fit the context (the server maps it to context_length_exceeded)."""

    def __init__(self, prompt_tokens: int, n_ctx: int):
        super().__init__(f"prompt has {prompt_tokens} tokens; the context holds {n_ctx}")
        self.prompt_tokens, self.n_ctx = prompt_tokens, n_ctx


CANCELLED = "cancelled"     # finish_reason of a generation its cancel event stopped


class KVCacheFullError(RuntimeError):
    """A unified KV pool has no room left for the next batch (the slots share it)."""


class EngineBusyError(RuntimeError):
    """``generate`` was called while another generation is running on this engine."""


class ModelFileChanged(UserError):
    """The model file is not the one loaded any more (truncated, replaced or rewritten: its
    device, inode, size or modification time differ), so no batch runs: llama.cpp reads the
    weights through a mapping of it, and a page past a cut end is a SIGBUS. ``first``: the
    first failure since the change was seen (the server logs that one)."""

    def __init__(self, path: str, change: str, first: bool = False):
        super().__init__(f"{path}: the model file changed under the running server ({change}); "
                         "restore it as it was, or restart the server")
        self.path, self.change, self.first = path, change, first


class NonFiniteLogits(UserError):
    """The model's output row holds NaN or Inf (broken weights, e.g. a damaged file, or a
    broken restored state): nothing is sampled from it, and the sequence's KV is dropped. A
    one-line error on the command line; the server's 500 (the model's fault, not the
    request's)."""


@dataclass(frozen=True, slots=True)
class Fault:
    """A broken part of a running engine, as ``/health`` reports it."""

    component: str          # "model_file", "profile_writer"
    message: str            # one line naming the file and what happened
    serving: bool           # True: generations go on without the part; False: they fail


def check_token_ids(tokens, n_vocab: int, what: str) -> None:
    """UserError naming the first id of ``tokens`` outside ``[0, n_vocab)``: the engine's
    own guard, under the server's (llama.cpp checks none of them and aborts on a bad one)."""
    for t in tokens:
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < n_vocab:
            raise UserError(f"{what}: token id {t} is outside the vocabulary (n_vocab "
                            f"{n_vocab}: ids 0..{n_vocab - 1})")
