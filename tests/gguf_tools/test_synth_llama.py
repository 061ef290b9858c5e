"""Synthetic models of every supported arch load in llama-cpp-python and generate."""
from __future__ import annotations

import pytest

llama_cpp = pytest.importorskip("llama_cpp")

from runtime.native.llama_lib import bindings  # noqa: E402

bindings()          # AMX-safe model defaults on a stock libllama (llama_lib._guard_amx)

from gguf_tools.synth import SynthSpec  # noqa: E402
from gguf_tools.synth_layouts import LAYOUTS  # noqa: E402


def _load(path):
    return llama_cpp.Llama(model_path=str(path), n_ctx=256, n_threads=2, verbose=False)


# deepseek2 also covers a leading dense layer, shared experts and a merged gate_up tensor
_ARCH_EXTRAS = {"deepseek2": {"dense_layers": 1, "shared_experts": 1, "gate_up_merged": True}}


@pytest.mark.parametrize("arch", sorted(LAYOUTS))
@pytest.mark.parametrize("dtype", ["f32", "q8_0", "q4_k_m"])
def test_arch_loads_and_generates(synth_model_factory, arch: str, dtype: str) -> None:
    wide = dtype == "q4_k_m"
    spec = SynthSpec(arch=arch, layers=3, experts=8, top_k=2, dtype=dtype, skew=1.0,
                     embd=256 if wide else 64, ff=256 if wide else 32,
                     **_ARCH_EXTRAS.get(arch, {}))
    llm = _load(synth_model_factory(spec))
    assert llm.n_vocab() == spec.vocab_size
    out = llm.create_completion("hello world", max_tokens=8, temperature=0)
    assert out["usage"]["completion_tokens"] >= 1
    assert out["choices"][0]["text"]
    # greedy decoding is deterministic: a fresh context gives the same text
    again = _load(synth_model_factory(spec)).create_completion("hello world", max_tokens=8,
                                                               temperature=0)
    assert again["choices"][0]["text"] == out["choices"][0]["text"]


def test_tokenizer_round_trips_and_knows_words(tiny_model) -> None:
    llm = _load(tiny_model)
    text = "hello world, the expert model: 42 €!\nnew line"
    tokens = llm.tokenize(text.encode(), add_bos=False)
    # SPM adds a leading space; "€" (not in the vocabulary) goes through <0xNN> byte tokens
    assert llm.detokenize(tokens).decode() == " " + text
    assert len(llm.tokenize(b"hello", add_bos=False)) == 1       # whole words are single tokens
    assert len(tokens) < len(text) // 2
    assert llm.tokenize(b"x", add_bos=True)[0] == llm.token_bos()


def test_chat_template_drives_chat_completion(tiny_model) -> None:
    llm = _load(tiny_model)
    out = llm.create_chat_completion(
        messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
        max_tokens=6, temperature=0)
    assert out["choices"][0]["message"]["role"] == "assistant"
    assert out["usage"]["prompt_tokens"] > 8    # the ChatML wrapper tokens were applied


@pytest.mark.parametrize(("arch", "dtype"), [
    ("gpt-oss", "mxfp4"), ("qwen3moe", "q4_0"), ("llama", "bf16"), ("qwen3moe", "q5_1"),
    ("olmoe", "f16"), ("deepseek2", "q4_1"), ("qwen3moe", "q6_k"), ("llama", "q5_0"),
])
def test_more_dtypes_load_and_generate(synth_model_factory, arch: str, dtype: str) -> None:
    wide = dtype.endswith("_k")
    spec = SynthSpec(arch=arch, layers=2, experts=4, top_k=2, dtype=dtype,
                     embd=256 if wide else 64, ff=256 if wide else 32,
                     **_ARCH_EXTRAS.get(arch, {}))
    out = _load(synth_model_factory(spec)).create_completion("the model", max_tokens=4,
                                                             temperature=0)
    assert out["usage"]["completion_tokens"] >= 1
