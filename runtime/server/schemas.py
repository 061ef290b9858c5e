"""Request bodies of the OpenAI-compatible endpoints (pydantic models).

Only what the engine can honour is accepted with meaning; fields OpenAI clients commonly send
but that change nothing here (``user``, ``presence_penalty`` ...) are ignored, and a few that
would silently change the answer's meaning (``n > 1``, ``logprobs``, ``echo``) are refused.
"""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class _SamplingFields(BaseModel):
    """Fields shared by chat and text completions."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None                      # any name is accepted: one model per process
    max_tokens: int | None = Field(None, ge=1)    # tokens to generate
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    # llama.cpp server extensions
    top_k: int | None = Field(None, ge=0)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repeat_penalty: float | None = Field(None, gt=0.0)

    @field_validator("n")
    @classmethod
    def _one_choice(cls, n: int) -> int:
        if n != 1:
            raise ValueError("only n=1 is supported")
        return n

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, stop: str | list[str] | None) -> str | list[str] | None:
        items = [stop] if isinstance(stop, str) else (stop or [])
        if any(s == "" for s in items):
            raise ValueError("stop strings must not be empty")
        return stop

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def include_usage_in_stream(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)   # newer name for max_tokens
    logprobs: bool | None = None

    @model_validator(mode="after")
    def _supported(self) -> ChatCompletionRequest:
        if self.logprobs:
            raise ValueError("logprobs are not supported")
        return self

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None \
            else self.max_tokens

    def message_dicts(self) -> list[dict[str, str]]:
        """Messages as the engine's chat template takes them (``developer`` counts as system)."""
        return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()}
                for m in self.messages]


class CompletionRequest(_SamplingFields):
    # One prompt: a string, a list holding one string, or a list of token ids.
    prompt: str | list[int] | list[str]
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, prompt: str | list[int] | list[str]) -> str | list[int] | list[str]:
        if isinstance(prompt, list):
            if not prompt:
                raise ValueError("prompt must not be empty")
            if isinstance(prompt[0], str) and len(prompt) != 1:
                raise ValueError("only one prompt per request is supported")
        return prompt

    @model_validator(mode="after")
    def _supported(self) -> CompletionRequest:
        if self.echo:
            raise ValueError("echo is not supported")
        if self.logprobs is not None:
            raise ValueError("logprobs are not supported")
        if self.suffix:
            raise ValueError("suffix is not supported")
        return self

    def prompt_input(self) -> str | list[int]:
        """The prompt as text or as token ids."""
        if isinstance(self.prompt, list) and isinstance(self.prompt[0], str):
            return self.prompt[0]
        return self.prompt
