"""``moe-offload bench``: the offload benchmark (llama-bench's manner).

    moe-offload bench [-m MODEL] [--config FILE ...] [-p 512] [-n 128] [-r 3] [--cold 64]
        [--budget SIZE] [--policies lru,lfu,...] [--mem-limit SIZE] [--n-cpu-moe N ...] [--json]

Without ``-m`` it writes (once) and uses the default benchmark model in the cache directory
(``runtime/bench/model.py``). Without ``--config`` the configurations are: plain mmap,
read-ahead (managed, room for every expert), each eviction policy at ``--budget``
(default 30% of the expert bytes) and configs/best-replay.toml at the same budget; with
``--config`` files, plain mmap and one row group per file. A model that fits in free memory
gets a note under the table: without memory pressure (``--mem-limit``) no tier can gain.
``--n-cpu-moe N`` adds static ``--n-cpu-moe`` placements (a GPU build only).
"""
from __future__ import annotations

import argparse
import shlex
import sys

from runtime.atomic_write import write_text
from runtime.errors import UserError
from runtime.units import parse_size_arg


def register(subparsers: argparse._SubParsersAction) -> None:
    from runtime.bench.offload import POLICIES  # noqa: PLC0415
    from runtime.commands.engine_args import HelpFormatter  # noqa: PLC0415

    parser = subparsers.add_parser(
        "bench", help="benchmark expert offload: mmap vs static placement vs managed policies",
        description="Measure prompt processing (pp), generation (tg) and cold start for plain "
                    "mmap, static placements and the residency manager's policies; prints a "
                    "markdown table (or JSON with --json).",
        formatter_class=HelpFormatter)
    parser.add_argument("-m", "--model", metavar="FILE", default=None,
                        help="GGUF model (default: the synthetic benchmark model, written once)")
    parser.add_argument("--config", action="append", default=[], metavar="FILE",
                        help="residency TOML to benchmark (repeatable)")
    parser.add_argument("-p", "--n-prompt", type=int, default=512, metavar="N",
                        help="prompt tokens of the pp test (0: skip)")
    parser.add_argument("-n", "--n-gen", type=int, default=128, metavar="N",
                        help="generated tokens of the tg test (0: skip)")
    parser.add_argument("-r", "--repetitions", type=int, default=3, metavar="N",
                        help="repetitions of each test")
    parser.add_argument("--cold", type=int, default=64, metavar="N",
                        help="tokens of the cold-start test after a page-cache drop (0: skip)")
    parser.add_argument("--budget", default=None, metavar="SIZE",
                        help="cpu expert budget of the policy rows (default: 30%% of the "
                             "model's expert bytes)")
    parser.add_argument("--policies", default=",".join(POLICIES),
                        help="eviction policies to run at --budget (comma-separated); "
                             "configs/best-replay.toml runs there too")
    parser.add_argument("--n-cpu-moe", type=int, action="append", default=[], metavar="N",
                        help="add a static placement with the first N layers' experts on the "
                             "CPU, the rest on the GPU (repeatable; needs a GPU build)")
    parser.add_argument("--mem-limit", default=None, metavar="SIZE",
                        help="run each config under a cgroup v1 memory limit (RAM + page "
                             "cache), so a model larger than the limit really pages")
    parser.add_argument("-t", "--threads", type=int, default=None, metavar="N",
                        help="CPU threads (default: the engine's)")
    parser.add_argument("-ngl", "--gpu-layers", type=int, default=None, metavar="N",
                        help="layers whose dense weights go to the GPU in the mmap and managed "
                             "rows (default: all with a GPU, none without)")
    parser.add_argument("--route-trace", metavar="TRACE", default=None,
                        help="route as TRACE did (a routing trace of the model's shape): each "
                             "config plays the trace (its prompt, then every decode row) "
                             "instead of the pp/tg/cold tests: pp and tg over warm plays, cold "
                             "over a play after a page-cache drop (-p and -n are not used)")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    parser.add_argument("--save-json", metavar="FILE", default=None,
                        help="also write the JSON to FILE (with the table printed)")
    parser.add_argument("--no-progress", action="store_true", help="no progress line")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from gguf_tools.facts import read_model_facts
    from runtime.bench import offload as bench
    from runtime.bench.model import ensure_model
    from runtime.ramtier.cgroup import MemoryLimit
    from runtime.residency.policies.factory import policy_names

    for flag, value, low in (("-p", args.n_prompt, 0), ("-n", args.n_gen, 0),
                             ("-r", args.repetitions, 1), ("--cold", args.cold, 0)):
        if value < low:
            raise UserError(f"{flag}: must be >= {low}, got {value}")
    model = args.model or str(ensure_model(progress=not args.no_progress))
    facts = read_model_facts(model)
    imposed = None
    if args.route_trace is not None:      # a bad trace: one line before any row runs
        from runtime.engine.hook.imposed_routing import imposed_for  # noqa: PLC0415

        imposed = imposed_for(args.route_trace, facts).note()
    total = facts.total_expert_bytes
    budget = parse_size_arg(args.budget, "--budget") if args.budget else int(total * 0.30)
    policies = tuple(p.strip() for p in args.policies.split(",") if p.strip())
    valid = policy_names("eviction")
    for name in policies:
        if name not in valid or name == "belady":
            raise UserError(f"--policies: {name!r} is not a live eviction policy "
                            f"(valid: {', '.join(v for v in valid if v != 'belady')})")
    mem_limit = parse_size_arg(args.mem_limit, "--mem-limit") if args.mem_limit else None
    if mem_limit and not MemoryLimit.supported():
        raise UserError("--mem-limit: no cgroup v1 memory controller here (or no write access)")
    if args.config:
        configs = [bench.BenchConfig("mmap", "mmap", "kernel (all)")]
        configs += bench.file_configs(args.config)
    else:
        configs = bench.default_configs(total, budget, policies, read_ahead=not mem_limit)
    configs += bench.static_configs(args.n_cpu_moe)
    if args.n_cpu_moe and not _has_gpu():
        raise UserError("--n-cpu-moe: no GPU backend in this llama.cpp build")

    gpu_layers = args.gpu_layers if args.gpu_layers is not None else (-1 if _has_gpu() else 0)
    import psutil  # noqa: PLC0415 - memory free before the run (its own pages not counted)

    pressure = bench.pressure_note(facts.file_bytes, psutil.virtual_memory().available,
                                   mem_limit)
    result = bench.run_bench(model, configs, p=args.n_prompt, n=args.n_gen,
                             reps=args.repetitions, cold=args.cold, threads=args.threads,
                             mem_limit=mem_limit, progress=not args.no_progress,
                             gpu_layers=gpu_layers, route_trace=args.route_trace)
    argv = sys.argv[1:]
    argv = argv[1:] if argv[:1] == ["bench"] else argv
    command = " ".join(["moe-offload bench", *(shlex.quote(a) for a in argv)])
    readahead = bench.read_ahead_kb(model)
    meta = {"command": command, "model": model, "expert_bytes": total, "budget_bytes": budget,
            "mem_limit_bytes": mem_limit, "read_ahead_kb": readahead, "routing": imposed,
            "memory_pressure_note": pressure or None}
    if args.save_json:
        write_text(args.save_json, bench.to_json(result, meta))
    if args.json:
        print(bench.to_json(result, meta))
        return 0
    print(f"model: {model} ({bench.mib(facts.file_bytes)}, experts {bench.mib(total)}: "
          f"{len(facts.moe_layers)} layers x {facts.n_expert} experts, {facts.n_expert_used} "
          f"used per token)" + (f"; memory limit {bench.mib(mem_limit)}" if mem_limit else "")
          + (f"; disk read_ahead_kb {readahead}" if readahead is not None else "")
          + (f"; {imposed}" if imposed else ""))
    print()
    print(bench.format_table(result.rows))
    print()
    if pressure:
        print(pressure)
    line = bench.cold_line(result, args.cold)
    if line:
        print(line)
    if not args.n_cpu_moe and not _has_gpu():
        print("static placements (--n-cpu-moe N): this machine has no GPU, so every expert is "
              "in host RAM; that is the mmap row")
    for note in result.notes:
        print(f"note: {note}")
    print(f"command: {command}")
    return 0



def _has_gpu() -> bool:
    from runtime.native import ggml_lib
    return any(d.kind != ggml_lib.GGML_BACKEND_DEVICE_TYPE_CPU for d in ggml_lib.devices())
