"""The C routing hook's name filter (forward mode), called the way the scheduler calls it: a
node reaches the Python callback only when its name starts with a forwarded prefix and is not a
name ggml derived from another node ("ffn_moe_topk-3 (reshaped)": the patched graph makes
several such per layer from the router's nodes, and each would cost a Python call per token)."""
from __future__ import annotations

import ctypes

import pytest

from runtime.native import llama_lib
from runtime.engine.native_hook import NativeHook
from runtime.engine.routing_hook import RouteAssembler

CALLBACK = ctypes.CFUNCTYPE(ctypes.c_bool, ctypes.c_void_p, ctypes.c_bool, ctypes.c_void_p)


@pytest.fixture
def hook():
    seen: list[tuple[bytes, bool]] = []
    h = NativeHook(RouteAssembler((0, 1), 2, 2), 2)

    def python_side(tensor, ask, _user):
        seen.append((ctypes.string_at(tensor + llama_lib.NAME_OFFSET), bool(ask)))
        return True

    callback = CALLBACK(python_side)
    h.lib.rh_set_forward(h.handle, h.ffi.cast("rh_eval_cb",
                                              ctypes.cast(callback, ctypes.c_void_p).value),
                         h.ffi.NULL)
    h._filter.set_prefixes([b"ffn_moe_topk-", b"ffn_moe_weights"])
    return h, seen, callback


def _call(h, name: bytes, ask: bool = True) -> bool:
    buf = ctypes.create_string_buffer(llama_lib.NAME_OFFSET + 64)
    buf[llama_lib.NAME_OFFSET:llama_lib.NAME_OFFSET + len(name)] = name
    return bool(h.callback(ctypes.addressof(buf), ask, h.user_data))


def test_forwards_only_exact_node_names(hook):
    h, seen, _ = hook
    wanted = [b"ffn_moe_topk-3", b"ffn_moe_weights_norm-47", b"ffn_moe_weights-0"]
    derived = [b"ffn_moe_topk-3 (cont)", b"ffn_moe_topk-3 (cont) (reshaped) (copy)",
               b"ffn_moe_weights_norm-47 (reshaped)"]
    other = [b"ffn_moe_probs-3", b"attn_norm-0", b""]
    assert all(_call(h, n) for n in wanted)
    assert not any(_call(h, n) for n in derived + other)
    assert [n for n, _ in seen] == wanted


def test_prefixes_can_change_between_batches(hook):
    h, seen, _ = hook
    h._filter.set_prefixes([b"ffn_moe_weights_norm-"])
    assert not _call(h, b"ffn_moe_topk-1")
    assert _call(h, b"ffn_moe_weights_norm-1", ask=False)
    h._filter.add_prefix(b"ffn_moe_probs-2")
    assert _call(h, b"ffn_moe_probs-2")
    assert seen == [(b"ffn_moe_weights_norm-1", False), (b"ffn_moe_probs-2", True)]
    with pytest.raises(ValueError):
        h._filter.set_prefixes([b"x" * 40])
