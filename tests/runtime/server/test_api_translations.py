"""The Anthropic and Responses translations of a chat answer, without a server: a template's
thinking (which the synthetic model's ChatML template has not) becomes a thinking block /
reasoning item first, then the text, then the tool calls, in each API's order and shape."""
from __future__ import annotations

import pytest

from runtime.engine.sampling import SamplingParams
from runtime.engine.types import GenerationChunk
from runtime.server.anthropic.routes import message_of
from runtime.server.anthropic.stream import AnthropicEvents, stop_reason
from runtime.server.chat_stream import ChatFramer
from runtime.server.requests import Prepared
from runtime.server.responses.routes import output_of
from runtime.server.responses.stream import ResponsesEvents
from runtime.server.structured import ToolFormat

CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>'
PIECES = ["<think>pl", "an</think>", "The ", "sum: ", *CALL]


def _frames(pieces: list[str], finish: str = "stop") -> list[dict]:
    """What the chat path streams for these pieces of a thinking, tool-calling answer,
    with the usage frame (3 of 10 prompt tokens from the cache) at the end."""
    prep = Prepared("prompt", 10, SamplingParams(), tool_format=ToolFormat.HERMES,
                    thinking=False)
    framer = ChatFramer({"id": "chatcmpl-1"}, prep, timings=True)
    frames = list(framer.opening())
    for piece in pieces:
        frames += framer.chunk(0, GenerationChunk(piece, 1))
    frames += framer.chunk(0, GenerationChunk("", None, finish_reason=finish))
    return frames + [{"choices": [], "usage": {"completion_tokens": len(pieces)},
                      "timings": {"cache_n": 3}}]


def _anthropic(frames: list[dict]) -> list[dict]:
    events = AnthropicEvents("msg_1", "m", 10)
    out = events.opening()
    for frame in frames:
        out += events.feed(frame)
    return out + events.closing()


def test_anthropic_stream_orders_thinking_text_and_tool_use():
    events = _anthropic(_frames(PIECES))
    shape = [(e["type"], e.get("index"), (e.get("content_block") or e.get("delta") or {})
              .get("type")) for e in events]
    assert shape[0] == ("message_start", None, None)
    starts = [s for s in shape if s[0] == "content_block_start"]
    assert starts == [("content_block_start", 0, "thinking"), ("content_block_start", 1, "text"),
                      ("content_block_start", 2, "tool_use")]
    # a thinking block closes with its (empty) signature, each block before the next starts
    at = shape.index(("content_block_start", 1, "text"))
    assert shape[at - 2:at] == [("content_block_delta", 0, "signature_delta"),
                                ("content_block_stop", 0, None)]
    thinking = "".join(e["delta"].get("thinking", "") for e in events
                       if e.get("index") == 0 and e["type"] == "content_block_delta")
    text = "".join(e["delta"].get("text", "") for e in events
                   if e.get("index") == 1 and e["type"] == "content_block_delta")
    arguments = "".join(e["delta"]["partial_json"] for e in events
                        if e.get("index") == 2 and e["type"] == "content_block_delta")
    assert (thinking, text.strip(), arguments) == ("plan", "The sum:", '{"a": 1}')
    assert shape[-3:] == [("content_block_stop", 2, None), ("message_delta", None, None),
                          ("message_stop", None, None)]
    delta = events[-2]
    assert delta["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert delta["usage"] == {"input_tokens": 7, "cache_creation_input_tokens": 0,
                              "cache_read_input_tokens": 3, "output_tokens": len(PIECES)}


def test_stop_reasons():
    assert [stop_reason(f) for f in ("stop", "length", "tool_calls", None)] == [
        "end_turn", "max_tokens", "tool_use", "end_turn"]


