"""``serve --reranking``: llama-server's /rerank (Jina's and TEI's shapes) on a synthetic
reranker (pooling rank, a rerank prompt) and on a model without a rerank prompt (llama-server's
``[BOS]query[EOS][SEP]doc[EOS]``, each special token where the vocabulary adds it); the 400s of
bad requests and the 501 of a server started without --reranking."""
from __future__ import annotations

import httpx
import pytest

from gguf_tools.synth_adapters import RERANK_TEMPLATE, write_synthetic_reranker

DOCS = ["a machine is a system that uses power", "learning is the process of study",
        "machine learning is a field of study in science", "the city has a river and a tree"]
QUERY = "machine learning is"
PATHS = ("/rerank", "/reranking", "/v1/rerank", "/v1/reranking")


@pytest.fixture(scope="module")
def reranker(tmp_path_factory, tiny_spec):
    return write_synthetic_reranker(tmp_path_factory.mktemp("rerank") / "reranker.gguf",
                                    tiny_spec)


@pytest.fixture(scope="module")
def http(start_server, reranker):
    server = start_server(reranker, "--reranking", "--metrics")
    with httpx.Client(base_url=server.base_url, timeout=60) as client:
        yield client


def n_tokens(http: httpx.Client, text: str, add_special: bool) -> int:
    return len(http.post("/tokenize", json={"content": text,
                                            "add_special": add_special}).json()["tokens"])


def test_rerank_scores_every_document_best_first(http):
    r = http.post("/rerank", json={"query": QUERY, "documents": DOCS, "model": "mine"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["model"] == "mine" and body["object"] == "list"
    results = body["results"]
    assert sorted(x["index"] for x in results) == [0, 1, 2, 3]
    scores = [x["relevance_score"] for x in results]
    assert scores == sorted(scores, reverse=True) and len(set(scores)) == 4
    # the model's rerank prompt, {query} and {document} replaced, tokenized without BOS
    expected = sum(n_tokens(http, RERANK_TEMPLATE.replace("{query}", QUERY)
                            .replace("{document}", d), False) for d in DOCS)
    assert body["usage"] == {"prompt_tokens": expected, "total_tokens": expected}
    for path in PATHS:                   # every alias, the same scores: one sequence each
        again = http.post(path, json={"query": QUERY, "documents": DOCS}).json()["results"]
        assert [x["index"] for x in again] == [x["index"] for x in results]
        assert [x["relevance_score"] for x in again] == pytest.approx(scores, abs=1e-5)
    alone = http.post("/rerank", json={"query": QUERY, "documents": [DOCS[2]]}).json()
    assert alone["results"][0]["relevance_score"] == pytest.approx(
        next(x["relevance_score"] for x in results if x["index"] == 2), abs=1e-5)
    assert "llamacpp:prompt_tokens_total" in http.get("/metrics").text


@pytest.mark.parametrize("top_n,expected", [(None, 4), (0, 0), (2, 2), (4, 4), (99, 4)])
def test_top_n(http, top_n, expected):
    body = {"query": QUERY, "documents": DOCS} | ({} if top_n is None else {"top_n": top_n})
    results = http.post("/rerank", json=body).json()["results"]
    full = http.post("/rerank", json={"query": QUERY, "documents": DOCS}).json()["results"]
    assert [x["index"] for x in results] == [x["index"] for x in full][:expected]


def test_tei_shape_with_texts(http):
    r = http.post("/rerank", json={"query": QUERY, "texts": DOCS, "top_n": 3,
                                   "return_text": True})
    assert r.status_code == 200, r.text
    results = r.json()
    assert isinstance(results, list) and len(results) == 3
    assert all(set(x) == {"index", "score", "text"} and x["text"] == DOCS[x["index"]]
               for x in results)
    plain = http.post("/v1/rerank", json={"query": QUERY, "texts": DOCS}).json()
    assert all(set(x) == {"index", "score"} for x in plain) and len(plain) == 4


@pytest.mark.parametrize("body,param", [
    ({"query": QUERY, "documents": []}, "documents"),
    ({"query": QUERY, "documents": None}, "documents"),
    ({"query": QUERY, "documents": 123}, "documents"),
    ({"query": QUERY, "documents": [1, 2, 3]}, "documents"),
    ({"query": QUERY}, "documents"),
    ({"documents": DOCS}, "query"),
    ({"query": 5, "documents": DOCS}, "query"),
    ({"query": QUERY, "documents": DOCS, "top_n": -1}, "top_n"),
    ({"query": QUERY, "documents": DOCS, "top_n": "2"}, "top_n"),
    ({"query": QUERY, "documents": DOCS, "return_text": True}, "return_text"),
    ({"query": QUERY, "documents": DOCS, "return_documents": True}, "return_documents"),
])
def test_bad_requests_are_400_naming_the_field(http, body, param):
    r = http.post("/rerank", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_a_ranking_server_gives_no_embeddings_and_no_completions(http):
    r = http.post("/v1/embeddings", json={"input": "hello"})
    assert r.status_code == 400 and "/rerank" in r.json()["error"]["message"]
    assert http.post("/completion", json={"prompt": "x"}).status_code == 501


def test_without_a_rerank_prompt_llama_servers_form(start_server, tiny_model):
    # the synthetic vocabulary adds BOS only: [BOS] query doc, as format_prompt_rerank
    server = start_server(tiny_model, "--rerank")
    with httpx.Client(base_url=server.base_url, timeout=60) as http:
        body = http.post("/rerank", json={"query": QUERY, "documents": DOCS[:2]}).json()
        expected = sum(1 + n_tokens(http, QUERY, False) + n_tokens(http, d, False)
                       for d in DOCS[:2])
        assert body["usage"]["prompt_tokens"] == expected
        assert len(body["results"]) == 2


def test_without_reranking_the_routes_are_llama_servers_501(start_server, tiny_model):
    server = start_server(tiny_model, "--embedding", "--pooling", "mean")
    with httpx.Client(base_url=server.base_url, timeout=60) as http:
        for path in PATHS:
            r = http.post(path, json={"query": QUERY, "documents": DOCS})
            assert r.status_code == 501
            assert r.json()["error"]["message"] == ("This server does not support reranking. "
                                                    "Start it with `--reranking`")
