"""A Hugging Face hub stand-in on 127.0.0.1 for ``-hf`` tests: the repository tree API
(``/api/models/REPO/tree/main``) and the resolve URLs (``/REPO/resolve/main/FILE``) with the
headers huggingface_hub reads (X-Repo-Commit, ETag, Content-Length). Point HF_ENDPOINT at
``url``; ``requests`` records every path asked for."""
from __future__ import annotations

import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

COMMIT = "0123456789abcdef0123456789abcdef01234567"


class FakeHub:
    def __init__(self, repos: dict[str, dict[str, Path]]):
        """``repos``: repo id -> {file name in the repo: local file served for it}."""
        self.repos = repos
        self.requests: list[str] = []
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):        # quiet
                pass

            def do_HEAD(self):
                self._answer(body=False)

            def do_GET(self):
                self._answer(body=True)

            def _answer(self, body: bool) -> None:
                path = unquote(urlsplit(self.path).path)
                hub.requests.append(f"{self.command} {path}")
                data, ctype, headers = hub._lookup(path)
                if data is None:
                    self.send_response(404)
                    self.send_header("X-Error-Code", "EntryNotFound")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                self.send_response(200)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(data)))
                for key, value in headers.items():
                    self.send_header(key, value)
                self.end_headers()
                if body:
                    self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def _lookup(self, path: str):
        for repo, files in self.repos.items():
            if path.startswith(f"/api/models/{repo}/tree/"):
                listing = [{"type": "file", "path": name, "size": local.stat().st_size,
                            "oid": hashlib.sha1(name.encode()).hexdigest()}
                           for name, local in files.items()]
                return json.dumps(listing).encode(), "application/json", {}
            if path.startswith(f"/api/models/{repo}/revision/") or path == f"/api/models/{repo}":
                info = {"id": repo, "sha": COMMIT,
                        "siblings": [{"rfilename": name} for name in files]}
                return json.dumps(info).encode(), "application/json", {}
            prefix = f"/{repo}/resolve/main/"
            if path.startswith(prefix) and path[len(prefix):] in files:
                data = files[path[len(prefix):]].read_bytes()
                etag = hashlib.sha256(data).hexdigest()
                return data, "application/octet-stream", {"X-Repo-Commit": COMMIT,
                                                          "ETag": f'"{etag}"'}
        return None, "", {}

    def __enter__(self) -> "FakeHub":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()
