"""The README's commands run as written.

Every fenced ``sh`` block of README.md runs, in order, in one scratch directory (where the
repository's ``configs``, ``tests`` and ``scripts`` are linked, so that repository-relative
paths work as from the repository root), with this interpreter's environment first on PATH
(``moe-offload``, ``python``), and must exit 0. Later blocks use what earlier ones wrote (the
synthetic model of "Try it on a synthetic model"). One change is made to the text: port 8080
becomes a free port, so that the test does not meet another server.

A block that cannot run here (it creates a venv, downloads a real model, needs a GPU) is
skipped only by an explicit marker on the line before it, giving the reason:
``<!-- readme-test: skip (reason) -->``. The markers are counted, and the blocks they skip
must be few. ``python`` blocks are compiled, not run (they talk to a server started by hand).
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import free_port

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
SKIP = re.compile(r"<!--\s*readme-test:\s*skip\s*\((?P<why>[^)]+)\)\s*-->")
FENCE = re.compile(r"^```(?P<lang>\S*)\s*$")
SHELLS = ("sh", "bash", "shell")
MAX_SKIPPED = 6            # set-up (2), download, 24 GB RAM, GPU ... and no more
MAX_LINES = 350
BLOCK_TIMEOUT_S = 180      # each block takes seconds; generous for a loaded machine
LINKED = ("configs", "tests", "scripts")
# absolute paths of a development machine: none in the user docs
MACHINE_PATH = re.compile(r"(?<![\w.~])(/work/|/home/|/root/|/Users/|\.\./shared/)")


@dataclass(frozen=True)
class Block:
    line: int          # 1-based line of the opening fence
    lang: str
    text: str
    skip: str | None   # the marker's reason, or None


def readme_blocks(text: str) -> list[Block]:
    blocks, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m or not m.group("lang"):
            i += 1
            continue
        start = i
        i += 1
        body = []
        while i < len(lines) and lines[i].strip() != "```":
            body.append(lines[i])
            i += 1
        marker = SKIP.search(lines[start - 1]) if start > 0 else None
        blocks.append(Block(start + 1, m.group("lang"), "\n".join(body) + "\n",
                            marker.group("why") if marker else None))
        i += 1
    return blocks


BLOCKS = readme_blocks(README.read_text())
SHELL_BLOCKS = [b for b in BLOCKS if b.lang in SHELLS]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("readme")
    for name in LINKED:
        (d / name).symlink_to(ROOT / name)
    return d


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return env


# what some blocks must print, by a text of the block: (block text, expected outputs)
EXPECTED = (
    ("moe-offload complete -m tiny.gguf -p", ("expert hit rate",)),
    ("moe-offload serve -m tiny.gguf", ('"object":"chat.completion"', '"type":"message"',
                                        '"devices"')),
    ("moe-offload replay", ("belady",)),
)


@pytest.mark.parametrize("block", SHELL_BLOCKS, ids=lambda b: f"line{b.line}")
def test_readme_shell_block_runs(block: Block, workdir: Path):
    if block.skip is not None:
        pytest.skip(f"README line {block.line}: {block.skip}")
    if "curl " in block.text and shutil.which("curl") is None:
        pytest.skip(f"README line {block.line}: curl is not installed here")
    script = block.text.replace("8080", str(free_port()))
    proc = subprocess.Popen(["bash", "-eu", "-c", script], cwd=workdir, env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=BLOCK_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        out = "(timed out)"
    finally:
        try:                                   # a server the block left behind, if it failed
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
    assert proc.returncode == 0, f"README line {block.line} exited {proc.returncode}:\n" \
                                 f"{block.text}\n--- output ---\n{out[-4000:]}"
    compact = out.replace(" ", "")
    for text, expected in EXPECTED:
        if text in block.text:
            missing = [e for e in expected if e.replace(" ", "") not in compact]
            assert not missing, f"README line {block.line}: {missing} not in\n{out[-4000:]}"


def test_readme_python_blocks_compile():
    for block in (b for b in BLOCKS if b.lang == "python"):
        compile(block.text, f"README.md:{block.line}", "exec")


def test_readme_skips_are_few_and_explained():
    skipped = [b for b in SHELL_BLOCKS if b.skip]
    assert skipped and len(skipped) <= MAX_SKIPPED, [b.line for b in skipped]
    markers = SKIP.findall(README.read_text())
    assert len(markers) == len(skipped), "a skip marker not right before a shell block"


def test_readme_is_short():
    assert len(README.read_text().splitlines()) < MAX_LINES


def test_user_docs_hold_no_machine_paths():
    docs = [README, ROOT / "models.md", *sorted((ROOT / "docs").rglob("*.md"))]
    found = [f"{p.relative_to(ROOT)}:{n}: {line.strip()}" for p in docs
             for n, line in enumerate(p.read_text().splitlines(), 1) if MACHINE_PATH.search(line)]
    assert not found, "\n".join(found)


def test_readme_test_command_is_ci_s():
    """CI runs the README's test command verbatim."""
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    command = next(b.text.strip() for b in SHELL_BLOCKS if "python -m pytest" in b.text)
    assert command in ci
