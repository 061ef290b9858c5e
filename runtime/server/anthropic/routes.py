"""The Anthropic Messages API (``POST /v1/messages``, ``/v1/messages/count_tokens``) as a
translation over the chat-completion path, as llama-server serves it: the body becomes a
``ChatCompletionRequest`` (system first, ``tool_use`` blocks as assistant ``tool_calls``,
``tool_result`` blocks as ``tool`` messages, ``thinking`` blocks as the turn's
``reasoning_content``), is generated like any chat request, and the answer (or its stream
of chunks, stream.py) is written back in Anthropic's shape.
Errors leave as ``{"type": "error", "error": {"type", "message"}}`` (errors.py).

Image blocks (base64 sources) in user messages and in tool results become the chat's
``image_url`` parts (served with ``--mmproj``; without it a 400 naming the flag:
runtime/server/images.py).
What Anthropic's API has and this server does not: documents and image URLs (a 400),
server tools (``web_search_...``, ``bash_...``: a 400 naming them), a
thinking budget or effort (``thinking.budget_tokens`` and ``output_config.effort`` are
accepted, only ``max_tokens`` bounds the answer), the matched stop sequence
(``stop_sequence`` is always null: the engine does not say which stop string ended the
answer, and ``stop_reason`` is ``end_turn`` for both).
"""
from __future__ import annotations

import json
import uuid
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from runtime.server.anthropic.stream import AnthropicEvents, stop_reason
from runtime.server.openai.completions import (chat_answer, chat_base, count_chat_tokens,
                                        submit_chat)
from runtime.server.errors import APIError, anthropic_error_body, register_route_shape
from runtime.server.images import anthropic_image
from runtime.server.schemas import MEDIA_PARTS, ChatCompletionRequest
from runtime.server.translated_stream import chat_request, event_source

ANTHROPIC_PATHS = frozenset({"/v1/messages", "/v1/messages/count_tokens"})
register_route_shape("anthropic", ANTHROPIC_PATHS)          # Anthropic clients read their shape

router = APIRouter()


class _Block(BaseModel):
    """One content block; the fields of every type Anthropic has, checked per type below."""

    model_config = ConfigDict(extra="forbid")
    type: str
    text: str | None = None
    id: str | None = None                      # tool_use
    name: str | None = None
    input: Any = None
    caller: Any = None                         # who called it (labels of a tool_use block)
    toolset_name: str | None = None
    tool_use_id: str | None = None             # tool_result
    content: str | list[dict[str, Any]] | None = None
    is_error: bool | None = None
    thinking: str | None = None                # thinking (an earlier answer's)
    signature: str | None = None
    data: str | None = None                    # redacted_thinking
    source: Any = None                         # image / document: refused
    cache_control: dict[str, Any] | None = None   # prompt caching hints: llama's KV cache rules
    citations: Any = None


class AnthropicMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["user", "assistant"]
    content: str | list[_Block]


class AnthropicTool(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    description: str | None = None
    input_schema: dict[str, Any] | None = None
    type: str | None = None                    # "custom" or absent; others are server tools
    cache_control: dict[str, Any] | None = None


class AnthropicToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class Thinking(BaseModel):
    """Thinking on (the template's ``enable_thinking``) or off; the rest changes nothing."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["enabled", "adaptive", "between_tools", "disabled"]
    budget_tokens: int | None = Field(None, ge=0)   # accepted; max_tokens bounds the answer
    display: Literal["summarized", "omitted"] | None = None


class OutputFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    format: OutputFormat | None = None          # the answer constrained to a JSON schema
    effort: str | None = None                   # a label; changes nothing


class MessagesRequest(BaseModel):
    """A Messages request (``/v1/messages/count_tokens`` takes one too, without max_tokens)."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None                   # any name: one model per process
    # [] is answered, as llama-server does: the template renders the generation prompt alone
    messages: list[AnthropicMessage]
    system: str | list[_Block] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None
    cache_control: dict[str, Any] | None = None   # prompt caching hint: llama's KV cache rules
    max_tokens: int | None = Field(None, ge=1)      # Anthropic requires it; llama-server not
    stream: bool = False
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)
    metadata: dict[str, Any] | None = None     # a label (user_id); changes nothing
    service_tier: str | None = None            # a label; changes nothing


