"""The offload benchmark: plain mmap vs static placement vs the residency manager's policies.

Each configuration runs in its own process (``runtime.bench.worker``), optionally under a cgroup v1
memory limit, after the model file's pages were dropped from the page cache. Rows are printed
as a markdown table in llama-bench's manner, or as JSON; the cold-start line compares the time
to generate after a page-cache drop, plain mmap faults against our parallel read-ahead.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

from runtime.errors import UserError
from runtime.bench.run import BenchConfig, COLD_PROMPT
from runtime.ramtier.pager import drop_file_cache
from runtime.units import format_size

POLICIES = ("lru", "lfu", "lfu-decay", "phase-weighted", "next-visit")
# the replay study's best config (docs/policy-study.md), a default row at --budget
BEST_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "best-replay.toml"
HEADER = ("config", "backend", "expert budget", "test", "t/s ± sd", "hit %",
          "demand-miss MiB/tok")


@dataclass(frozen=True)
class BenchRow:
    config: str
    backend: str
    budget: str
    test: str
    tps: float
    tps_sd: float
    hit_pct: float | None
    demand_miss_mib_per_tok: float | None
    read_mib_per_tok: float
    seconds: float                       # mean seconds of one repetition
    samples_tps: tuple[float, ...] = field(default=())

    @property
    def has_sd(self) -> bool:
        """A spread to show: more than one repetition (one has none; "± 0.00" would say it
        never varies)."""
        return len(self.samples_tps) != 1

    def cells(self) -> tuple[str, ...]:
        return (self.config, self.backend, self.budget, self.test,
                f"{self.tps:.2f} ± {self.tps_sd:.2f}" if self.has_sd else f"{self.tps:.2f}",
                "-" if self.hit_pct is None else f"{self.hit_pct:.1f}",
                "-" if self.demand_miss_mib_per_tok is None
                else f"{self.demand_miss_mib_per_tok:.2f}")


@dataclass
class BenchResult:
    rows: list[BenchRow]
    cold_ratios: dict[str, float]        # managed config -> mmap cold seconds / its seconds
    notes: list[str]
    details: dict[str, dict]             # config -> worker output (tier stats, truth, ...)


def mib(n: int) -> str:
    """A size for the table: whole MiB from 10 MiB on, more digits below (a tiny model's
    budget is not "0 MiB")."""
    if n < 10 << 20:
        return format_size(n)
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def merged_notes(notes: list[tuple[str, str]]) -> list[str]:
    """Notes as ``(who, what)``, one line per distinct ``what`` naming everyone it concerns
    (in order): twelve rows with the same notice make one line."""
    by_what: dict[str, list[str]] = {}
    for who, what in notes:
        whos = by_what.setdefault(what, [])
        if who and who not in whos:
            whos.append(who)
    return [f"{', '.join(whos)}: {what}" if whos else what for what, whos in by_what.items()]


def default_configs(total_expert_bytes: int, budget_bytes: int,
                    policies: tuple[str, ...] = POLICIES, *,
                    read_ahead: bool = True,
                    best_config: Path | None = BEST_CONFIG) -> list[BenchConfig]:
    """mmap (kernel paging); read-ahead (managed, room for every expert: reads only; left
    out under a memory limit, where it cannot hold its budget); each eviction policy at
    ``budget_bytes``; and ``best_config``'s policies at ``budget_bytes`` (when the file is
    there: a source checkout)."""
    configs = [BenchConfig("mmap", "mmap", "kernel (all)")]
    if read_ahead:
        configs.append(BenchConfig("read-ahead", "managed", f"{mib(total_expert_bytes)} (all)",
                                   config={"devices": {"cpu": total_expert_bytes + (1 << 20)}}))
    for name in policies:
        configs.append(BenchConfig(
            name, "managed", mib(budget_bytes),
            config={"devices": {"cpu": int(budget_bytes)},
                    "policy": {"prefill": {"eviction": name}, "decode": {"eviction": name}}}))
    if best_config is not None and best_config.is_file():
        import tomllib  # noqa: PLC0415

        data = tomllib.loads(best_config.read_text(encoding="utf-8"))
        data["devices"] = {"cpu": int(budget_bytes)}
        configs.append(BenchConfig(best_config.stem, "managed", mib(budget_bytes), config=data))
    return configs


def pressure_note(file_bytes: int, available_bytes: int, mem_limit: int | None) -> str:
    """The line under the table when nothing forces the model out of memory: "" under a
    memory limit, or when the model file is larger than the memory available."""
    if mem_limit or file_bytes > available_bytes:
        return ""
    return (f"note: the model ({mib(file_bytes)}) fits in free memory ({mib(available_bytes)}), "
            "so after its first read the kernel's page cache holds every expert and no "
            "managed tier can gain without memory pressure: the rows above measure the "
            "tiers' overhead. `--mem-limit SIZE` (below the model's size) runs each config "
            "under a memory limit, where the tiers can gain.")


def static_configs(n_layers: list[int]) -> list[BenchConfig]:
    """``--n-cpu-moe N`` placements (GPU machines): experts of the first N layers on the CPU."""
    return [BenchConfig(f"n-cpu-moe={n}", "static", f"static: {n} layers on CPU", n_cpu_moe=n)
            for n in n_layers]


def file_configs(paths: list[str]) -> list[BenchConfig]:
    """One managed config per residency TOML (checked here, so a bad file fails early)."""
    from runtime.residency.config import load_config

    out = []
    for path in paths:
        config = load_config(path)
        label = ", ".join(b.text if b.device == "cpu" else f"{b.device} {b.text}"
                          for b in config.devices) or "-"
        out.append(BenchConfig(Path(path).stem, "managed", label, config_path=str(path)))
    return out


def run_bench(model: str, configs: list[BenchConfig], *, p: int, n: int, reps: int, cold: int,
              threads: int | None = None, mem_limit: int | None = None,
              progress: bool = True, gpu_layers: int = 0,
              route_trace: str | None = None) -> BenchResult:
    """Run every config in a fresh worker process; rows in config then test order."""
    from tqdm import tqdm

    tests = sum(1 for t in (p, n, cold) if t > 0)
    if route_trace is not None:     # a cold play, a warm-up play, then reps plays
        tests = 1 + (cold > 0)
    bar = tqdm(total=len(configs) * (1 + tests * reps), desc="bench", unit="step",
               file=sys.stderr, disable=not progress or None, leave=False)
    rows: list[BenchRow] = []
    notes: list[tuple[str, str]] = []           # (config [test], what): merged_notes
    details: dict[str, dict] = {}
    try:
        for cfg in configs:
            drop_file_cache(model)          # every config starts from a cold page cache
            try:
                out = _run_worker(model, cfg, p=p, n=n, reps=reps, cold=cold,
                                  threads=threads, mem_limit=mem_limit, bar=bar,
                                  gpu_layers=gpu_layers, route_trace=route_trace)
            except UserError as err:        # one config failing keeps the others' rows
                if len(configs) == 1:
                    raise
                notes.append(("", str(err)))
                continue
            details[cfg.name] = out
            for note in out.get("tier", {}).get("notices", []):
                notes.append((cfg.name, note))
            for test, s in out["tests"].items():
                if s["demand_miss_mib_per_tok"] and \
                        s["read_mib_per_tok"] < 0.5 * s["demand_miss_mib_per_tok"]:
                    notes.append((f"{cfg.name} {test}", "read under half of its demand-miss "
                                  "bytes from storage (read_mib_per_tok in --json): another "
                                  "process had the file cached (optimistic)"))
                rows.append(BenchRow(cfg.name, out["backend"], cfg.budget_label, test,
                                     s["tps"], s["tps_sd"], s["hit_pct"],
                                     s["demand_miss_mib_per_tok"], s["read_mib_per_tok"],
                                     s["seconds"], tuple(s["samples_tps"])))
    finally:
        bar.close()
    return BenchResult(rows, cold_ratios(rows, cold), merged_notes(notes), details)


def _run_worker(model: str, cfg: BenchConfig, *, p, n, reps, cold, threads, mem_limit,
                bar, gpu_layers: int = 0, route_trace: str | None = None) -> dict:
    from runtime.ramtier.cgroup import MemoryLimit

    job = json.dumps({"model": model, "config": cfg.to_json(), "p": p, "n": n, "reps": reps,
                      "cold": cold, "threads": threads, "gpu_layers": gpu_layers,
                      "route_trace": route_trace})
    group = MemoryLimit(mem_limit, name=f"moe-bench-{os.getpid()}") if mem_limit else None
    cmd = [sys.executable, "-m", "runtime.bench.worker"]
    env = dict(os.environ, PYTHONPATH=_repo_root() + os.pathsep + os.environ.get("PYTHONPATH", ""))
    if group is not None:
        group.__enter__()
    try:
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env=env,
                                preexec_fn=group.join if group is not None else None)
        errors: list[str] = []

        def pump() -> None:
            for line in proc.stderr:
                if line.startswith("@@ "):
                    bar.set_description(f"bench {cfg.name}: {line[3:].strip()}")
                    bar.update(1)
                elif line.strip():
                    errors.append(line.rstrip())

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        try:
            stdout, _ = proc.communicate(job)
        except BaseException:       # Ctrl-C (or any error) here: the worker stops too
            proc.kill()
            proc.wait()
            raise
        reader.join()
        peak = group.peak_bytes() if group is not None else None
    finally:
        if group is not None:
            group.__exit__(None, None, None)
    lines = [ln for ln in stdout.splitlines() if ln.strip()]
    result = json.loads(lines[-1]) if lines else {}
    if proc.returncode != 0 or "tests" not in result:
        why = result.get("error") or (errors[-1] if errors else f"exit status {proc.returncode}")
        if proc.returncode in (-9, 137):
            why = f"killed (out of memory under the {mib(mem_limit)} limit?)" if mem_limit else why
        raise UserError(f"bench config {cfg.name}: {why}")
    if peak is not None:
        result["cgroup_peak_bytes"] = peak
    return result


def _repo_root() -> str:
    return str(Path(__file__).resolve().parents[2])


def cold_ratios(rows: list[BenchRow], cold: int) -> dict[str, float]:
    """mmap's cold-test seconds over each other config's (> 1: faster than kernel faults)."""
    test = next((r.test for r in rows if r.test.startswith("cold")), f"cold{cold}")
    base = next((r for r in rows if r.config == "mmap" and r.test == test), None)
    if base is None:
        return {}
    return {r.config: base.seconds / r.seconds for r in rows
            if r.test == test and r.config != "mmap" and r.seconds > 0}


def format_table(rows: list[BenchRow]) -> str:
    """Markdown, llama-bench style: text columns left, numbers right."""
    header = HEADER if any(r.has_sd for r in rows) else \
        tuple("t/s" if h == "t/s ± sd" else h for h in HEADER)
    cells = [header] + [r.cells() for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(HEADER))]
    right = {4, 5, 6}

    def line(row) -> str:
        return "| " + " | ".join(c.rjust(w) if i in right else c.ljust(w)
                                 for i, (c, w) in enumerate(zip(row, widths))) + " |"

    rule = "| " + " | ".join(("-" * (w - 1) + ":") if i in right else "-" * w
                             for i, w in enumerate(widths)) + " |"
    return "\n".join([line(header), rule] + [line(r) for r in cells[1:]])


def cold_line(result: BenchResult, cold: int) -> str:
    """The cold-start comparison, one line per managed config."""
    if not result.cold_ratios:
        return ""
    test = next((r.test for r in result.rows if r.test.startswith("cold")), f"cold{cold}")
    secs = {r.config: r.seconds for r in result.rows if r.test == test}
    parts = [f"{name} {secs[name]:.2f} s, {speed_words(ratio)}"
             for name, ratio in result.cold_ratios.items()]
    what = ("the trace's prompt and decode rows" if test.endswith("@trace")
            else f"{COLD_PROMPT}-token prompt + {cold} tokens")
    return (f"cold start (page cache dropped; {what}): "
            f"mmap faults {secs['mmap']:.2f} s; speed against mmap: " + "; ".join(parts))


def speed_words(ratio: float) -> str:
    """``ratio`` = mmap's seconds / this config's (its speed against mmap's), one way for
    gains and losses alike: "1.52x (faster)", "0.52x (slower)", "1.00x (as fast)"."""
    if ratio >= 1.005:
        return f"{ratio:.2f}x (faster)"
    if ratio <= 1 / 1.005:
        return f"{ratio:.2f}x (slower)"
    return "1.00x (as fast)"


def to_json(result: BenchResult, meta: dict) -> str:
    """The rows (same as the table) plus the cold-start ratios and run metadata."""
    return json.dumps({"meta": meta,
                       "rows": [r.__dict__ | {"samples_tps": list(r.samples_tps)}
                                for r in result.rows],
                       "cold_start_ratio_vs_mmap": result.cold_ratios,
                       "notes": result.notes,
                       "details": result.details}, indent=2)


def read_ahead_kb(path: str) -> int | None:
    """The kernel readahead window of the block device holding ``path`` (KiB), if known:
    plain mmap's fault read-around scales with it."""
    st = os.stat(path)
    base = Path(f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}")
    for candidate in (base / "queue" / "read_ahead_kb", base.parent / "queue" / "read_ahead_kb"):
        try:
            return int(candidate.resolve().read_text())
        except (OSError, ValueError):
            continue
    try:
        return int((base.resolve().parent / "queue" / "read_ahead_kb").read_text())
    except (OSError, ValueError):
        return None
