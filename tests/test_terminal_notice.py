"""The native build's notice reaches the terminal while pytest captures output: a pytest run
in a subprocess, whose session fixture says a line the way tests/native's build fixture does,
shows it at once (before the test's own result), with the default fd capture on."""
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


def test_build_notice_is_on_the_terminal_not_captured(tmp_path):
    (tmp_path / "conftest.py").write_text(CHILD_CONFTEST)
    (tmp_path / "test_child.py").write_text(CHILD_TEST)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           str(tmp_path / "test_child.py")], capture_output=True, text=True,
                          env=env, cwd=tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    notice = [i for i, line in enumerate(lines) if "building the patched llama.cpp" in line]
    assert notice, proc.stdout                      # on pytest's terminal (its stdout)
    assert "captured test output" not in proc.stdout   # the test's own print stays captured
    passed = next(i for i, line in enumerate(lines) if "1 passed" in line)
    assert notice[0] < passed
