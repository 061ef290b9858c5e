"""llama.cpp's flags with llama.cpp's meaning: static tensor placement (``-ot``,
``--n-cpu-moe``, ``--cpu-moe``) as override rules, and one line for each llama.cpp flag these
commands do not take, naming what does the job here.

    rules = placement_rules(args)           # [(regex, "CPU" | "CUDA0" | ...)], first match wins
    line = equivalent_line(sys.argv[1:])    # "" or "-ctk: ... here: ..."

Pure: no llama.cpp. A rule's buffer type is resolved to a pointer at load time
(``runtime.engine.residency_setup.buffer_type``).
"""
from __future__ import annotations

import argparse
import re

from runtime.errors import UserError

# llama.cpp's LLM_FFN_EXPS_REGEX and llm_ffn_exps_block_regex (common/common.h)
FFN_EXPS_REGEX = r"\.ffn_(up|down|gate|gate_up)_(ch|)exps"


def block_exps_regex(layer: int) -> str:
    """The routed-expert tensors of one layer, as llama.cpp's ``--n-cpu-moe`` names them."""
    return rf"blk\.{layer}{FFN_EXPS_REGEX}"


# llama.cpp flags no command here takes -> what does that job here (one line each)
_KV_TYPE = "the KV cache is f16 here (llama.cpp's default); there is no flag for its type"
_SPLIT = ("layers go to GPUs by -ngl, experts by the residency budgets (--devices.cuda:0 SIZE, "
          "--devices.cuda:1 SIZE); remote machines by `moe-offload plan --rpc HOST:PORT`")
