"""Token ids from a client are range-checked before llama.cpp sees them (runtime/server/
token_ids.py): an id past the vocabulary once killed the server with std::out_of_range in
token_to_piece. Every route that takes ids answers 400 naming the id and n_vocab, streamed or
not, and the server stays up."""
from __future__ import annotations

import json

import httpx
import pytest

from tests.runtime.server.error_shapes import error_of

BAD_IDS = [-1, 99999, 2**31, 2**31 - 1, 2**63, 2**64]     # n_vocab of tiny_model: 1621


@pytest.fixture(scope="module")
def server(start_server, tiny_model):
    return start_server(tiny_model)


@pytest.fixture(scope="module")
def n_vocab(server) -> int:
    # /detokenize's own message says it; the vocabulary of the synthetic model
    r = httpx.post(f"{server.base_url}/detokenize", json={"tokens": [10**6]}, timeout=30)
    return int(r.json()["error"]["message"].split("n_vocab ")[1].split(":")[0])


def _post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.base_url}{path}", content=json.dumps(body),
                      headers={"Content-Type": "application/json"}, timeout=60)


def _assert_names(err: dict, token: int, n_vocab: int) -> None:
    assert f"token id {token} " in err["message"], err
    assert f"n_vocab {n_vocab}" in err["message"], err


@pytest.mark.parametrize("token", BAD_IDS + ["n_vocab"])
@pytest.mark.parametrize("stream", [False, True])
def test_native_completion_refuses_ids_outside_the_vocabulary(server, n_vocab, token, stream):
    token = n_vocab if token == "n_vocab" else token
    for prompt in ([token], [5, token], [[5, token]], [[5], [token]], ["text", token]):
        if stream and isinstance(prompt[0], list):
            continue                  # several prompts are not streamed (a 400 of its own)
        r = _post(server, "/completion", {"prompt": prompt, "n_predict": 2, "stream": stream})
        _assert_names(error_of(r, "/completion"), token, n_vocab)
    server.assert_alive()
    assert httpx.get(f"{server.base_url}/health", timeout=10).status_code == 200


def test_every_route_taking_ids_checks_them(server, n_vocab):
    bad = n_vocab
    cases = [("/completion", {"prompt": "hi", "n_predict": 1, "logit_bias": [[bad, 1.0]]}),
             ("/completion", {"prompt": "hi", "n_predict": 1, "logit_bias": {str(bad): 1}}),
             ("/completions", {"prompt": [bad], "n_predict": 1}),
             ("/detokenize", {"tokens": [1, bad]}),
             ("/v1/completions", {"prompt": [bad], "max_tokens": 1}),
             ("/v1/completions", {"prompt": "hi", "max_tokens": 1,
                                  "logit_bias": {str(bad): 1}}),
             ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                       "max_tokens": 1, "logit_bias": {str(bad): 1}})]
    for path, body in cases:
        _assert_names(error_of(_post(server, path, body), path), bad, n_vocab)
    for path, body in [("/detokenize", {"tokens": [2**64]}),
                       ("/v1/completions", {"prompt": [2**64], "max_tokens": 1}),
                       ("/v1/completions", {"prompt": [-5], "max_tokens": 1})]:
        error_of(_post(server, path, body), path)
    # the ids at the edges of the vocabulary are fine
    ok = _post(server, "/detokenize", {"tokens": [0, n_vocab - 1]})
    assert ok.status_code == 200, ok.text
    ok = _post(server, "/completion", {"prompt": [0, n_vocab - 1], "n_predict": 1})
    assert ok.status_code == 200, ok.text
    server.assert_alive()


def test_n_probs_is_bounded(server):
    for n in (-1, 21, 2**64):
        error_of(_post(server, "/completion", {"prompt": "hi", "n_predict": 1, "n_probs": n}),
                 "/completion")
    r = _post(server, "/completion", {"prompt": "hi", "n_predict": 1, "n_probs": 20})
    assert r.status_code == 200 and len(r.json()["completion_probabilities"][0][
        "top_logprobs"]) == 20


def test_a_slot_file_with_ids_outside_the_vocabulary_is_refused(start_server, tiny_model,
                                                                  tmp_path):
    """A slot file (runtime/engine/slot_file.py: header, int32 ids, state) from another
    model, or edited (its checksum made to match), carries ids llama.cpp would index
    unchecked later."""
    import struct

    from runtime.engine import slot_file
    server = start_server(tiny_model, "--slot-save-path", str(tmp_path), "-c", "256")
    with httpx.Client(base_url=server.base_url, timeout=60) as http:
        assert http.post("/completion", json={"prompt": "the sea", "n_predict": 2}).is_success
        assert http.post("/slots/0?action=save", json={"filename": "s.bin"}).is_success
        raw = bytearray((tmp_path / "s.bin").read_bytes())
        n_tokens = slot_file.HEADER.unpack_from(raw)[3]
        assert n_tokens > 0
        struct.pack_into("<i", raw, slot_file.HEADER.size, 99999)     # the first id
        slot_file.seal(raw, n_tokens)
        (tmp_path / "bad.bin").write_bytes(bytes(raw))
        r = http.post("/slots/0?action=restore", json={"filename": "bad.bin"})
        err = error_of(r, "/slots/0")
        assert "token id 99999" in err["message"], err
        r = http.post("/completion", json={"prompt": "the sea", "n_predict": 2})
        assert r.status_code == 200 and r.json()["timings"]["cache_n"] == 0   # slot emptied
        assert http.post("/slots/0?action=restore", json={"filename": "s.bin"}).is_success
    server.assert_alive()


def test_embedding_inputs_are_checked(start_server, tiny_model, n_vocab):
    server = start_server(tiny_model, "--embedding", "--pooling", "mean")
    for path, key in (("/v1/embeddings", "input"), ("/embedding", "content")):
        for value in ([n_vocab], [[1, 2], [5, -1]], ["text", 2**64]):
            err = error_of(_post(server, path, {key: value}), path)
            assert "token id" in err["message"] and f"n_vocab {n_vocab}" in err["message"]
        assert _post(server, path, {key: [1, n_vocab - 1]}).status_code == 200
    server.assert_alive()
