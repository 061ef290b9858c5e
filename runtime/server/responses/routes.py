"""The OpenAI Responses API (``POST /v1/responses``, ``/v1/responses/input_tokens``) as a
translation over the chat-completion path, as llama-server serves it: ``instructions`` and the
``input`` (a string, or items: messages, ``function_call`` and ``function_call_output``;
``input_image`` parts, data: URLs, in a message or a function's output are images as on the
chat route, served with ``--mmproj``) become a ``ChatCompletionRequest``, generated like any
chat request; the answer comes back as a ``response`` with output items (reasoning, message, function calls), or as Responses events
(stream.py).

Nothing is stored: ``previous_response_id``, ``conversation``, ``item_reference`` items and
``background`` are refused (400), ``store`` and the other labels change nothing. Earlier
``reasoning`` items become their assistant turn's ``reasoning_content`` (for templates that
render it).
"""
from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from runtime.server.openai.completions import (chat_answer, chat_base, count_chat_tokens,
                                        submit_chat)
from runtime.server.errors import APIError
from runtime.server.images import NO_PROJECTOR, image_bytes
from runtime.server.responses.stream import (ResponsesEvents, function_call_item,
                                             message_item, new_id, reasoning_item,
                                             response_object, usage_of)
from runtime.server.schemas import MEDIA_PARTS, ChatCompletionRequest, arguments_problem
from runtime.server.translated_stream import chat_request, event_source

router = APIRouter()

TEXT_PARTS = frozenset({"input_text", "output_text", "text"})


class ResponsesRequest(BaseModel):
    """A Responses request (``/v1/responses/input_tokens`` takes one too)."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None                  # any name: one model per process
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None        # {"format": {"type": text|json_object|json_schema}}
    reasoning: dict[str, Any] | None = None   # {"effort"}: "none"/"minimal" turn thinking off
    previous_response_id: str | None = None   # refused: nothing is stored here
    conversation: str | dict[str, Any] | None = None
    # labels: accepted, change nothing here
    store: bool | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    service_tier: str | None = None
    include: list[str] | None = None
    truncation: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stream: bool = False
    background: bool | None = None
    # llama.cpp's sampler fields
    top_k: int | None = Field(None, ge=0)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    seed: int | None = None
    # llama-server's telemetry (stream.py): timings on each event (the whole
    # answer's on a non-streamed one), the prompt's progress as response.in_progress events
    timings_per_token: bool = False
    return_progress: bool = False


def _parts(content: Any, where: str, images: list[str]) -> str | list[dict]:
    """A string, or a list of parts as the chat path's parts: text (joined there as the chat
    path joins them; run together in a prefill) and ``input_image`` parts as ``image_url``
    parts (``images`` collects where each one stands)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{where}: must be a string or a list of parts",
                       code="invalid_value", param=where)
    parts: list[dict] = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in TEXT_PARTS and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        elif kind == "refusal" and isinstance(part.get("refusal"), str):
            parts.append({"type": "text", "text": part["refusal"]})
        elif kind == "input_image":
            parts.append(_input_image(part, f"{where}.{i}"))
            images.append(f"{where}.{i}")
        elif kind in MEDIA_PARTS:
            raise APIError(400, f"{where}.{i}: {kind!r} parts are not taken here (images are "
                                "input_image parts with a data: URL, served with a multimodal "
                                "projector: llama-server's --mmproj)", code="invalid_value",
                           param=f"{where}.{i}")
        else:
            raise APIError(400, f"{where}.{i}: only text and image parts are supported (got "
                                f"{kind!r})", code="invalid_value", param=f"{where}.{i}")
    return parts


def _input_image(part: dict, where: str) -> dict:
    """An ``input_image`` part (``image_url``: a data: URL) as the chat's ``image_url`` part;
    a 400 naming ``where`` for a stored file or a URL to fetch."""
    if part.get("file_id") is not None:
        raise APIError(400, f"{where}.file_id: this server stores no files; send the image "
                            "inline (image_url: data:image/png;base64,...)",
                       code="invalid_value", param=f"{where}.file_id")
    url = part.get("image_url")
    if url is None:
        raise APIError(400, f"{where}: an input_image needs its image_url",
                       code="invalid_value", param=f"{where}.image_url")
    image_bytes(url, f"{where}.image_url", url=True)      # a bad one named here
    return {"type": "image_url", "image_url": {"url": url, "detail": part.get("detail")}}


