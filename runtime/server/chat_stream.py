"""Frames of a streamed chat answer: the role first, then content deltas as they come, with
the thinking split off as ``reasoning_content`` (reasoning.py) and tool calls held back and
sent as ``tool_calls`` deltas when the choice ends (tool_stream.py)."""
from __future__ import annotations

from typing import Any

from runtime.engine.types import CANCELLED
from runtime.server import shapes, structured
from runtime.server.requests import Prepared
from runtime.server.reasoning import ReasoningStream
from runtime.server.tool_stream import ToolCallStream


class ChatFramer:
    """Stream frames of a chat answer. With tools in play, content is streamed as it comes
    except what could be a tool call (tool_stream.py); calls are sent when the choice ends, as
    ``tool_calls`` deltas (id and name, then the arguments)."""

    def __init__(self, base: dict, prep: Prepared, timings: bool = False):
        self.base, self.prep = base, prep
        # timings_per_token: llama-server's timings on every frame after the opening (so far;
        # the engine's own on a choice's last frame and the usage frame)
        self.timings = timings
        self._clock = shapes.RunningTimings(prep.prompt_tokens)
        self._generated: dict[int, int] = {}            # choice index -> tokens so far
        self._tools: dict[int, ToolCallStream] = {}
        self._reasoning: dict[int, ReasoningStream] = {}
        self._held_lp: dict[int, list] = {}

    def _frame(self, index: int, delta: dict, finish: str | None = None,
               logprobs: list | None = None) -> dict:
        lp = None if logprobs is None else {"content": logprobs, "refusal": None}
        return self.base | {"choices": [{"index": index, "delta": delta, "logprobs": lp,
                                         "finish_reason": finish}]}

    def opening(self) -> list[dict]:     # as llama-server: the role, content null
        return [self._frame(i, {"role": "assistant", "content": None})
                for i in range(self.prep.n)]

    def chunk(self, index: int, chunk: Any) -> list[dict]:
        if chunk.progress is not None:          # return_progress: llama-server's frame
            self._clock.prompt = chunk.progress
            frame = self.base | {"choices": [],
                                 "prompt_progress": shapes.prompt_progress(chunk.progress)}
            if self.timings:
                frame["timings"] = shapes.progress_timings(chunk.progress)
            return [frame]
        if chunk.token is not None:
            self._generated[index] = self._generated.get(index, 0) + 1
        frames = self._frames(index, chunk)
        if self.timings and frames and "timings" not in frames[-1]:
            frames[-1]["timings"] = self._clock.now(self._generated.get(index, 0))
        return frames

    def _frames(self, index: int, chunk: Any) -> list[dict]:
        want_lp = self.prep.params.logprobs is not None
        entry = [shapes.chat_logprob(chunk.logprob)] if chunk.logprob is not None else []
        finish = chunk.finish_reason if chunk.finish_reason not in (None, CANCELLED) else None
        text, frames = chunk.text or "", []
        if self.prep.thinking is not None:      # the thinking first, as reasoning_content
            split = self._reasoning.setdefault(index, ReasoningStream(self.prep.thinking))
            reasoning, text = split.feed(text)
            if finish is not None:
                tail = split.finish()
                reasoning, text = reasoning + tail[0], text + tail[1]
            if reasoning:
                frames.append(self._frame(index, {"reasoning_content": reasoning},
                                          logprobs=entry if want_lp else None))
                entry = []
        if self.prep.tool_format is not None:
            return frames + self._tool_content(index, text, entry, want_lp, finish)
        if text or entry:
            frames.append(self._frame(index, {"content": text},
                                      logprobs=entry if want_lp else None))
        if finish is not None:
            frames.append(self._frame(index, {}, finish))
            if self.timings and chunk.timings is not None:
                frames[-1]["timings"] = shapes.llama_timings(chunk.timings,
                                                             self.prep.prompt_tokens)
        return frames

    def _tool_content(self, index: int, text: str, entry: list, want_lp: bool,
                      finish: str | None) -> list[dict]:
        stream = self._tools.setdefault(index, ToolCallStream(self.prep.tool_format))
        held_lp = self._held_lp.setdefault(index, [])
        held_lp.extend(entry)
        text = stream.feed(text)
        frames = []
        if text:                # the logprobs held so far go out with the text
            frames.append(self._frame(index, {"content": text},
                                      logprobs=list(held_lp) if want_lp else None))
            held_lp.clear()
        return frames if finish is None else frames + self._release(index, finish)

    def _release(self, index: int, finish: str) -> list[dict]:
        stream = self._tools.pop(index)
        began = stream.calling
        text, calls = stream.finish()
        entries = self._held_lp.pop(index, [])
        lp = entries if self.prep.params.logprobs is not None else None
        content = text.strip()
        if not calls:
            frames = [self._frame(index, {"content": text}, logprobs=lp)] if text or lp else []
            last = self._frame(index, {}, finish)
            if finish == "length" and began:       # max_tokens ended the answer in a call
                last["choices"][0]["note"] = structured.cut_call_note(
                    self.prep.params.max_tokens)
            return frames + [last]
        frames = []
        if content:
            frames.append(self._frame(index, {"content": content}, logprobs=lp))
            lp = None
        for i, call in enumerate(calls):
            frames.append(self._frame(index, {"tool_calls": [{
                "index": i, "id": call.id, "type": "function",
                "function": {"name": call.name, "arguments": ""}}]}, logprobs=lp))
            lp = None
            frames.append(self._frame(index, {"tool_calls": [{
                "index": i, "function": {"arguments": call.arguments}}]}))
        return frames + [self._frame(index, {}, "tool_calls")]
