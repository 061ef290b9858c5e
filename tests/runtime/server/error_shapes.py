"""What an error answer of each route looks like (shared by the error-contract, token-id and
fuzz tests): llama-server's ``{"error": {"code": STATUS, "message", "type"}}`` on its own
routes, Anthropic's ``{"type": "error", "error": {"type", "message"}}`` on the Messages API,
OpenAI's ``{"error": {"message", "type", "param", "code"}}`` elsewhere."""
from __future__ import annotations

import httpx

NATIVE = ("/completion", "/completions", "/tokenize", "/detokenize", "/apply-template",
          "/embedding", "/infill", "/props", "/slots")
ANTHROPIC = ("/v1/messages", "/v1/messages/count_tokens")


def error_of(r: httpx.Response, path: str) -> dict:
    """The error object of a 4xx answer, checked against ``path``'s API shape."""
    assert 400 <= r.status_code < 500, f"{path}: {r.status_code} {r.text[:500]}"
    body = r.json()
    if path in ANTHROPIC:
        assert body.get("type") == "error" and set(body["error"]) == {"type", "message"}, body
        assert body["error"]["message"], body
        return body["error"]
    assert set(body) == {"error"}, body
    err = body["error"]
    assert isinstance(err["message"], str) and err["message"], err
    assert isinstance(err["type"], str), err
    if path in NATIVE or path.startswith("/slots/"):
        assert err["code"] == r.status_code, err
    else:
        assert {"message", "type", "param", "code"} <= set(err), err
        assert err["code"] is None or isinstance(err["code"], str), err
    return err
