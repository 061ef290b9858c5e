"""The hostile part of scripts/soak.py's traffic (issue 32's attacks among them).

- ``INVALID``: requests each of which must get a 4xx in its route's API shape: out-of-vocabulary
  ids, surrogates, non-finite and past-64-bit numbers, ``logit_bias: [[]]``, JSON nested
  20,000 deep on the routes that read their body themselves, bodies that are not UTF-8, wrong
  methods, too many stop strings, a /tokenize or /detokenize past its cap.
- Bursts that once starved the server, each answer a 200 or a 429 in the route's shape:
  ``SCHEMA_BURST`` chats with a 5,000-item enum at once (their schema is prepared only in a
  queue place), ``SLOT_BURST`` saves of one slot at once (they wait in the queue).
- ``half_open``: connections that send the start of a request head and nothing more (the
  server's ``--header-timeout`` closes them).
- ``SLOT_BREAKS`` / ``broken_slot_file``: a slot's file broken as a careless operator or a bad
  disk would (soak.py's ``slot_attack`` restores it: a 400 naming the problem).

``SERVE_FLAGS`` are the limits soak.py's server runs with, so that these stay cheap.
"""
from __future__ import annotations

import json
import random
import socket
from concurrent.futures import ThreadPoolExecutor

import httpx

SERVE_FLAGS = ["--max-tokenize-kib", "64", "--max-detokenize-tokens", "1000",
               "--header-timeout", "5"]
NATIVE = ("/completion", "/tokenize", "/detokenize", "/apply-template", "/infill", "/slots/")
ANTHROPIC = ("/v1/messages",)

_DEEP = b'{"a":' * 20_000 + b"1" + b"}" * 20_000
_CHAT = '{"messages":[{"role":"user","content":"hi"}],"max_tokens":2,'
INVALID: list[tuple[str, str, bytes | None]] = [          # (method, path, raw body)
    ("POST", "/completion", b'{"prompt":[99999]}'),
    ("POST", "/completion", b'{"prompt":[[5,1000000]]}'),
    ("POST", "/v1/completions", b'{"prompt":"a\\ud800b"}'),
    ("POST", "/completion", b'{"prompt":[]}'),
    ("POST", "/v1/chat/completions", (_CHAT + '"temperature":1e999}').encode()),
    ("POST", "/completion",
     b'{"prompt":"x","json_schema":{"type":"string","minLength":100000000}}'),
    ("POST", "/completion",
     b'{"prompt":"x","json_schema":{"$ref":"#/$defs/a","$defs":{"a":{"$ref":"#/$defs/a"}}}}'),
    ("POST", "/apply-template", b"{}"),
    ("POST", "/detokenize", b'{"tokens":[-1]}'),
    ("POST", "/v1/chat/completions", b"{not json"),
    ("POST", "/tokenize", b'{"content":"\\udc00"}'),
    # issue 32
    ("POST", "/detokenize", _DEEP), ("POST", "/infill", _DEEP),
    ("POST", "/apply-template", _DEEP), ("POST", "/slots/0?action=save", _DEEP),
    ("POST", "/completion", b'{"prompt":"hi","n_predict":2,"logit_bias":[[]]}'),
    ("POST", "/completion", b'{"prompt":"hi","logit_bias":[[1,' + b"9" * 400 + b"]]}"),
    ("POST", "/v1/chat/completions", (_CHAT + f'"seed":{2**70}}}').encode()),
    ("POST", "/completion",
     b'{"prompt":"hi","json_schema":{"type":"integer","minimum":1' + b"0" * 400 + b"}}"),
    ("POST", "/v1/messages", b'{"model":"m","max_tokens":2,"messages":[{"role":"user",'
                             b'"content":"caf\xe9"}]}'),
    ("GET", "/v1/messages", None), ("GET", "/completion", None), ("PUT", "/tokenize", None),
    ("POST", "/v1/chat/completions", (_CHAT + f'"stop":{json.dumps(["s"] * 5000)}}}').encode()),
    ("POST", "/tokenize", b'{"content":"' + b"x" * (70 << 10) + b'"}'),
    ("POST", "/detokenize", json.dumps({"tokens": [5] * 2000}).encode()),
]

