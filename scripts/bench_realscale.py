"""The real-scale benchmark: full-size models with a real router's routing, moe-offload against
llama.cpp, side by side in one run.

    python scripts/bench_realscale.py [--case a] [--case b] [--case c] [--dir DIR] [-t 1]

Cases (models are written with ``moe-offload synth --preset``, one at a time, outside the
repository in ``--dir``, and deleted after their case unless ``--keep``):
  a  qwen3-30b-a3b Q4_K_M (17 GB), top-6, under a cgroup memory limit of 8 GiB, routing from the
     Qwen3-30B-A3B trace;
  b  qwen3-30b-a3b Q8_0 (~32 GB, larger than this machine's RAM), top-6, no limit, the same trace;
  c  gpt-oss-120b (MXFP4 experts, ~61 GB), top-2, routing from the gpt-oss-120b trace: only where
     the disk holds it (the table says so when it does not).
Rows: plain llama.cpp as a user runs it (llama-cpp-python's defaults: mmap, CPU repacking) and as
a careful user would (``--no-repack``, mmap); moe-offload ``lru``, ``next-visit`` and
``configs/best-replay.toml`` (affinity prefetch), each at the cpu budget ``plan`` picks for the
case (the memory limit, or this machine's available RAM). Every row is its own process, started
after the model file's pages were dropped from the page cache, and plays the whole trace:
its prompt, then every decode row (routing imposed: ``--route-trace``).

Columns: load time, time to first token, decode t/s over the trace's decode tokens, bytes read
from storage per decode token (/proc/PID/io), peak RAM (the model file's pages in the page cache
+ the process's anonymous memory, sampled every 0.25 s), hit rate, and the live decode
demand-miss bytes next to ``moe-offload replay``'s prediction for the same trace, config and
budget. A row that dies says how (OOM, error, timeout). The table is printed and written to
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

from runtime.bench.memwatch import MemoryWatch  # noqa: E402
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


def planned_budget(model: Path, limit: int | None, ctx: int) -> int:
    from runtime.commands.planner import plan_model  # noqa: PLC0415

    plan = plan_model(str(model), ctx, {"cpu": limit} if limit else None)
    return next(d.budget_bytes for d in plan.devices if d.device == "cpu")


def rows_for(budget: int, cost: dict | None) -> list[TraceRow]:
    both = lambda name: {"policy": {"prefill": {"eviction": name},  # noqa: E731
                                    "decode": {"eviction": name}}}
    label = format_size(budget)
    return [
        TraceRow("llama.cpp (defaults)", "llama.cpp", note="mmap, CPU repacking on"),
        TraceRow("llama.cpp --no-repack", "llama.cpp", repack=False, note="mmap"),
        TraceRow("lru", "managed", config=both("lru"), budget_bytes=budget, note=label,
                 cost=cost),
        TraceRow("next-visit", "managed", config=both("next-visit"), budget_bytes=budget,
                 note=label, cost=cost),
        TraceRow("best-replay.toml", "managed", budget_bytes=budget, note=label, cost=cost,
                 config_path=str(ROOT / "configs" / "best-replay.toml")),
    ]


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


def run_row(model: Path, trace: Path, row: TraceRow, *, limit: int | None, threads: int,
            timeout: float) -> dict:
    """The row in a fresh process, its memory watched from here. A row past ``timeout``
    seconds is stopped and reports how far it got (its ``@@`` progress lines)."""
    drop_file_cache(str(model))
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


def replay_prediction(trace: Path, row: TraceRow, budget: int, cost: Path | None) -> int | None:
    # ``trace``: at the model's sizes (trace_at_model_sizes)
    """``moe-offload replay``'s decode demand-miss bytes for this row's config and budget."""
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
        args = ["replay", str(trace), "--capacity", f"{budget}B", "--config", str(config),
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


def fmt(value, spec: str, none: str = "-") -> str:
    return none if value is None else format(value, spec)


def table(case: Case, results: list[tuple[TraceRow, dict, int | None]]) -> list[str]:
    head = ("row", "budget", "load s", "TTFT s", "decode t/s", "disk MB/tok", "peak RAM GiB",
            "hit %", "decode demand-miss MB (live)", "replay MB", "live/replay",
            "prefetch used / issued MB")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row, r, predicted in results:
        if "died" in r:
            p = r.get("partial") or {}
            cells = [row.name, row.note, fmt(p.get("load_s"), ".1f"),
                     fmt(p.get("ttft_s"), ".2f"),
                     f"({p['decode_tps']:.3f})" if p.get("decoded") else "-",
                     fmt(p.get("read_bytes_per_decode_token") and
                         p["read_bytes_per_decode_token"] / 1e6, ".1f"),
                     f"{r.get('peak_ram_bytes', 0) / GIB:.2f}", "-", "-", "-", "-",
                     r["died"]]
            lines.append("| " + " | ".join(cells) + " |")
            continue
        d = r.get("decode")
        hit = 100 * d["hits"] / d["accesses"] if d and d["accesses"] else None
        live = d["demand_miss_bytes"] if d else None
        ratio = live / predicted if live is not None and predicted else None
        pf = (f"{d['prefetch_used_bytes'] / 1e6:.0f} / {d['prefetch_issued_bytes'] / 1e6:.0f}"
              if d and d["prefetch_issued_bytes"] else "-")
        cells = [row.name, row.note, f"{r['load_s']:.1f}", fmt(r.get("ttft_s"), ".2f"),
                 f"{r['decode_tps']:.2f}", fmt(r.get("read_bytes_per_decode_token") and
                                              r["read_bytes_per_decode_token"] / 1e6, ".1f"),
                 f"{r['peak_ram_bytes'] / GIB:.2f}", fmt(hit, ".1f"),
                 fmt(live and live / 1e6, ".0f"), fmt(predicted and predicted / 1e6, ".0f"),
                 fmt(ratio, ".3f"), pf]
        lines.append("| " + " | ".join(cells) + " |")
    ok = [(row, r) for row, r, _ in results if "died" not in r]
    base = [r["decode_tps"] for row, r in ok if row.kind == "llama.cpp"]
    # a llama.cpp row stopped at the time limit: its rate so far (decode only speeds up as the
    # page cache warms, so this flatters it less than it seems: say so)
    partial = [r["partial"]["decode_tps"] for row, r, _ in results
               if row.kind == "llama.cpp" and r.get("partial", {}).get("decoded")]
    if not base and partial:
        base = partial
        lines.append("")
        lines.append("(llama.cpp rows stopped at the time limit: their decode rate so far, in "
                     "parentheses, is the baseline below)")
    lru = next((r["decode_tps"] for row, r in ok if row.name == "lru"), None)
    if base:
        best = max(base)
        lines.append("")
        lines.append("decode speed against the best llama.cpp row that ran "
                     f"({best:.2f} t/s): " + ", ".join(
                         f"{row.name} {r['decode_tps'] / best:.2f}x" for row, r in ok
                         if row.kind == "managed"))
    else:
        lines.append("")
        lines.append("no llama.cpp row ran to the end")
    if lru:
        lines.append("against lru: " + ", ".join(
            f"{row.name} {r['decode_tps'] / lru:.2f}x" for row, r in ok
            if row.kind == "managed" and row.name != "lru"))
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     allow_abbrev=False)
    parser.add_argument("--case", action="append", choices=sorted(CASES),
                        help="cases to run (default: a, b, c)")
    parser.add_argument("--dir", default=os.path.expanduser("~/.cache/moe-offload/realscale"),
                        help="where the models are written (outside the repository)")
    parser.add_argument("-t", "--threads", type=int, default=1, help="llama.cpp threads")
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
    cases = [CASES[k] for k in (args.case or sorted(CASES))]
    cost_table, cost_path = None, Path(args.cost) if args.cost else None
    if args.cost:                   # the live managed rows run on the same [cost] as replay
        import tomllib  # noqa: PLC0415

        with open(args.cost, "rb") as fh:
            cost_table = tomllib.load(fh).get("cost")
    directory = Path(args.dir)
    directory.mkdir(parents=True, exist_ok=True)
    command = "python scripts/bench_realscale.py " + " ".join(sys.argv[1:])
    report = [f"# Real-scale benchmark, {dt.date.today().isoformat()}", "",
              "```", command, "```", "",
              f"Machine: {os.cpu_count()} cores, "
              f"{format_size(os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES'))} RAM, "
              f"llama.cpp threads {args.threads}. Routing imposed from the real traces "
              "(`--route-trace`); model weights are random (`moe-offload synth --preset`).", ""]
    for case in cases:
        print(f"\n== case {case.key}: {case.title}", flush=True)
        free = shutil.disk_usage(directory).free
        need = planned_size(case)
        report += [f"## Case {case.key}: {case.title}", ""]
        if need > free - 2 * GIB:
            msg = (f"not run: the model needs {format_size(need)} and {directory} has "
                   f"{format_size(free)} free")
            print(msg)
            report += [msg, ""]
            continue
        model = write_model(case, directory)
        try:
            budget = planned_budget(model, case.mem_limit, 512)
            cost_file, case_cost = cost_path, cost_table
            if args.calibrate:
                cost_file, case_cost = calibrate(model, directory)
                report += [f"`moe-offload calibrate --storage {model.name}`: "
                           + ", ".join(f"{k} = {v}" for k, v in case_cost.items()), ""]
            rows = rows_for(budget, case_cost)
            sized = trace_at_model_sizes(case.trace, model, directory)
            if args.rows:
                wanted = {r.strip() for r in args.rows.split(",")}
                rows = [r for r in rows if r.name in wanted]
            results = []
            for row in rows:
                print(f"-- {row.name} ...", flush=True)
                r = run_row(model, case.trace, row, limit=case.mem_limit,
                            threads=args.threads, timeout=args.timeout)
                predicted = replay_prediction(sized, row, budget, cost_file)
                results.append((row, r, predicted))
                print(json.dumps({k: v for k, v in r.items() if k != "tier_notices"}),
                      flush=True)
            lines = table(case, results)
            print("\n".join(lines), flush=True)
            report += [f"Model {model.name}: {format_size(model.stat().st_size)}; cpu budget "
                       f"(plan, at -c 512{' under the limit' if case.mem_limit else ''}): "
                       f"{format_size(budget)}; trace {case.trace.name}.", "", *lines, ""]
        finally:
            if not args.keep:
                model.unlink(missing_ok=True)
            for p in [*directory.glob(f"*.{model.stem}.rtb"),
                      *directory.glob(f"{model.stem}.cost.toml")]:
                p.unlink()
    out = Path(args.out) if args.out else \
        ROOT / "docs" / "benchmarks" / f"{dt.date.today().isoformat()}-realscale.md"
    from runtime.atomic_write import write_text  # noqa: PLC0415

    write_text(out, "\n".join(report) + "\n")
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
