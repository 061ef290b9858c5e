"""Thinking split from the answer, as llama-server's ``reasoning_format`` (deepseek/auto):
the text between ``<think>`` and ``</think>`` is ``reasoning_content``, the rest ``content``.

A template whose generation prompt ends inside an open ``<think>`` (DeepSeek-R1, QwQ with
``enable_thinking``) makes the answer start in the thinking part (llama.cpp's "thinking forced
open"). ``ReasoningStream`` does the split while streaming: a tail that could be the start of
a tag is held until the next piece.
"""
from __future__ import annotations

from runtime.server.tool_stream import partial_suffix

OPEN, CLOSE = "<think>", "</think>"
FORMATS = ("auto", "deepseek", "none")     # llama-server's reasoning_format values kept here


def thinking_forced_open(prompt: str) -> bool:
    """The prompt ends inside an unclosed ``<think>`` block."""
    end = prompt.rstrip()
    return end.endswith(OPEN)


class ReasoningStream:
    """Pieces in; ``(reasoning, content)`` text that is safe to send now out."""

    def __init__(self, forced_open: bool) -> None:
        self._state = "think" if forced_open else "start"   # start | think | answer
        self._held = ""
        self.thought = forced_open         # a thinking block was (or is being) written

    def feed(self, text: str) -> tuple[str, str]:
        self._held += text
        reasoning = content = ""
        while True:
            if self._state == "answer":
                content += self._held
                self._held = ""
                return reasoning, content
            if self._state == "start":      # only leading blanks may precede <think>
                start = self._held.lstrip()
                if start.startswith(OPEN):
                    self._held, self._state = start[len(OPEN):], "think"
                    self.thought = True
                    continue
                if not start or OPEN.startswith(start):
                    return reasoning, content
                self._state = "answer"
                continue
            at = self._held.find(CLOSE)                 # thinking
            if at >= 0:
                reasoning += self._held[:at]
                self._held, self._state = self._held[at + len(CLOSE):].lstrip(), "answer"
                continue
            keep = partial_suffix(self._held, CLOSE)
            reasoning += self._held[:len(self._held) - keep]
            self._held = self._held[len(self._held) - keep:]
            return reasoning, content

    def finish(self) -> tuple[str, str]:
        """The rest at the end: an unclosed thinking block is all reasoning."""
        held, self._held = self._held, ""
        return (held, "") if self._state == "think" else ("", held)


def split_reasoning(text: str, forced_open: bool) -> tuple[str | None, str]:
    """A whole answer: (reasoning_content or None, content)."""
    stream = ReasoningStream(forced_open)
    reasoning, content = stream.feed(text)
    r_tail, c_tail = stream.finish()
    reasoning += r_tail
    content += c_tail
    return (reasoning if stream.thought else None), content
