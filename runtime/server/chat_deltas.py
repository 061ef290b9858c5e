"""Walking a streamed chat answer's chunk frames (chat_stream.py's) for another API's events:
``ChatDeltas.feed(frame)`` keeps the usage frame's counts, timings and the finish reason, and
hands each prompt progress report, reasoning, text and tool-call delta, in order, to the
subclass (anthropic/stream.py, responses/stream.py), which turns it into its API's events.
Pure: frames in, events out."""
from __future__ import annotations


class ChatDeltas:
    """Subclasses implement ``on_reasoning(text)``, ``on_text(text)``, ``on_call(call_id,
    name)`` (a tool call begins) and ``on_arguments(text)`` (its arguments so far grow), each
    returning a list of events."""

    def __init__(self, prompt_tokens: int) -> None:
        self.prompt_tokens = prompt_tokens
        self._finish: str | None = None    # the chat finish_reason
        self._output_tokens = 0
        self._cached = 0                   # prompt tokens served from the KV cache
        self._timings: dict | None = None  # llama-server's timings of the whole answer

    def feed(self, frame: dict) -> list[dict]:
        if frame.get("prompt_progress") is not None:      # return_progress
            return self.on_progress(frame["prompt_progress"], frame.get("timings"))
        if frame.get("usage"):                     # the usage frame at the end
            self._output_tokens = frame["usage"]["completion_tokens"]
            self._timings = frame.get("timings")
            self._cached = (self._timings or {}).get("cache_n", 0)
        events: list[dict] = []
        for choice in frame.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("reasoning_content"):
                events += self.on_reasoning(delta["reasoning_content"])
            if delta.get("content"):
                events += self.on_text(delta["content"])
            for call in delta.get("tool_calls") or []:
                if call.get("id"):                 # a call begins
                    events += self.on_call(call["id"], call["function"]["name"])
                arguments = (call.get("function") or {}).get("arguments")
                if arguments:
                    events += self.on_arguments(arguments)
            if choice.get("finish_reason"):
                self._finish = choice["finish_reason"]
        return events

    def on_progress(self, progress: dict, timings: dict | None) -> list[dict]:
        """The prompt's evaluation went on (llama-server's ``prompt_progress``); no event
        unless the API has one."""
        return []

    def on_reasoning(self, text: str) -> list[dict]:
        raise NotImplementedError

    def on_text(self, text: str) -> list[dict]:
        raise NotImplementedError

    def on_call(self, call_id: str, name: str) -> list[dict]:
        raise NotImplementedError

    def on_arguments(self, text: str) -> list[dict]:
        raise NotImplementedError
