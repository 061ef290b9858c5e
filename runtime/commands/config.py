"""``moe-offload config check FILE [-m MODEL.gguf]``: validate a residency config.

Prints each device's resolved capacity in bytes (and in experts, with a model), with a model
the pools of each device-cache device (the layers that share an expert layout and the slots
each gets at that budget, as the cache allocates them at load), and the policies per phase;
exit 0. Any problem is one line naming the file and the key, exit 2.
"""
from __future__ import annotations

import argparse

from runtime.residency.capacity import probe_device_memory, resolve_budget
from runtime.residency.config_cli import add_config_arguments, config_from_args
from runtime.residency.types import Phase
from runtime.units import format_ranges, format_size


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("config", help="residency configuration tools",
                                   description="Residency configuration tools.")
    sub = parser.add_subparsers(dest="config_command", metavar="SUBCOMMAND")
    check = sub.add_parser(
        "check", help="validate a residency config TOML and print resolved capacities",
        description="Validate a residency config TOML; print each device's resolved expert "
                    "budget in bytes (and in experts with -m). Flags override the file.")
    check.add_argument("file", metavar="FILE", help="residency config TOML")
    check.add_argument("-m", "--model", metavar="MODEL.gguf", default=None,
                       help="a GGUF model: check budgets against its expert sizes")
    add_config_arguments(check, config_file_flag=False)
    check.set_defaults(func=run_check)
    parser.set_defaults(func=lambda args: (parser.print_help(), 2)[1])


def _pool_lines(model: str, device: str, capacity: int, facts) -> list[str]:
    """The pools the device cache makes on ``device`` at ``capacity`` (cache devices only);
    devices without a cache hold one pool of every MoE layer."""
    from runtime.residency.config import is_cache_device  # noqa: PLC0415

    if not is_cache_device(device):
        return [f"    pool 0: layers {format_ranges(facts.moe_layers)}: {capacity} bytes"]
    from runtime.native.pools import probe_pools  # noqa: PLC0415

    probe = probe_pools(model, device, capacity, facts.moe_layers)
    if probe.why_not:
        return [f"    pools: {probe.why_not}"]
    out = []
    for i, pool in enumerate(probe.pools):
        out.append(f"    pool {i}: layers {format_ranges(pool.layers)}: {pool.slots} slots x "
                   f"{pool.slot_bytes} bytes = {pool.capacity_bytes} bytes "
                   f"({format_size(pool.capacity_bytes)})")
    return out


def _remote_lines(config, largest: int | None, facts=None) -> list[str]:
    """Each rpc:HOST:PORT device: contacted with a short timeout; its capacity and link, or
    a UserError (one line naming it) when unreachable or over its memory. With a model, the
    plan a load with the default context would make."""
    from runtime.rpc.setup import plan_for, resolve_remotes  # noqa: PLC0415

    lines = []
    resolved = resolve_remotes(config, largest_expert=largest)
    for budget, _dev, info, capacity in resolved:
        bw = f", {info.bandwidth_bps / 1e9:.2f} GB/s" if info.bandwidth_bps else ""
        lines.append(f"  devices.{budget.device} = {budget.text!r}: {capacity} bytes "
                     f"({format_size(capacity)}) of {format_size(info.free_bytes)} free / "
                     f"{format_size(info.total_bytes)}; reachable, rpc {info.proto}, "
                     f"rtt {info.rtt_s * 1e3:.2f} ms{bw}")
    if config.remotes:
        lines.append(f"  rpc.mode = {config.rpc_mode!r}, rpc.timeout_s = {config.rpc_timeout_s:g}")
    if config.remotes and facts is not None:
        from runtime.engine.types import EngineSettings  # noqa: PLC0415

        settings = EngineSettings(model_path=facts.path)
        plan = plan_for(config, facts, settings, resolved)
        lines.append(f"  at -c {settings.n_ctx} -ub {settings.n_ubatch}: {plan.describe()}")
    return lines


def run_check(args: argparse.Namespace) -> int:
    config = config_from_args(args, path=args.file)
    facts = None
    if args.model is not None:
        from gguf_tools.facts import read_model_facts
        facts = read_model_facts(args.model)
    moe_bytes = [b for b in facts.expert_bytes if b > 0] if facts else []
    largest = max(moe_bytes) if moe_bytes else None
    mean = sum(moe_bytes) / len(moe_bytes) if moe_bytes else None
    lines = [f"{args.file}: ok"]
    if facts is not None:
        lines.append(f"  model {facts.path}: {len(moe_bytes)} MoE layers x {facts.n_expert} "
                     f"experts, largest expert {largest} bytes, all experts "
                     f"{facts.total_expert_bytes} bytes")
    if not config.devices and not config.remotes:
        lines.append("  devices: none configured (each device gets 'auto' when used)")
    for budget in config.devices:
        if budget in config.remotes:      # [rpc] mode = "cache": listed with the remotes below
            continue
        mem = probe_device_memory(budget.device)
        free, total = mem if mem is not None else (None, None)
        capacity = resolve_budget(budget, free_bytes=free, total_bytes=total,
                                  largest_expert=largest, source=config.source)
        line = (f"  devices.{budget.device} = {budget.text!r}: {capacity} bytes "
                f"({format_size(capacity)})")
        if mean:
            n_total = len(moe_bytes) * facts.n_expert
            fits = int(capacity // mean)
            if fits >= n_total:
                line += f", all {n_total} experts fit"
            else:
                share = capacity / max(1, facts.total_expert_bytes)
                line += f", ~{fits} of {n_total} experts ({share:.1%} of the expert bytes)"
        if mem is None:
            line += "; device memory unknown here (not checked against it)"
        lines.append(line)
        if facts is not None:
            lines.extend(_pool_lines(args.model, budget.device, capacity, facts))
    lines.extend(_remote_lines(config, largest, facts))
    lines.append(f"  policy.phase_specific = {str(config.phase_specific).lower()}")
    for phase in (Phase.PREFILL, Phase.DECODE):
        pp = config.policies_for(phase)
        parts = []
        for role in ("admission", "prefetch", "eviction"):
            spec = getattr(pp, role)
            params = ", ".join(f"{k}={v:g}" for k, v in spec.params)
            parts.append(f"{role}={spec.name}" + (f"({params})" if params else ""))
        lines.append(f"  {phase.label}: " + " ".join(parts))
    c = config.cost
    lines.append("  cost: " + " ".join(f"{k}={getattr(c, k):g}" for k in c.__dataclass_fields__))
    print("\n".join(lines))
    return 0