_DRAFT = "speculative decoding (a draft model) is not supported here"
_UNTAKEN: dict[tuple[str, ...], str] = {
    ("-ctk", "--cache-type-k", "-ctv", "--cache-type-v"): _KV_TYPE,
    ("-dev", "--device"): _SPLIT, ("-ts", "--tensor-split"): _SPLIT,
    ("-sm", "--split-mode"): _SPLIT, ("-mg", "--main-gpu"): _SPLIT,
    ("--rpc",): "remote devices are residency devices here: `moe-offload plan --rpc "
                "HOST:PORT` writes the config that names them",
    ("-fit", "--fit", "--fit-target", "--fit-ctx"): "--auto plans the placement from this "
                                                    "machine's free memory",
    ("-md", "--model-draft", "--draft", "--draft-max", "--draft-min", "-ngld",
     "--gpu-layers-draft", "-cd", "--ctx-size-draft", "--spec-replace"): _DRAFT,
    ("--lora", "--lora-scaled", "--lora-init-without-apply", "--control-vector"):
        "LoRA adapters and control vectors are not supported here",
    ("--mmproj-url", "-mmu"): "download the mmproj GGUF and give --mmproj FILE",
    ("--image", "--audio"): "images go in requests to `moe-offload serve --mmproj FILE` "
                            "(image_url parts); audio is not supported here",
    ("-cnv", "--conversation", "-i", "--interactive", "-if", "--interactive-first"):
        "`moe-offload chat -m MODEL` is the interactive conversation",
    ("-st", "--single-turn"): "`moe-offload complete -m MODEL -p PROMPT` answers once",
    ("-nkvo", "--no-kv-offload"): "the KV cache follows -ngl here",
    ("--numa",): "NUMA placement is left to the kernel here",
    ("-C", "--cpu-mask", "-Cr", "--cpu-range", "--prio", "--poll", "--cpu-strict"):
        "thread placement is left to the kernel here; -t N sets the thread count",
    ("--log-file", "--log-disable", "--log-colors", "--log-verbosity", "-lv", "--log-prefix",
     "--log-timestamps"): "logs go to stderr; -v shows llama.cpp's own log",
    ("-mu", "--model-url", "-dr", "--docker-repo"):
        "-hf USER/MODEL[:QUANT] downloads from Hugging Face; anything else: download it and "
        "give -m FILE",
    ("-hft", "--hf-token"): "huggingface_hub reads the token from HF_TOKEN or "
                            "`hf auth login`",
    ("-hfv", "--hf-repo-v", "-hffv", "--hf-file-v"): "vocoders are not supported here",
    ("--mirostat", "--mirostat-lr", "--mirostat-ent", "--dynatemp-range", "--dynatemp-exp",
     "--xtc-probability", "--xtc-threshold", "--typical", "--dry-multiplier",
     "--presence-penalty", "--frequency-penalty", "--samplers", "--sampling-seq",
     "--logit-bias", "-l"):
        "on the command line: --temp --top-p --top-k --min-p --repeat-penalty; the server "
        "takes the other samplers as request fields",
    ("--grammar", "--grammar-file", "-j", "--json-schema", "-jf", "--json-schema-file"):
        "structured output is a request field of `moe-offload serve` (response_format, "
        "grammar, json_schema)",
    ("--rope-scaling", "--rope-scale", "--rope-freq-base", "--rope-freq-scale", "--yarn-orig-ctx",
     "--yarn-ext-factor", "--yarn-attn-factor", "--yarn-beta-slow", "--yarn-beta-fast"):
        "RoPE settings come from the model file here",
    ("--override-kv",): "model metadata comes from the file here (gguf_tools edits a copy)",
    ("-dt", "--defrag-thold", "--swa-full", "--ctx-checkpoints", "--swa-checkpoints"):
        "the KV cache is laid out by llama.cpp's defaults here (serve: -kvu)",
    ("-nocb", "--no-cont-batching"): "serve -np 1 answers one request at a time",
    ("--cache-reuse",): "serve reuses a slot's KV prefix by itself (--cache-ram keeps more)",
    ("-sps", "--slot-prompt-similarity"): "serve -np N picks the slot with the longest "
                                          "common prefix by itself",
    ("--models-dir", "--models-max", "--models-preset", "--no-models-autoload"):
        "serve runs the one model it was started with (no router mode)",
    ("--rerank", "--reranking"): "reranking is not served here",
    ("--chat-template-kwargs",): "each request's chat_template_kwargs (serve --reasoning off "
                                 "sets enable_thinking=false)",
    ("--reasoning-budget",): "serve --reasoning off, or a request's reasoning_effort",
    ("-lcs", "--lookup-cache-static", "-lcd", "--lookup-cache-dynamic"): _DRAFT,
    ("--ssl-key-file", "--ssl-cert-file"): "serve speaks plain HTTP: put a TLS proxy in front",
    ("--api-key-file",): "--api-key KEY, or the MOE_OFFLOAD_API_KEY environment variable",
    ("-to", "--timeout", "--threads-http"): "serve's HTTP timeouts and threads are uvicorn's",
    ("--path", "--api-prefix"): "serve's routes are fixed (llama-server's and OpenAI's)",
    ("--no-warmup", "--warmup"): "there is no warm-up run here",
    ("-e", "--escape", "--no-escape"): "prompts are taken as written here",
    ("--no-perf",): "the timings line goes to stderr; redirect it to drop it",
    ("--check-tensors",): "`moe-offload inspect MODEL` reads and checks the file",
}
UNTAKEN: dict[str, str] = {flag: why for flags, why in _UNTAKEN.items() for flag in flags}


def equivalent_line(argv: list[str], known: set[str] = frozenset()) -> str:
    """One line for the first llama.cpp flag in ``argv`` that the command does not take (not
    in ``known``: the parsers' own flags), naming the equivalent; "" when there is none.
    Stops at ``--``."""
    for token in argv:
        if token == "--":
            break
        flag = token.split("=", 1)[0]
        why = None if flag in known else UNTAKEN.get(flag)
        if why is not None and token.startswith("-"):
            return f"{flag} is llama.cpp's flag; {why}"
    return ""


