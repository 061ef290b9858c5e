"""``--stats-json FILE``: the residency manager's final snapshot, written when a run ends
(``complete``, ``trace record``): the same JSON as the server's ``GET /v1/residency``."""
from __future__ import annotations

import argparse
from pathlib import Path

from runtime.atomic_write import write_text
from runtime.errors import UserError


def add_stats_json_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--stats-json", metavar="FILE",
                        help="write the residency manager's final snapshot to FILE (the JSON "
                             "of the server's GET /v1/residency)")


def check_stats_json_path(path: str | None) -> None:
    if path is not None and not Path(path).resolve().parent.is_dir():
        raise UserError(f"{path}: directory {Path(path).resolve().parent} does not exist")


def write_stats_json(path: str | None, engine) -> None:
    """The manager's snapshot as JSON (``{"devices": {}}`` without residency), atomically."""
    if path is None:
        return
    text = (engine.manager.snapshot().to_json(indent=1) if engine.manager is not None
            else '{"devices": {}}')
    write_text(path, text + "\n")
