"""Greedy parity with plain llama-cpp-python, residency management on and off.

1. ``moe-offload complete`` (a real subprocess) prints exactly the text of
   ``Llama(model, n_ctx=N).create_completion(prompt, max_tokens=M, temperature=0)``.
2. Token level, in process, over a longer run: the engine's token ids equal those of
   ``Llama.generate`` (the loop create_completion runs on). This one also covers outputs with
   raw byte tokens, where create_completion's UTF-8 "multibyte fix" skips its max_tokens check
   and overshoots (llama-cpp-python 0.3.36), so its text cannot be compared at a fixed length.
"""
from __future__ import annotations

import itertools

import pytest

from runtime.engine.engine import Engine
from runtime.engine.sampling import SamplingParams

N_PREDICT = 48
N_CTX = 512
RESIDENCY = [
    ["--no-residency"],
    [],                                        # defaults: manager on, hook on
    ["--devices.cpu", "100KiB"],               # a budget that forces evictions
]


@pytest.fixture(scope="module")
def llama(tiny_model):
    import llama_cpp
    from runtime.native.llama_lib import bindings
    bindings()          # AMX-safe model defaults on a stock libllama (llama_lib._guard_amx)

    llm = llama_cpp.Llama(model_path=str(tiny_model), n_ctx=N_CTX, verbose=False)
    yield llm
    llm.close()


@pytest.fixture(scope="module")
def reference(llama, prompt):
    out = llama.create_completion(prompt, max_tokens=N_PREDICT, temperature=0)
    # a fair comparison needs create_completion to have stopped at exactly max_tokens
    assert out["usage"]["completion_tokens"] == N_PREDICT, out["usage"]
    return out["choices"][0]["text"]


@pytest.mark.parametrize("residency", RESIDENCY, ids=["off", "on-default", "on-evicting"])
def test_complete_matches_llama_cpp_python(tiny_model, prompt, reference, cli, residency):
    proc = cli("complete", "-m", str(tiny_model), "-p", prompt, "-n", str(N_PREDICT),
               "--temp", "0", "-c", str(N_CTX), "-t", "1", *residency)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == reference + "\n"     # complete ends a pipe's text with a newline
    closing = proc.stderr.strip().splitlines()[-1]
    assert "prompt:" in closing and "generation:" in closing and "expert hit rate:" in closing
    if residency == ["--no-residency"]:
        assert "n/a (residency off)" in closing
    else:
        assert "%" in closing.split("expert hit rate:")[1]


def test_tokens_match_llama_generate_on_and_off(tiny_model, llama, make_settings):
    from runtime.residency.config import load_config

    prompt, n = "Once upon a time the little dog", 96
    tokens = llama.tokenize(prompt.encode(), add_bos=True, special=True)
    want = list(itertools.islice(llama.generate(tokens, temp=0.0), n))
    evicting = load_config(None, overrides={"devices.cpu": "100KiB"})
    for kw in (dict(manage_residency=False), dict(), dict(config=evicting)):
        with Engine(make_settings(tiny_model, **kw), progress=False) as engine:
            chunks = list(engine.generate(tokens, SamplingParams(max_tokens=n, temperature=0)))
            got = [c.token for c in chunks if c.token is not None]
            assert got == want, kw
            if engine.manager is not None:
                snap = engine.manager.snapshot().device("cpu")
                assert snap.total.accesses > 0
                if "config" in kw:
                    assert snap.total.evictions > 0   # the budget really was too small
