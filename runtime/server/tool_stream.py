"""Streaming a chat answer that may hold tool calls: content goes out as it comes, and only
what could be (the start of) a call is held back.

A Hermes/Qwen call begins with ``<tool_call>`` anywhere in the answer: the text before it is
content, a tail that could be the marker's beginning waits for the next token, and from the
marker on everything is held until the answer ends, then parsed. A Mistral or Llama 3 call is
the whole answer (``[TOOL_CALLS]``, ``<|python_tag|>``, or bare JSON): the answer is held while
its first characters could still begin one, then either streamed as plain content from there
on or held to the end and parsed. Held text that parses into no call is content after all.
"""
from __future__ import annotations

from runtime.server.structured import ToolCall, ToolFormat, parse_tool_calls

HERMES_MARK = "<tool_call>"
WHOLE_ANSWER_STARTS = ("[TOOL_CALLS]", "<|python_tag|>", "{", "[")


class ToolCallStream:
    """One choice's text in (``feed``), the content safe to send now out; ``finish`` gives
    the rest: (content still to send, the calls)."""

    def __init__(self, fmt: ToolFormat) -> None:
        self.fmt = fmt
        self._held = ""
        self._calling = False      # a call has begun: hold to the end
        self._plain = False        # (whole-answer formats) the answer is not a call

    def feed(self, text: str) -> str:
        self._held += text
        if self._calling:
            return ""
        if self._plain:
            return self._take(len(self._held))
        if self.fmt is ToolFormat.HERMES:
            at = self._held.find(HERMES_MARK)
            if at >= 0:
                self._calling = True
                return self._take(at)
            return self._take(len(self._held) - partial_suffix(self._held, HERMES_MARK))
        start = self._held.lstrip()
        if not start or any(mark.startswith(start) for mark in WHOLE_ANSWER_STARTS):
            return ""                                   # could still become a call
        if start.startswith(WHOLE_ANSWER_STARTS):
            self._calling = True
            return ""
        self._plain = True
        return self._take(len(self._held))

    @property
    def calling(self) -> bool:
        """A call has begun (its text is held to the end)."""
        return self._calling

    def finish(self) -> tuple[str, list[ToolCall]]:
        text, self._held = self._held, ""
        if not self._calling:
            return text, []
        content, calls = parse_tool_calls(text, self.fmt)
        return (content or "", calls) if calls else (text, [])

    def _take(self, n: int) -> str:
        out, self._held = self._held[:n], self._held[n:]
        return out


def partial_suffix(text: str, mark: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``mark``."""
    for n in range(min(len(mark) - 1, len(text)), 0, -1):
        if text.endswith(mark[:n]):
            return n
    return 0