def _text_of(blocks: str | list, where: str) -> str:
    """The text of a string or of a list of text blocks (a tool result, the system)."""
    if isinstance(blocks, str):
        return blocks
    return "\n\n".join(_block_text(block, f"{where}.{i}") for i, block in enumerate(blocks))


def _block_text(block: Any, where: str) -> str:
    """A text block's text; a 400 naming ``where`` for any other block."""
    kind = block.type if isinstance(block, _Block) else block.get("type")
    text = block.text if isinstance(block, _Block) else block.get("text")
    if kind in MEDIA_PARTS or kind == "document":
        raise _media(where, kind)
    if kind != "text" or not isinstance(text, str):
        raise APIError(400, f"{where}: only text blocks are supported here (got {kind!r})",
                       code="invalid_value", param=where)
    return text


def _tool_result(content: str | list[dict[str, Any]], where: str, is_error: bool | None) -> Any:
    """A tool result's content as the tool message's: its text (blocks joined by a blank
    line), or, when it holds image blocks, its text and image parts in order."""
    prefix = "Error: " if is_error else ""
    if isinstance(content, str) or not any(b.get("type") == "image" for b in content):
        return prefix + _text_of(content, where)
    parts: list[dict[str, Any]] = [{"type": "text", "text": prefix}] if prefix else []
    for i, block in enumerate(content):
        parts.append(anthropic_image(block.get("source"), f"{where}.{i}.source")
                     if block.get("type") == "image" else
                     {"type": "text", "text": _block_text(block, f"{where}.{i}")})
    return parts


def _media(param: str, kind: str) -> APIError:
    return APIError(400, f"{param}: {kind} input is not supported here (images are: image "
                         "blocks in user messages and tool results, with a multimodal "
                         "projector: llama-server's --mmproj)", code="invalid_value",
                    param=param)


def _turns(i: int, message: AnthropicMessage) -> list[dict[str, Any]]:
    """One Anthropic message as chat messages: tool results become ``tool`` messages (first:
    they answer the calls of the turn before), tool uses the assistant's ``tool_calls``."""
    if isinstance(message.content, str):
        return [{"role": message.role, "content": message.content}]
    parts: list[dict[str, Any]] = []         # text and image parts, in order
    thoughts: list[str] = []
    calls: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    for j, block in enumerate(message.content):
        where = f"messages.{i}.content.{j}"
        if block.type == "text":
            parts.append({"type": "text", "text": block.text or ""})
        elif block.type == "image" and message.role == "user":
            parts.append(anthropic_image(block.source, f"{where}.source"))
        elif block.type == "thinking" and message.role == "assistant":
            thoughts.append(block.thinking or "")      # reasoning_content, for the template
        elif block.type == "redacted_thinking":
            continue                    # encrypted by Anthropic: nothing to render
        elif block.type == "tool_use" and message.role == "assistant":
            if not block.id or not block.name:
                raise APIError(400, f"{where}: a tool_use block needs id and name",
                               code="invalid_value", param=where)
            calls.append({"id": block.id, "type": "function", "function": {
                "name": block.name, "arguments": json.dumps(block.input or {})}})
        elif block.type == "tool_result" and message.role == "user":
            if not block.tool_use_id:
                raise APIError(400, f"{where}: a tool_result block needs tool_use_id",
                               code="invalid_value", param=where)
            results.append({"role": "tool", "tool_call_id": block.tool_use_id,
                            "content": _tool_result(block.content or "", f"{where}.content",
                                                    block.is_error)})
        elif block.type in MEDIA_PARTS or block.type == "document":
            raise _media(where, block.type)
        else:
            raise APIError(400, f"{where}: a {block.type!r} block is not supported in a "
                                f"{message.role} message", code="invalid_value", param=where)
    turns = list(results)
    if parts or calls or thoughts or not results:
        # text parts: joined as the chat path joins them (run together in a prefill)
        turn: dict[str, Any] = {"role": message.role, "content": parts}
        if calls:
            turn["tool_calls"] = calls
        if thoughts:
            turn["reasoning_content"] = "\n\n".join(thoughts)
        turns.append(turn)
    return turns


