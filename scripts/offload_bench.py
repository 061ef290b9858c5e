#!/usr/bin/env python3
"""The offload benchmark as a script: same options and output as ``moe-offload bench``.

    python scripts/offload_bench.py [-m MODEL] [--config FILE ...] [-p 512] [-n 128] [-r 3]
        [--cold 64] [--budget SIZE] [--mem-limit SIZE] [--json]
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from runtime.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
