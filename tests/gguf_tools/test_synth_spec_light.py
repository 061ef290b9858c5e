"""synth_spec loads without gguf-py: the CLI describes and parses `moe-offload synth` without
it. (No import circle anywhere in the tree: tests/test_import_layers.py.)"""
from __future__ import annotations

import subprocess
import sys


def test_synth_spec_imports_without_gguf() -> None:
    code = "import sys, gguf_tools.synth_spec; assert 'gguf' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
