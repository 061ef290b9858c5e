"""Presets: the planned bytes of every preset equal the real models' (models.md, the two real
routing traces), small variants write what was planned and load, and the CLI's refusals."""
from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

import pytest

from gguf_tools.expert_index import ExpertIndex
from gguf_tools.facts import EXPERT_TENSOR_RE
from gguf_tools.presets import PRESET_DTYPES, PRESETS, get_preset
from gguf_tools.synth import (VOCAB, SynthSpec, SynthSpecError, planned_file_bytes,
                              tensor_nbytes, tensor_plans, write_synthetic_model)
from runtime.cli import build_parser
from runtime.commands.synth import spec_from_args
from runtime.errors import UserError
from runtime.traces.route_csv import read_route_csv
from runtime.units import format_size
from tests.gguf_tools.test_inspect_synth_cli import assert_one_line_error, moe_offload

TRACES = Path(__file__).resolve().parents[1] / "runtime" / "traces" / "data"

# models.md "Expert shapes and bytes per expert": bytes of one expert (every ffn_*_exps tensor of
# the layer, biases included, as `inspect` counts them) -> number of layers with that size
MODELS_MD = {
    "qwen3-30b-a3b": {"q8_0": {5_013_504: 48}, "q4_k_m": {2_654_208: 24, 3_059_712: 24}},
    "qwen3-235b-a22b": {"q8_0": {20_054_016: 94}, "q4_k_m": {10_616_832: 48, 12_238_848: 46}},
    "gpt-oss-20b": {"q8_0": {13_253_760: 24}, "q4_k_m": {13_253_760: 24}},
    "gpt-oss-120b": {"q8_0": {13_253_760: 36}, "q4_k_m": {13_253_760: 36}},
    "mixtral-8x7b": {"q8_0": {187_170_816: 32}, "q4_k_m": {99_090_432: 16, 114_229_248: 16}},
    "deepseek-v2-lite": {"q8_0": {0: 1, 9_191_424: 26},
                         "q4_k_m": {0: 1, 5_226_496: 14, 6_307_840: 12}},
    "olmoe-1b-7b": {"q8_0": {6_684_672: 16}, "q4_k_m": {3_538_944: 8, 4_079_616: 8}},
}


def planned_layer_bytes(spec: SynthSpec, *, biases_are_dense: bool = False
                        ) -> tuple[list[int], list[int]]:
    """Per layer: bytes of one routed expert, and every other byte of the layer (from the plan;
    nothing written). ``biases_are_dense``: count expert biases as dense, as the real traces'
    recorder did."""
    expert, dense = [0] * spec.layers, [0] * spec.layers
    for plan in tensor_plans(spec):
        layer = re.match(r"blk\.(\d+)\.", plan.name)
        if not layer:
            continue
        i, n = int(layer.group(1)), tensor_nbytes(plan)
        m = EXPERT_TENSOR_RE.match(plan.name)
        if m and not (biases_are_dense and m["kind"] == "bias"):
            expert[i] += n // spec.experts
        else:
            dense[i] += n
    return expert, dense


@pytest.mark.parametrize("dtype", PRESET_DTYPES)
@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_plans_the_documented_expert_bytes(name: str, dtype: str) -> None:
    spec = PRESETS[name].spec(dtype)
    expert, _ = planned_layer_bytes(spec)
    assert Counter(expert) == MODELS_MD[name][dtype]
    assert spec.vocab_size == PRESETS[name].n_vocab


@pytest.mark.parametrize("trace", sorted(TRACES.glob("*.route.csv")), ids=lambda p: p.name)
def test_presets_reproduce_the_real_files_bytes_per_layer(trace: Path) -> None:
    """The traces were recorded on the real Q4_K_M files: each layer's expert bytes (weights
    only; the recorder counts gpt-oss's expert biases as dense) and dense bytes."""
    header = read_route_csv(trace).header
    preset = get_preset(trace.name.removesuffix(".route.csv"))
    spec = preset.spec("q4_k_m", top_k=header.n_expert_used)    # the runs overrode top-k
    assert (spec.arch, spec.layers, spec.experts) == (header.arch, header.n_layer,
                                                      header.n_expert)
    expert, dense = planned_layer_bytes(spec, biases_are_dense=True)
    assert expert == list(header.expert_bytes)
    assert dense == list(header.dense_bytes)


def test_overrides_replace_one_value_and_are_validated() -> None:
    base, six = PRESETS["qwen3-30b-a3b"].spec(), PRESETS["qwen3-30b-a3b"].spec(top_k=6)
    assert (base.top_k, six.top_k) == (8, 6)
    assert {f: getattr(six, f) for f in ("layers", "experts", "embd", "ff", "n_vocab")} == {
        "layers": 48, "experts": 128, "embd": 2048, "ff": 768, "n_vocab": 151936}
    with pytest.raises(SynthSpecError, match="--top-k 200 is more than --experts 128"):
        PRESETS["qwen3-30b-a3b"].spec(top_k=200)
    with pytest.raises(SynthSpecError, match="transcribed for q8_0, q4_k_m only"):
        PRESETS["olmoe-1b-7b"].spec("f16")
    with pytest.raises(SynthSpecError, match="unknown preset 'qwen4'.*olmoe-1b-7b"):
        get_preset("qwen4")