_ENUM = {"type": "string", "enum": [f"item{i:04d}" for i in range(5000)]}
SCHEMA_BURST = ("/v1/chat/completions", {
    "messages": [{"role": "user", "content": "pick one"}], "max_tokens": 4,
    "response_format": {"type": "json_schema", "json_schema": {"name": "e", "schema": _ENUM}}})
SLOT_BURST = ("/slots/0?action=save", {"filename": "soak-slot.bin"})
BURST = 8                        # requests sent at once


# what the restore's 400 must say of a file broken so; "erase" empties the slot instead
SLOT_BREAKS = {"flipped": "checksum mismatch", "version": "unsupported state version 2",
               "legacy": "unsupported state version 0", "short": "cut short", "erase": ""}


class Malformed(Exception):
    """An answer that broke its contract."""


def strict_json(text: str):
    """JSON as the wire must carry it: NaN, Infinity and -Infinity are malformed."""
    def refuse(constant: str):
        raise Malformed(f"{constant} in JSON: {text[:150]}")
    return json.loads(text, parse_constant=refuse)


def check_error(path: str, r: httpx.Response) -> None:
    """``r`` is an error in the shape of ``path``'s API (llama-server's carries the status)."""
    body = strict_json(r.text)
    err = body.get("error")
    if not isinstance(err, dict) or not err.get("message"):
        raise Malformed(f"{path} {r.status_code}: no error object: {r.text[:200]}")
    if path.startswith(ANTHROPIC) and body.get("type") != "error":
        raise Malformed(f"{path}: not Anthropic's error shape: {body}")
    if path.startswith(NATIVE) and err.get("code") != r.status_code:
        raise Malformed(f"{path}: not llama-server's error shape: {err}")


def send_invalid(http: httpx.Client, method: str, path: str,
                 raw: bytes | None) -> httpx.Response:
    headers = {"Content-Type": "application/json"} if raw is not None else {}
    return http.request(method, path, content=raw, headers=headers)


def burst(http: httpx.Client, path: str, body: dict) -> list[httpx.Response]:
    """``BURST`` copies of one request at once; each answer is a 200 or a 429 in the route's
    shape (else ``Malformed``)."""
    with ThreadPoolExecutor(BURST) as pool:
        answers = list(pool.map(lambda _: http.post(path, json=body), range(BURST)))
    for r in answers:
        if r.status_code == 429:
            check_error(path, r)
        elif r.status_code != 200:
            raise Malformed(f"burst {path}: {r.status_code} {r.text[:200]}")
        else:
            strict_json(r.text)
    return answers


def half_open(base: str, n: int = 10) -> list[socket.socket]:
    """``n`` connections that send the start of a request head and stop there."""
    host, port = base.removeprefix("http://").rsplit(":", 1)
    socks = []
    for _ in range(n):
        sock = socket.create_connection((host, int(port)), timeout=10)
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: soak\r\n")
        socks.append(sock)
    return socks


def broken_slot_file(good: bytes, how: str, rng: random.Random) -> bytes:
    """``good`` (a saved slot file: runtime/engine/slot_file.py) broken as ``how`` says."""
    from runtime.engine import slot_file  # noqa: PLC0415

    data = bytearray(good)
    if how == "flipped":                           # one int32 past the header, e.g. KV metadata
        at = rng.randrange(slot_file.HEADER.size, len(data) - 3)
        data[at:at + 4] = bytes(b ^ 0xFF for b in data[at:at + 4])
    elif how == "version":
        data[8:12] = (2).to_bytes(4, "little")
    elif how == "legacy":                          # llama.cpp's own header, no checksum
        n_tokens = slot_file.HEADER.unpack_from(good)[3]
        data = bytearray(slot_file.LLAMA_MAGIC + (3).to_bytes(4, "little")
                         + n_tokens.to_bytes(4, "little") + good[slot_file.HEADER.size:])
    else:                                          # "short": cut
        del data[-rng.randint(1, 64):]             # (an empty slot's file: into its header)
    return bytes(data)