def _messages(body: ResponsesRequest, images: list[str]) -> list[dict[str, Any]]:
    """The chat messages of the request; ``images`` gets where each image part stands."""
    messages: list[dict[str, Any]] = []
    if body.instructions:
        messages.append({"role": "system", "content": body.instructions})
    if isinstance(body.input, str):
        return messages + [{"role": "user", "content": body.input}]
    for i, item in enumerate(body.input):
        where = f"input.{i}"
        kind = item.get("type", "message")
        if kind == "message":
            if item.get("role") not in ("user", "system", "developer", "assistant"):
                raise APIError(400, f"{where}.role: must be user, system, developer or "
                                    "assistant", code="invalid_value", param=f"{where}.role")
            text = _parts(item.get("content", ""), f"{where}.content", images)
            last = messages[-1] if messages else None
            if item["role"] == "assistant" and last is not None and last["role"] == "assistant" \
                    and not last["content"] and not last.get("tool_calls"):
                last["content"] = text          # the answer after its reasoning item
            else:
                messages.append({"role": item["role"], "content": text})
        elif kind == "function_call":
            if not all(isinstance(item.get(k), str) for k in ("call_id", "name", "arguments")):
                raise APIError(400, f"{where}: a function_call needs call_id, name and "
                                    "arguments (strings)", code="invalid_value", param=where)
            if (problem := arguments_problem(item["arguments"])) is not None:
                raise APIError(400, f"{where}: the function_call item's arguments {problem}",
                               code="invalid_value", param=f"{where}.arguments")
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":   # calls of the same turn
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise APIError(400, f"{where}: a function_call_output needs its call_id",
                               code="invalid_value", param=where)
            messages.append({"role": "tool", "tool_call_id": item["call_id"],
                             "content": _parts(item.get("output", ""), f"{where}.output",
                                               images)})
        elif kind == "reasoning":       # an earlier answer's thinking: its reasoning_content
            parts = item.get("content") or item.get("summary") or []
            thought = "\n\n".join(p.get("text", "") for p in parts if isinstance(p, dict))
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last["reasoning_content"] = thought
            else:
                messages.append({"role": "assistant", "content": "",
                                 "reasoning_content": thought})
        elif kind == "item_reference":
            raise APIError(400, f"{where}: item references need stored responses, and this "
                                "server stores none; send the items themselves",
                           code="invalid_value", param=where)
        else:
            raise APIError(400, f"{where}: {kind!r} items are not supported here (messages, "
                                "function_call and function_call_output are)",
                           code="invalid_value", param=where)
    if not any(m["role"] != "system" for m in messages):
        raise APIError(400, "input: holds no message", code="invalid_value", param="input")
    return messages


def _tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    out = []
    for i, tool in enumerate(tools or []):
        if tool.get("type") != "function":
            raise APIError(400, f"tools.{i}: {tool.get('type')!r} tools are run by OpenAI's "
                                "servers, not here; give function tools",
                           code="invalid_value", param=f"tools.{i}")
        out.append({"type": "function", "function": {
            k: v for k, v in tool.items() if k != "type" and v is not None}})
    return out or None


def _tool_choice(choice: str | dict[str, Any] | None) -> Any:
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise APIError(400, "tool_choice: must be 'auto', 'none', 'required' or "
                                "{\"type\": \"function\", \"name\": NAME}",
                           code="invalid_value", param="tool_choice")
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice


def _response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    fmt = (text or {}).get("format")
    if fmt is None or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_schema":
        if "schema" not in fmt:
            raise APIError(400, "text.format: a json_schema format needs its 'schema'",
                           code="invalid_value", param="text.format.schema")
        return {"type": "json_schema", "json_schema": {
            k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}}
    return fmt


