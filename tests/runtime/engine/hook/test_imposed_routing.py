"""``--route-trace``: the model routes exactly as a trace did (route_hook.c sets the router's
logits so that llama.cpp's own top-k picks the trace's experts).

``trace record --route-trace T`` must record T's routing back, row for row (a model routing on
its own picks other experts: the test fails without the override); residency on and off give
the same greedy tokens under imposed routing; bad traces are refused in one line."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from gguf_tools.synth import SynthSpec
from runtime.traces.files import read_trace, write_trace
from tests.conftest import write_dense_gguf

REAL = Path(__file__).parents[2] / "traces" / "data"
ARGS = ["-c", "512", "-t", "1", "--temp", "0"]
ROUTED = ("phase", "step", "layer", "slot", "expert")


def _same_routing(a, b) -> None:
    assert len(a) == len(b)
    for name in ROUTED:
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name), err_msg=name)
    np.testing.assert_allclose(a.weight, b.weight, atol=1e-4)


@pytest.fixture(scope="module")
def small_trace(tmp_path_factory, tiny_spec) -> Path:
    """A synthetic trace of the tiny model's shape: 20 prompt + 30 decode tokens."""
    from runtime.traces.synthetic import SynthTraceSpec, synthesize

    spec = SynthTraceSpec(n_layer=tiny_spec.layers, n_expert=tiny_spec.experts,
                              top_k=tiny_spec.top_k, prompt_tokens=20, decode_tokens=30,
                              seed=7)
    path = tmp_path_factory.mktemp("imposed") / "t.rtb"
    write_trace(synthesize(spec), path)
    return path


def test_record_plays_the_trace_back(tiny_model, small_trace, cli, tmp_path):
    out = tmp_path / "back.rtb"
    proc = cli("trace", "record", "-m", str(tiny_model), "--route-trace", str(small_trace),
               "-o", str(out), *ARGS)
    assert proc.returncode == 0, proc.stderr
    assert "routing imposed from t.rtb" in proc.stderr
    _same_routing(read_trace(small_trace), read_trace(out))


def test_a_model_routing_on_its_own_differs(tiny_model, small_trace, cli, tmp_path):
    """The check above can fail: the same prompt without the override routes otherwise."""
    out = tmp_path / "own.rtb"
    trace = read_trace(small_trace)
    proc = cli("trace", "record", "-m", str(tiny_model), "-p",
               "The quick brown fox jumps over the lazy dog. " * 3, "-n", "31", "-o", str(out),
               *ARGS)
    assert proc.returncode == 0, proc.stderr
    own = read_trace(out)
    n = min(len(own), len(trace))
    assert (own.expert[:n] != trace.expert[:n]).mean() > 0.3


@pytest.mark.skipif(not (REAL / "qwen3-30b-a3b.route.csv").exists(), reason="no real trace")
def test_a_real_trace_plays_back(synth_model_factory, cli, tmp_path):
    """Qwen3-30B-A3B's trace (48 layers, 128 experts, top-6; its prefill routed only the
    prompt's last token at the last layer, as llama.cpp does) on a model of its shape."""
    model = synth_model_factory(SynthSpec(layers=48, experts=128, top_k=6, embd=64, ff=32))
    real = REAL / "qwen3-30b-a3b.route.csv"
    out = tmp_path / "back.csv"
    proc = cli("trace", "record", "-m", str(model), "--route-trace", str(real),
               "-o", str(out), *ARGS)
    assert proc.returncode == 0, proc.stderr
    _same_routing(read_trace(real), read_trace(out))


def test_greedy_tokens_equal_with_residency_on_and_off(tiny_model, small_trace, cli, tmp_path):
    config = tmp_path / "cpu.toml"
    config.write_text('[devices]\ncpu = "1MiB"\n')
    on = cli("complete", "-m", str(tiny_model), "--route-trace", str(small_trace),
             "--config", str(config), *ARGS)
    off = cli("complete", "-m", str(tiny_model), "--route-trace", str(small_trace),
              "--no-residency", *ARGS)
    assert on.returncode == 0, on.stderr
    assert off.returncode == 0, off.stderr
    assert on.stdout == off.stdout and on.stdout.strip()
    # the whole trace by default: 31 tokens (one from the prompt, one per decode row)
    assert "generation: 31 tok" in on.stderr and "routing imposed from t.rtb" in on.stderr


def _one_line_error(proc, *needles: str) -> None:
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


def test_bad_traces_are_refused_in_one_line(tiny_model, small_trace, cli, tmp_path,
                                            synth_model_factory):
    run = lambda trace, *extra: cli("complete", "-m", str(tiny_model),  # noqa: E731
                                    "--route-trace", str(trace), *extra, *ARGS)
    # another shape: both named
    other = synth_model_factory(SynthSpec(layers=4, experts=8, top_k=3, embd=64, ff=32))
    _one_line_error(cli("complete", "-m", str(other), "--route-trace", str(small_trace), *ARGS),
                    "top-2", "top-3")
    # more tokens than the trace holds: how many it holds
    _one_line_error(run(small_trace, "-n", "40"), "20 prompt + 30 decode", "at most -n 31")
    _one_line_error(run(small_trace, "-p", "word " * 60), "the trace holds")
    # missing, corrupt, truncated
    _one_line_error(run(tmp_path / "none.rtb"), "no such file")
    bad = tmp_path / "bad.csv"
    bad.write_text("not a trace\n")
    _one_line_error(run(bad))
    cut = tmp_path / "cut.rtb"
    cut.write_bytes(small_trace.read_bytes()[:-100])
    _one_line_error(run(cut))
    # a dense model
    dense = write_dense_gguf(tmp_path / "dense.gguf")
    _one_line_error(cli("complete", "-m", str(dense), "--route-trace", str(small_trace), *ARGS),
                    "not a mixture-of-experts model")