def _tools(tools: list[AnthropicTool] | None) -> list[dict[str, Any]] | None:
    if not tools:
        return None
    out = []
    for i, tool in enumerate(tools):
        if tool.type not in (None, "custom"):
            raise APIError(400, f"tools.{i}: {tool.type!r} is a server tool (run by the "
                                "API), which this server does not run; give a custom tool "
                                "with an input_schema", code="invalid_value", param=f"tools.{i}")
        out.append({"type": "function", "function": {
            "name": tool.name, "description": tool.description,
            "parameters": tool.input_schema or {"type": "object", "properties": {}}}})
    return out


def _tool_choice(choice: AnthropicToolChoice | None) -> Any:
    if choice is None:
        return None
    if choice.type == "tool":
        if not choice.name:
            raise APIError(400, "tool_choice.name: a tool choice of type 'tool' needs the "
                                "tool's name", code="invalid_value", param="tool_choice.name")
        return {"type": "function", "function": {"name": choice.name}}
    return {"auto": "auto", "any": "required", "none": "none"}[choice.type]


def to_chat_request(body: MessagesRequest) -> ChatCompletionRequest:
    """The chat-completion request that generates this Messages request's answer."""
    messages: list[dict[str, Any]] = []
    if body.system is not None:
        system = _text_of(body.system, "system")
        if system:
            messages.append({"role": "system", "content": system})
    for i, message in enumerate(body.messages):
        messages.extend(_turns(i, message))
    chat: dict[str, Any] = {"messages": messages, "model": body.model}
    chat["tools"] = _tools(body.tools)
    chat["tool_choice"] = _tool_choice(body.tool_choice)      # without tools: a 400 if forced
    if body.tool_choice is not None and body.tool_choice.disable_parallel_tool_use:
        chat["parallel_tool_calls"] = False
    if body.thinking is not None:
        chat["chat_template_kwargs"] = {"enable_thinking": body.thinking.type != "disabled"}
    if body.output_config is not None and body.output_config.format is not None:
        chat["response_format"] = {"type": "json_schema", "json_schema": {
            "name": "output", "schema": body.output_config.format.schema_}}
    chat |= {"max_tokens": body.max_tokens, "stop": body.stop_sequences or None,
             "temperature": body.temperature, "top_p": body.top_p, "top_k": body.top_k,
             "stream": body.stream}
    return chat_request(chat, empty_messages=True)


def message_of(answer: dict, model: str) -> dict:
    """A ``chat.completion`` answer as an Anthropic message."""
    choice = answer["choices"][0]
    message = choice["message"]
    content: list[dict[str, Any]] = []
    if message.get("reasoning_content"):
        content.append({"type": "thinking", "thinking": message["reasoning_content"],
                        "signature": ""})       # no signature: nothing to verify locally
    if message.get("content"):
        content.append({"type": "text", "text": message["content"]})
    for call in message.get("tool_calls") or []:
        content.append({"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
                        "input": _arguments(call["function"]["arguments"])})
    usage = answer["usage"]
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {"id": f"msg_{uuid.uuid4().hex[:24]}", "type": "message", "role": "assistant",
            "model": model, "content": content,
            "stop_reason": stop_reason(choice["finish_reason"]), "stop_sequence": None,
            "usage": {"input_tokens": usage["prompt_tokens"] - cached,
                      "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached,
                      "output_tokens": usage["completion_tokens"]}}


def _arguments(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except ValueError:
        return {}


@router.post("/v1/messages")
async def messages(body: MessagesRequest, request: Request):
    """An Anthropic Messages answer, streamed (Anthropic's events) or not."""
    chat = to_chat_request(body)
    prep, job = await submit_chat(request, chat)
    base = chat_base(request)
    model = request.app.state.host.model_id
    if not body.stream:
        return JSONResponse(message_of(await chat_answer(request, chat, prep, job, base), model))
    return event_source(job, prep, base, AnthropicEvents(f"msg_{uuid.uuid4().hex[:24]}",
                                                         model, prep.prompt_tokens),
                        anthropic_error_body)


@router.post("/v1/messages/count_tokens")
async def count_tokens(body: MessagesRequest, request: Request) -> dict:
    """``{"input_tokens": N}``: the prompt tokens the request would take (a whole Messages
    request is accepted too, as llama-server does: its other fields do not change the count)."""
    return {"input_tokens": await count_chat_tokens(request, to_chat_request(body))}
