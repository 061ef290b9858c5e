"""Errors a user can act on: the CLI prints them as one line and exits non-zero."""
from __future__ import annotations


class UserError(Exception):
    """Bad input or an impossible request. ``str(err)`` is the single line shown to the user.

    By convention the message names the file (and key or line) it is about, e.g.
    ``"model.gguf: not a GGUF file (bad magic b'PK\\x03\\x04')"``.
    """

    exit_code = 2
