"""``moe-offload serve`` failing cleanly: one line on stderr, a non-zero exit, no traceback."""
from __future__ import annotations

import socket
import struct
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[3]


def _serve(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "runtime.cli", "serve", *args], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)


def _assert_one_line_error(result: subprocess.CompletedProcess, needle: str) -> None:
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("moe-offload: error")]
    assert len(errors) == 1, result.stderr
    assert needle in errors[0]


def test_missing_model_file(tmp_path: Path) -> None:
    missing = tmp_path / "nope.gguf"
    _assert_one_line_error(_serve("-m", str(missing), "--port", "0"), str(missing))


def test_file_that_is_not_gguf_is_refused_before_listening(tmp_path: Path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"PK\x03\x04 this is a zip file, not a GGUF model" * 10)
    result = _serve("-m", str(bad), "--port", "0")
    _assert_one_line_error(result, str(bad))
    assert "listening" not in result.stderr


def test_model_llama_cpp_cannot_load_stops_the_server(tmp_path: Path, tiny_model: Path) -> None:
    # A well-formed GGUF whose tokenizer llama.cpp does not know: it fails only when loaded,
    # in the background, after the server is already listening.
    data = bytearray(tiny_model.read_bytes())
    key = b"tokenizer.ggml.model"
    at = data.index(key) + len(key)
    value_type, length = struct.unpack_from("<IQ", data, at)
    assert value_type == 8 and data[at + 12: at + 12 + length] == b"llama"   # GGUF string
    data[at + 12: at + 12 + length] = b"x" * length
    bad = tmp_path / "unknown-tokenizer.gguf"
    bad.write_bytes(bytes(data))
    result = _serve("-m", str(bad), "--port", "0")
    assert "listening on http://127.0.0.1:" in result.stderr
    _assert_one_line_error(result, str(bad))


def test_busy_port(tiny_model: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        result = _serve("-m", str(tiny_model), "--port", str(port))
    _assert_one_line_error(result, f"127.0.0.1:{port}")


def test_help_shows_server_flags_and_defaults() -> None:
    result = _serve("--help", timeout=60)
    assert result.returncode == 0
    for flag in ("--host", "--port", "--api-key", "--alias", "--queue-size", "-m", "-c"):
        assert flag in result.stdout
    assert "127.0.0.1" in result.stdout and "8080" in result.stdout


def test_sigterm_ends_streams_with_an_error_and_exits(start_server, tiny_model: Path) -> None:
    import json

    import httpx

    server = start_server(tiny_model)
    body = {"prompt": "the king saw a river", "max_tokens": 4000, "temperature": 0,
            "stream": True}
    with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        server.proc.terminate()
        rest = [line for line in lines if line.startswith("data: ")]
    # the answer was cut short: the stream says so instead of ending with [DONE]
    assert rest and rest[-1] != "data: [DONE]"
    error = json.loads(rest[-1][6:])["error"]
    assert error["code"] == "server_shutdown"
    server.proc.wait(timeout=30)
    assert "Traceback" not in server.log()


def test_router_mode_and_sleep_flags_are_checked_before_listening(tmp_path: Path,
                                                                    tiny_model: Path) -> None:
    models = tmp_path / "models"
    models.mkdir()
    (models / "alpha.gguf").symlink_to(tiny_model)
    (models / "beta.gguf").symlink_to(tiny_model)
    preset = tmp_path / "models.ini"
    router = ("--models-dir", str(models))
    cases = [
        (("-m", str(tiny_model), *router), "not both"),
        ((*router, "--models-max", "-1"), "--models-max"),
        ((*router, "--write-profile", str(tmp_path / "p")), "--write-profile: not in router"),
        ((*router, "--alias", "x"), "per model: alias"),
        (("--models-dir", str(tmp_path / "none")), "does not exist or is not a directory"),
        (("-m", str(tiny_model), "--sleep-idle-seconds", "-5"), "--sleep-idle-seconds"),
        (("-m", str(tiny_model), "--sleep-idle-seconds", "1", "--write-profile",
          str(tmp_path / "p")), "one or the other"),
    ]
    for text, said in {"[x]\nmodel = /no/such.gguf\n": "no such file",
                       "[x]\nmodle = /a.gguf\n": "option 'modle' not recognized",
                       "[alpha]\nport = 9\n": "not a per-model option",
                       "[alpha]\nctx-size = many\n": "argument -c/--ctx-size",
                       "[alpha]\nalias = beta\n": "already model 'alpha'",
                       "[x]\nctx-size = 9\n": "no model"}.items():
        cases.append((("--models-preset", str(preset), *router), said, text))
    for case in cases:
        args, said = case[0], case[1]
        if len(case) == 3:
            preset.write_text(case[2])
        result = _serve(*args, "--port", "0")
        _assert_one_line_error(result, said)
        assert "listening" not in result.stderr
