"""The llama.cpp-style flags every model-running command shares (complete, chat, serve, trace
record), and their translation into ``EngineSettings`` / ``SamplingParams``.

    parser = subparsers.add_parser(..., formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_engine_args(parser)                 # -m -c -t -ngl -b -ub -s -v --config --no-residency
    add_sampling_args(parser)               # -n --temp --top-p --top-k --min-p ...
    settings = settings_from_args(args)
    params = sampling_from_args(args)
"""
from __future__ import annotations

import argparse
import sys

from runtime.engine.sampling import SamplingParams
from runtime.engine.types import EngineSettings
from runtime.errors import UserError
from runtime.version import version_line


def add_engine_args(parser: argparse.ArgumentParser, *, model_required: bool = True,
                    residency: bool = True) -> None:
    """Model, context, threads, placement and (unless ``residency=False``) residency flags,
    with llama.cpp's names."""
    from runtime.residency.config_cli import add_config_arguments  # noqa: PLC0415

    from runtime.engine.llama_flags import add_placement_args  # noqa: PLC0415

    g = parser.add_argument_group("model and runtime")
    g.add_argument("-m", "--model", metavar="FILE",
                   help="GGUF model file" + (" (or -hf REPO)" if model_required else ""))
    parser.set_defaults(model_required=model_required)
    g.add_argument("-hf", "-hfr", "--hf-repo", dest="hf_repo", default=None,
                   metavar="USER/MODEL[:QUANT]",
                   help="download the model from Hugging Face into its cache (as llama.cpp: "
                        "QUANT picks the file, Q4_K_M when there is one)")
    g.add_argument("-hff", "--hf-file", dest="hf_file", default=None, metavar="FILE",
                   help="with -hf: this file of the repository (wins over :QUANT)")
    g.add_argument("-c", "--ctx-size", type=int, default=4096, metavar="N",
                   help="context size in tokens (0 = the model's training context)")
    g.add_argument("-t", "--threads", type=int, default=None, metavar="N",
                   help="CPU threads at most, for generation and prompts (default: every "
                        "core). Each runs on N or on 1, whichever measures faster per token "
                        "while it runs: on a busy machine one thread can be faster")
    g.add_argument("-tb", "--threads-batch", type=int, default=None, metavar="N",
                   help="CPU threads at most for prompts (default: -t's, else every core)")
    g.add_argument("-ngl", "--gpu-layers", "--n-gpu-layers", dest="gpu_layers", type=int,
                   default=0, metavar="N",
                   help="layers whose dense weights go to the GPU (-1 = all); experts are "
                        "placed by the residency manager")
    g.add_argument("-b", "--batch-size", type=int, default=2048, metavar="N",
                   help="logical batch: max prompt tokens per decode call")
    g.add_argument("-ub", "--ubatch-size", type=int, default=512, metavar="N",
                   help="physical batch: max tokens per graph evaluation")
    g.add_argument("-fa", "--flash-attn", choices=("on", "off", "auto"), default="off",
                   help="flash attention (off matches plain llama-cpp-python exactly)")
    g.add_argument("-s", "--seed", type=int, default=-1, help="sampling seed (-1 = random)")
    if residency:
        g.add_argument("--no-residency", action="store_true",
                       help="plain llama.cpp placement: no residency manager, no routing hook")
    g.add_argument("-v", "--verbose", action="store_true", help="show llama.cpp's own log")
    g.add_argument("--mmap", dest="mmap", action="store_true", default=True,
                   help="map the model file (the default)")
    g.add_argument("--no-mmap", dest="mmap", action="store_false",
                   help="read the weights into memory instead of mapping the file")
    g.add_argument("--mlock", action="store_true",
                   help="lock the model's pages in RAM (never swapped out)")
    g.add_argument("--no-repack", dest="repack", action="store_false", default=None,
                   help="no repacked CPU weight layouts (llama.cpp's extra buffer types)")
    g.add_argument("--list-devices", action=_ListDevices,
                   help="list the devices llama.cpp sees here, then exit")
    g.add_argument("--version", action="version", version=version_line())
    add_placement_args(parser.add_argument_group(
        "static placement (llama.cpp's flags; the README says how they meet the budgets)"))
    if residency:
        g.add_argument("--auto", action="store_true",
                       help="plan the residency config from this machine's free memory at "
                            "load (what `moe-offload plan` prints; -ngl 99 with a GPU)")
        g.add_argument("--profile", metavar="FILE", default=None,
                       help="a routing profile of this model (moe-offload profile) that "
                            "warm-starts eviction next-visit and prefetch affinity")
        add_config_arguments(parser)
        show_residency_defaults(parser)


