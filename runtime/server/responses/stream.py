"""A streamed chat answer's chunks (chat_stream.py's frames) as OpenAI Responses events:
``response.created``, ``response.in_progress``, then per output item (a reasoning item, a
message, one ``function_call`` per call, in the order they come) its ``output_item.added``,
deltas and ``.done`` events, then ``response.completed`` with the whole response. Pure: frames
in, events out, no I/O; ``response_object`` also shapes the non-streamed answer."""
from __future__ import annotations

import time
import uuid
from typing import Any

from runtime.server.chat_deltas import ChatDeltas


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


def response_object(response_id: str, created_at: int, echo: dict, output: list[dict],
                    status: str, usage: dict | None) -> dict:
    """The ``response`` object; ``echo``: the request's settings it repeats (model,
    instructions, tools, ...). ``status`` "incomplete" when the answer hit its token limit."""
    return {"id": response_id, "object": "response", "created_at": created_at,
            "status": status, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"}
            if status == "incomplete" else None,
            **echo, "output": output, "usage": usage}


def usage_of(prompt_tokens: int, output_tokens: int, cached: int) -> dict:
    return {"input_tokens": prompt_tokens, "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": output_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt_tokens + output_tokens}


def message_item(item_id: str, text: str, status: str = "completed") -> dict:
    return {"id": item_id, "type": "message", "status": status, "role": "assistant",
            "content": [_text_part(text)] if status == "completed" else []}


def reasoning_item(item_id: str, text: str) -> dict:
    return {"id": item_id, "type": "reasoning", "summary": [],
            "content": [{"type": "reasoning_text", "text": text}], "status": "completed"}


def function_call_item(item_id: str, call_id: str, name: str, arguments: str,
                       status: str = "completed") -> dict:
    return {"id": item_id, "type": "function_call", "status": status, "call_id": call_id,
            "name": name, "arguments": arguments}


def _text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


class ResponsesEvents(ChatDeltas):
    """One answer's events. ``opening()`` first, ``feed(frame)`` for each chat chunk frame,
    ``closing()`` once the frames are done; each event carries its ``sequence_number``.
    llama-server's telemetry, as it sends it: with ``timings_per_token`` the last event of
    each frame carries the frame's ``timings``; each prompt progress report (the request's
    ``return_progress``) is a ``response.in_progress`` event with ``prompt_progress``; and
    ``response.completed`` carries the answer's ``timings``."""

    def __init__(self, response_id: str, echo: dict, prompt_tokens: int,
                 timings_per_token: bool = False) -> None:
        super().__init__(prompt_tokens)
        self.timings_per_token = timings_per_token
        self.response_id, self.echo = response_id, echo
        self.created_at = int(time.time())
        self.output: list[dict] = []        # finished items
        self._item: dict | None = None      # the open item (its text so far in "_text")
        self._text = ""
        self._seq = -1

    def opening(self) -> list[dict]:
        return [self.event("response.created", response=self._response("in_progress")),
                self.event("response.in_progress", response=self._response("in_progress"))]

    def feed(self, frame: dict) -> list[dict]:
        events = super().feed(frame)
        if self.timings_per_token and events and frame.get("timings") and \
                frame.get("choices"):
            events[-1]["timings"] = frame["timings"]
        return events

    def on_progress(self, progress: dict, timings: dict | None) -> list[dict]:
        event = self.event("response.in_progress", response=self._response("in_progress"),
                           prompt_progress=progress)
        if self.timings_per_token and timings:
            event["timings"] = timings
        return [event]

    def on_reasoning(self, text: str) -> list[dict]:
        return self._text_delta("reasoning", text)

    def on_text(self, text: str) -> list[dict]:
        return self._text_delta("message", text)

    def on_call(self, call_id: str, name: str) -> list[dict]:      # its own item
        return self._open(function_call_item(new_id("fc"), call_id, name, "", "in_progress"))

    def on_arguments(self, text: str) -> list[dict]:
        self._text += text
        return [self.event("response.function_call_arguments.delta", **self._where(),
                           delta=text)]

    def closing(self) -> list[dict]:
        events = [] if self.output or self._item is not None else \
            self._open(message_item(new_id("msg"), "", "in_progress"))   # an empty answer
        events += self._close()
        status = "incomplete" if self._finish == "length" else "completed"
        done = self.event("response.completed", response=self._response(status))
        if self._timings:                 # llama-server's, on its completed event
            done["timings"] = self._timings
        return events + [done]

    def _response(self, status: str) -> dict:
        usage = None if status == "in_progress" else \
            usage_of(self.prompt_tokens, self._output_tokens, self._cached)
        return response_object(self.response_id, self.created_at, self.echo,
                               list(self.output), status, usage)

    def event(self, kind: str, **fields: Any) -> dict:
        self._seq += 1
        return {"type": kind, "sequence_number": self._seq, **fields}

    def _where(self, content: bool = False) -> dict:
        where = {"item_id": self._item["id"], "output_index": len(self.output)}
        return where | {"content_index": 0} if content else where

    def _text_delta(self, kind: str, text: str) -> list[dict]:
        events = [] if self._item is not None and self._item["type"] == kind else self._open(
            message_item(new_id("msg"), "", "in_progress") if kind == "message" else
            {"id": new_id("rs"), "type": "reasoning", "summary": [], "content": [],
             "status": "in_progress"})
        self._text += text
        name = "response.output_text.delta" if kind == "message" else \
            "response.reasoning_text.delta"
        extra = {"logprobs": []} if kind == "message" else {}
        return events + [self.event(name, **self._where(True), delta=text, **extra)]

    def _open(self, item: dict) -> list[dict]:
        events = self._close()
        self._item, self._text = item, ""
        events.append(self.event("response.output_item.added",
                                  output_index=len(self.output), item=item))
        if item["type"] == "message":
            events.append(self.event("response.content_part.added", **self._where(True),
                                      part=_text_part("")))
        return events

    def _close(self) -> list[dict]:
        item, text = self._item, self._text
        if item is None:
            return []
        kind, events = item["type"], []
        if kind == "message":
            done = message_item(item["id"], text)
            events += [self.event("response.output_text.done", **self._where(True), text=text,
                                   logprobs=[]),
                       self.event("response.content_part.done", **self._where(True),
                                   part=_text_part(text))]
        elif kind == "reasoning":
            done = reasoning_item(item["id"], text)
            events.append(self.event("response.reasoning_text.done", **self._where(True),
                                      text=text))
        else:
            done = function_call_item(item["id"], item["call_id"], item["name"], text)
            events.append(self.event("response.function_call_arguments.done",
                                      **self._where(), name=item["name"], arguments=text))
        events.append(self.event("response.output_item.done", output_index=len(self.output),
                                  item=done))
        self.output.append(done)
        self._item, self._text = None, ""
        return events
