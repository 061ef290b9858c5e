"""``--ui-mcp-proxy`` on the real server: /cors-proxy calls the target with only the headers
named ``x-llama-server-proxy-header-*``, passes its status, body and a redirect's Location
back, and is 403 without the flag; an internal target is a 400, as llama-server answers."""
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
        status = {"/missing": 404, "/moved": 302}.get(self.path, 200)
        self.send_response(status)
        if status == 302:
            self.send_header("Location", "/ok")
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
        moved = http.get("/cors-proxy", params={"url": f"{base}/moved"}, headers=auth)
        assert moved.status_code == 302 and moved.headers["location"] == "/ok"   # for the page
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


# Internal targets in the spellings a page could use; none is connected to: the proxy
# refuses local names first and resolves the rest (literals: no DNS query) and refuses.
INTERNAL = ["http://127.0.0.1:{port}/", "http://localhost:{port}/", "http://[::1]:{port}/",
            "http://2130706433:{port}/", "http://0177.0.0.1:{port}/", "http://0x7f.1:{port}/",
            "http://127.1:{port}/", "http://0:{port}/", "http://0.0.0.0:{port}/",
            "http://[::]:{port}/", "http://[::ffff:127.0.0.1]:{port}/",
            "http://[::ffff:7f00:1]:{port}/", "http://[2002:7f00:1::]:{port}/",
            "http://[64:ff9b::7f00:1]:{port}/", "http://10.1.2.3/", "http://172.16.0.1/",
            "http://192.168.1.1/", "http://169.254.169.254/latest/meta-data/",
            "http://[fd00:ec2::254]/", "http://100.100.100.200/", "http://[fe80::1]/",
            "http://224.0.0.1/", "http://[ff02::1]/", "https://127.0.0.1:{port}/",
            "http://LOCALHOST:{port}/", "http://printer.local/", "http://db.internal/",
            "http://router.home.arpa/", "http://metadata.goog./"]
MALFORMED = ["", "file:///etc/passwd", "gopher://x/", "http://", "http://[::1", "http:///x",
             "http://a:99999/", "http://a:x/", "http://a b/", "http://a\tb/", "http://a/\n",
             "http://u:p@127.0.0.1/", "http://ex%41mple.com/", "http://a:0/", "javascript:x",
             "http://example.com?query", "http://[::1]suffix/", "http://example.com:/"]


def test_proxy_refuses_internal_targets_and_malformed_urls(start_server, tiny_model, target):
    server = start_server(tiny_model, "--ui-mcp-proxy")
    before = len(target.seen)
    with httpx.Client(base_url=server.base_url, timeout=30) as http:
        for url in INTERNAL:
            url = url.format(port=target.server_port)
            r = http.get("/cors-proxy", params={"url": url})
            assert r.status_code == 400, (url, r.text)
            assert "internal" in r.json()["error"]["message"], r.text
            assert "--ui-mcp-proxy-allow" in r.json()["error"]["message"]
        for url in MALFORMED:
            r = http.post("/cors-proxy", params={"url": url}, content=b"{}")
            assert r.status_code == 400, (url, r.text)
    assert len(target.seen) == before, "a refused target was reached"
    server.assert_alive()


def test_proxy_allow_list_by_network_and_by_name(start_server, tiny_model, target):
    server = start_server(tiny_model, "--ui-mcp-proxy", "--ui-mcp-proxy-allow",
                          "127.0.0.0/8,localhost")
    with httpx.Client(base_url=server.base_url, timeout=30) as http:
        for host in ("127.0.0.1", "localhost", "2130706433"):
            r = http.get("/cors-proxy",
                         params={"url": f"http://{host}:{target.server_port}/ok"})
            assert r.status_code == 200 and r.json()["path"] == "/ok", (host, r.text)
        r = http.get("/cors-proxy", params={"url": "http://10.0.0.1/"})
        assert r.status_code == 400         # only what the list names
