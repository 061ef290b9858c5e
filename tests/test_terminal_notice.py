"""The native build's notice reaches the terminal while pytest captures output: a pytest run
in a subprocess, whose session fixture says a line the way the session's build does
(tests/conftest.py), shows it at once (before the test's own result), with the default fd
capture on; and a build that says nothing for a while still gets a line on the terminal."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

CHILD_CONFTEST = "from tests.conftest import pytest_configure  # noqa: F401\n"
CHILD_TEST = '''
import time
import pytest
from tests.conftest import terminal_notice

@pytest.fixture(scope="session")
def slow_build():
    terminal_notice("[child, once per cache] building the patched llama.cpp (minutes)")
    time.sleep(0.2)
    return "built"

def test_uses_the_build(slow_build):
    print("captured test output")
    assert slow_build == "built"
'''


# a build silent for longer than the progress interval (extracting, configuring): the fixture
# waits until the progress thread has said something of its own, however long that takes
CHILD_SILENT_TEST = '''
import time
import pytest
from tests.conftest import _BuildProgress

@pytest.fixture(scope="session")
def slow_build():
    with _BuildProgress("[child] ", every=0.2) as say:
        say("configuring")
        first = say.last
        deadline = time.monotonic() + 60
        while say.last == first and time.monotonic() < deadline:
            time.sleep(0.05)
    return "built"

def test_uses_the_build(slow_build):
    assert slow_build == "built"
'''


def _run_child(tmp_path, test: str) -> list[str]:
    """A pytest run of ``test`` in a child; its terminal's lines."""
    (tmp_path / "conftest.py").write_text(CHILD_CONFTEST)
    (tmp_path / "test_child.py").write_text(test)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           str(tmp_path / "test_child.py")], capture_output=True, text=True,
                          env=env, cwd=tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout.splitlines()


def test_build_notice_is_on_the_terminal_not_captured(tmp_path):
    lines = _run_child(tmp_path, CHILD_TEST)
    proc_stdout = "\n".join(lines)
    notice = [i for i, line in enumerate(lines) if "building the patched llama.cpp" in line]
    assert notice, proc_stdout                      # on pytest's terminal (its stdout)
    assert "captured test output" not in proc_stdout   # the test's own print stays captured
    passed = next(i for i, line in enumerate(lines) if "1 passed" in line)
    assert notice[0] < passed


def test_a_silent_build_still_says_it_works(tmp_path):
    lines = _run_child(tmp_path, CHILD_SILENT_TEST)
    said = [i for i, line in enumerate(lines) if line.startswith("[child] ")]
    assert lines[said[0]] == "[child] configuring", lines
    assert any(lines[i].startswith("[child] still building (") for i in said[1:]), lines
    assert said[-1] < next(i for i, line in enumerate(lines) if "1 passed" in line)
