"""The C routing hook's watched nodes, called the way the scheduler calls it: a node reaches the
Python watcher only when its name is exactly a watched one (never a name ggml derived from it,
"ffn_moe_probs-3 (reshaped)": the patched graph makes several such per layer) and only inside a
framed batch; the framing nodes themselves never cost a Python call."""
from __future__ import annotations

import ctypes

import numpy as np
import pytest

from runtime.native import ggml_tensor
from runtime.engine.hook.c_hook import CHook
from runtime.engine.hook.config import HookConfig
from runtime.residency.types import Phase


@pytest.fixture
def hook(monkeypatch):
    seen: list[tuple[str, bool]] = []
    h = CHook(HookConfig(n_layer=2, moe_layers=(0, 1), n_expert_used=2))
    monkeypatch.setattr(ggml_tensor, "read_tensor", lambda _ptr: np.zeros(1))
    for name in ("ffn_moe_probs-1", "ffn_moe_probs-0"):
        h.watch(name, lambda n, _data: seen.append(n))
    h.begin_batch(Phase.PREFILL, 0, 1, 1)
    yield h, seen
    h.abort_batch()


def _call(h, name: bytes, ask: bool = True) -> bool:
    buf = ctypes.create_string_buffer(ggml_tensor.NAME_OFFSET + 64)
    buf[ggml_tensor.NAME_OFFSET:ggml_tensor.NAME_OFFSET + len(name)] = name
    return bool(h.callback(ctypes.addressof(buf), ask, h.user_data))


def test_watches_only_exact_node_names(hook):
    h, seen = hook
    wanted = [b"ffn_moe_probs-1", b"ffn_moe_probs-0"]
    derived = [b"ffn_moe_probs-1 (cont)", b"ffn_moe_probs-1 (reshaped) (copy)",
               b"ffn_moe_probs-0 (reshaped)"]
    other = [b"ffn_moe_probs-2", b"ffn_moe_probs_biased-0", b"attn_norm-0", b""]
    assert all(_call(h, n) for n in wanted)                 # ask: compute up to here
    assert not any(_call(h, n) for n in derived + other)
    assert seen == []                                       # asks never reach Python
    assert all(_call(h, n, ask=False) for n in wanted)
    assert seen == ["ffn_moe_probs-1", "ffn_moe_probs-0"]


def test_nothing_is_watched_outside_a_batch(hook):
    h, seen = hook
    h.abort_batch()
    assert not _call(h, b"ffn_moe_probs-1")
    assert seen == []


def test_watched_names_are_checked(hook):
    h, _ = hook
    with pytest.raises(ValueError):
        h.watch("attn_norm-0", lambda *_: None)
    with pytest.raises(ValueError):
        h.watch("ffn_moe_" + "x" * 60, lambda *_: None)


def test_the_hooks_description_names_only_the_models_layers():
    with pytest.raises(ValueError, match="MoE layers \\[2\\] outside the model's 2 layers"):
        HookConfig(n_layer=2, moe_layers=(0, 2), n_expert_used=2)
