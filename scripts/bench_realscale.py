"""The real-scale benchmark: full-size models with a real router's routing, moe-offload against
llama.cpp, side by side in one run, at the settings users have.

    python scripts/bench_realscale.py [--case a] [--case b] [--case c] [--threads 1,default]
        [--read-ahead 128] [--busy N] [--dir DIR]

Cases (models are written with ``moe-offload synth --preset``, one at a time, outside the
repository in ``--dir``, and deleted after their case unless ``--keep``):
  a  qwen3-30b-a3b Q4_K_M (17 GB), top-6, under a cgroup memory limit of 8 GiB, routing from the
     Qwen3-30B-A3B trace;
  b  qwen3-30b-a3b Q8_0 (~32 GB, larger than this machine's RAM), top-6, no limit, the same trace;
  c  gpt-oss-120b (MXFP4 experts, ~61 GB), top-2, routing from the gpt-oss-120b trace: only where
     the disk holds it (the table says so when it does not).
Rows, each at every ``--threads`` setting ("default": the runtime's own choice):
  * ceiling: the same model and threads with every expert resident (no limit, the whole file in
    the page cache first, llama.cpp's mmap, no repacking): the compute limit;
  * plain llama.cpp as a user runs it (llama-cpp-python's defaults: mmap, CPU repacking) and as a
    careful user would (``--no-repack``, mmap), at ``--read-ahead`` KiB (the usual 128: set on the
    model's disk for the run and put back after, where this process may; else the table says
    what it was), and once more at the machine's own read-ahead when that differs;
  * moe-offload ``lru``, ``next-visit`` and ``configs/best-replay.toml`` (affinity prefetch), each
    at the cpu budget ``plan`` picks for the case (the memory limit, or this machine's available
    RAM), at ``--read-ahead``; ``lru`` once more at the machine's own read-ahead.
Every row is its own process, started after the model file's pages were dropped from the page
cache (the ceiling's: after the file was read whole), and plays the whole trace: its prompt,
then every decode row (routing imposed: ``--route-trace``). ``--busy N`` runs N busy processes
beside every row (a machine that does something else).

Columns: threads (decode/prompt), read-ahead, load time, time to first token, decode t/s and
ms per token against the ceiling's at the same threads, bytes read from storage per decode
token (/proc/PID/io), the share of the RAM tier's decode reads already in when first needed
(overlap) and the time a thread waited for reads per decode token, peak RAM (the model file's
pages in the page cache + the process's anonymous memory, sampled every second), hit rate, and
the live decode demand-miss bytes next to ``moe-offload replay``'s prediction for the same
trace, config and budget. A row that dies says how (OOM, error, timeout). The machine (cores,
read-ahead, load before each row) is written with the table, printed and saved to
``docs/benchmarks/DATE-realscale.md`` with the command.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from runtime.bench.machine import BusyLoad, ReadAhead, load_now, read_ahead_kb, warm  # noqa: E402
from runtime.bench.memwatch import MemoryWatch  # noqa: E402
from runtime.bench.realscale_table import table  # noqa: E402
from runtime.bench.trace_run import TraceRow  # noqa: E402
from runtime.ramtier.cgroup import MemoryLimit  # noqa: E402
from runtime.ramtier.pager import drop_file_cache  # noqa: E402
from runtime.units import format_size  # noqa: E402

TRACES = ROOT / "tests" / "runtime" / "traces" / "data"
GIB = 1 << 30


@dataclass(frozen=True)
class Case:
    key: str
    preset: str
    dtype: str
    top_k: int
    trace: Path
    mem_limit: int | None
    title: str


CASES = {
    "a": Case("a", "qwen3-30b-a3b", "q4_k_m", 6, TRACES / "qwen3-30b-a3b.route.csv", 8 * GIB,
              "qwen3-30b-a3b Q4_K_M, top-6, under an 8 GiB memory limit"),
    "b": Case("b", "qwen3-30b-a3b", "q8_0", 6, TRACES / "qwen3-30b-a3b.route.csv", None,
              "qwen3-30b-a3b Q8_0 (larger than RAM), top-6, no memory limit"),
    "c": Case("c", "gpt-oss-120b", "q4_k_m", 2, TRACES / "gpt-oss-120b.route.csv", None,
              "gpt-oss-120b (MXFP4 experts as shipped), top-2, no memory limit"),
}


def cli(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "runtime.cli", *args], text=True,
                          capture_output=True, cwd=ROOT, **kw)


def planned_size(case: Case) -> int:
    from gguf_tools.presets import get_preset  # noqa: PLC0415
    from gguf_tools.synth import planned_file_bytes  # noqa: PLC0415

    return planned_file_bytes(get_preset(case.preset).spec(case.dtype, top_k=case.top_k))


def write_model(case: Case, directory: Path) -> Path:
    path = directory / f"{case.preset}-{case.dtype}-top{case.top_k}.gguf"
    if path.exists():
        return path
    t0 = time.perf_counter()
    proc = cli("synth", str(path), "--preset", case.preset, "--dtype", case.dtype,
               "--top-k", str(case.top_k), "--quiet")
    if proc.returncode != 0:
        raise SystemExit(f"bench_realscale: synth failed: {proc.stderr.strip()}")
    print(f"wrote {path.name} ({format_size(path.stat().st_size)}) in "
          f"{time.perf_counter() - t0:.0f} s", flush=True)
    return path


def planned_budget(model: Path, limit: int | None, ctx: int) -> tuple[int, int]:
    """(the cpu budget ``plan`` picks, the experts the RAM tier keeps within it: the budget
    less its one-use room, runtime/ramtier model_split; replay predicts at the kept part)."""
    from gguf_tools.facts import read_model_facts  # noqa: PLC0415
    from runtime.planner import plan_model  # noqa: PLC0415
    from runtime.ramtier import model_split  # noqa: PLC0415

    plan = plan_model(str(model), ctx, {"cpu": limit} if limit else None)
    budget = next(d.budget_bytes for d in plan.devices if d.device == "cpu")
    facts = read_model_facts(str(model))
    return budget, model_split(budget, facts.total_expert_bytes, facts).kept


@dataclass(frozen=True)
class Run:
    """One row of the table: a TraceRow at a thread count and a read-ahead."""

    row: TraceRow
    threads: int | None          # None: the runtime's default
    read_ahead: int | None       # KiB; None: the machine's own
    ceiling: bool = False        # every expert resident: no limit, the file in the cache first

    @property
    def label(self) -> str:
        return self.row.name


def rows_for(budget: int, kept: int, cost: dict | None, threads: list[int | None],
             read_ahead: int | None, own_read_ahead: int | None,
             own_rows: bool = True) -> list[Run]:
    both = lambda name: {"policy": {"prefill": {"eviction": name},  # noqa: E731
                                    "decode": {"eviction": name}}}
    label = f"{format_size(budget)} ({format_size(kept)} kept)"
    default = threads[-1]
    managed = [
        TraceRow("lru", "managed", config=both("lru"), budget_bytes=budget, note=label,
                 cost=cost),
        TraceRow("next-visit", "managed", config=both("next-visit"), budget_bytes=budget,
                 note=label, cost=cost),
        TraceRow("best-replay.toml", "managed", budget_bytes=budget, note=label, cost=cost,
                 config_path=str(ROOT / "configs" / "best-replay.toml")),
    ]
    no_repack = TraceRow("llama.cpp --no-repack", "llama.cpp", repack=False, note="mmap")
    runs = [Run(TraceRow("ceiling", "llama.cpp", repack=False, note="all experts resident"), t,
                None, ceiling=True) for t in threads]
    runs.append(Run(TraceRow("llama.cpp (defaults)", "llama.cpp",
                             note="mmap, CPU repacking on"), default, read_ahead))
    runs += [Run(no_repack, t, read_ahead) for t in threads]
    runs += [Run(row, t, read_ahead) for row in managed for t in threads]
    if own_read_ahead is not None and read_ahead is not None and own_read_ahead != read_ahead \
            and own_rows:
        runs += [Run(no_repack, default, own_read_ahead), Run(managed[0], default, own_read_ahead)]
    return runs


def trace_at_model_sizes(trace: Path, model: Path, directory: Path) -> Path:
    """The trace with the model's bytes per expert and dense bytes per layer in its header
    (a Q8_0 model's experts are larger than those of the Q4_K_M file the trace was recorded
    on): replay then predicts for the bytes the live run moves."""
    from dataclasses import replace  # noqa: PLC0415

    from runtime.traces.files import read_trace, write_trace  # noqa: PLC0415
    from runtime.traces.model_header import header_from_model  # noqa: PLC0415
    from runtime.traces.trace import COLUMNS, RouteTrace  # noqa: PLC0415

    t = read_trace(trace)
    mine = header_from_model(str(model))
    header = replace(t.header, expert_bytes=mine.expert_bytes, dense_bytes=mine.dense_bytes)
    out = directory / f"{trace.stem}.{model.stem}.rtb"
    write_trace(RouteTrace(header=header, source=str(out),
                           **{name: getattr(t, name) for name in COLUMNS}), out)
    return out


def run_row(model: Path, trace: Path, row: TraceRow, *, limit: int | None,
            threads: int | None, timeout: float, warm_first: bool = False) -> dict:
    """The row in a fresh process, its memory watched from here, after the model file's pages
    were dropped (``warm_first``: after the whole file was read into the page cache). A row
    past ``timeout`` seconds is stopped and reports how far it got (its ``@@`` progress
    lines)."""
    drop_file_cache(str(model))
    cached = warm(model) if warm_first else None     # share of the file's pages in the cache
    job = json.dumps({"model": str(model), "trace": str(trace), "row": row.to_json(),
                      "threads": threads})
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
    group = MemoryLimit(limit, name=f"realscale-{os.getpid()}") if limit else None
    started = time.perf_counter()
    last: dict = {}
    with (group if group is not None else contextlib.nullcontext()), \
            MemoryWatch(model, interval=1.0,
                        cgroup_dir=group.path if group is not None else None) as watch:
        proc = subprocess.Popen([sys.executable, "-m", "runtime.bench.trace_run"], cwd=ROOT,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env=env,
                                preexec_fn=group.join if group is not None else None)
        watch.pid = proc.pid
        errors: list[str] = []

        def pump() -> None:
            for line in proc.stderr:
                if line.startswith("@@ "):
                    last.update(json.loads(line[3:]))
                elif line.strip():
                    errors.append(line.rstrip())

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        proc.stdin.write(job)
        proc.stdin.close()
        try:
            proc.wait(timeout=timeout)
            stopped = False
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            stopped = True
        reader.join()
        out = proc.stdout.read()
        peak_ram = max((s.file_cache_bytes + s.rss_anon_bytes for s in watch.samples), default=0)
        group_peak = group.peak_bytes() if group is not None else None
    result: dict = {"wall_s": time.perf_counter() - started, "peak_ram_bytes": peak_ram,
                    "peak_anon_bytes": watch.peak("rss_anon_bytes"),
                    "peak_expert_cache_bytes": watch.peak("expert_cache_bytes"),
                    "cgroup_peak_bytes": group_peak, "progress": dict(last)}
    if cached is not None:
        result["cached_at_start"] = cached
    if stopped:
        done = last.get("decoded", 0)
        rate = done / last["decode_s"] if last.get("decode_s") else 0.0
        result["died"] = (f"stopped at the {timeout:.0f} s limit: " + (
            f"{done} decode tokens at {rate:.3f} t/s" if "ttft_s" in last else
            "before its first token" if "load_s" in last else "while loading"))
        result["partial"] = {"load_s": last.get("load_s"), "ttft_s": last.get("ttft_s"),
                             "decode_tps": rate, "decoded": done,
                             "read_bytes_per_decode_token": last.get("read", 0) / done
                             if done else None}
    elif proc.returncode == -9 and limit:
        result["died"] = (f"OOM (killed under the {format_size(limit)} limit; anonymous peak "
                          f"{format_size(watch.peak('rss_anon_bytes'))})")
    elif proc.returncode != 0:
        try:
            why = json.loads(out.strip().splitlines()[-1])["error"]
        except (ValueError, KeyError, IndexError):
            why = errors[-1] if errors else f"exit status {proc.returncode}"
        result["died"] = f"error: {why[:160]}"
    else:
        result.update(json.loads(out.strip().splitlines()[-1]))
    return result


def replay_prediction(trace: Path, row: TraceRow, kept: int, cost: Path | None) -> int | None:
    # ``trace``: at the model's sizes (trace_at_model_sizes)
    """``moe-offload replay``'s decode demand-miss bytes for this row's config at the capacity
    the RAM tier keeps (``kept``: the budget less its one-use room)."""
    if row.kind != "managed":
        return None
    with tempfile.TemporaryDirectory() as tmp:
        if row.config_path:
            config = Path(row.config_path)
        else:
            config = Path(tmp) / "row.toml"
            policy = row.config["policy"]
            config.write_text("".join(
                f'[policy.{phase}]\neviction = "{p["eviction"]}"\n'
                for phase, p in policy.items()))
        args = ["replay", str(trace), "--capacity", f"{kept}B", "--config", str(config),
                "--json"]
        if cost is not None:
            args += ["--cost", str(cost)]
        proc = cli(*args)
    if proc.returncode != 0:
        print(f"replay failed for {row.name}: {proc.stderr.strip()}", file=sys.stderr)
        return None
    return int(json.loads(proc.stdout)[0]["decode"]["demand_miss_bytes"])


def calibrate(model: Path, directory: Path) -> tuple[Path, dict]:
    """``moe-offload calibrate --storage MODEL``: this machine's rates (its disk's cold reads
    included) as a [cost] TOML for the managed rows and replay's prediction."""
    import tomllib  # noqa: PLC0415

    proc = cli("calibrate", "--storage", str(model), "--repeats", "2")
    if proc.returncode != 0:
        raise SystemExit(f"bench_realscale: calibrate failed: {proc.stderr.strip()}")
    snippet = proc.stdout[proc.stdout.index("[cost]"):]
    path = directory / f"{model.stem}.cost.toml"
    path.write_text(snippet)
    print(snippet, flush=True)
    return path, tomllib.loads(snippet)["cost"]


