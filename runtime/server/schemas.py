"""Request bodies of the OpenAI-compatible endpoints (pydantic models).

Every field is either honoured or refused: an unknown field is a 400 naming it (it would
otherwise be silently ignored). Fields OpenAI clients send that change nothing for one local
model are accepted (``IGNORED_FIELDS``: ``user``, ``metadata``, ``store``, ``service_tier``,
``safety_identifier``, ``prompt_cache_key``); ``reasoning_effort`` turns the template's
thinking off ("none", "minimal") or on (the others) unless ``chat_template_kwargs`` sets
``enable_thinking``; and ``cache_prompt`` (llama-server's: false evaluates the whole prompt
instead of reusing the KV prefix).
"""
from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import (BaseModel, ConfigDict, Field, ValidationInfo, field_validator,
                      model_validator)

MAX_CHOICES = 16        # n
# accepted, and change nothing here (README: "Request fields")
IGNORED_FIELDS = ("user", "metadata", "store", "service_tier", "safety_identifier",
                  "prompt_cache_key")
REASONING_OFF = ("none", "minimal")     # reasoning_effort values that turn thinking off
INT64 = {"ge": -(1 << 63), "le": (1 << 64) - 1}   # an integer field's bounds: 64 bits, as
                                                  # llama-server's parser holds


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class _SamplingFields(BaseModel):
    """Fields shared by chat and text completions."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None                      # any name is accepted: one model per process
    max_tokens: int | None = Field(None, ge=1)    # tokens to generate
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    seed: int | None = Field(None, **INT64)
    stop: str | list[str] | None = None
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    stream: bool = False
    stream_options: StreamOptions | None = None
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None    # token id (as a string) -> bias
    response_format: dict[str, Any] | None = None
    user: str | None = None                       # a label; changes nothing
    metadata: dict[str, str] | None = None        # a label; changes nothing
    store: bool | None = None                     # OpenAI keeps answers; nothing is stored here
    service_tier: str | None = None               # one tier here
    safety_identifier: str | None = None          # a label; changes nothing
    prompt_cache_key: str | None = None           # the KV prefix is reused by itself here
    # llama.cpp server extensions
    top_k: int | None = Field(None, ge=0, le=2**31 - 1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repeat_penalty: float | None = Field(None, gt=0.0)
    grammar: str | None = None                    # GBNF
    json_schema: dict[str, Any] | None = None
    cache_prompt: bool | None = None              # false: evaluate the whole prompt
    id_slot: int | None = Field(None, ge=-1)      # the -np slot to use (-1: any free one)
    n_predict: int | None = Field(None, ge=1)     # llama.cpp's name for max_tokens
    lora: Any = None                              # [{"id", "scale"}]: this request's LoRA
    #                                               scales (requests.checked_lora)

    @model_validator(mode="after")
    def _n_predict(self):
        if self.n_predict is not None and self.max_tokens is None:
            self.max_tokens = self.n_predict
        return self

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        for key, value in (bias or {}).items():
            if not key.lstrip("-").isdigit():
                raise ValueError(f"keys must be token ids, got {key!r}")
            if not -100.0 <= value <= 100.0:
                raise ValueError(f"bias of token {key} must be in [-100, 100], got {value}")
        return bias

    @field_validator("response_format")
    @classmethod
    def _format(cls, fmt: dict[str, Any] | None) -> dict[str, Any] | None:
        if fmt is not None and fmt.get("type") not in ("text", "json_object", "json_schema"):
            raise ValueError("type must be 'text', 'json_object' or 'json_schema'")
        return fmt

    def logit_bias_ids(self) -> dict[int, float]:
        return {int(k): float(v) for k, v in (self.logit_bias or {}).items()}

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


class ToolCallFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    arguments: str | dict[str, Any] = "{}"


def arguments_problem(arguments: Any) -> str | None:
    """Why an earlier tool call's arguments cannot be rendered (llama-server parses them to
    render the history: not JSON is a 400), or None."""
    if isinstance(arguments, str) and arguments.strip():
        try:
            json.loads(arguments)
        except ValueError:
            return f"must be a JSON object (as a string): {arguments[:80]!r} is not JSON"
    return None


class ToolCallItem(BaseModel):
    model_config = ConfigDict(extra="forbid")
    id: str | None = None
    type: Literal["function"] = "function"
    function: ToolCallFunction


MEDIA_PARTS = frozenset({"image_url", "input_image", "input_audio", "audio_url", "video_url",
                         "file", "image", "audio"})   # content parts that carry media
MEDIA_MARKER = "<__media__>"      # where an image stands in the prompt (runtime/server/images.py)


class ImagePart(BaseModel):
    """An ``image_url`` content part: its URL (a data: URL; runtime/server/images.py checks
    it once the server's projector is known)."""

    model_config = ConfigDict(extra="forbid")
    url: Any
    detail: Any = None            # OpenAI's resolution hint: the projector decides here


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    # a list of parts arrives as their texts and images (ImagePart)
    content: str | list[str | ImagePart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallItem] | None = None     # assistant turns that called tools
    tool_call_id: str | None = None                  # tool turns: which call this answers
    refusal: str | None = None
    reasoning_content: str | None = None             # an earlier answer's thinking (templates
                                                     # that render it, e.g. between tool calls)

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts(cls, value: Any) -> Any:
        if not isinstance(value, list):
            return value
        texts: list[Any] = []
        for i, part in enumerate(value):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            if kind == "image_url":
                image = part.get("image_url")
                texts.append(ImagePart(url=image) if not isinstance(image, dict) else
                             ImagePart(url=image.get("url"), detail=image.get("detail")))
                continue
            if kind in MEDIA_PARTS:
                raise ValueError(f"part {i}: {kind!r} parts are not taken here (images are "
                                 "'image_url' parts, with a multimodal projector: llama-"
                                 "server's --mmproj)")
            if kind != "text" or not isinstance(part.get("text"), str):
                raise ValueError(f"part {i}: only text parts are supported (got {kind!r})")
            texts.append(part["text"])
        return texts

    @model_validator(mode="after")
    def _call_arguments(self) -> ChatMessage:
        for i, call in enumerate(self.tool_calls or []):
            problem = arguments_problem(call.function.arguments)
            if problem is not None:
                raise ValueError(f"the {self.role} message's tool_calls.{i}.function.arguments "
                                 f"{problem}")
        return self

    def text(self, prefill: bool = False) -> str:
        """The content as one string: text parts joined by a newline, as llama.cpp joins
        them for a template (common_chat_msgs_to_json_oaicompat), or run together when the
        message is the prefill of the answer (llama-server appends each part's text)."""
        if isinstance(self.content, list):
            return ("" if prefill else "\n").join(
                MEDIA_MARKER if isinstance(p, ImagePart) else p for p in self.content)
        return self.content or ""


class FunctionSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: FunctionSpec


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: dict[str, str]

    @field_validator("function")
    @classmethod
    def _named(cls, fn: dict[str, str]) -> dict[str, str]:
        if not isinstance(fn.get("name"), str) or set(fn) != {"name"}:
            raise ValueError("must be {\"name\": FUNCTION}")
        return fn


class ChatCompletionRequest(_SamplingFields):
    # at least one, unless validated with context {"empty_messages": True} (the Anthropic
    # route: llama-server answers messages [] there)
    messages: list[ChatMessage]
    max_completion_tokens: int | None = Field(None, ge=1)   # newer name for max_tokens
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[ToolSpec] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # llama-server's: more chat template variables, the prompt's end, debugging and timings
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool | None = None      # None: unless the last turn is a prefill
    continue_final_message: bool | None = None     # vLLM's name for the prefill
    verbose: bool = False                          # the answer carries "__verbose"
    timings_per_token: bool = False                # llama-server's "timings" in the answer
    return_progress: bool = False                  # stream the prompt's progress
    # the thinking split off into reasoning_content (auto/deepseek) or left in (none)
    reasoning_format: Literal["auto", "deepseek", "none"] | None = None
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None

    def template_kwargs(self) -> dict[str, Any] | None:
        """``chat_template_kwargs`` with ``reasoning_effort`` as ``enable_thinking`` (the
        request's own kwargs win); templates without thinking ignore the variable."""
        if self.reasoning_effort is None:
            return self.chat_template_kwargs
        return {"enable_thinking": self.reasoning_effort not in REASONING_OFF} | \
            (self.chat_template_kwargs or {})

    @field_validator("messages")
    @classmethod
    def _some_messages(cls, messages: list[ChatMessage], info: ValidationInfo
                       ) -> list[ChatMessage]:
        if not messages and not (info.context or {}).get("empty_messages"):
            raise ValueError("must hold at least one message")
        return messages

    @model_validator(mode="after")
    def _supported(self) -> ChatCompletionRequest:
        if self.add_generation_prompt and self.continue_final_message:
            raise ValueError("add_generation_prompt and continue_final_message cannot both "
                             "be true")
        if self.continue_final_message and (not self.messages or
                                            self.messages[-1].role != "assistant"):
            raise ValueError("continue_final_message needs an assistant message at the end")
        roles = [m.role for m in self.messages]
        if roles[-2:] == ["assistant", "assistant"]:
            raise ValueError("messages: two assistant messages at the end (the last one may "
                             "be a prefill of the answer, one is enough)")
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        if self.tool_choice not in (None, "none", "auto") and not self.tools:
            raise ValueError("tool_choice needs tools")
        return self

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None \
            else self.max_tokens

    def ends_in_prefill(self) -> bool:
        """The last message is the start of the answer (an assistant message without tool
        calls, and no generation prompt asked for after it): the model continues it."""
        last = self.messages[-1] if self.messages else None
        return last is not None and last.role == "assistant" and not last.tool_calls \
            and not self.add_generation_prompt

    def message_dicts(self) -> list[dict[str, Any]]:
        """Messages as the engine's chat template takes them (``developer`` counts as system);
        tool calls and tool results keep their OpenAI fields."""
        out = []
        prefill = self.ends_in_prefill()
        for i, m in enumerate(self.messages):
            d: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role,
                                 "content": m.text(prefill and i == len(self.messages) - 1)}
            if m.tool_calls:
                d["tool_calls"] = [c.model_dump() for c in m.tool_calls]
            if m.tool_call_id is not None:
                d["tool_call_id"] = m.tool_call_id
            if m.name is not None:
                d["name"] = m.name
            if m.reasoning_content is not None:
                d["reasoning_content"] = m.reasoning_content
            out.append(d)
        return out

    def tool_dicts(self) -> list[dict[str, Any]] | None:
        if not self.tools:
            return None
        return [t.model_dump(exclude_none=True) for t in self.tools]

    def tool_choice_value(self) -> Any:
        if isinstance(self.tool_choice, NamedToolChoice):
            return self.tool_choice.model_dump()
        return self.tool_choice if self.tool_choice is not None else \
            ("auto" if self.tools else None)


class CompletionRequest(_SamplingFields):
    # One prompt: a string or a list of token ids (a list holding one string is unwrapped).
    prompt: str | list[int]
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=20)
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1)

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
        if self.echo and self.logprobs is not None:
            raise ValueError("echo with logprobs is not supported (no prompt logprobs)")
        if self.suffix:
            raise ValueError("suffix is not supported")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of other than n is not supported")
        return self

    def prompt_input(self) -> str | list[int]:
        """The prompt as text or as token ids."""
        return self.prompt
