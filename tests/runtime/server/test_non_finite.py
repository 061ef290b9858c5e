"""NaN / Inf expert weights in the served file (issue 32): before, 200 with empty text, 500 "Out
of range float values are not JSON compliant" with logprobs, and streams carrying
``"token_logprobs":[NaN]`` (invalid JSON); the output stayed empty once the bytes were good
again. Now the non-finite logits are caught before sampling: a clean 500 in the route's shape,
in-band in a stream, strict JSON everywhere, and once the weights are good the next request
answers normally (the failed request's KV was dropped)."""
from __future__ import annotations

import json
import math

import anthropic
import httpx
import openai
import pytest

from tests.runtime.server.broken_files import model_copy, poison_experts, restore_bytes

CHAT = [{"role": "user", "content": "tell me about the sea"}]
NON_FINITE = "logits are not finite"


def _strict(text: str):
    """JSON as the wire must carry it: NaN, Infinity and -Infinity refused."""
    def refuse(constant: str):
        raise ValueError(f"{constant} on the wire: {text[:200]}")
    return json.loads(text, parse_constant=refuse)


def _events(r: httpx.Response) -> list:
    return [_strict(line[6:]) for line in r.text.splitlines()
            if line.startswith("data: ") and line != "data: [DONE]"]


def _stream(server, path: str, body: dict) -> list:
    r = httpx.post(f"{server.base_url}{path}", json=body | {"stream": True}, timeout=60)
    assert r.status_code == 200, r.text
    return _events(r)


@pytest.mark.parametrize("value, parallel", [(math.nan, "1"), (math.inf, "2")],
                         ids=["nan", "inf-np2"])
def test_non_finite_weights_fail_requests_cleanly_and_the_context_recovers(
        start_server, tiny_model, tmp_path, value, parallel):
    copy = model_copy(tiny_model, tmp_path)
    poison_experts(copy, value)
    server = start_server(copy, "-c", str(512 * int(parallel)), "-np", parallel)
    client = openai.OpenAI(base_url=server.api_url, api_key="x", max_retries=0, timeout=60)
    claude = anthropic.Anthropic(base_url=server.base_url, api_key="x", max_retries=0,
                                 timeout=60)
    with pytest.raises(openai.APIStatusError) as err:
        client.chat.completions.create(model="x", messages=CHAT, max_tokens=4)
    assert err.value.status_code == 500 and err.value.code == "non_finite_logits"
    assert NON_FINITE in err.value.message
    with pytest.raises(openai.APIStatusError) as err:
        client.completions.create(model="x", prompt="the sea", max_tokens=4, logprobs=3)
    assert err.value.status_code == 500 and NON_FINITE in err.value.message
    with pytest.raises(openai.APIError, match=NON_FINITE):        # in-band, in the stream
        for _ in client.completions.create(model="x", prompt="the sea", max_tokens=4,
                                           logprobs=3, stream=True):
            pass
    with pytest.raises(anthropic.InternalServerError, match=NON_FINITE):
        claude.messages.create(model="x", max_tokens=4, messages=CHAT)
    native = httpx.post(f"{server.base_url}/completion", timeout=60,
                        json={"prompt": "the sea", "n_predict": 4, "n_probs": 3})
    assert native.status_code == 500 and NON_FINITE in _strict(native.text)["error"]["message"]
    events = _stream(server, "/completion", {"prompt": "the sea", "n_predict": 4, "n_probs": 3})
    assert events and NON_FINITE in events[-1]["error"]["message"]       # strict JSON, all
    events = _stream(server, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 4,
                                                      "logprobs": True, "top_logprobs": 2})
    assert NON_FINITE in events[-1]["error"]["message"]
    assert httpx.get(f"{server.base_url}/health", timeout=10).status_code == 200
    server.assert_alive()

    restore_bytes(copy, tiny_model, copy.stat())      # good weights, the same file as loaded
    answer = client.chat.completions.create(model="x", messages=CHAT, max_tokens=6,
                                            temperature=0, logprobs=True, top_logprobs=2)
    assert answer.choices[0].message.content and answer.usage.completion_tokens > 0
    assert all(math.isfinite(t.logprob) for t in answer.choices[0].logprobs.content)
    events = _stream(server, "/completion", {"prompt": "the sea", "n_predict": 4, "n_probs": 3})
    assert events[-1]["stop"] is True and "".join(e["content"] for e in events)
