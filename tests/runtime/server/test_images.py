"""Images through a multimodal projector (``serve --mmproj``), on the real server with the
synthetic model and the synthetic mmproj (gguf_tools/synth_mmproj.py: a LLaVA-style
projector, 4 image tokens per image): OpenAI ``image_url`` parts, Responses ``input_image``
parts, Anthropic ``image`` blocks, llama-server's ``multimodal_data``, in one slot and in two
(-np 2: the batch scheduler). The answers mean nothing; what is checked is that they are answers, that the same
request gives the same greedy text, that a different image is evaluated again from where it
starts (no KV shared across images), and that bad images are 400s in each route's shape."""
from __future__ import annotations

import base64
import struct
import zlib

import anthropic
import httpx
import openai
import pytest

from gguf_tools.synth_mmproj import MmprojSpec, write_synthetic_mmproj

QUESTION = "What is in this picture?"


def png(seed: int, size: int = 16) -> bytes:
    """A real RGB PNG of ``size`` x ``size`` pixels, its pattern set by ``seed``."""
    rows = b"".join(b"\x00" + bytes((x * 37 + y * 11 + seed * 101) % 256
                                    for x in range(size * 3)) for y in range(size))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + \
            struct.pack(">I", zlib.crc32(kind + data))
    header = struct.pack(">IIBBBBB", size, size, 8, 2, 0, 0, 0)   # 8-bit RGB
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(rows))
            + chunk(b"IEND", b""))


A, B = (base64.b64encode(png(seed)).decode() for seed in (1, 2))


def image_part(data: str) -> dict:
    return {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{data}"}}


@pytest.fixture(scope="module")
def mmproj(tmp_path_factory, tiny_spec):
    return write_synthetic_mmproj(tmp_path_factory.mktemp("mmproj") / "mmproj.gguf",
                                  MmprojSpec(text_embd=tiny_spec.embd))


@pytest.fixture(scope="module", params=[(), ("-np", "2")], ids=["one-slot", "two-slots"])
def server(request, start_server, tiny_model, mmproj, tmp_path_factory):
    slots = tmp_path_factory.mktemp("slots")
    return start_server(tiny_model, "--mmproj", str(mmproj), "--slot-save-path", str(slots),
                        *request.param)


def chat(server, data: str, **extra) -> dict:
    r = httpx.post(f"{server.api_url}/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": [image_part(data),
                                                  {"type": "text", "text": QUESTION}]}],
        "max_tokens": 8, "temperature": 0, **extra})
    assert r.status_code == 200, r.text
    return r.json()


def test_an_image_is_answered_the_same_each_time(server):
    client = openai.OpenAI(base_url=server.api_url, api_key="none")
    messages = [{"role": "user", "content": [image_part(A), {"type": "text", "text": QUESTION}]}]
    first = client.chat.completions.create(model="any", messages=messages, max_tokens=8,
                                           temperature=0)
    again = client.chat.completions.create(model="any", messages=messages, max_tokens=8,
                                           temperature=0)
    assert first.choices[0].message.content
    assert again.choices[0].message.content == first.choices[0].message.content
    text_only = client.chat.completions.create(model="any", max_tokens=1, messages=[
        {"role": "user", "content": [{"type": "text", "text": "\n" + QUESTION}]}])
    # the image's 4 embeddings stand where its marker's text tokens would be
    assert first.usage.prompt_tokens > text_only.usage.prompt_tokens - 2


def test_a_different_image_shares_no_cached_prefix(server):
    first_a = chat(server, A)
    after_a = chat(server, B)                        # the KV holds A's prompt
    alone = chat(server, B, cache_prompt=False)      # the whole prompt evaluated afresh
    assert after_a["choices"][0]["message"]["content"] == \
        alone["choices"][0]["message"]["content"]
    assert after_a["choices"][0]["message"]["content"] != \
        first_a["choices"][0]["message"]["content"]      # the image matters to the answer
    # B after A was evaluated from B's start: only the template's text before it was reused
    n_prompt = after_a["usage"]["prompt_tokens"]
    assert 4 < after_a["timings"]["prompt_n"] < n_prompt == alone["timings"]["prompt_n"]
    again = chat(server, B)
    assert again["timings"]["prompt_n"] == 1          # the same image: all but the last token
    assert again["choices"][0]["message"]["content"] == alone["choices"][0]["message"]["content"]


def test_a_slot_holding_an_image_is_not_saved_to_a_file(server):
    chat(server, A, id_slot=0)
    r = httpx.post(f"{server.base_url}/slots/0?action=save", json={"filename": "a.bin"})
    assert r.status_code == 400 and "image" in r.json()["error"]["message"], r.text
    chat(server, B, id_slot=0)                           # the slot serves on


