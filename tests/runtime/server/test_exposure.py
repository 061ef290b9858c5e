"""Exposure: a non-loopback --host prints a loud warning (louder without --api-key), and CORS
lets an answer be read with credentials only when --cors-origin lists the origin (under the
default '*' the preflight echoes the origin with credentials, as llama-server's, but the answers
carry '*' without them)."""
from __future__ import annotations

import time

import httpx
import pytest

from runtime.server.exposure import exposure_warning, is_loopback
from tests.runtime.server.conftest import launch


def _preflight(server, origin: str) -> httpx.Response:
    return httpx.options(f"{server.base_url}/v1/chat/completions", headers={
        "Origin": origin, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "Authorization"}, timeout=10)


def test_default_cors_answers_any_origin_without_credentials(start_server, tiny_model):
    server = start_server(tiny_model)
    for origin in ("http://evil.test", "http://localhost:3000"):
        r = _preflight(server, origin)           # as llama-server's preflight
        assert r.status_code == 200
        assert r.headers["access-control-allow-origin"] == origin
        assert r.headers["access-control-allow-credentials"] == "true"
        r = httpx.get(f"{server.base_url}/v1/models", headers={"Origin": origin}, timeout=10)
        assert r.headers["access-control-allow-origin"] == "*"
        assert "access-control-allow-credentials" not in r.headers


def test_listed_origins_are_echoed_with_credentials(start_server, tiny_model):
    server = start_server(tiny_model, "--cors-origin", "https://app.test,localhost")
    for origin in ("https://app.test", "http://localhost:8080", "http://[::1]:3000"):
        r = _preflight(server, origin)
        assert r.headers["access-control-allow-origin"] == origin
        assert r.headers["access-control-allow-credentials"] == "true"
        assert "Origin" in r.headers["vary"]
    for origin in ("http://evil.test", "https://app.test.evil", "http://localhost.evil.test",
                   "http://[::1"):
        r = _preflight(server, origin)
        assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


def test_warning_text():
    assert exposure_warning(["127.0.0.1", "::1"], False, False) is None
    assert all(is_loopback(a) for a in ("127.0.0.1", "127.9.9.9", "::1", "localhost",
                                        "::ffff:127.0.0.1"))
    assert not any(is_loopback(a) for a in ("0.0.0.0", "::", "10.0.0.1", "example.test"))
    keyed = exposure_warning(["0.0.0.0"], True, False)
    open_ = exposure_warning(["0.0.0.0"], False, True)
    assert "every interface" in keyed and "NO --api-key" not in keyed
    assert "NO --api-key" in open_ and open_.startswith("!" * 78) and "--ui-mcp-proxy" in open_


@pytest.mark.parametrize("key", [False, True])
def test_serve_on_every_interface_warns(tiny_model, tmp_path, key):
    """Binds 0.0.0.0 for a moment (nothing is sent anywhere) and reads the warning."""
    log = tmp_path / "serve.log"
    proc = launch(tiny_model, log, "--host", "0.0.0.0", *(["--api-key", "k"] if key else []))
    try:
        deadline = time.monotonic() + 60
        while "listening on" not in log.read_text() and time.monotonic() < deadline:
            assert proc.poll() is None, log.read_text()
            time.sleep(0.05)
        text = log.read_text()
    finally:
        proc.kill()
        proc.wait(10)
    assert "WARNING: serving on every interface (0.0.0.0)" in text, text
    assert ("NO --api-key" in text) is not key
    assert (("!" * 78) in text) is not key          # louder without a key