class _ListDevices(argparse.Action):
    """``--list-devices``: llama.cpp's device list (name, memory), then exit 0."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        from runtime.native import ggml_lib  # noqa: PLC0415
        from runtime.residency.capacity import probe_device_memory  # noqa: PLC0415

        print("Available devices:")
        for dev in ggml_lib.devices():
            free, total = dev.free_bytes, dev.total_bytes
            if dev.kind == ggml_lib.GGML_BACKEND_DEVICE_TYPE_CPU:
                # ggml's CPU device reports its total as free: the RAM available now is
                # what a --devices.cpu N% budget takes its share of
                free, total = probe_device_memory("cpu")
            memory = f" ({total >> 20} MiB, {free >> 20} MiB free)" if total else ""
            print(f"  {dev.name}{memory}")
        parser.exit(0)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` with "(default: X)" only where there is a value to show: not None or False,
    not a switch (its help says what it does), not a help that states its own default."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if (action.default is None or action.default is False or action.nargs == 0
                or action.default == [] or "(default:" in (action.help or "")):
            return action.help
        return super()._get_help_string(action)

    def _format_text(self, text: str) -> str:          # docstrings' ``code`` reads as code
        return super()._format_text(text.replace("``", ""))

    def _expand_help(self, action: argparse.Action) -> str:
        return super()._expand_help(action).replace("``", "")


def residency_defaults() -> dict[str, str]:
    """Dotted residency key -> its built-in default as ``--help`` shows it."""
    from dataclasses import fields  # noqa: PLC0415

    from runtime.residency.config import ResidencyConfig  # noqa: PLC0415
    from runtime.residency.config_cli import config_keys  # noqa: PLC0415
    from runtime.residency.policies.factory import param_defaults, policy_names  # noqa: PLC0415

    base = ResidencyConfig()
    out: dict[str, str] = {"policy.phase_specific": str(base.phase_specific).lower()}
    for f in fields(base.cost):
        out[f"cost.{f.name}"] = f"{getattr(base.cost, f.name):g}"
    for phase in ("prefill", "decode"):
        policies = getattr(base, phase)
        for role in ("admission", "prefetch", "eviction"):
            spec = getattr(policies, role)
            out[f"policy.{phase}.{role}"] = spec.name
            chosen = dict(getattr(spec, "params", ()) or ())
            for name in policy_names(role):       # a parameter's default, by its policy
                for param, value in param_defaults(role, name).items():
                    value = chosen.get(param, value) if name == spec.name else value
                    out.setdefault(f"policy.{phase}.{role}_params.{param}",
                                   f"{value:g}, for {name}")
    for key in config_keys():
        if key.startswith("devices."):
            out[key] = "not set"
    return out


def show_residency_defaults(parser: argparse.ArgumentParser) -> None:
    """Put each residency flag's real default in its help (the flags default to None so that
    only the given ones override the file)."""
    from runtime.residency.config_cli import config_keys  # noqa: PLC0415

    defaults = residency_defaults()
    by_flag = {f"--{key}": key for key in config_keys()}
    for action in parser._actions:  # noqa: SLF001 - argparse has no public accessor
        key = next((by_flag[o] for o in action.option_strings if o in by_flag), None)
        if key is None:
            continue
        shown = f" (default: {defaults.get(key, 'built-in')})"
        if getattr(action, "advanced_help", None) is not None:     # listed by --help-all
            action.advanced_help += shown
        elif action.help not in (None, argparse.SUPPRESS):
            action.help += shown


def add_sampling_args(parser: argparse.ArgumentParser, *, predict_default: int = 128) -> None:
    """Generation length and sampler flags (llama.cpp's names and defaults)."""
    d = SamplingParams()
    g = parser.add_argument_group("sampling")
    g.add_argument("-n", "--predict", "--n-predict", dest="predict", type=int,
                   default=predict_default, metavar="N", action=_StoreGiven,
                   help="tokens to generate (-1 = until the context is full)")
    g.add_argument("--temp", type=float, default=d.temperature,
                   help="temperature (0 = greedy)")
    g.add_argument("--top-p", type=float, default=d.top_p, help="nucleus sampling (1.0 = off)")
    g.add_argument("--top-k", type=int, default=d.top_k, help="top-k sampling (0 = off)")
    g.add_argument("--min-p", type=float, default=d.min_p, help="min-p sampling (0.0 = off)")
    g.add_argument("--repeat-penalty", type=float, default=d.repeat_penalty,
                   help="penalise the last 64 tokens' repeats (1.0 = off)")
    g.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help="stop when TEXT is generated (repeatable; TEXT is not printed)")
    g.add_argument("--ignore-eos", action="store_true",
                   help="never sample end-of-generation tokens (generate the whole -n)")