def add_placement_args(group: argparse._ArgumentGroup) -> None:
    """llama.cpp's static placement flags (rules ahead of the residency manager's)."""
    group.add_argument("-ot", "--override-tensor", action="append", default=[],
                       metavar="REGEX=BUFT[,...]",
                       help="llama.cpp's tensor override: tensors whose name matches REGEX "
                            "are loaded into buffer type BUFT (CPU, CUDA0, ...); first match "
                            "wins, ahead of the residency manager's placement")
    group.add_argument("-cmoe", "--cpu-moe", action="store_true",
                       help="keep every routed expert in host memory (what the residency "
                            "manager does already; with --no-residency, llama.cpp's meaning)")
    group.add_argument("-ncmoe", "--n-cpu-moe", type=int, default=None, metavar="N",
                       help="keep the routed experts of the first N layers in host memory; "
                            "a --devices.cuda:0 budget then fills the GPU from layer N on")


def parse_override_tensor(values: list[str]) -> list[tuple[str, str]]:
    """``-ot`` values (``REGEX=BUFT``, comma-separated, repeatable) to rules, in order.
    UserError (one line) for a missing ``=``, an empty part or a regex that does not compile."""
    rules = []
    for value in values:
        for part in value.split(","):
            pattern, sep, buft = part.partition("=")
            if not sep or not pattern or not buft.strip():
                raise UserError(f"-ot {value}: each rule is REGEX=BUFT (e.g. 'exps=CPU'), "
                                f"got {part!r}")
            try:
                re.compile(pattern)
            except re.error as exc:
                raise UserError(f"-ot {value}: {pattern!r} is not a regex ({exc})") from None
            rules.append((pattern, buft.strip()))
    return rules


def placement_rules(args: argparse.Namespace) -> list[tuple[str, str]]:
    """The static rules these flags give, in llama.cpp's order: ``-ot`` first, then
    ``--cpu-moe`` / ``--n-cpu-moe`` (llama.cpp appends those to the overrides)."""
    rules = parse_override_tensor(list(getattr(args, "override_tensor", None) or []))
    n_cpu_moe = getattr(args, "n_cpu_moe", None)
    if n_cpu_moe is not None and n_cpu_moe < 0:
        raise UserError(f"--n-cpu-moe: {n_cpu_moe} must be >= 0")
    if getattr(args, "cpu_moe", False):
        rules.append((FFN_EXPS_REGEX, "CPU"))
    elif n_cpu_moe:
        rules += [(block_exps_regex(i), "CPU") for i in range(n_cpu_moe)]
    return rules


def cpu_expert_layers(rules: list[tuple[str, str]], expert_tensors: dict[int, list[str]]
                      ) -> tuple[int, ...]:
    """MoE layers whose routed-expert tensors the first matching rule sends to the CPU.
    ``expert_tensors``: layer -> its routed-expert tensor names."""
    out = []
    for layer, names in sorted(expert_tensors.items()):
        if names and all(_target(rules, name) == "cpu" for name in names):
            out.append(layer)
    return tuple(out)


def gpu_expert_tensors(rules: list[tuple[str, str]], names: list[str]) -> list[tuple[str, str]]:
    """(tensor, buffer type) for each routed-expert tensor a rule sends off the CPU."""
    return [(name, buft) for name in names
            if (buft := _first_match(rules, name)) is not None and not _is_cpu(buft)]


def _first_match(rules: list[tuple[str, str]], name: str) -> str | None:
    for pattern, buft in rules:
        if re.search(pattern, name):
            return buft
    return None


def _target(rules: list[tuple[str, str]], name: str) -> str | None:
    buft = _first_match(rules, name)
    return None if buft is None else ("cpu" if _is_cpu(buft) else "gpu")


def _is_cpu(buft: str) -> bool:
    return buft.upper() in ("CPU", "CPU_MAPPED")
