"""What the server does not serve answers so, on the real server: llama-server's routes for
router mode and audio are 501 naming the feature (built-in tools: llama-server's 403, in
test_llama_server_parity.py); media content parts and multimodal_data are 400 naming the
projector."""
from __future__ import annotations

import httpx
import pytest

from runtime.server.llama_server.unsupported import UNSUPPORTED


@pytest.fixture(scope="module")
def http(start_server, tiny_model):
    server = start_server(tiny_model)
    with httpx.Client(base_url=server.base_url, timeout=30) as client:
        yield client


def test_every_unserved_route_is_501_naming_the_feature(http):
    for (method, path), what in UNSUPPORTED.items():
        r = http.request(method, path, json={})
        assert r.status_code == 501, (method, path, r.text)
        error = r.json()["error"]
        assert error["type"] == "not_supported_error" and error["message"] == f"{what}."
    assert "router mode" in http.post("/models/load", json={"model": "x"}).text
    assert http.get("/models").status_code == 200          # the served ones stay served



@pytest.mark.parametrize("part", [
    {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
    {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
])
def test_media_parts_are_400_naming_the_projector(http, part):
    r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is this?"}, part]}]})
    assert r.status_code == 400
    assert "multimodal projector" in r.json()["error"]["message"]
    r = http.post("/completion", json={"prompt": {"prompt_string": "x <__media__>",
                                                  "multimodal_data": ["AAAA"]}})
    assert r.status_code == 400 and "multimodal projector" in r.json()["error"]["message"]
    assert "--mmproj" in r.json()["error"]["message"]


def test_an_image_without_a_projector_names_the_flag_in_each_shape(http):
    """The server was started without --mmproj: images are a 400 saying what is missing."""
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is this?"}, image]}]})
    assert r.status_code == 400 and "--mmproj" in r.json()["error"]["message"]
    assert r.json()["error"]["param"] == "messages.0.content.1"
    r = http.post("/v1/messages", json={"max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                     "data": "AAAA"}}]}]})
    assert r.status_code == 400 and r.json()["type"] == "error"
    assert "--mmproj" in r.json()["error"]["message"]
    caps = http.get("/v1/models").json()["data"][0]["capabilities"]
    assert caps == ["completion"] and http.get("/props").json()["modalities"]["vision"] is False