def parse_threads(text: str) -> list[int | None]:
    out: list[int | None] = []
    for part in text.split(","):
        part = part.strip()
        if part == "default":
            out.append(None)
        elif part.isdigit() and int(part) > 0:
            out.append(int(part))
        else:
            raise SystemExit(f"--threads {text}: a list of thread counts or 'default'")
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     allow_abbrev=False)
    parser.add_argument("--case", action="append", choices=sorted(CASES),
                        help="cases to run (default: a, b, c)")
    parser.add_argument("--dir", default=os.path.expanduser("~/.cache/moe-offload/realscale"),
                        help="where the models are written (outside the repository)")
    parser.add_argument("-t", "--threads", default="1,default",
                        help="thread counts, each row at each (default: 1,default; 'default' is "
                             "the runtime's own choice)")
    parser.add_argument("--no-own-read-ahead", action="store_true",
                        help="leave out the two rows at the disk's own read_ahead_kb (when it "
                             "differs from --read-ahead; llama.cpp's takes 10 min at 8 MiB)")
    parser.add_argument("--read-ahead", type=int, default=128, metavar="KIB",
                        help="read_ahead_kb of the model's disk for the rows (default 128, the "
                             "usual; set and put back where this process may); 0: leave it")
    parser.add_argument("--busy", type=int, default=0, metavar="N",
                        help="N busy processes beside every row (a competing CPU load)")
    parser.add_argument("--rows", default=None,
                        help="comma-separated row names to run (default: all)")
    parser.add_argument("--keep", action="store_true", help="keep the models afterwards")
    parser.add_argument("--cost", default=None, metavar="TOML",
                        help="a [cost] table (moe-offload calibrate --storage MODEL) for the "
                             "managed rows and replay's prediction alike: the rates the "
                             "prefetch planner times its reads on")
    parser.add_argument("--calibrate", action="store_true",
                        help="measure this machine's rates per case (moe-offload calibrate "
                             "--storage MODEL) and use them as --cost does")
    parser.add_argument("--timeout", type=float, default=900,
                        help="seconds per row; a row past it is stopped and reports its rate so "
                             "far")
    parser.add_argument("--out", default=None, help="markdown file (default: "
                        "docs/benchmarks/DATE-realscale.md)")
    args = parser.parse_args()
    threads = parse_threads(args.threads)
    cases = [CASES[k] for k in (args.case or sorted(CASES))]
    cost_table, cost_path = None, Path(args.cost) if args.cost else None
    if args.cost:                   # the live managed rows run on the same [cost] as replay
        import tomllib  # noqa: PLC0415

        with open(args.cost, "rb") as fh:
            cost_table = tomllib.load(fh).get("cost")
    directory = Path(args.dir)
    directory.mkdir(parents=True, exist_ok=True)
    own_ra = read_ahead_kb(directory)
    wanted_ra = args.read_ahead or None
    command = "python scripts/bench_realscale.py " + " ".join(sys.argv[1:])
    report = [f"# Real-scale benchmark, {dt.date.today().isoformat()}", "",
              "```", command, "```", "",
              f"Machine: {os.cpu_count()} cores, "
              f"{format_size(os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES'))} RAM; "
              f"the model's disk has read_ahead_kb {own_ra} (rows ran at "
              f"{wanted_ra or own_ra} KiB unless the column says otherwise); "
              f"{load_now().describe()} at the start"
              + (f"; {args.busy} busy processes beside every row" if args.busy else "")
              + ". Routing imposed from the real traces (`--route-trace`); model weights are "
              "random (`moe-offload synth --preset`).", ""]
    with BusyLoad(args.busy):
        for case in cases:
            report += run_case(case, args, threads, wanted_ra, own_ra, cost_path, cost_table,
                               directory)
    out = Path(args.out) if args.out else \
        ROOT / "docs" / "benchmarks" / f"{dt.date.today().isoformat()}-realscale.md"
    from runtime.atomic_write import write_text  # noqa: PLC0415

    write_text(out, "\n".join(report) + "\n")
    print(f"\nwrote {out}")
    return 0


