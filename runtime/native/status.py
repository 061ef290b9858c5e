"""What native builds exist, and which one runs: ``moe-offload native status [--json]``."""
from __future__ import annotations

import os

from runtime.native.build import BACKENDS, find_build, list_builds, patch_files, patches_hash
from runtime.native.source import cache_root


def native_status() -> dict:
    """``{"built": bool, "dir": lib dir of this install's current build or None, "in_use": the
    lib dir a command loads (runtime.native.lib_dir_for without devices) or None, "in_use_from":
    "LLAMA_CPP_LIB_PATH" | "install" | None, "backends": [backends with a current build],
    "builds": [...], "stale": n, "cache": root, "patches": [names]}``. A build is current when
    made from today's patches and device cache store sources."""
    current = patches_hash()
    builds = list_builds()
    fresh = [b for b in builds if b.patches_hash == current]
    backends = [be for be in BACKENDS if any(b.backend == be for b in fresh)]
    from runtime.native.install import default_build, installed_backend  # noqa: PLC0415

    from runtime.native import LIB_PATH_ENV  # noqa: PLC0415

    preferred = default_build()
    rpc = find_build(rpc=True)
    env = os.environ.get(LIB_PATH_ENV)
    in_use = env or (preferred.lib_dir if preferred else None)
    return {
        "built": bool(fresh),
        "dir": preferred.lib_dir if preferred else None,
        "in_use": in_use,
        "in_use_from": LIB_PATH_ENV if env else ("install" if preferred else None),
        "installed_backend": installed_backend(),
        "backends": backends,
        "rpc": rpc is not None,
        "rpc_dir": rpc.lib_dir if rpc else None,
        "builds": [{"backend": b.backend, "dir": b.lib_dir, "key": b.key,
                    "built_at": b.built_at, "build_seconds": b.build_seconds,
                    "source": b.source, "rpc": b.rpc} for b in fresh],
        "stale": len(builds) - len(fresh),
        "cache": str(cache_root()),
        "patches": [p.name for p in patch_files()],
        "patches_hash": current,
    }


def format_status(status: dict) -> str:
    """The human-readable form: one line per fact."""
    lines = [f"built: {'yes' if status['built'] else 'no'}"]
    if status["in_use_from"] == "install":
        backend = next((b["backend"] for b in status["builds"] if b["dir"] == status["dir"]),
                       status["installed_backend"])
        lines.append(f"in use: {status['in_use']} (this install's {backend} build)")
    elif status["in_use_from"] is not None:
        lines.append(f"in use: {status['in_use']} (${status['in_use_from']}; this install's "
                     f"build: {status['dir'] or 'none'})")
    if status["built"]:
        lines.append(f"backends: {', '.join(status['backends'])}")
        lines.append(f"rpc: yes ({status['rpc_dir']})" if status["rpc"] else
                     "rpc: no (`moe-offload native build` builds ggml's RPC backend)")
    if status["dir"] is None:
        from runtime.native.install import missing_message  # noqa: PLC0415

        lines.append(missing_message(status["installed_backend"]))
    if status["stale"]:
        lines.append(f"stale builds (older patches): {status['stale']}")
    lines.append(f"cache: {status['cache']}")
    lines.append(f"patches: {', '.join(status['patches'])}")
    return "\n".join(lines)
