#!/usr/bin/env python3
"""Write the pruned llama.cpp source archive that travels with the repository, for builds on
machines without network (scripts/gpu_check.sh).

    python scripts/make_source_archive.py [--sdist PATH] [--out offline/llama-cpp-python-0.3.36-pruned.tar.xz]

From the llama-cpp-python 0.3.36 sdist (pip download, cached; or --sdist): the parts of
vendor/llama.cpp a library build needs (runtime/native/source.py NEEDED), without the ggml
backends no target here uses (only CPU, CUDA, Vulkan, BLAS, RPC stay), plus the pure-Python
``llama_cpp`` bindings (which load libllama from LLAMA_CPP_LIB_PATH). Deterministic: sorted
members, fixed mtimes and owners, so the same sdist gives the same bytes.
"""
from __future__ import annotations

import argparse
import io
import lzma
import sys
import tarfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from runtime.atomic_write import write_bytes  # noqa: E402
from runtime.native.source import (NEEDED, SKIPPED, VENDOR_PREFIX,  # noqa: E402
                                   resolve_source)

PRUNED_BACKENDS = tuple(f"ggml/src/ggml-{b}/" for b in (
    "cann", "et", "hip", "metal", "musa", "sycl", "webgpu", "zdnn", "opencl", "hexagon",
    "zendnn", "openvino", "virtgpu"))
ROOT = "llama_cpp_python-0.3.36/"
DEFAULT_OUT = Path(__file__).resolve().parents[1] / "offline" / \
    "llama-cpp-python-0.3.36-pruned.tar.xz"


def keep(rel_vendor: str | None, rel_pkg: str | None) -> bool:
    if rel_vendor is not None:
        return (rel_vendor.startswith(NEEDED) and not rel_vendor.startswith(SKIPPED)
                and not rel_vendor.startswith(PRUNED_BACKENDS))
    return rel_pkg is not None and rel_pkg.endswith((".py", ".typed")) and "/server/" not in rel_pkg


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument("--sdist", default=None, help="the llama-cpp-python 0.3.36 sdist")
    parser.add_argument("--out", default=str(DEFAULT_OUT))
    args = parser.parse_args(argv)
    source = resolve_source(args.sdist)
    if source.kind != "tarball":
        parser.error("--sdist must be the .tar.gz")
    members = []
    with tarfile.open(source.path) as tar:
        for m in tar:
            if not m.isfile():
                continue
            name = m.name.split("/", 1)[1] if "/" in m.name else m.name
            vendor = name[len(VENDOR_PREFIX):] if name.startswith(VENDOR_PREFIX) else None
            pkg = name if name.startswith("llama_cpp/") else None
            if keep(vendor, pkg):
                members.append((ROOT + name, tar.extractfile(m).read(), m.mode))
    members.sort()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, data, mode in members:
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(data), mode & 0o755 | 0o644, 0
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            tar.addfile(info, io.BytesIO(data))
    write_bytes(out, lzma.compress(buf.getvalue(), preset=9 | lzma.PRESET_EXTREME))  # atomic
    print(f"{out}: {len(members)} files, {out.stat().st_size / 2**20:.1f} MiB "
          f"(from {source.path})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
