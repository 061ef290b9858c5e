"""A streamed chat answer's chunks (chat_stream.py's frames) as Anthropic's Messages events:
``message_start``, then per content block ``content_block_start`` / ``content_block_delta`` /
``content_block_stop`` (a thinking block, a text block, one ``tool_use`` block per call, in
the order they come, indices counting up from 0), then ``message_delta`` (stop reason, usage)
and ``message_stop``. Pure: frames in, events out, no I/O."""
from __future__ import annotations

from typing import Any

from runtime.server.chat_deltas import ChatDeltas

# chat finish_reason -> Anthropic stop_reason (a stop string and the end-of-generation token
# are both "stop" here: end_turn)
_STOP_REASONS = {"tool_calls": "tool_use", "length": "max_tokens"}


def stop_reason(finish_reason: str | None) -> str:
    return _STOP_REASONS.get(finish_reason or "stop", "end_turn")


class AnthropicEvents(ChatDeltas):
    """One answer's events. ``opening()`` first, ``feed(frame)`` for each chat chunk frame,
    ``closing()`` once the frames are done."""

    def __init__(self, message_id: str, model: str, prompt_tokens: int) -> None:
        super().__init__(prompt_tokens)
        self.message_id, self.model = message_id, model
        self._index = -1              # index of the last block started
        self._open: str | None = None  # type of the open block: thinking | text | tool_use

    def opening(self) -> list[dict]:
        return [{"type": "message_start", "message": {
            "id": self.message_id, "type": "message", "role": "assistant", "model": self.model,
            "content": [], "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": self.prompt_tokens, "cache_creation_input_tokens": 0,
                      "cache_read_input_tokens": 0, "output_tokens": 0}}}]

    def on_reasoning(self, text: str) -> list[dict]:
        return self._delta("thinking", {"type": "thinking_delta", "thinking": text})

    def on_text(self, text: str) -> list[dict]:
        return self._delta("text", {"type": "text_delta", "text": text})

    def on_call(self, call_id: str, name: str) -> list[dict]:      # its own block
        return self._start("tool_use", {"type": "tool_use", "id": call_id, "name": name,
                                        "input": {}})

    def on_arguments(self, text: str) -> list[dict]:
        return [{"type": "content_block_delta", "index": self._index,
                 "delta": {"type": "input_json_delta", "partial_json": text}}]

    def closing(self) -> list[dict]:
        return self._stop() + [
            {"type": "message_delta",
             "delta": {"stop_reason": stop_reason(self._finish), "stop_sequence": None},
             "usage": {"input_tokens": self.prompt_tokens - self._cached,
                       "cache_creation_input_tokens": 0,
                       "cache_read_input_tokens": self._cached,
                       "output_tokens": self._output_tokens}},
            {"type": "message_stop"}]

    def _delta(self, kind: str, delta: dict) -> list[dict]:
        events = [] if self._open == kind else self._start(kind, {
            "thinking": {"type": "thinking", "thinking": "", "signature": ""},
            "text": {"type": "text", "text": ""}}[kind])
        return events + [{"type": "content_block_delta", "index": self._index, "delta": delta}]

    def _start(self, kind: str, block: dict[str, Any]) -> list[dict]:
        events = self._stop()
        self._index += 1
        self._open = kind
        return events + [{"type": "content_block_start", "index": self._index,
                          "content_block": block}]

    def _stop(self) -> list[dict]:
        if self._open is None:
            return []
        events = []
        if self._open == "thinking":     # Anthropic closes thinking with its signature
            events.append({"type": "content_block_delta", "index": self._index,
                           "delta": {"type": "signature_delta", "signature": ""}})
        self._open = None
        return events + [{"type": "content_block_stop", "index": self._index}]