ANSWER = {"id": "chatcmpl-1", "created": 1, "choices": [{"index": 0, "finish_reason": "tool_calls",
          "message": {"role": "assistant", "content": "The sum:", "reasoning_content": "plan",
                      "tool_calls": [{"id": "call_1", "type": "function",
                                      "function": {"name": "add", "arguments": '{"a": 1}'}}]}}],
          "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15,
                    "prompt_tokens_details": {"cached_tokens": 3}}}


def test_anthropic_message_of_a_chat_answer():
    message = message_of(ANSWER, "m")
    assert message["content"] == [
        {"type": "thinking", "thinking": "plan", "signature": ""},
        {"type": "text", "text": "The sum:"},
        {"type": "tool_use", "id": "call_1", "name": "add", "input": {"a": 1}}]
    assert message["stop_reason"] == "tool_use" and message["stop_sequence"] is None
    assert message["usage"] == {"input_tokens": 7, "cache_creation_input_tokens": 0,
                                "cache_read_input_tokens": 3, "output_tokens": 5}


def test_responses_output_of_a_chat_answer():
    output = output_of(ANSWER)
    assert [item["type"] for item in output] == ["reasoning", "message", "function_call"]
    assert output[0]["content"] == [{"type": "reasoning_text", "text": "plan"}]
    assert output[1]["content"][0]["text"] == "The sum:"
    assert (output[2]["call_id"], output[2]["name"], output[2]["arguments"]) == (
        "call_1", "add", '{"a": 1}')


def _responses(frames: list[dict]) -> list[dict]:
    events = ResponsesEvents("resp_1", {"model": "m"}, 10)
    out = events.opening()
    for frame in frames:
        out += events.feed(frame)
    return out + events.closing()


def test_responses_stream_orders_reasoning_message_and_function_call():
    events = _responses(_frames(PIECES))
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    added = [e["item"]["type"] for e in events if e["type"] == "response.output_item.added"]
    assert added == ["reasoning", "message", "function_call"]
    done = [e["output_index"] for e in events if e["type"] == "response.output_item.done"]
    assert done == [0, 1, 2]
    completed = events[-1]
    assert completed["type"] == "response.completed"
    output = completed["response"]["output"]
    assert output[0]["content"][0]["text"] == "plan"
    assert output[1]["content"][0]["text"].strip() == "The sum:"
    assert output[2]["arguments"] == '{"a": 1}' and output[2]["name"] == "add"
    assert completed["response"]["usage"]["input_tokens_details"] == {"cached_tokens": 3}
    assert completed["response"]["status"] == "completed"


def test_responses_stream_of_an_empty_cut_answer_still_has_a_message():
    events = _responses(_frames([], finish="length"))
    completed = events[-1]["response"]
    assert completed["status"] == "incomplete"
    assert completed["incomplete_details"] == {"reason": "max_output_tokens"}
    assert [item["type"] for item in completed["output"]] == ["message"]
    assert completed["output"][0]["content"][0]["text"] == ""


