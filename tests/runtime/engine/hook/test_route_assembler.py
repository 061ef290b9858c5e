"""RouteAssembler without llama.cpp: events per (layer, ubatch) with the right context
positions, the last layer's output-trimmed rows, strict completeness, and observer framing;
plus the load-time expert placement plan."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from runtime.engine import residency_setup
from runtime.engine.placement import plan_placement
from runtime.engine.hook.events import RouteCaptureError
from runtime.engine.hook.reference import RouteAssembler
from runtime.engine.types import EngineSettings
from runtime.residency.config import parse_config
from runtime.residency.manager import ExpertResidencyManager
from runtime.residency.types import Phase

K = 2


class Collect:
    def __init__(self):
        self.events, self.ends = [], []

    def on_route(self, e):
        self.events.append(e)

    def on_batch_end(self, phase, n):
        self.ends.append((phase, n))


def _feed_layer(a, layer, rows, stage=2):
    experts = np.arange(rows * K, dtype=np.int32).reshape(rows, K) % 8
    a.on_topk(layer, experts)
    a.on_weights(layer, 0, np.full((rows, K), 0.3, np.float32))      # raw
    a.on_weights(layer, stage, np.full((rows, K), 0.5, np.float32))  # applied (normalised)
    a.flush(layer)


def test_ubatches_and_trimmed_last_layer():
    a = RouteAssembler(moe_layers=(0, 1, 2), n_expert_used=K, n_layer=3)
    seen = Collect()
    a.observers.append(seen)
    a.begin_batch(Phase.PREFILL, first_step=10, n_tokens=7, n_outputs=1)
    for rows_last, rows in ((0, 4), (1, 3)):           # ubatches of 4 and 3 tokens
        _feed_layer(a, 0, rows)
        _feed_layer(a, 1, rows)
        _feed_layer(a, 2, rows_last)                    # last layer: output rows only
    a.end_batch()
    got = [(e.layer, e.first_step, e.n_tokens) for e in seen.events]
    # 0-row events are not emitted; the output row is the batch's last token (10 + 6)
    assert got == [(0, 10, 4), (1, 10, 4), (0, 14, 3), (1, 14, 3), (2, 16, 1)]
    assert all((e.weights == 0.5).all() for e in seen.events)   # the applied stage wins
    assert seen.ends == [(Phase.PREFILL, 7)]


def test_strict_mode_reports_missing_tokens():
    a = RouteAssembler(moe_layers=(0, 1), n_expert_used=K, n_layer=2)
    a.strict = True
    a.begin_batch(Phase.PREFILL, 0, n_tokens=5, n_outputs=5)
    _feed_layer(a, 0, 5)
    _feed_layer(a, 1, 1)                                # trimmed: 4 tokens never routed
    with pytest.raises(RouteCaptureError, match="layer 1: routed 1 tokens of 5"):
        a.end_batch()


def test_layers_without_a_flush_node_are_flushed_in_order():
    a = RouteAssembler(moe_layers=(0, 1), n_expert_used=K, n_layer=2)
    seen = Collect()
    a.observers.append(seen)
    a.begin_batch(Phase.DECODE, 20, 1, 1)
    for layer in (0, 1):
        a.on_topk(layer, np.array([[1, 2]], np.int32))
        a.on_weights(layer, 0, np.array([[0.6, 0.4]], np.float32))
    a.end_batch()
    assert [(e.layer, e.phase, e.first_step) for e in seen.events] == \
        [(0, Phase.DECODE, 20), (1, Phase.DECODE, 20)]


def test_missing_weights_is_an_error():
    a = RouteAssembler(moe_layers=(0,), n_expert_used=K, n_layer=1)
    a.begin_batch(Phase.DECODE, 0, 1, 1)
    a.on_topk(0, np.array([[1, 2]], np.int32))
    with pytest.raises(RouteCaptureError, match="weights"):
        a.flush(0)


def _gpu_manager(eb, budget):
    """A manager as the engine builds it (build_manager) for a cuda:0 budget."""
    m = ExpertResidencyManager(parse_config({"devices": {"cuda:0": budget}}))
    m.bind_model(eb, 4)
    m.resolve_device("cuda:0", free_bytes=10_000, total_bytes=20_000)
    return m


def test_placement_plans():
    eb = (0, 100, 100, 100)        # layer 0 dense
    off = plan_placement(manage_residency=False)
    assert off.rules == ()
    cpu = plan_placement(manage_residency=True)
    assert [t for _, t in cpu.rules] == ["cpu"] and cpu.gpu_expert_layers == ()
    manager = _gpu_manager(eb, "900B")
    gpu = plan_placement(manage_residency=True, static=manager.plan_static("cuda:0"))
    assert gpu.gpu_expert_layers == (1, 2) and gpu.gpu_expert_bytes == 800
    assert [t for _, t in gpu.rules] == ["gpu", "cpu"]
    import re
    pattern = re.compile(gpu.rules[0][0])
    assert pattern.search("blk.2.ffn_down_exps.weight")
    assert not pattern.search("blk.3.ffn_down_exps.weight")
    assert not pattern.search("blk.12.ffn_down_exps.weight")
    none_fit = plan_placement(manage_residency=True,
                              static=_gpu_manager(eb, "399B").plan_static("cuda:0"))
    assert none_fit.gpu_expert_layers == () and [t for _, t in none_fit.rules] == ["cpu"]


def test_engine_plan_pins_the_static_layers_in_the_manager():
    """residency_setup.plan with a GPU and no device cache: the manager plans and
    pins, so its snapshot shows the GPU's experts; with the cache built it stays dynamic."""
    eb = (0, 100, 50, 100)
    facts = SimpleNamespace(expert_bytes=eb, n_expert=4, moe_layers=(1, 2, 3))
    settings = EngineSettings(model_path="unused.gguf")
    manager = _gpu_manager(eb, "700B")
    # no patched library loaded: the manager plans and pins
    placement = residency_setup.plan(settings, manager.config, facts, manager, has_gpu=True,
                                     device_cache=False)
    assert placement.gpu_expert_layers == (1, 2) and placement.gpu_expert_bytes == 600
    d = manager.snapshot().device("cuda:0")
    assert (d.resident_experts, d.resident_bytes, d.static_bytes) == (8, 600, 600)
    a = manager.access_layer("cuda:0", 3, [0, 1], Phase.DECODE)
    assert a.misses == 2 and a.admitted == () and len(a.transient) == 2
    cached = _gpu_manager(eb, "700B")
    placement = residency_setup.plan(settings, cached.config, facts, cached, has_gpu=True,
                                     device_cache=True)
    assert placement.gpu_expert_layers == () and not cached.is_static("cuda:0")
    no_gpu = _gpu_manager(eb, "700B")
    placement = residency_setup.plan(settings, no_gpu.config, facts, no_gpu, has_gpu=False,
                                     device_cache=False)
    assert placement.gpu_expert_layers == () and not no_gpu.is_static("cuda:0")


