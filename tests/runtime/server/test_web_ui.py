"""The chat page at ``/`` on the real server: public static files (no API key, nothing from
elsewhere), the chat route it calls still guarded, and ``--no-ui`` answering 404. The page in
a browser: test_chat_page.py."""
from __future__ import annotations

import re
import time

import httpx
import pytest

KEY = "web-ui-test-key"


@pytest.fixture(scope="module")
def server(start_server, tiny_model):
    return start_server(tiny_model, "--api-key", KEY)


def test_page_and_its_files_are_public(server):
    with httpx.Client(base_url=server.base_url, timeout=30) as http:
        page = http.get("/")
        assert page.status_code == 200
        assert page.text.startswith("<!doctype html>")
        assert page.headers["content-type"].startswith("text/html")
        assert "/v1/chat/completions" in page.text          # what the page streams from
        assert http.get("/index.html").text == page.text
        manifest = http.get("/manifest.webmanifest")
        assert manifest.status_code == 200 and manifest.json()["start_url"] == "/"
        worker = http.get("/sw.js")
        assert worker.status_code == 200 and "javascript" in worker.headers["content-type"]
        # the page's own scripts and style, all from the package: nothing from a CDN
        for path in ("/app.js", "/markdown.js", "/experts.js", "/style.css"):
            asset = http.get(path)
            assert asset.status_code == 200, path
            assert path[1:] in page.text
        assert not re.search(r"""(src|href)=["']?(https?:)?//""", page.text)
        version = http.get("/_app/version.json")
        assert version.status_code == 200 and version.json()["version"].startswith("b")
        # the API behind the page still wants the key
        r = http.post("/v1/chat/completions",
                      json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})
        assert r.status_code == 401
        r = http.post("/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"},
                      json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})
        assert r.status_code == 200, r.text


def _ready_line(server) -> str:
    """The log's "loaded ...; serving ..." line (written just after /health turns 200)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        line = next((l for l in server.log().splitlines() if "; serving " in l), None)
        if line is not None:
            return line
        time.sleep(0.05)
    raise AssertionError(server.log())


def test_serve_says_where_the_chat_page_is(server):
    assert f"; the chat page: {server.base_url}/" in _ready_line(server)


def test_no_ui_answers_404(start_server, tiny_model):
    server = start_server(tiny_model, "--no-ui")
    assert "chat page" not in _ready_line(server)
    with httpx.Client(base_url=server.base_url, timeout=30) as http:
        for path in ("/", "/index.html", "/sw.js", "/manifest.webmanifest", "/_app/version.json",
                     "/app.js", "/style.css"):
            assert http.get(path).status_code == 404, path
        assert http.get("/health").status_code == 200