# small variants with each preset's attention and vocabulary padding: fewer layers and experts
# and a narrower expert ff (gpt-oss keeps its 2880-wide Q5_0/Q8_0 attention and MXFP4 experts;
# deepseek its 192/128 MLA heads, its dense first layer and shared experts; mixtral its Q5_K)
_SMALL = {"layers": 1, "experts": 4, "top_k": 2, "ff": 256, "n_vocab": VOCAB.size + 500}
_SMALL_EXTRA = {"deepseek-v2-lite": {"layers": 2, "dense_ff": 512},
                "mixtral-8x7b": {"experts": 8}}   # 8 experts: Q8_0 attn_k/v, Q5_K attn_output


@pytest.mark.parametrize("name", ["gpt-oss-20b", "deepseek-v2-lite", "olmoe-1b-7b",
                                  "mixtral-8x7b"])
def test_small_variant_writes_what_was_planned_and_loads(tmp_path: Path, name: str) -> None:
    llama_cpp = pytest.importorskip("llama_cpp")
    from runtime.native.llama_lib import bindings  # noqa: PLC0415

    bindings()        # AMX-safe model defaults on a stock libllama
    spec = PRESETS[name].spec("q4_k_m", **{**_SMALL, **_SMALL_EXTRA.get(name, {})})
    path = write_synthetic_model(tmp_path / f"{name}.gguf", spec)
    assert path.stat().st_size == planned_file_bytes(spec)
    facts = ExpertIndex.open(path).facts
    assert list(facts.expert_bytes) == planned_layer_bytes(spec)[0]
    assert facts.tensor_types == {p.name: p.qtype.name for p in tensor_plans(spec)}
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=128, n_threads=2, verbose=False)
    assert llm.n_vocab() == spec.n_vocab
    tokens = llm.tokenize(b"hello world", add_bos=False)
    assert max(tokens) < VOCAB.size and llm.detokenize(tokens) == b" hello world"
    out = llm.create_completion("hello world", max_tokens=4, temperature=0)
    assert out["usage"]["completion_tokens"] >= 1
    assert all(t < VOCAB.size for t in llm.tokenize(out["choices"][0]["text"].encode(),
                                                    add_bos=False))


def _spec(*argv: str) -> SynthSpec:
    return spec_from_args(build_parser().parse_args(["synth", *argv]))


def test_cli_preset_flags_override_the_preset() -> None:
    spec = _spec("--preset", "qwen3-30b-a3b", "--top-k", "6", "out.gguf")
    assert spec == PRESETS["qwen3-30b-a3b"].spec("q4_k_m", top_k=6)
    assert _spec("--preset", "gpt-oss-120b", "--dtype", "q8_0", "--layers", "2", "x").layers == 2
    assert _spec("--preset", "olmoe-1b-7b", "--n-vocab", "0", "x").vocab_size == VOCAB.size
    # without a preset, the flags keep their SynthSpec defaults
    assert _spec("x") == SynthSpec(shared_experts=0)
    assert _spec("--arch", "deepseek2", "x").shared_experts == 1
    with pytest.raises(UserError, match="--arch cannot be combined with --preset"):
        _spec("--preset", "olmoe-1b-7b", "--arch", "llama", "x")


def test_cli_list_presets() -> None:
    result = moe_offload("synth", "--list-presets")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    for name, preset in PRESETS.items():
        row = next(line for line in lines if line.startswith(name + " "))
        sizes = [format_size(planned_file_bytes(preset.spec(dtype))) for dtype in PRESET_DTYPES]
        assert row.split()[-4:] == " ".join(sizes).split(), row


def test_cli_refusals(tmp_path: Path) -> None:
    out = tmp_path / "m.gguf"
    result = moe_offload("synth", "--preset", "qwen4", out)
    assert_one_line_error(result, "unknown preset 'qwen4'", ", ".join(PRESETS))
    assert_one_line_error(moe_offload("synth", "--preset", "olmoe-1b-7b", "--arch", "llama", out),
                          "--arch cannot be combined with --preset")
    assert_one_line_error(moe_offload("synth", "--preset", "olmoe-1b-7b", "--dtype", "f16", out),
                          str(out), "q8_0, q4_k_m only")
    assert_one_line_error(moe_offload("synth", "--preset", "olmoe-1b-7b"), "give OUT.gguf")
    assert list(tmp_path.iterdir()) == []


def test_cli_writes_a_small_preset_variant_inspect_reads(tmp_path: Path) -> None:
    out = tmp_path / "olmoe.gguf"
    result = moe_offload("synth", "--preset", "olmoe-1b-7b", "--layers", "2", "--experts", "4",
                         "--top-k", "2", "--ff", "256", "--n-vocab", "0", out)
    assert result.returncode == 0, result.stderr
    assert "preset olmoe-1b-7b" in result.stdout
    data = json.loads(moe_offload("inspect", out, "--json").stdout)
    assert (data["arch"], data["n_layer"], data["n_expert"], data["n_expert_used"],
            data["n_embd"], data["context_length"]) == ("olmoe", 2, 4, 2, 2048, 4096)
    # a 2-layer Q4_K_M: more_bits holds from layer 7 * 2 // 8 = 1 on (llama-quantize's rule)
    assert [t["down"] for t in data["expert_types"]] == ["Q4_K", "Q6_K"]
    assert data["tensor_types"]["output.weight"] == "Q6_K"
    assert data["tensor_types"]["blk.1.attn_v.weight"] == "Q6_K"
