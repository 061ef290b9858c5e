"""The compiled C pre-filter itself, called the way the scheduler calls it: a node reaches the
Python callback only when its name starts with a forwarded prefix and is not a name ggml
derived from another node ("ffn_moe_topk-3 (reshaped)": the patched graph makes several such
per layer from the router's nodes, and each would cost a Python call per token)."""
from __future__ import annotations

import ctypes

import pytest

from runtime.engine.route_filter import RouteFilter, load_filter_library

NAME_OFFSET = 16
CALLBACK = ctypes.CFUNCTYPE(ctypes.c_bool, ctypes.c_void_p, ctypes.c_bool, ctypes.c_void_p)


@pytest.fixture
def route_filter():
    lib = load_filter_library()
    if lib is None:
        pytest.skip("no C compiler: only the Python hook exists here")
    seen: list[tuple[bytes, bool]] = []

    def python_side(tensor, ask, _user):
        seen.append((ctypes.string_at(tensor + NAME_OFFSET), bool(ask)))
        return True

    callback = CALLBACK(python_side)
    filt = RouteFilter(lib, callback, [b"ffn_moe_topk-", b"ffn_moe_weights"], NAME_OFFSET,
                       CALLBACK)
    return filt, seen, callback


def _node(name: bytes):
    buf = ctypes.create_string_buffer(NAME_OFFSET + 64)
    buf[NAME_OFFSET:NAME_OFFSET + len(name)] = name
    return buf


def _call(filt, name: bytes, ask: bool = True) -> bool:
    node = _node(name)
    return bool(filt.callback(ctypes.addressof(node), ask, filt.user_data))


def test_forwards_only_exact_node_names(route_filter):
    filt, seen, _ = route_filter
    wanted = [b"ffn_moe_topk-3", b"ffn_moe_weights_norm-47", b"ffn_moe_weights-0"]
    derived = [b"ffn_moe_topk-3 (cont)", b"ffn_moe_topk-3 (cont) (reshaped) (copy)",
               b"ffn_moe_weights_norm-47 (reshaped)"]
    other = [b"ffn_moe_probs-3", b"attn_norm-0", b""]
    assert all(_call(filt, n) for n in wanted)
    assert not any(_call(filt, n) for n in derived + other)
    assert [n for n, _ in seen] == wanted


def test_prefixes_can_change_between_batches(route_filter):
    filt, seen, _ = route_filter
    filt.set_prefixes([b"ffn_moe_weights_norm-"])
    assert not _call(filt, b"ffn_moe_topk-1")
    assert _call(filt, b"ffn_moe_weights_norm-1", ask=False)
    filt.add_prefix(b"ffn_moe_probs-2")
    assert _call(filt, b"ffn_moe_probs-2")
    assert seen == [(b"ffn_moe_weights_norm-1", False), (b"ffn_moe_probs-2", True)]
