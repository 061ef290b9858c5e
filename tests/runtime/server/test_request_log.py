"""``serve`` at the HTTP edge, as llama-server: one log line per request (method, route,
status, tokens, t/s, time), a JSON body taken without a Content-Type, the fields OpenAI
clients send that change nothing here accepted, and ``reasoning_effort`` as the template's
``enable_thinking``. A real ``moe-offload serve`` process on a synthetic model."""
from __future__ import annotations

import json
import re
import time

import httpx
import pytest

from runtime.server.schemas import IGNORED_FIELDS

# a template that shows whether thinking is on (ChatML otherwise)
THINKING_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
                     "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>"
                     "assistant\n{% if enable_thinking %}[thinking on]{% else %}[thinking off]"
                     "{% endif %}{% endif %}")
CHAT = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4, "temperature": 0}


@pytest.fixture(scope="module")
def server(start_server, tiny_model, tmp_path_factory):
    template = tmp_path_factory.mktemp("template") / "thinking.jinja"
    template.write_text(THINKING_TEMPLATE)
    return start_server(tiny_model, "--chat-template-file", str(template))


def _lines(server, pattern: str, wait_s: float = 5.0) -> list[str]:
    """The server's log lines matching ``pattern`` (the line follows the answer: wait)."""
    deadline = time.monotonic() + wait_s
    while True:
        found = [ln for ln in server.log().splitlines() if re.search(pattern, ln)]
        if found or time.monotonic() > deadline:
            return found
        time.sleep(0.05)


def test_a_log_line_per_request(server):
    chat = httpx.post(f"{server.api_url}/chat/completions", json=CHAT, timeout=60)
    assert chat.status_code == 200, chat.text
    usage = chat.json()["usage"]
    line = _lines(server, r"POST /v1/chat/completions ")
    assert len(line) == 1, server.log()
    match = re.fullmatch(r"moe-offload: POST /v1/chat/completions 127\.0\.0\.1 200 \| "
                         r"(\d+) prompt \+ (\d+) generated tokens, [\d.]+ t/s \| [\d.]+ s",
                         line[0])
    assert match, line[0]
    assert int(match.group(1)) == usage["prompt_tokens"]
    assert int(match.group(2)) == usage["completion_tokens"] == 4
    with httpx.stream("POST", f"{server.api_url}/completions", timeout=60,
                      json={"prompt": "A", "max_tokens": 3, "stream": True}) as stream:
        assert stream.status_code == 200
        "".join(stream.iter_text())
    assert re.search(r"POST /v1/completions 127\.0\.0\.1 200 \| \d+ prompt \+ 3 generated",
                     _lines(server, r"POST /v1/completions ")[0])
    assert httpx.get(f"{server.api_url}/models", timeout=10).status_code == 200
    assert re.fullmatch(r"moe-offload: GET /v1/models 127\.0\.0\.1 200 \| [\d.]+ s",
                        _lines(server, r"GET /v1/models ")[0])
    assert httpx.get(f"{server.base_url}/nope", timeout=10).status_code == 404
    assert _lines(server, r"GET /nope 127\.0\.0\.1 404 \| ")
    assert not _lines(server, r"GET /health ", wait_s=0)     # pollers make no line


def test_control_characters_from_a_client_are_escaped_in_the_log(server):
    """CR/LF and ESC in a URL path once forged whole log lines (and drove the terminal); a
    long path is cut."""
    forged = "moe-offload: POST /v1/chat/completions 10.0.0.1 200 | 0.01 s"
    for raw in ("/x%0d%0a" + forged.replace(" ", "%20"), "/y%1b[31m%e2%80%ae%00"):
        assert httpx.get(f"{server.base_url}{raw}", timeout=10).status_code == 404
    assert _lines(server, r"GET /x\\x0d\\x0amoe-offload: POST .* 127\.0\.0\.1 404 \| ")
    assert _lines(server, r"GET /y\\x1b\[31m\\u202e\\x00 127\.0\.0\.1 404 \| ")
    assert httpx.get(f"{server.base_url}/z{'a' * 5000}", timeout=10).status_code == 404
    assert _lines(server, r"GET /za{254}\.\.\.\(5002 characters\) 127\.0\.0\.1 404")  # cut
    log = server.log()
    assert not any(line.startswith(forged) for line in log.splitlines()), log
    assert not any(c in log for c in "\x1b\x00\u202e\r"), repr(log[-500:])
    r = httpx.post(f"{server.api_url}/chat/completions", json=CHAT, timeout=60)
    assert r.status_code == 200, r.text


def test_fields_that_change_nothing_are_accepted(server):
    plain = httpx.post(f"{server.api_url}/chat/completions", json=CHAT, timeout=60)
    labels = {"user": "u-1", "metadata": {"k": "v"}, "store": True, "service_tier": "auto",
              "safety_identifier": "s-1", "prompt_cache_key": "p-1"}
    assert set(labels) == set(IGNORED_FIELDS)
    labelled = httpx.post(f"{server.api_url}/chat/completions", json=CHAT | labels, timeout=60)
    assert labelled.status_code == 200, labelled.text
    assert labelled.json()["choices"][0]["message"] == plain.json()["choices"][0]["message"]
    text = httpx.post(f"{server.api_url}/completions", timeout=60,
                      json={"prompt": "A", "max_tokens": 2, "store": False, "user": "u"})
    assert text.status_code == 200, text.text
    unknown = httpx.post(f"{server.api_url}/chat/completions", json=CHAT | {"bogus": 1},
                         timeout=60)
    assert unknown.status_code == 400 and "bogus" in unknown.text     # still refused


def test_json_body_without_a_content_type(server):
    body = json.dumps(CHAT).encode()
    want = httpx.post(f"{server.api_url}/chat/completions", json=CHAT, timeout=60).json()
    for headers in ({}, {"Content-Type": "application/x-www-form-urlencoded"},
                    {"Content-Type": "text/plain"}):
        request = httpx.Request("POST", f"{server.api_url}/chat/completions", content=body,
                                headers=headers)
        assert "content-type" in request.headers or not headers     # none: none is sent
        got = httpx.Client(timeout=60).send(request)
        assert got.status_code == 200, (headers, got.text)
        assert got.json()["choices"][0]["message"] == want["choices"][0]["message"]
    native = httpx.post(f"{server.base_url}/tokenize", content=b'{"content": "Hello"}',
                        timeout=30)
    assert native.status_code == 200 and native.json()["tokens"]


@pytest.mark.parametrize("effort, shown", [("none", "[thinking off]"),
                                           ("minimal", "[thinking off]"),
                                           ("low", "[thinking on]"),
                                           ("high", "[thinking on]")])
def test_reasoning_effort_sets_thinking(server, effort, shown):
    answer = httpx.post(f"{server.api_url}/chat/completions", timeout=60,
                        json=CHAT | {"reasoning_effort": effort, "verbose": True})
    assert answer.status_code == 200, answer.text
    assert answer.json()["__verbose"]["prompt"].endswith(shown)


def test_chat_template_kwargs_win_over_reasoning_effort(server):
    answer = httpx.post(f"{server.api_url}/chat/completions", timeout=60,
                        json=CHAT | {"reasoning_effort": "none", "verbose": True,
                                     "chat_template_kwargs": {"enable_thinking": True}})
    assert answer.json()["__verbose"]["prompt"].endswith("[thinking on]")
    bad = httpx.post(f"{server.api_url}/chat/completions", timeout=60,
                     json=CHAT | {"reasoning_effort": "extreme"})
    assert bad.status_code == 400 and "reasoning_effort" in bad.text