def run_case(case: Case, args, threads, wanted_ra, own_ra, cost_path, cost_table,
             directory: Path) -> list[str]:
    print(f"\n== case {case.key}: {case.title}", flush=True)
    free = shutil.disk_usage(directory).free
    need = planned_size(case)
    report = [f"## Case {case.key}: {case.title}", ""]
    if need > free - 2 * GIB:
        msg = (f"not run: the model needs {format_size(need)} and {directory} has "
               f"{format_size(free)} free")
        print(msg)
        return report + [msg, ""]
    model = write_model(case, directory)
    try:
        budget, kept = planned_budget(model, case.mem_limit, 512)
        cost_file, case_cost = cost_path, cost_table
        if args.calibrate:
            cost_file, case_cost = calibrate(model, directory)
            report += [f"`moe-offload calibrate --storage {model.name}`: "
                       + ", ".join(f"{k} = {v}" for k, v in case_cost.items()), ""]
        runs = rows_for(budget, kept, case_cost, threads, wanted_ra, own_ra,
                        not args.no_own_read_ahead)
        sized = trace_at_model_sizes(case.trace, model, directory)
        if args.rows:
            wanted = {r.strip() for r in args.rows.split(",")}
            runs = [r for r in runs if r.row.name in wanted]
        results = []
        for run in runs:
            with ReadAhead(model, run.read_ahead) as ra:
                load = load_now(args.busy)
                print(f"-- {run.label}, threads {run.threads or 'default'}, read-ahead "
                      f"{ra.now} KiB, {load.describe()} ...", flush=True)
                r = run_row(model, case.trace, run.row, limit=None if run.ceiling else
                            case.mem_limit, threads=run.threads, timeout=args.timeout,
                            warm_first=run.ceiling)
                r["read_ahead_kb"] = ra.now
                r["load"] = f"{load.load1:.1f}" + (f" +{args.busy} busy" if args.busy else "")
            predicted = replay_prediction(sized, run.row, kept, cost_file)
            results.append((run, r, predicted))
            print(json.dumps({k: v for k, v in r.items() if k != "tier_notices"}), flush=True)
        lines = table(case, results)
        print("\n".join(lines), flush=True)
        report += [f"Model {model.name}: {format_size(model.stat().st_size)}; cpu budget "
                   f"(plan, at -c 512{' under the limit' if case.mem_limit else ''}): "
                   f"{format_size(budget)} ({format_size(kept)} of experts kept); trace "
                   f"{case.trace.name}. The ceiling rows ran with no limit and the file in the "
                   "page cache.", "", *lines, ""]
    finally:
        if not args.keep:
            model.unlink(missing_ok=True)
        for p in [*directory.glob(f"*.{model.stem}.rtb"),
                  *directory.glob(f"{model.stem}.cost.toml")]:
            p.unlink()
    return report


if __name__ == "__main__":
    sys.exit(main())
