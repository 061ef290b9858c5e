"""The one range check of token ids that come from a client.

Every route that takes token ids (a prompt given as ids, nested prompt lists, ``logit_bias``
keys, ``/detokenize``, ``/infill``'s prompt) passes them through ``checked_ids`` before any of
them reaches llama.cpp: ``llama_token_to_piece`` and friends index the vocabulary without a
bounds check (an id past it throws ``std::out_of_range`` through C and kills the process), and
ctypes refuses ids past int32 with an OverflowError. A bad id is a 400 naming it and n_vocab.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from runtime.server.errors import APIError


def id_error(token: Any, n_vocab: int, param: str) -> APIError:
    shown = repr(token) if not isinstance(token, int) or isinstance(token, bool) else str(token)
    if len(shown) > 40:
        shown = shown[:37] + "..."
    return APIError(400, f"{param}: token id {shown} is outside the vocabulary (n_vocab "
                         f"{n_vocab}: ids 0..{n_vocab - 1})", code="invalid_value", param=param)


def checked_id(token: Any, n_vocab: int, param: str) -> int:
    """``token`` as an int in ``[0, n_vocab)``, else a 400 naming it (bools are not ids)."""
    if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < n_vocab:
        raise id_error(token, n_vocab, param)
    return token


def checked_ids(tokens: Iterable[Any], n_vocab: int, param: str) -> list[int]:
    """Every id of ``tokens`` checked by ``checked_id``; the list of them."""
    return [checked_id(t, n_vocab, param) for t in tokens]


def engine_vocab(engine: Any) -> int:
    """The engine's vocabulary size (a test double without one gets no upper bound)."""
    n_vocab = getattr(engine, "n_vocab", None)
    return int(n_vocab) if n_vocab is not None else 2**31 - 1
