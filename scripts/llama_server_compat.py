#!/usr/bin/env python3
"""Run ``moe-offload serve`` in place of llama.cpp's ``llama-server``, taking its flags.

llama.cpp's server tests (tools/server/tests) start ``$LLAMA_SERVER_BIN_PATH`` with
llama-server's flags. This maps them onto ``moe-offload serve``: the flags with a meaning here
are translated, the ones about llama-server internals (KV types, draft models, MCP ...) are
dropped with a note on stderr, and a model named by ``--hf-repo`` /
``--model-url`` (which we never download) is replaced by a small synthetic MoE model written
once into ``~/.cache/moe-offload/llama-server-compat/`` (with ``--embedding`` it pools
``mean``, as the tests' embedding models do; with ``--reranking`` it is a synthetic
reranker; a vision model (``VISION``) or ``--mmproj-url`` gets a synthetic projector). Tests whose assertions depend on the text or the vocabulary of llama.cpp's own test
models cannot pass against it; the others can.

Router mode: started without a model, llama-server serves the models of its download cache;
here those the tests name (``CACHED``) are written as a preset of stand-ins (one file each,
so that they differ), added to any ``--models-preset`` given, whose ``hf-repo`` keys become
stand-ins too (keys with no meaning here are dropped, with a note).

    LLAMA_SERVER_BIN_PATH=scripts/llama-server  pytest tools/server/tests/unit/...
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

# flag -> our flag (None: same name), for flags that take a value
VALUE_FLAGS = {
    "--port": None, "--temp": None, "--seed": "-s", "--ctx-size": "-c", "-c": None,
    "--batch-size": "-b", "-b": None, "--ubatch-size": "-ub", "-ub": None,
    "--threads": "-t", "-t": None, "--host": None, "--n-gpu-layers": "-ngl", "-ngl": None,
    "-fa": None, "--flash-attn": "-fa", "--n-predict": "-n", "-n": None, "--api-key": None,
    "--chat-template-file": None, "--chat-template": None, "--top-k": None, "--top-p": None,
    "--min-p": None, "--repeat-penalty": None, "--parallel": "-np", "-np": None,
    "--reasoning": None, "--reasoning-format": None, "--tags": None,
    "--pooling": None, "--slot-save-path": None, "--cache-ram": None,
    "--sleep-idle-seconds": None, "--models-max": None, "--models-dir": None,
    "--lora": None, "--lora-scaled": None,
}
SWITCHES = {"--metrics": "--metrics", "--slots": "--slots", "--no-slots": "--no-slots",
            "--verbose": "-v", "-v": "-v", "--jinja": "--jinja",
            "--kv-unified": "--kv-unified", "--no-ui": "--no-ui", "--no-webui": "--no-ui",
            "--ui-mcp-proxy": "--ui-mcp-proxy",
            "--no-cache-idle-slots": "--no-cache-idle-slots",
            "--cache-idle-slots": "--cache-idle-slots", "--embedding": "--embedding",
            "--embeddings": "--embedding", "--context-shift": "--context-shift",
            "--no-models-autoload": "--no-models-autoload", "--reranking": "--reranking",
            "--rerank": "--reranking", "--lora-init-without-apply": "--lora-init-without-apply"}
# llama-server flags with no counterpart here: (takes a value, why it is dropped)
DROPPED = {
    "--offline": (False, "nothing is downloaded here anyway"),
    "--no-jinja": (False, "templates are always jinja here"),
    "--cont-batching": (False, "always on with -np N"),
    "--swa-full": (False, "default SWA cache"),
    "--backend_sampling": (False, "sampling is llama.cpp's CPU chain"),
    "-ctk": (True, "default KV types"), "-ctv": (True, "default KV types"),
    "--grp-attn-n": (True, "no self-extend"),
    "--grp-attn-w": (True, "no self-extend"),
    "--spec-type": (True, "no speculative decoding"),
    "--spec-draft-n-max": (True, "no speculative decoding"),
    "--spec-draft-n-min": (True, "no speculative decoding"),
    "--spec-synth-len": (True, "no speculative decoding"),
    "--spec-synth-rates": (True, "no speculative decoding"),
    "--draft": (True, "no speculative decoding"), "--draft-max": (True, "no speculative decoding"),
    "--draft-min": (True, "no speculative decoding"),
    "--reasoning-budget": (True, "no reasoning budget"),
    "--reasoning-force-close-message": (True, "no reasoning budget"),
    "--model-draft": (True, "no speculative decoding"),
    "--media-path": (True, "no local media files"),
    "--cache-reuse-hybrid": (True, "no prompt cache"),
    "--cache-reuse-hybrid-min-share": (True, "no prompt cache"),
    "--tools": (True, "no built-in tools"),
    "--tools-runtime": (True, "no built-in tools"),
    "--mcp-servers-config": (True, "no MCP"), "--mcp-servers-json": (True, "no MCP"),
}


# models whose projector llama-server takes from the Hugging Face registry (given a stand-in
# projector here, unless --no-mmproj)
VISION = ("ggml-org/tinygemma3-GGUF",)
# llama-server's download cache as the router tests find it (their models, by cache name)
CACHED = ("ggml-org/tinygemma3-GGUF:Q8_0", "ggml-org/test-model-stories260K:F32",
          "ggml-org/test-model-stories260K-infill:F32", "ggml-org/stories15M_MOE:F16")


def _cache_dir() -> Path:
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return cache / "moe-offload" / "llama-server-compat"


def _written_once(path: Path, write) -> Path:
    """``path``, written by ``write(tmp)`` when it is not there yet (to a temporary file then
    renamed: two servers starting at once find one whole file)."""
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        write(tmp)
        os.replace(tmp, path)
    return path


def synthetic_model(name: str, seed: int = 0, *, reranker: bool = False) -> Path:
    """A small synthetic MoE model standing in for ``name`` (written once; ``seed`` > 0:
    a file of its own, for a router's several models; ``reranker``: with pooling rank and a
    rerank prompt, gguf_tools/synth_adapters.py)."""
    from gguf_tools.synth import SynthSpec, write_synthetic_model
    from gguf_tools.synth_adapters import write_synthetic_reranker

    stem = "stand-in" + ("-reranker" if reranker else "") + (f"-{seed}" if seed else "")
    spec = SynthSpec(arch="qwen3moe", layers=4, experts=8, top_k=2, embd=64, ff=32,
                     dtype="f32", seed=seed, skew=1.0, context_length=8192)
    write = write_synthetic_reranker if reranker else write_synthetic_model
    return _written_once(_cache_dir() / f"{stem}.gguf", lambda tmp: write(tmp, spec))


def synthetic_mmproj() -> Path:
    """A synthetic projector for the stand-in models (gguf_tools/synth_mmproj.py)."""
    from gguf_tools.synth_mmproj import MmprojSpec, write_synthetic_mmproj

    return _written_once(_cache_dir() / "stand-in-mmproj.gguf",
                         lambda tmp: write_synthetic_mmproj(tmp, MmprojSpec(text_embd=64)))


def router_preset(given: str | None) -> Path:
    """A preset of stand-ins: the cache's models, then ``given``'s sections (their
    ``hf-repo`` as a stand-in; keys with no meaning here dropped)."""
    import configparser

    out = configparser.ConfigParser(delimiters=("=",), interpolation=None,
                                    default_section="\x00none")
    out.optionxform = str
    stand_ins: dict[str, Path] = {}

    def stand_in(name: str) -> str:
        if name not in stand_ins:
            stand_ins[name] = synthetic_model(name, seed=len(stand_ins) + 1)
        return str(stand_ins[name])

    for name in CACHED:
        out[name] = {"model": stand_in(name)}
        if name.startswith(VISION):
            out[name]["mmproj"] = str(synthetic_mmproj())
    if given is not None:
        src = configparser.ConfigParser(delimiters=("=",), interpolation=None,
                                        default_section="\x00none")
        src.optionxform = str
        src.read(given)
        for section in src.sections():
            keys = {}
            for key, value in src.items(section):
                if key in ("hf-repo", "hf", "hfr", "model-url", "mu"):
                    keys["model"] = stand_in(value.split(":")[0] + ":stand-in")
                elif key in ("dedup-cache-models",):
                    sys.stderr.write(f"llama-server-compat: preset key {key} dropped (no "
                                     "download cache here)\n")
                else:
                    keys[key] = value
            out[section] = keys
    import hashlib
    import io

    text = io.StringIO()
    out.write(text)
    digest = hashlib.sha256(text.getvalue().encode()).hexdigest()[:16]
    return _written_once(_cache_dir() / f"router-{digest}.ini",   # one per distinct preset
                         lambda tmp: tmp.write_text(text.getvalue()))


def translate(argv: list[str]) -> list[str]:
    """llama-server's argv (without the program) -> ``moe-offload serve``'s."""
    out: list[str] = []
    model: str | None = None
    wanted: str | None = None
    preset: str | None = None
    mmproj: str | None = None           # --mmproj FILE or --mmproj-url (a stand-in)
    i = 0
    while i < len(argv):
        flag, value = argv[i], argv[i + 1] if i + 1 < len(argv) else None
        if flag in VALUE_FLAGS:
            out += [VALUE_FLAGS[flag] or flag, value]
            i += 2
        elif flag == "--alias":
            out += ["--alias", value]
            i += 2
        elif flag in ("--cors-origins", "--cors-origin"):
            out += ["--cors-origin", value]
            i += 2
        elif flag in ("--model", "-m"):
            model = value
            i += 2
        elif flag in ("--mmproj", "-mm", "--mmproj-url", "-mmu"):
            mmproj = value if Path(value).is_file() else str(synthetic_mmproj())
            i += 2
        elif flag == "--no-mmproj":
            mmproj = ""
            i += 1
        elif flag == "--models-preset":
            preset = value
            i += 2
        elif flag in ("--hf-repo", "--hf-file", "--model-url", "-hf", "-hff", "-mu"):
            wanted = wanted or value
            i += 2
        elif flag in SWITCHES:
            out.append(SWITCHES[flag])
            i += 1
        elif flag in DROPPED:
            takes_value, why = DROPPED[flag]
            sys.stderr.write(f"llama-server-compat: {flag} dropped ({why})\n")
            i += 2 if takes_value else 1
        else:
            sys.stderr.write(f"llama-server-compat: unknown llama-server flag {flag}\n")
            sys.exit(2)
    if "--metrics" not in argv:           # llama-server serves /metrics only when asked
        out.append("--no-metrics")
    if "--ui-mcp-proxy" in out:         # llama-server's proxy reaches loopback, and its tests
        out += ["--ui-mcp-proxy-allow", "127.0.0.0/8,::1,localhost"]   # proxy to 127.0.0.1
    if "--embedding" in out and "--pooling" not in out and "--reranking" not in out:
        out += ["--pooling", "mean"]      # the stand-in model has none; the tests' models mean
    if model is None and wanted is None:           # llama-server's router mode
        if "--models-dir" not in out or preset is not None:
            out += ["--models-preset", str(router_preset(preset))]
        return ["serve", *out]
    if model is None or not Path(model).is_file():
        model = str(synthetic_model(model or wanted or "model",
                                    reranker="--reranking" in out))
    if mmproj is None and wanted is not None and wanted.startswith(VISION):
        mmproj = str(synthetic_mmproj())       # the registry's projector, as llama-server
    return ["serve", "-m", model, *(["--mmproj", mmproj] if mmproj else []), *out]


def main() -> None:
    args = translate(sys.argv[1:])
    sys.stderr.write("llama-server-compat: moe-offload " + " ".join(args) + "\n")
    os.execv(sys.executable, [sys.executable, "-m", "runtime.cli", *args])


if __name__ == "__main__":
    main()
