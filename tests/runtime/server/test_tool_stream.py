"""ToolCallStream: content streams as it comes; only what could be a tool call is held."""
from __future__ import annotations

import json

from runtime.server.structured import ToolFormat
from runtime.server.tool_stream import ToolCallStream


def _feed(fmt: ToolFormat, pieces: list[str]) -> tuple[list[str], str, list]:
    stream = ToolCallStream(fmt)
    out = [stream.feed(p) for p in pieces]
    tail, calls = stream.finish()
    return out, tail, calls


def test_hermes_streams_content_and_holds_the_call():
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>'
    out, tail, calls = _feed(ToolFormat.HERMES, ["Let me ", "add. <tool", "_call>", call[11:]])
    assert out == ["Let me ", "add. ", "", ""]      # "<tool" waits: it may begin the marker
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("add", {"a": 1})]
    assert tail == ""


def test_hermes_a_false_start_is_content():
    out, tail, calls = _feed(ToolFormat.HERMES, ["a <to", "y> b"])
    assert out == ["a ", "<toy> b"] and tail == "" and calls == []
    out, tail, calls = _feed(ToolFormat.HERMES, ["x <tool_call>not json"])
    assert out == ["x "] and tail == "<tool_call>not json" and calls == []


def test_whole_answer_formats():
    out, tail, calls = _feed(ToolFormat.LLAMA3, [" ", "Hello", " there"])
    assert out == ["", " Hello", " there"] and tail == "" and calls == []
    out, tail, calls = _feed(ToolFormat.LLAMA3, ['{"name": "f", ', '"parameters": {}}'])
    assert out == ["", ""] and [c.name for c in calls] == ["f"] and tail == ""
    out, tail, calls = _feed(ToolFormat.MISTRAL,
                             ["[TOOL", '_CALLS][{"name": "g", "arguments": {}}]'])
    assert out == ["", ""] and [c.name for c in calls] == ["g"]
    out, tail, calls = _feed(ToolFormat.MISTRAL, ["[TOO", "THING]"])
    assert out == ["", ""] and tail == "[TOOTHING]" and calls == []
