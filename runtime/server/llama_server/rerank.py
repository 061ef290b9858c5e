"""Reranking, as llama-server serves it with ``--reranking`` (a context with rank pooling):
``POST /rerank`` (and ``/reranking``, ``/v1/rerank``, ``/v1/reranking``).

Jina's shape: ``{"query", "documents": [...], "top_n"}`` answers
``{"model", "object": "list", "usage", "results": [{"index", "relevance_score"}]}``, best
first; TEI's: ``"texts"`` instead of ``"documents"`` answers ``[{"index", "score"}]`` (with
``"text"`` when ``return_text``). Each (query, document) is one sequence, scored alone: the
model's rerank prompt (``tokenizer.chat_template.rerank``, ``{query}`` and ``{document}``
replaced) when it has one, else llama-server's ``[BOS]query[EOS][SEP]doc[EOS]`` with each
special token where the vocabulary adds it (server-common.cpp, ``format_prompt_rerank``).
"""
from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from runtime.engine.embedding import rank_score, ranks
from runtime.server.errors import APIError
from runtime.server.jobs import run_pooling, side_work
from runtime.server.requests import json_object

router = APIRouter()

NOT_RERANKING = "This server does not support reranking. Start it with `--reranking`"


def rerank_tokens(engine: Any, query: str, document: str) -> list[int]:
    """The prompt llama-server scores for one document (format_prompt_rerank)."""
    from runtime.native.llama_lib import bindings  # noqa: PLC0415

    ll, vocab = bindings(), engine.vocab_ptr
    raw = ll.llama_model_chat_template(engine.model_ptr, b"rerank")
    if raw:
        prompt = raw.decode("utf-8").replace("{query}", query).replace("{document}", document)
        return engine.tokenize(prompt, add_special=False)
    eos = ll.llama_vocab_eos(vocab)
    if eos < 0:
        eos = ll.llama_vocab_sep(vocab)
    tokens = [ll.llama_vocab_bos(vocab)] if ll.llama_vocab_get_add_bos(vocab) else []
    tokens += engine.tokenize(query, add_special=False)
    if ll.llama_vocab_get_add_eos(vocab):
        tokens.append(eos)
    if ll.llama_vocab_get_add_sep(vocab):
        tokens.append(ll.llama_vocab_sep(vocab))
    tokens += engine.tokenize(document, add_special=False)
    if ll.llama_vocab_get_add_eos(vocab):
        tokens.append(eos)
    return tokens


def _request(body: dict) -> tuple[str, list[str], int | None, bool, bool]:
    """(query, documents, top_n, TEI's shape?, return_text); a 400 as llama-server's."""
    tei = "texts" in body
    if "query" not in body:
        raise APIError(400, '"query" must be provided', code="invalid_value", param="query")
    query = body.pop("query")
    if not isinstance(query, str):
        raise APIError(400, '"query" must be a string', code="invalid_value", param="query")
    documents = body.pop("documents", None)
    texts = body.pop("texts", None)
    documents = documents if documents is not None else texts
    if not isinstance(documents, list) or not documents \
            or not all(isinstance(d, str) for d in documents):
        raise APIError(400, '"documents" must be a non-empty string array', code="invalid_value",
                       param="documents")
    top_n = body.pop("top_n", None)
    if top_n is not None and (isinstance(top_n, bool) or not isinstance(top_n, int)
                              or top_n < 0):
        raise APIError(400, '"top_n" must be a non-negative integer', code="invalid_value",
                       param="top_n")
    return_text = body.pop("return_text", False)
    if not isinstance(return_text, bool):
        raise APIError(400, '"return_text" must be a boolean', code="invalid_value",
                       param="return_text")
    if return_text and not tei:     # llama-server returns the text in TEI's shape only
        raise APIError(400, '"return_text" is TEI\'s: send the documents as "texts"',
                       code="invalid_value", param="return_text")
    return query, documents, top_n, tei, return_text


@router.post("/rerank")
@router.post("/reranking")
@router.post("/v1/rerank")
@router.post("/v1/reranking")
async def rerank(request: Request) -> JSONResponse:
    """Score each document against the query; best first, ``top_n`` of them."""
    state = request.app.state
    if not state.settings.embedding:
        raise APIError(501, NOT_RERANKING, code="not_supported",
                       error_type="not_supported_error")
    engine = state.host.engine()
    if not ranks(engine):              # --embedding with another pooling
        raise APIError(501, NOT_RERANKING, code="not_supported",
                       error_type="not_supported_error")
    body = await json_object(request)
    query, documents, top_n, tei, return_text = _request(body)
    model = body.pop("model", None)
    if body:
        name = sorted(body)[0]
        raise APIError(400, f"{name}: this field is not supported by this server",
                       code="unsupported_parameter", param=name)
    prompts = await side_work(request, lambda: [rerank_tokens(engine, query, d)
                                                for d in documents])
    scores = await run_pooling(state, prompts, lambda t: rank_score(engine, t), "documents")
    label = "score" if tei else "relevance_score"
    results = [{"index": i, label: s} | ({"text": documents[i]} if return_text else {})
               for i, s in enumerate(scores)]
    results.sort(key=lambda r: r[label], reverse=True)    # stable: ties keep their order
    results = results[:len(results) if top_n is None else top_n]
    if tei:
        return JSONResponse(results)
    n = sum(len(p) for p in prompts)
    return JSONResponse({"model": model if isinstance(model, str) else state.host.model_id,
                         "object": "list", "usage": {"prompt_tokens": n, "total_tokens": n},
                         "results": results})