class _StoreGiven(argparse.Action):
    """Store the value and mark ``<dest>_given`` (a default the run may choose otherwise)."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)
        setattr(namespace, f"{self.dest}_given", True)


def add_route_trace_arg(parser: argparse.ArgumentParser) -> None:
    """``--route-trace TRACE`` (runtime.engine.hook.imposed_routing)."""
    parser.add_argument(
        "--route-trace", metavar="TRACE", default=None,
        help="route as TRACE did (a routing trace, CSV or .rtb, of the model's shape): prompt "
             "tokens take its prefill rows, generated tokens its decode rows, at every MoE "
             "layer. Without a prompt the prompt is as long as the trace's; -n defaults to the "
             "rest of the trace; end-of-text is suppressed so the whole trace plays")


def settings_from_args(args: argparse.Namespace) -> EngineSettings:
    """``EngineSettings`` from parsed ``add_engine_args`` flags (UserError on bad values)."""
    from runtime.residency.config_cli import config_from_args  # noqa: PLC0415

    from runtime.engine.hub import resolve_model  # noqa: PLC0415
    from runtime.engine.llama_flags import placement_rules  # noqa: PLC0415

    resolve_model(args)
    manage = hasattr(args, "no_residency") and not args.no_residency
    rules = tuple(placement_rules(args))
    gpu_layers = args.gpu_layers
    if manage and getattr(args, "auto", False):
        from runtime.residency.config_cli import config_from_text  # noqa: PLC0415
        from runtime.planner import plan_model  # noqa: PLC0415

        if getattr(args, "config", None):
            raise UserError("--auto plans the residency config itself: give --auto or "
                            "--config, not both")
        planned = plan_model(args.model, args.ctx_size or 4096)
        for line in planned.chosen():            # the budgets it chose, and why
            print(f"moe-offload: {line}", file=sys.stderr, flush=True)
        config = config_from_text(planned.to_toml(), args, source="--auto")
        gpu_layers = gpu_layers or planned.gpu_layers
    else:
        config = config_from_args(args) if manage else None
    if config is not None:
        check_cuda_devices(config)
    return EngineSettings(
        model_path=args.model, n_ctx=args.ctx_size, n_threads=args.threads,
        n_threads_batch=args.threads_batch,
        n_gpu_layers=gpu_layers, n_batch=args.batch_size, n_ubatch=args.ubatch_size,
        seed=args.seed, config_path=getattr(args, "config", None), manage_residency=manage,
        verbose=args.verbose, config=config, flash_attn=args.flash_attn,
        profile_path=getattr(args, "profile", None) if manage else None,
        route_trace=getattr(args, "route_trace", None),
        tensor_rules=rules, use_mmap=args.mmap, use_mlock=args.mlock, repack=args.repack)


def check_cuda_devices(config) -> None:
    """A ``cuda:N`` budget on a machine without that GPU is one line and a non-zero exit (on
    the command line; the engine itself still runs such a device as bookkeeping). A GPU
    counts when the NVIDIA driver shows it, or llama.cpp lists it where it is loaded already:
    loading it here would pin this process to the stock library before the engine picks the
    patched CUDA build."""
    import glob  # noqa: PLC0415
    import sys  # noqa: PLC0415

    wanted = sorted(b.device for b in config.devices if b.device.startswith("cuda:"))
    if not wanted:
        return
    listed = 0
    if "llama_cpp.llama_cpp" in sys.modules:
        from runtime.native import ggml_lib  # noqa: PLC0415

        listed = sum(1 for d in ggml_lib.devices() if d.name.upper().startswith("CUDA"))
    present = max(listed, len(glob.glob("/proc/driver/nvidia/gpus/*")),
                  len(glob.glob("/dev/nvidia[0-9]*")))
    missing = [d for d in wanted if int(d.split(":")[1]) >= present]
    if missing:
        have = f"{present} CUDA device{'s' if present != 1 else ''}" if present else \
            "no CUDA device (no NVIDIA GPU or driver found)"
        raise UserError(f"{missing[0]}: no such device, this machine has {have}; drop its "
                        "budget (host RAM is --devices.cpu SIZE)")


def sampling_from_args(args: argparse.Namespace) -> SamplingParams:
    """``SamplingParams`` from parsed ``add_sampling_args`` (+ ``-s``) flags."""
    if args.predict == 0 or args.predict < -1:
        raise UserError(f"--predict: {args.predict} must be positive, or -1 for no limit")
    return SamplingParams(max_tokens=args.predict, temperature=args.temp, top_p=args.top_p,
                          top_k=args.top_k, min_p=args.min_p,
                          repeat_penalty=args.repeat_penalty,
                          seed=getattr(args, "seed", -1), stop=list(args.stop),
                          ignore_eos=args.ignore_eos)
