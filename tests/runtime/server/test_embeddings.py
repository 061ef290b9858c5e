"""``serve --embedding``: OpenAI's /v1/embeddings (the official client), llama-server's
/embedding (pooling none: one vector per token), normalization, and 501s both ways."""
from __future__ import annotations

import base64
import math
import struct

import httpx
import openai
import pytest


@pytest.fixture(scope="module")
def mean_server(start_server, tiny_model):
    return start_server(tiny_model, "--embedding", "--pooling", "mean", "--metrics", "-b", "64")


def test_openai_embeddings(mean_server):
    client = openai.OpenAI(base_url=mean_server.api_url, api_key="x", max_retries=0)
    answer = client.embeddings.create(model="any", input=["hello world", "goodbye world",
                                                           "hello world"])
    vectors = [d.embedding for d in answer.data]
    assert [d.index for d in answer.data] == [0, 1, 2]
    assert len(vectors[0]) == 64                                  # the model's n_embd
    assert all(math.isclose(math.sqrt(sum(x * x for x in v)), 1.0, rel_tol=1e-6)
               for v in vectors)                                  # euclidean-normalized
    assert vectors[0] == vectors[2] and vectors[0] != vectors[1]
    assert answer.usage.prompt_tokens > 0
    b64 = client.embeddings.create(model="any", input="hello world", encoding_format="base64")
    raw = base64.b64decode(b64.data[0].embedding)                 # little-endian float32
    assert list(struct.unpack(f"<{len(raw) // 4}f", raw)) == pytest.approx(vectors[0], rel=1e-6)
    with httpx.Client(base_url=mean_server.base_url) as http:
        raw = http.post("/embedding", json={"content": "hello world", "embd_normalize": -1})
        assert raw.status_code == 200
        v = raw.json()[0]["embedding"][0]
        norm = math.sqrt(sum(x * x for x in v))
        assert norm != pytest.approx(1.0) and [x / norm for x in v] == pytest.approx(vectors[0])
        assert http.post("/completion", json={"prompt": "x"}).status_code == 501
        assert http.post("/v1/embeddings", json={"input": "x", "dimensions": 3}).status_code == 400
        assert http.post("/v1/embeddings", json={}).status_code == 400
        forms = http.post("/v1/embeddings", json={"input": [
            "hello world", {"prompt_string": "hello world"},
            {"content": [{"type": "text", "text": "hello "}, {"type": "text", "text": "world"}]},
            [12, 34, "world"]]}).json()["data"]
        for d in forms[:3]:            # f32 threads may differ in the last bits between calls
            assert d["embedding"] == pytest.approx(vectors[0], abs=1e-5)
        assert len(forms) == 4 and forms[3]["embedding"] != pytest.approx(vectors[0], abs=1e-3)
        one = http.post("/v1/embeddings", json={"input": [12, 34, "world"]}).json()["data"]
        assert len(one) == 1 and one[0]["embedding"] == pytest.approx(forms[3]["embedding"],
                                                                      abs=1e-5)
        for bad in ([], {"content": "x"}, {"content": [{"type": "image_url"}]}, [1.5]):
            assert http.post("/v1/embeddings", json={"input": bad}).status_code == 400, bad
        r = http.post("/v1/embeddings", json={"input": "word " * 100})   # > -b 64
        assert r.status_code == 400 and "too large" in r.json()["error"]["message"]
        metrics = http.get("/metrics").text
        assert "llamacpp:tokens_predicted_total 0" in metrics


def test_pooling_none_gives_one_vector_per_token(start_server, tiny_model):
    server = start_server(tiny_model, "--embedding", "--pooling", "none")
    with httpx.Client(base_url=server.base_url) as http:
        tokens = http.post("/tokenize", json={"content": "hello world",
                                              "add_special": True}).json()["tokens"]
        r = http.post("/embedding", json={"content": "hello world"})
        assert r.status_code == 200
        assert len(r.json()[0]["embedding"]) == len(tokens)
        r = http.post("/embeddings", json={"input": "hello world"})    # llama-server's shape too
        assert r.status_code == 200 and len(r.json()[0]["embedding"]) == len(tokens)
        r = http.post("/v1/embeddings", json={"input": "hello world"})
        assert r.status_code == 400 and "not OAI compatible" in r.json()["error"]["message"]


def test_without_embedding_the_routes_are_501(start_server, tiny_model):
    server = start_server(tiny_model)
    r = httpx.post(server.base_url + "/v1/embeddings", json={"input": "x"})
    assert r.status_code == 501 and r.json()["error"]["type"] == "not_supported_error"