def test_anthropic_image_blocks_answer_as_the_chat_route(server):
    client = anthropic.Anthropic(base_url=server.base_url, api_key="none")
    message = client.messages.create(model="any", max_tokens=8, extra_body={"temperature": 0},
                                     messages=[
        {"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": A}},
            {"type": "text", "text": QUESTION}]}])
    answer = chat(server, A)
    assert message.content[0].text == answer["choices"][0]["message"]["content"]
    counted = client.messages.count_tokens(model="any", messages=[{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": A}},
        {"type": "text", "text": QUESTION}]}])
    assert counted.input_tokens == answer["usage"]["prompt_tokens"]   # the image's 4 included


def test_responses_input_image_answers_as_the_chat_route(server):
    client = openai.OpenAI(base_url=server.api_url, api_key="none")
    content = [{"type": "input_image", "image_url": f"data:image/png;base64,{A}"},
               {"type": "input_text", "text": QUESTION}]
    response = client.responses.create(model="any", max_output_tokens=8, temperature=0,
                                       input=[{"role": "user", "content": content}])
    answer = chat(server, A)
    assert response.output_text == answer["choices"][0]["message"]["content"]
    assert response.usage.input_tokens == answer["usage"]["prompt_tokens"]  # the image's 4 too
    counted = httpx.post(f"{server.api_url}/responses/input_tokens", json={
        "input": [{"role": "user", "content": content}]}).json()
    assert counted["input_tokens"] == answer["usage"]["prompt_tokens"]
    other = client.responses.create(model="any", max_output_tokens=8, temperature=0, input=[
        {"role": "user", "content": [content[0] | {"image_url": f"data:image/png;base64,{B}"},
                                     content[1]]}])
    assert other.output_text == chat(server, B)["choices"][0]["message"]["content"]


@pytest.mark.parametrize("part, param", [
    ({"image_url": "data:image/png;base64,!!!"}, "input.1.content.0.image_url"),
    ({"image_url": "https://example.com/cat.png"}, "input.1.content.0.image_url"),
    ({"file_id": "file-123"}, "input.1.content.0.file_id"),
    ({}, "input.1.content.0.image_url"),
    ({"image_url": f"data:image/png;base64,{base64.b64encode(b'no pixels').decode()}"},
     "messages"),
])
def test_a_bad_responses_image_is_a_400_naming_its_part(server, part, param):
    with pytest.raises(openai.BadRequestError) as err:
        openai.OpenAI(base_url=server.api_url, api_key="none").responses.create(
            model="any", max_output_tokens=4, input=[
                {"role": "developer", "content": "Answer briefly."},
                {"role": "user", "content": [{"type": "input_image", **part}]}])
    assert err.value.body["type"] == "invalid_request_error"
    assert err.value.body["param"].startswith(param), err.value.body


def test_a_tool_result_holding_an_image_answers_alike_in_each_api(server):
    """An image a tool returned (a screenshot, a file read): Anthropic ``tool_result`` image
    blocks, Responses ``function_call_output`` input_image parts and a chat ``tool`` message's
    image_url part are one prompt, so one greedy answer."""
    call = {"id": "call_1", "type": "function",
            "function": {"name": "read", "arguments": '{"file": "a.png"}'}}
    chat_answer = httpx.post(f"{server.api_url}/chat/completions", timeout=60, json={
        "max_tokens": 8, "temperature": 0, "messages": [
            {"role": "user", "content": QUESTION},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": [
                {"type": "text", "text": "File: a.png"}, image_part(A)]}]}).json()
    text = chat_answer["choices"][0]["message"]["content"]
    message = anthropic.Anthropic(base_url=server.base_url, api_key="none").messages.create(
        model="any", max_tokens=8, extra_body={"temperature": 0}, messages=[
            {"role": "user", "content": QUESTION},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "call_1",
                                               "name": "read", "input": {"file": "a.png"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "call_1",
                                          "content": [
                {"type": "text", "text": "File: a.png"},
                {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                             "data": A}}]}]}])
    response = openai.OpenAI(base_url=server.api_url, api_key="none").responses.create(
        model="any", max_output_tokens=8, temperature=0, input=[
            {"role": "user", "content": QUESTION},
            {"type": "function_call", "call_id": "call_1", "name": "read",
             "arguments": '{"file": "a.png"}'},
            {"type": "function_call_output", "call_id": "call_1", "output": [
                {"type": "input_text", "text": "File: a.png"},
                {"type": "input_image", "image_url": f"data:image/png;base64,{A}"}]}])
    assert message.content[0].text == text and response.output_text == text
    anthropic_prompt = message.usage.input_tokens + message.usage.cache_read_input_tokens
    assert anthropic_prompt == response.usage.input_tokens == \
        chat_answer["usage"]["prompt_tokens"]


