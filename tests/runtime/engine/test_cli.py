"""``moe-offload complete`` and ``moe-offload chat`` as real subprocesses on a synthetic
model: stdout carries only generated text, stderr the closing timings line; chat keeps history
across turns from piped stdin and stops at /exit; bad input is one line and a non-zero exit."""
from __future__ import annotations

import pytest

from runtime.engine.engine import Engine
from runtime.engine.sampling import SamplingParams
from runtime.residency.policies.factory import policy_names

COMMON = ["-c", "512", "-t", "1", "--temp", "0"]


def _replies(engine, turns, n, system=None):
    """What the chat command should print for ``turns``, computed in process."""
    messages = [{"role": "system", "content": system}] if system else []
    out = []
    for text in turns:
        messages.append({"role": "user", "content": text})
        reply = "".join(c.text for c in engine.generate(
            engine.chat_prompt(messages), SamplingParams(max_tokens=n, temperature=0)))
        messages.append({"role": "assistant", "content": reply})
        out.append(reply)
    return out


def test_complete_streams_only_text_to_stdout(tiny_model, prompt, cli, make_settings):
    proc = cli("complete", "-m", str(tiny_model), "-p", prompt, "-n", "16", *COMMON)
    assert proc.returncode == 0, proc.stderr
    with Engine(make_settings(tiny_model, manage_residency=False), progress=False) as engine:
        want = "".join(c.text for c in engine.generate(
            prompt, SamplingParams(max_tokens=16, temperature=0)))
    assert proc.stdout == want + "\n"       # a pipe gets whole lines
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("prompt: ")   # quiet llama.cpp, one line
    assert "t/s" in lines[0] and "expert hit rate:" in lines[0]


def test_complete_prompt_file_and_stop_string(tiny_model, prompt, cli, tmp_path):
    f = tmp_path / "prompt.txt"
    f.write_text(prompt, encoding="utf-8")
    full = cli("complete", "-m", str(tiny_model), "-f", str(f), "-n", "24", *COMMON)
    assert full.returncode == 0, full.stderr
    assert full.stdout.endswith("\n")
    text = full.stdout[:-1]
    stop = text[len(text) // 2:][:3]
    assert stop.strip(), "need a visible stop string"
    cut = cli("complete", "-m", str(tiny_model), "-f", str(f), "-n", "24", "--stop", stop,
              *COMMON)
    assert cut.returncode == 0, cut.stderr
    assert cut.stdout == text[:text.index(stop)] + "\n"


def test_chat_piped_stdin_keeps_history(tiny_model, cli, make_settings):
    turns = ["Hello there", "Tell me about the sea"]
    proc = cli("chat", "-m", str(tiny_model), "-n", "10", "--system", "Be brief", *COMMON,
               stdin="\n".join(turns) + "\n")
    assert proc.returncode == 0, proc.stderr
    with Engine(make_settings(tiny_model, manage_residency=False), progress=False) as engine:
        want = _replies(engine, turns, 10, system="Be brief")
    assert proc.stdout == "".join(r + "\n" for r in want)
    assert "expert hit rate:" in proc.stderr.strip().splitlines()[-1]


def test_chat_exit_command(tiny_model, cli):
    proc = cli("chat", "-m", str(tiny_model), "-n", "4", *COMMON,
               stdin="first\n/exit\nnever answered\n")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("\n") == 1


def test_chat_answers_help_and_unknown_commands_itself(tiny_model, cli):
    proc = cli("chat", "-m", str(tiny_model), "-n", "4", *COMMON,
               stdin="/help\n/nonsense x\nhello\n/exit\n")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("\n") == 1              # one reply: only "hello" reached the model
    assert "unknown command /nonsense" in proc.stderr
    assert proc.stderr.count("/reset   forget the conversation") == 2


def test_help_shows_residency_defaults_not_none(cli):
    short = cli("complete", "--help")
    assert short.returncode == 0
    assert "--devices.cuda:0" in short.stdout and "--help-all" in short.stdout
    assert "--policy.decode.eviction" not in short.stdout      # advanced: --help-all
    assert len(short.stdout.splitlines()) < 130
    proc = cli("complete", "--help-all")
    assert proc.returncode == 0
    assert "(default: None)" not in proc.stdout
    text = " ".join(proc.stdout.split())
    unwrapped = text.replace("- ", "-")           # argparse may wrap after a hyphen
    names = ", ".join(policy_names("eviction"))         # the registry's, in its order
    assert f"--policy.decode.eviction NAME {names} (default: next-visit)" in unwrapped
    assert "--cost.link_gbps X number (default: 25)" in text


@pytest.mark.parametrize("command", [("chat",), ("trace", "record"), ("bench",), ("serve",),
                                     ("replay",), ("plan",), ("demo",), ("synth",),
                                     ("trace", "synth"), ("inspect",), ("profile",)])
def test_no_help_shows_a_none_or_false_default(cli, command):
    proc = cli(*command, "--help")
    assert proc.returncode == 0, proc.stderr
    assert "(default: None)" not in proc.stdout and "(default: False)" not in proc.stdout
    assert "(default: [])" not in proc.stdout and "``" not in proc.stdout   # no RST markup


def test_model_directory_is_named_as_such(cli, tmp_path):
    proc = cli("complete", "-m", str(tmp_path), "-p", "x")
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"moe-offload: error: {tmp_path}: is a directory; -m wants " \
                                  "a GGUF model file"


def test_help_shows_defaults(cli):
    proc = cli("complete", "--help")
    assert proc.returncode == 0
    for flag, default in [("--ctx-size", "4096"), ("--predict", "128"), ("--temp", "0.8"),
                          ("--top-k", "40"), ("--ubatch-size", "512"), ("--batch-size", "2048")]:
        assert flag in proc.stdout
        assert f"(default: {default})" in proc.stdout


def test_bad_input_is_one_line(tiny_model, cli, tmp_path):
    cases = [
        (["complete", "-m", str(tmp_path / "missing.gguf"), "-p", "x"], "no such model file"),
        (["complete", "-m", str(tiny_model), "-p", "x", "--temp", "-1"], "temperature"),
        (["complete", "-m", str(tiny_model), "-p", "x", "-n", "0"], "--predict"),
        (["complete", "-m", str(tiny_model), "-f", str(tmp_path / "nope.txt")], "no such file"),
    ]
    not_gguf = tmp_path / "not.gguf"
    not_gguf.write_bytes(b"PK\x03\x04 definitely not a gguf")
    cases.append((["complete", "-m", str(not_gguf), "-p", "x"], str(not_gguf)))
    for args, needle in cases:
        proc = cli(*args)
        assert proc.returncode != 0, args
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and needle in lines[0], (args, proc.stderr)
        assert "Traceback" not in proc.stderr
