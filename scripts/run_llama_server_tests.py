#!/usr/bin/env python3
"""Run llama.cpp's own server tests (tools/server/tests) against ``moe-offload serve``.

The tests come from the llama-cpp-python 0.3.36 source archive (the sdist), so they match the
llama.cpp our runtime links; the repository's pruned archive (offline/) leaves them out,
so the sdist is fetched once by pip (~75 MB, runtime.native.source.download_sdist) into
~/.cache/moe-offload/native/sdist/ when it is not there. The tests themselves download nothing:
the models they name are replaced by a synthetic MoE model (scripts/llama_server_compat.py maps
llama-server's flags).
The tests are extracted into a temporary directory, run, and the counts printed:

    python scripts/run_llama_server_tests.py [--sdist FILE | --tests DIR] [--suites A,B]
                                             [-k EXPR] [--per-test S] [--json]

Every suite runs (unit/test_*.py; the tests marked slow are deselected): the ones about
features this server lacks fail and count. scripts/llama_server_tests.manifest holds the
sha256 of each extracted file (checked before the run). ``--per-test`` bounds one test's
time. The llama.cpp files keep their MIT license (LICENSE is extracted next to them); none is
copied into this repository.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import socket
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MANIFEST = REPO / "scripts" / "llama_server_tests.manifest"   # sha256 of each extracted file
ARCHIVE = "llama_cpp_python-0.3.36.tar.gz"
TESTS_IN_ARCHIVE = "llama_cpp_python-0.3.36/vendor/llama.cpp/tools/server/tests"
LICENSE_IN_ARCHIVE = "llama_cpp_python-0.3.36/vendor/llama.cpp/LICENSE"
TEMPLATES_IN_ARCHIVE = "llama_cpp_python-0.3.36/vendor/llama.cpp/models/templates"  # tests read
# every suite runs (unit/test_*.py, the slow ones deselected): the ones about what we lack
# (router, MCP, vision, reranking, speculative decoding, LoRA ...) count as failures

STUB_WGET = '''"""Stand-in for the wget package: this run downloads nothing."""
def download(url, out=None):
    raise RuntimeError(f"download refused (offline run): {url}")
'''
STUB_TIMEOUT = '''"""A per-test time limit (SIGALRM), so one hung request cannot stall the run."""
import os
import signal

import pytest


def _expired(signum, frame):
    raise TimeoutError("test time limit reached")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    signal.signal(signal.SIGALRM, _expired)
    signal.alarm(int(os.environ.get("LLAMA_TESTS_TIMEOUT", "300")))
    try:
        yield
    finally:
        signal.alarm(0)
'''
STUB_FILELOCK = '''"""Stand-in for the filelock package (an flock on the path)."""
import fcntl


class FileLock:
    def __init__(self, path, timeout=-1):
        self._path, self._fh = path, None

    def __enter__(self):
        self._fh = open(self._path, "w")
        fcntl.flock(self._fh, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc):
        fcntl.flock(self._fh, fcntl.LOCK_UN)
        self._fh.close()
'''


def default_sdist() -> Path:
    """The cached sdist, fetched by pip first when missing (UserError when that fails)."""
    from runtime.native.source import cache_root, download_sdist  # noqa: PLC0415

    return download_sdist(cache_root() / "sdist")


def extract(sdist: Path, into: Path) -> Path:
    with tarfile.open(sdist) as tar:
        members = [m for m in tar.getmembers()
                   if m.name.startswith((TESTS_IN_ARCHIVE + "/", TEMPLATES_IN_ARCHIVE + "/"))
                   or m.name == LICENSE_IN_ARCHIVE]
        if not members:
            raise SystemExit(f"{sdist}: no {TESTS_IN_ARCHIVE} inside")
        tar.extractall(into, members=members, filter="data")
    tests = into / TESTS_IN_ARCHIVE
    check_manifest(into / "llama_cpp_python-0.3.36" / "vendor" / "llama.cpp")
    (tests / "LICENSE.llama.cpp").write_bytes((into / LICENSE_IN_ARCHIVE).read_bytes())
    return tests


def check_manifest(root: Path) -> None:
    """The extracted files are the ones MANIFEST names, byte for byte."""
    for line in MANIFEST.read_text().splitlines():
        if line and not line.startswith("#"):
            digest, name = line.split(maxsplit=1)
            path = root / name
            if not path.is_file() or hashlib.sha256(path.read_bytes()).hexdigest() != digest:
                raise SystemExit(f"{name}: not the file {MANIFEST.name} names")


def run(tests: Path, work: Path, select: str | None, timeout: float, per_test: int,
        suites: list[str] | None) -> dict:
    stubs = work / "stubs"
    stubs.mkdir(exist_ok=True)
    (stubs / "wget.py").write_text(STUB_WGET)
    (stubs / "filelock.py").write_text(STUB_FILELOCK)
    (stubs / "llama_tests_timeout.py").write_text(STUB_TIMEOUT)
    launcher = work / "llama-server"
    launcher.write_text(f"#!/bin/sh\nexec {sys.executable} {REPO / 'scripts/llama_server_compat.py'}"
                        ' "$@"\n')
    launcher.chmod(0o755)
    # a free port, not the tests' default 8080: two runs (or another server) on one machine
    # would answer each other's requests
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = dict(os.environ, LLAMA_SERVER_BIN_PATH=str(launcher),
               # the stubs first; the caller's own path kept (where its llama_cpp may be)
               PYTHONPATH=os.pathsep.join([str(stubs), str(REPO), *filter(None, [
                   os.environ.get("PYTHONPATH")])]), PYTHONUNBUFFERED="1",
               LLAMA_TESTS_TIMEOUT=str(per_test))
    env.setdefault("PORT", str(port))
    every = {p.stem.removeprefix("test_"): f"unit/{p.name}"
             for p in (tests / "unit").glob("test_*.py")}
    names = [s.removeprefix("test_") for s in suites] if suites is not None else sorted(every)
    if unknown := [n for n in names if n not in every]:
        raise SystemExit(f"--suites: no suite {', '.join(unknown)} (there are: "
                         f"{', '.join(sorted(every))})")
    files = [every[n] for n in names]
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "not slow", "-p", "no:cacheprovider",
           "-p", "llama_tests_timeout", "-o", "addopts=", "--tb=line", "-rfE", *files]
    if select:
        cmd += ["-k", select]
    proc = subprocess.run(cmd, cwd=tests, env=env, capture_output=True, text=True,
                          timeout=timeout)
    tail = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    counts = {k: int(v) for v, k in re.findall(r"(\d+) (passed|failed|errors?|skipped|"
                                               r"deselected|xfailed|xpassed)", tail)}
    return {"command": " ".join(cmd), "summary": tail, "counts": counts,
            "passed": counts.get("passed", 0), "output": proc.stdout,
            "stderr": proc.stderr[-4000:], "returncode": proc.returncode}


def main() -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument("--sdist", type=Path, default=None,
                        help=f"the {ARCHIVE} to read (default: the cached one, fetched by pip "
                             "when missing)")
    parser.add_argument("--tests", type=Path, default=None,
                        help="an already extracted tools/server/tests directory")
    parser.add_argument("-k", dest="select", default=None, help="pytest -k expression")
    parser.add_argument("--suites", default=None,
                        help="comma-separated unit suites to run, e.g. vision_api,router "
                             "(default: all of them)")
    parser.add_argument("--timeout", type=float, default=7200, help="seconds for the run")
    parser.add_argument("--per-test", type=int, default=300, help="seconds for one test")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="llama-server-tests-") as tmp:
        work = Path(tmp)
        if args.tests is not None:
            tests = args.tests
        else:
            sys.path.insert(0, str(REPO))       # runtime, also from a checkout not installed
            from runtime.errors import UserError  # noqa: PLC0415

            try:
                sdist = args.sdist or default_sdist()
            except UserError as exc:
                sys.stderr.write(f"{exc} (or give --sdist / --tests)\n")
                return 2
            if not sdist.is_file():
                sys.stderr.write(f"{sdist}: not found (give --sdist / --tests)\n")
                return 2
            tests = extract(sdist, work)
        suites = args.suites.split(",") if args.suites else None
        result = run(tests, work, args.select, args.timeout, args.per_test, suites)
    if args.json:
        print(json.dumps({k: v for k, v in result.items() if k != "output"}))
    else:
        print(result["output"])
        if not result["counts"]:          # pytest ended without its summary: say why
            print(f"pytest exited with {result['returncode']}; its stderr ends:\n"
                  f"{result['stderr']}")
        print(f"llama.cpp server tests against moe-offload serve: {result['summary']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