def test_a_models_dir_model_with_an_mmproj_file_takes_images(start_server, tiny_model, mmproj,
                                                            server, tmp_path_factory):
    """Router mode (llama-server's --models-dir rule): a subdirectory's file named mmproj* is
    its model's projector; a model without one refuses images naming the flag."""
    root = tmp_path_factory.mktemp("models")
    (root / "seeing").mkdir()
    (root / "seeing" / "model-Q8.gguf").symlink_to(tiny_model)
    (root / "seeing" / "mmproj-model-f16.gguf").symlink_to(mmproj)
    (root / "blind.gguf").symlink_to(tiny_model)
    router = start_server(None, "--models-dir", str(root))
    listed = {m["id"]: m for m in httpx.get(f"{router.api_url}/models").json()["data"]}
    assert listed["seeing"]["architecture"]["input_modalities"] == ["text", "image"]
    assert listed["blind"]["architecture"]["input_modalities"] == ["text"]
    body = {"messages": [{"role": "user", "content": [image_part(A), {"type": "text",
                                                                      "text": QUESTION}]}],
            "max_tokens": 8, "temperature": 0}
    r = httpx.post(f"{router.api_url}/chat/completions", timeout=120,
                   json=body | {"model": "seeing"})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == \
        chat(server, A)["choices"][0]["message"]["content"]
    r = httpx.post(f"{router.api_url}/chat/completions", timeout=120,
                   json=body | {"model": "blind"})
    assert r.status_code == 400 and "--mmproj" in r.json()["error"]["message"], r.text


def test_completion_takes_multimodal_data(server):
    def complete(data: str) -> dict:
        r = httpx.post(f"{server.base_url}/completion", timeout=60, json={
            "prompt": {"prompt_string": f"Look: <__media__> {QUESTION}",
                       "multimodal_data": [data]}, "n_predict": 8, "temperature": 0})
        assert r.status_code == 200, r.text
        return r.json()
    first, again = complete(A), complete(A)
    assert first["content"] and again["content"] == first["content"]
    assert complete(B)["content"] != first["content"]


def test_capabilities_say_multimodal(server):
    props = httpx.get(f"{server.base_url}/props").json()
    assert props["modalities"]["vision"] is True and props["media_marker"] == "<__media__>"
    models = httpx.get(f"{server.api_url}/models").json()
    assert "multimodal" in models["data"][0]["capabilities"]
    assert "multimodal" in models["models"][0]["capabilities"]


BROKEN = [("not base64", "!!!"),
          ("not an image", base64.b64encode(b"just some text, not pixels").decode())]


@pytest.mark.parametrize("what, data", BROKEN, ids=[w for w, _ in BROKEN])
def test_a_broken_image_is_a_400_in_each_routes_shape(server, what, data):
    with pytest.raises(openai.BadRequestError) as err:
        openai.OpenAI(base_url=server.api_url, api_key="none").chat.completions.create(
            model="any", max_tokens=4, messages=[{"role": "user", "content": [
                image_part(data), {"type": "text", "text": QUESTION}]}])
    assert err.value.body["code"] == "invalid_value" and "messages" in err.value.body["param"]
    with pytest.raises(anthropic.BadRequestError) as aerr:
        anthropic.Anthropic(base_url=server.base_url, api_key="none").messages.create(
            model="any", max_tokens=4, messages=[{"role": "user", "content": [
                {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                             "data": data}}]}])
    assert aerr.value.body["type"] == "error"
    assert aerr.value.body["error"]["type"] == "invalid_request_error"
    r = httpx.post(f"{server.base_url}/completion", json={
        "prompt": {"prompt_string": "x <__media__> y", "multimodal_data": [data]}})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    assert "multimodal_data" in r.json()["error"]["message"] or "image" in \
        r.json()["error"]["message"]


@pytest.mark.parametrize("body, words", [
    ({"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}]}]},
     "fetches no URL"),
    ({"messages": [{"role": "user", "content": [image_part(A), image_part(B), {
        "type": "text", "text": "<__media__>"}]}]}, "marker"),
])
def test_image_urls_and_stray_markers_are_400(server, body, words):
    r = httpx.post(f"{server.api_url}/chat/completions", json=body | {"max_tokens": 2})
    assert r.status_code == 400 and words in r.json()["error"]["message"], r.text


def test_serve_refuses_a_projector_it_cannot_use_in_one_line(tmp_path, tiny_model):
    """Before or at the load, never a traceback: a missing file, a projector of another
    width than the model's, --mmproj for every model of router mode."""
    from tests.runtime.server.test_serve_command import _assert_one_line_error, _serve

    _assert_one_line_error(_serve("-m", str(tiny_model), "--mmproj", str(tmp_path / "no.gguf"),
                                  "--port", "0"), "no.gguf: no such file")
    wide = write_synthetic_mmproj(tmp_path / "wide.gguf", text_embd=96)   # the model has 64
    result = _serve("-m", str(tiny_model), "--mmproj", str(wide), "--port", "0")
    _assert_one_line_error(result, f"--mmproj {wide}: llama.cpp cannot load it")
    assert "n_embd = 64" in result.stderr and "\nhint" not in result.stderr   # llama.cpp's why
    models = tmp_path / "models"
    models.mkdir()
    (models / "alpha.gguf").symlink_to(tiny_model)
    _assert_one_line_error(_serve("--models-dir", str(models), "--mmproj", str(wide),
                                  "--port", "0"), "per model: mmproj = FILE")
