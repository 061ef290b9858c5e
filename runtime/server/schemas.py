"""Request bodies of the OpenAI-compatible endpoints (pydantic models).

Only what the engine can honour is accepted with meaning; fields OpenAI clients commonly send
but that change nothing here (``user``, ``presence_penalty`` ...) are ignored, and a few that
would silently change the answer's meaning (``n > 1``, ``logprobs``, ``echo``) are refused.
"""
from __future__ import annotations

from typing import Any, Literal

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
    top_k: int | None = Field(None, ge=0, le=2**31 - 1)
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


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | None = None     # a list of text parts arrives joined into one string

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts(cls, value: Any) -> Any:
        if not isinstance(value, list):
            return value
        texts = []
        for i, part in enumerate(value):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            if kind != "text" or not isinstance(part.get("text"), str):
                raise ValueError(f"part {i}: only text parts are supported (got {kind!r})")
            texts.append(part["text"])
        return "".join(texts)

    def text(self) -> str:
        return self.content or ""


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
    # One prompt: a string or a list of token ids (a list holding one string is unwrapped).
    prompt: str | list[int]
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, prompt: Any) -> Any:
        if isinstance(prompt, list):
            if not prompt:
                raise ValueError("must not be empty")
            if all(isinstance(p, str) for p in prompt):
                if len(prompt) != 1:
                    raise ValueError("only one prompt per request is supported")
                return prompt[0]
            if not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
                raise ValueError("must be a string, or a list of token ids")
            return prompt
        if not isinstance(prompt, str):
            raise ValueError("must be a string, or a list of token ids")
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
        return self.prompt