def test_device_cache_ready_follows_the_library_actually_loaded(tmp_path, monkeypatch):
    """The static GPU plan is the fallback exactly when the libllama to load lacks the cache."""
    monkeypatch.delenv("LLAMA_CPP_LIB_PATH", raising=False)
    stock, patched = tmp_path / "stock", tmp_path / "patched"
    stock.mkdir()
    patched.mkdir()
    (patched / "libmoe_device_cache.so").write_bytes(b"")
    gpu = parse_config({"devices": {"cuda:0": "1GiB"}})
    plain = parse_config({"devices": {"cpu": "1GiB"}})
    def ready(lib_dir, config):      # as Engine.__init__ asks it
        settings = EngineSettings(model_path="m.gguf", lib_dir=lib_dir)
        return residency_setup.device_cache_ready(
            config, residency_setup.library_dir(settings, config))

    assert ready(str(patched), gpu)
    assert not ready(str(stock), gpu)
    assert not ready(str(patched), plain)
    monkeypatch.setenv("LLAMA_CPP_LIB_PATH", str(patched))
    assert ready(None, gpu)
    monkeypatch.setenv("LLAMA_CPP_LIB_PATH", str(stock))
    assert not ready(None, gpu)


def test_static_rules_come_first_and_the_gpu_layers_start_after_the_cpu_ones():
    """llama.cpp's --n-cpu-moe with a cuda:0 budget: its rules lead, the layers it keeps on
    the CPU are skipped by the static GPU plan; -ot sending experts to a GPU is refused."""
    from runtime.engine.llama_flags import parse_override_tensor, placement_rules
    from runtime.errors import UserError

    eb = (0, 100, 50, 100)
    names = {f"blk.{i}.ffn_{p}_exps.weight": "f32" for i in (1, 2, 3)
             for p in ("gate", "up", "down")}
    facts = SimpleNamespace(expert_bytes=eb, n_expert=4, moe_layers=(1, 2, 3),
                            tensor_types=names | {"blk.1.attn_q.weight": "f32"})
    rules = tuple(placement_rules(SimpleNamespace(override_tensor=[], cpu_moe=False,
                                                  n_cpu_moe=2)))
    settings = EngineSettings(model_path="unused.gguf", tensor_rules=rules)
    manager = _gpu_manager(eb, "700B")
    placement = residency_setup.plan(settings, manager.config, facts, manager, has_gpu=True,
                                     device_cache=False)
    assert placement.gpu_expert_layers == (2, 3) and placement.gpu_expert_bytes == 600
    assert placement.rules[:2] == rules and [t for _, t in placement.rules[2:]] == ["gpu", "cpu"]
    plain = _gpu_manager(eb, "700B")             # without the flag: from the first MoE layer
    assert residency_setup.plan(EngineSettings(model_path="unused.gguf"), plain.config, facts,
                                plain, has_gpu=True, device_cache=False
                                ).gpu_expert_layers == (1, 2)
    to_gpu = EngineSettings(model_path="unused.gguf",
                            tensor_rules=tuple(parse_override_tensor([r"blk\.3\.=CUDA0"])))
    with pytest.raises(UserError, match="blk.3.ffn_.*CUDA0.*--devices.cuda:0"):
        residency_setup.plan(to_gpu, manager.config, facts, _gpu_manager(eb, "700B"),
                             has_gpu=True, device_cache=False)
    other = EngineSettings(model_path="unused.gguf", manage_residency=False,
                           tensor_rules=tuple(parse_override_tensor([r"blk\.3\.=CUDA0"])))
    assert residency_setup.plan(other, None, facts, None, has_gpu=True,
                                device_cache=False).rules == ((r"blk\.3\.", "CUDA0"),)