def test_anthropic_request_as_chat_messages():
    from runtime.server.anthropic.routes import MessagesRequest, to_chat_request

    body = MessagesRequest.model_validate({"max_tokens": 8, "system": [
        {"type": "text", "text": "Be terse."}], "messages": [
        {"role": "user", "content": "Fix it"},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "look first", "signature": "x"},
            {"type": "tool_use", "id": "call_1", "name": "ls", "input": {"path": "."}}]},
        {"role": "user", "content": [
            {"type": "text", "text": "here:"},
            {"type": "tool_result", "tool_use_id": "call_1", "is_error": True,
             "content": [{"type": "text", "text": "denied"}]}]}],
        "tools": [{"name": "ls", "input_schema": {"type": "object"}}],
        "tool_choice": {"type": "any"}, "thinking": {"type": "disabled"}})
    chat = to_chat_request(body)
    assert chat.message_dicts() == [
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": "Fix it"},
        {"role": "assistant", "content": "", "reasoning_content": "look first", "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "ls", "arguments": '{"path": "."}'}}]},
        {"role": "tool", "content": "Error: denied", "tool_call_id": "call_1"},
        {"role": "user", "content": "here:"}]
    assert chat.tool_choice_value() == "required" and chat.max_tokens == 8
    assert chat.chat_template_kwargs == {"enable_thinking": False}


def test_responses_input_items_as_chat_messages():
    from runtime.server.responses.routes import ResponsesRequest, to_chat_request

    body = ResponsesRequest.model_validate({"instructions": "Be terse.", "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "Fix it"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [],
         "content": [{"type": "reasoning_text", "text": "look first"}]},
        {"type": "function_call", "call_id": "call_1", "name": "ls", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "a.py"},
        {"type": "message", "role": "assistant",
         "content": [{"type": "output_text", "text": "Done."}]},
        {"role": "user", "content": "Thanks"}], "max_output_tokens": 5,
        "tools": [{"type": "function", "name": "ls", "parameters": {"type": "object"}}],
        "tool_choice": {"type": "function", "name": "ls"}})
    chat = to_chat_request(body, has_projector=False)
    assert chat.message_dicts() == [
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": "Fix it"},
        {"role": "assistant", "content": "", "reasoning_content": "look first", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "ls", "arguments": "{}"}}]},
        {"role": "tool", "content": "a.py", "tool_call_id": "call_1"},
        {"role": "assistant", "content": "Done."},
        {"role": "user", "content": "Thanks"}]
    assert chat.tool_choice_value() == {"type": "function", "function": {"name": "ls"}}
    assert chat.max_tokens == 5


def test_responses_images_as_chat_image_parts_in_order():
    from runtime.server.errors import APIError
    from runtime.server.responses.routes import ResponsesRequest, to_chat_request
    from runtime.server.schemas import MEDIA_MARKER

    url = "data:image/png;base64,iVBORw0KGgo="
    body = ResponsesRequest.model_validate({"instructions": "Look.", "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "Compare"},
                                     {"type": "input_image", "image_url": url},
                                     {"type": "input_text", "text": "with"}]},
        {"type": "function_call", "call_id": "c", "name": "shot", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c", "output": [
            {"type": "input_image", "image_url": url, "detail": "low"}]}]})
    chat = to_chat_request(body, has_projector=True)
    assert [m["content"] for m in chat.message_dicts()] == [
        "Look.", f"Compare\n{MEDIA_MARKER}\nwith", "", MEDIA_MARKER]
    assert chat.messages[3].content[0].url == url and chat.messages[3].content[0].detail == \
        "low"
    with pytest.raises(APIError) as err:
        to_chat_request(body, has_projector=False)
    assert err.value.param == "input.0.content.1" and "--mmproj" in err.value.message


def test_an_error_after_the_headers_ends_the_stream_with_the_apis_error_event():
    import anyio

    from runtime.server.errors import APIError, anthropic_error_body
    from runtime.server.translated_stream import translated

    async def frames_then_shutdown():
        for frame in _frames(["Hel", "lo"])[:3]:
            yield frame
        raise APIError(503, "The server is shutting down; the answer was cut short.",
                       code="server_shutdown")

    async def collect(translator, error_event) -> list[dict]:
        return [e async for e in translated(frames_then_shutdown(), translator, error_event)]

    events = anyio.run(collect, AnthropicEvents("msg_1", "m", 10), anthropic_error_body)
    assert [e["type"] for e in events] == ["message_start", "content_block_start",
                                           "content_block_delta", "content_block_delta",
                                           "error"]
    assert events[-1]["error"] == {
        "type": "overloaded_error",
        "message": "The server is shutting down; the answer was cut short."}
    responses = ResponsesEvents("resp_1", {"model": "m"}, 10)
    events = anyio.run(collect, responses, lambda err: responses.event(
        "error", code=err.code, message=err.message, param=err.param))
    assert events[-1]["type"] == "error" and events[-1]["code"] == "server_shutdown"
    assert events[-1]["sequence_number"] == len(events) - 1