def to_chat_request(body: ResponsesRequest, has_projector: bool) -> ChatCompletionRequest:
    """The chat-completion request that generates this Responses request's answer (a 400 for
    images to a server without a projector)."""
    for name, value in (("previous_response_id", body.previous_response_id),
                        ("conversation", body.conversation),
                        ("background", body.background or None)):
        if value is not None:
            raise APIError(400, f"{name}: this server stores no responses or conversations; "
                                "send the whole conversation as input", code="invalid_value",
                           param=name)
    images: list[str] = []
    chat: dict[str, Any] = {"messages": _messages(body, images), "model": body.model,
                            "tools": _tools(body.tools),
                            "tool_choice": _tool_choice(body.tool_choice),
                            "parallel_tool_calls": body.parallel_tool_calls,
                            "response_format": _response_format(body.text)}
    if images and not has_projector:
        raise APIError(400, f"{images[0]}: image input {NO_PROJECTOR}", code="invalid_value",
                       param=images[0])
    effort = (body.reasoning or {}).get("effort")
    if effort is not None:
        chat["chat_template_kwargs"] = {"enable_thinking": effort not in ("none", "minimal")}
    chat |= {"max_tokens": body.max_output_tokens, "temperature": body.temperature,
             "top_p": body.top_p, "top_k": body.top_k, "min_p": body.min_p, "seed": body.seed,
             "stream": body.stream, "return_progress": body.return_progress or None}
    return chat_request(chat)


def _echo(body: ResponsesRequest, model: str) -> dict:
    """The request's settings a response repeats."""
    return {"model": model, "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens, "metadata": body.metadata or {},
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": None, "reasoning": body.reasoning or {},
            "store": False, "temperature": body.temperature, "top_p": body.top_p,
            "text": body.text or {"format": {"type": "text"}},
            "tool_choice": body.tool_choice or "auto", "tools": body.tools or [],
            "truncation": body.truncation or "disabled", "user": body.user}


def output_of(answer: dict) -> list[dict]:
    """A ``chat.completion`` answer's message as Responses output items."""
    message = answer["choices"][0]["message"]
    output = []
    if message.get("reasoning_content"):
        output.append(reasoning_item(new_id("rs"), message["reasoning_content"]))
    calls = message.get("tool_calls") or []
    if message.get("content") or not calls:
        output.append(message_item(new_id("msg"), message.get("content") or ""))
    for call in calls:
        output.append(function_call_item(new_id("fc"), call["id"], call["function"]["name"],
                                          call["function"]["arguments"]))
    return output


@router.post("/v1/responses")
@router.post("/responses", include_in_schema=False)
async def responses(body: ResponsesRequest, request: Request):
    """A Responses answer, streamed (Responses events) or not."""
    chat = to_chat_request(body, bool(request.app.state.settings.mmproj))
    prep, job = await submit_chat(request, chat)
    base = chat_base(request)
    echo = _echo(body, request.app.state.host.model_id)
    if not body.stream:
        answer = await chat_answer(request, chat, prep, job, base)
        usage = answer["usage"]
        status = "incomplete" if answer["choices"][0]["finish_reason"] == "length" else \
            "completed"
        out = response_object(
            new_id("resp"), answer["created"], echo, output_of(answer), status,
            usage_of(usage["prompt_tokens"], usage["completion_tokens"],
                     (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)))
        if body.timings_per_token and answer.get("timings"):
            out["timings"] = answer["timings"]
        return JSONResponse(out)
    events = ResponsesEvents(new_id("resp"), echo, prep.prompt_tokens, body.timings_per_token)
    return event_source(job, prep, base, events, lambda err: events.event(
        "error", code=err.code, message=err.message, param=err.param))


@router.post("/v1/responses/input_tokens")
@router.post("/responses/input_tokens", include_in_schema=False)
async def input_tokens(body: ResponsesRequest, request: Request) -> dict:
    """``{"object": "response.input_tokens", "input_tokens": N}`` (a whole Responses request is
    accepted: its other fields do not change the count)."""
    return {"object": "response.input_tokens",
            "input_tokens": await count_chat_tokens(
                request, to_chat_request(body, bool(request.app.state.settings.mmproj)))}
