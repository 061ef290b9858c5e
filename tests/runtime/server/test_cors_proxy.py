"""``--ui-mcp-proxy`` on the real server: /cors-proxy calls the target with only the headers
named ``x-llama-server-proxy-header-*``, passes its status and body back, and is 403 without
the flag."""
from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

KEY = "proxy-test-key"


class _Target(BaseHTTPRequestHandler):
    def _answer(self, body: bytes) -> None:
        self.server.seen.append((self.command, self.path, dict(self.headers), body))
        status = 404 if self.path == "/missing" else 200
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        payload = json.dumps({"path": self.path, "body": body.decode()}).encode()
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def do_GET(self):  # noqa: N802 - http.server's names
        self._answer(b"")

    def do_POST(self):  # noqa: N802
        self._answer(self.rfile.read(int(self.headers.get("Content-Length", 0))))

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def target():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Target)
    server.seen = []
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def test_proxy_forwards_only_named_headers(start_server, tiny_model, target):
    server = start_server(tiny_model, "--api-key", KEY, "--ui-mcp-proxy",
                          "--ui-mcp-proxy-allow", "127.0.0.1")
    base = f"http://127.0.0.1:{target.server_port}"
    auth = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(base_url=server.base_url, timeout=30) as http:
        r = http.get("/cors-proxy", params={"url": f"{base}/capture?x=1"}, headers=auth | {
            "Cookie": "session=secret", "X-Api-Key": KEY,
            "x-llama-server-proxy-header-accept": "application/json",
            "x-llama-server-proxy-header-authorization": "Bearer explicit"})
        assert r.status_code == 200, r.text
        assert r.json()["path"] == "/capture?x=1"
        method, _, headers, _ = target.seen[-1]
        headers = {k.lower(): v for k, v in headers.items()}
        assert method == "GET" and headers["authorization"] == "Bearer explicit"
        assert headers["accept"] == "application/json"
        assert "cookie" not in headers and "x-api-key" not in headers
        r = http.post("/cors-proxy", params={"url": f"{base}/rpc"}, headers=auth | {
            "x-llama-server-proxy-header-content-type": "application/json"},
            content=b'{"jsonrpc":"2.0"}')
        assert r.status_code == 200 and r.json()["body"] == '{"jsonrpc":"2.0"}'
        assert http.get("/cors-proxy", params={"url": f"{base}/missing"},
                        headers=auth).status_code == 404          # the target's status
        bad = http.get("/cors-proxy", params={"url": "file:///etc/passwd"}, headers=auth)
        assert bad.status_code == 400 and "scheme" in bad.json()["error"]["message"]
        assert http.get("/cors-proxy", params={"url": f"http://u:p@127.0.0.1:{target.server_port}/"},
                        headers=auth).status_code == 400
        gone = http.get("/cors-proxy", params={"url": "http://127.0.0.1:9/"}, headers=auth)
        assert gone.status_code == 502
        assert http.get("/cors-proxy", params={"url": f"{base}/x"}).status_code == 401


def test_proxy_is_403_without_the_flag(start_server, tiny_model, target):
    server = start_server(tiny_model)
    r = httpx.get(f"{server.base_url}/cors-proxy",
                  params={"url": f"http://127.0.0.1:{target.server_port}/"}, timeout=30)
    assert r.status_code == 403 and "--ui-mcp-proxy" in r.json()["error"]["message"]
