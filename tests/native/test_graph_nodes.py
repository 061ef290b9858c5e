"""What the device cache costs the graph: the nodes of a one-token decode graph with and without
a registered cache (every node the scheduler asks cb_eval about, which is every node of every
split). Per MoE layer the cache adds the slot path's expert chain (its matmuls, activation and
weighting, named ``*_hot``) and at most 6 other nodes: the view the host writes the id planes
at, three views of it, the concat of both paths' outputs and the gather back to the routing
positions. (With a backend that cannot read the cache's memory in place, a GPU's beside the
CPU, one more: the planes' copy on the cache's device, which the Vulkan tests check.)"""
from __future__ import annotations

from gguf_tools.expert_index import ExpertIndex
from tests.native.conftest import run_child


def test_the_cache_adds_at_most_six_nodes_per_layer_besides_the_slot_path(native_build,
                                                                          q8_model):
    facts = ExpertIndex.open(q8_model).facts
    n_moe = len(facts.moe_layers)
    res = run_child("nodes", {"model": str(q8_model), "capacity": 2_000_000,
                              "prompt_tokens": list(range(10, 26))}, native_build.lib_dir)
    plain, cache = res["plain"], res["cache"]
    added = cache["nodes"] - plain["nodes"]
    print(f"{n_moe} MoE layers: {plain['nodes']} nodes plain, {cache['nodes']} with the cache "
          f"({added / n_moe:g} per layer, {cache['hot'] / n_moe:g} of them the slot path)")
    assert plain["hot"] == 0
    # qwen3moe: separate up and gate projections: up, gate, swiglu, down, weighting on the slots
    assert cache["hot"] == 5 * n_moe
    assert added % n_moe == 0
    small = (added - cache["hot"]) // n_moe
    assert 1 <= small <= 6
