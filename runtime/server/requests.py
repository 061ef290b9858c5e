"""Requests made ready for the engine: prompt, sampling parameters (grammar, bias, logprobs),
length checked against the context, tool handling decided. Runs off the event loop (it
tokenizes and renders templates)."""
from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Any

from fastapi import Request

from runtime.engine.projector import MediaPrompt
from runtime.engine.sampling import SamplingParams, check_grammar
from runtime.errors import UserError
from runtime.server import structured
from runtime.server.errors import APIError
from runtime.server.images import image_bytes, media_prompt, require_projector
from runtime.server.limits import Limits, check_prompt_tokens, check_request
from runtime.server.reasoning import thinking_forced_open
from runtime.server.schemas import (ChatCompletionRequest, CompletionRequest, ImagePart,
                                    _SamplingFields)
from runtime.server.token_ids import checked_id, checked_ids, engine_vocab

DEFAULT_COMPLETION_MAX_TOKENS = 16   # OpenAI's default for /v1/completions


@dataclass(frozen=True, slots=True)
class Prepared:
    """A request ready for the engine: ``n`` choices of ``prompt`` with ``params``."""

    prompt: str | list[int] | MediaPrompt      # MediaPrompt: with images (server/images.py)
    prompt_tokens: int
    params: SamplingParams
    n: int = 1
    tool_format: structured.ToolFormat | None = None   # parse tool calls from the answers
    echo_text: str = ""                               # completions' echo: the prompt text
    progress: bool = False                            # return_progress: stream the prefill's
    # reasoning_format: None = no split; else whether the answer starts inside <think>
    thinking: bool | None = None
    cache_prompt: bool = True                         # false: evaluate the whole prompt
    id_slot: int = -1                                 # the -np slot asked for; -1: any
    truncated: bool = False                           # --context-shift cut the prompt

    def choice_params(self, index: int) -> SamplingParams:
        """Choice ``index``'s parameters: a given seed moves on by one per choice."""
        if index == 0 or self.params.seed < 0:
            return self.params
        return replace(self.params, seed=(self.params.seed + index) & 0x7FFFFFFF)


def checked_slot(engine: Any, id_slot: int | None) -> int:
    """The request's ``id_slot`` (-1: any), or a 400 when there is no such slot."""
    n_slots = int(getattr(getattr(engine, "settings", None), "n_parallel", 1) or 1)
    if id_slot is None or id_slot == -1:
        return -1
    if not 0 <= id_slot < n_slots:
        raise APIError(400, f"id_slot: {id_slot} is not a slot (0..{n_slots - 1})",
                       code="invalid_value", param="id_slot")
    return id_slot


def context_error(n_prompt: int, n_ctx: int, what: str, n_predict: int | None = None) -> APIError:
    """The context-overflow answer: OpenAI's code, llama-server's type and numbers."""
    asked = "" if n_predict is None else (
        f" However, you requested {n_prompt + n_predict} tokens ({n_prompt} in the {what}, "
        f"{n_predict} in the completion).")
    err = APIError(400, f"The request exceeds the available context size: this model's "
                        f"maximum context length is {n_ctx} tokens.{asked} "
                        f"The {what} has {n_prompt} tokens; please reduce its length or the "
                        "completion's.", code="context_length_exceeded",
                   param="messages" if what == "messages" else "prompt",
                   # the prompt itself does not fit: llama-server's type, with its numbers
                   error_type="exceed_context_size_error" if n_predict is None else None)
    err.extra = {"n_prompt_tokens": n_prompt, "n_ctx": n_ctx}
    return err


def check_context(engine: Any, n_prompt: int, max_tokens: int | None, default: int | None,
                  param: str, limits: Limits | None = None) -> int:
    """Resolve max_tokens (tokens), at most what is left of the context after the prompt;
    refuse a prompt that does not fit the context window or ``limits``."""
    check_prompt_tokens(n_prompt, limits, "messages" if param == "messages" else "prompt")
    n_ctx = int(engine.n_ctx)
    if n_prompt >= n_ctx:
        raise context_error(n_prompt, n_ctx, "messages" if param == "messages" else "prompt")
    if max_tokens is None:
        max_tokens = default if default is not None else n_ctx - n_prompt
    if getattr(getattr(engine, "settings", None), "context_shift", False):
        return max_tokens               # the context shifts when it is full
    # as llama-server: the answer stops where the context ends (finish_reason "length")
    return min(max_tokens, n_ctx - n_prompt)


SAMPLER_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repeat_penalty", "seed",
                  "frequency_penalty", "presence_penalty")


def sampling_params(req: _SamplingFields, max_tokens: int, *, grammar: str | None = None,
                    logprobs: int | None = None, post_sampling: bool = False, n_keep: int = 0,
                    defaults: SamplingParams | None = None) -> SamplingParams:
    """The request's sampler fields; unset ones take ``defaults`` (the server's own flags,
    as llama-server does), else SamplingParams' defaults."""
    fields: dict[str, Any] = {"max_tokens": max_tokens, "stop": req.stop_list(),
                              "logit_bias": req.logit_bias_ids(), "grammar": grammar,
                              "logprobs": logprobs, "post_sampling": post_sampling,
                              "n_keep": n_keep,
                              "ignore_eos": defaults is not None and defaults.ignore_eos}
    for name in SAMPLER_FIELDS:
        value = getattr(req, name)
        if value is None and defaults is not None:
            value = getattr(defaults, name)
        if value is not None:
            fields[name] = value
    if not fields["stop"] and defaults is not None and defaults.stop:
        fields["stop"] = list(defaults.stop)
    try:
        return SamplingParams(**fields)
    except UserError as exc:
        raise APIError(400, str(exc), code="invalid_value") from exc


def checked_lora(engine: Any, entries: Any) -> dict[int, float] | None:
    """A request's ``"lora"`` field as ``{id: scale}`` (None when absent), or a 400."""
    if entries is None:
        return None
    adapters = getattr(engine, "lora", None)
    if not isinstance(entries, list):
        raise APIError(400, "lora: must be an array of objects with 'id' and 'scale' fields",
                       code="invalid_value", param="lora")
    if adapters is None:
        if not entries:
            return None
        raise APIError(400, "lora: this server has no LoRA adapters (start it with --lora "
                            "FILE)", code="invalid_value", param="lora")
    try:
        return adapters.checked(entries, "lora")
    except UserError as exc:
        raise APIError(400, str(exc), code="invalid_value", param="lora") from exc


def checked_grammar(engine: Any, grammar: str | None, param: str) -> str | None:
    if grammar is None:
        return None
    vocab = getattr(engine, "vocab_ptr", None)
    if vocab is not None:
        try:
            check_grammar(vocab, grammar)
        except UserError as exc:
            reason = str(exc).removeprefix("grammar: ")
            raise APIError(400, f"{param}: {reason}", code="invalid_value", param=param) from exc
    return grammar


def _check_bias(engine: Any, req: _SamplingFields) -> None:
    n_vocab = engine_vocab(engine)
    for token in req.logit_bias_ids():
        checked_id(token, n_vocab, "logit_bias")


def template_variables(reasoning: str, kwargs: dict | None) -> dict:
    """The chat template's extra variables, as llama-server passes them: ``enable_thinking``
    (false only with ``--reasoning off``), then the request's ``chat_template_kwargs``."""
    return {"enable_thinking": reasoning != "off"} | (kwargs or {})


def render_prompt(engine: Any, messages: list[dict], *, tools: list[dict] | None,
                  add_generation_prompt: bool | None, variables: dict) -> str:
    """The chat template's prompt for ``messages`` (a 400 when the template refuses them). A
    last assistant message without tool calls is the start of the answer (prefill), unless
    ``add_generation_prompt`` is true: rendered, then cut right after its text, so that the
    model continues it (llama-server appends the text after the generation prompt; templates
    that close every turn leave the same text open)."""
    prefill = bool(messages) and messages[-1]["role"] == "assistant" \
        and not messages[-1].get("tool_calls") and not add_generation_prompt
    add = not prefill if add_generation_prompt is None else add_generation_prompt
    try:
        prompt = engine.chat_prompt(messages, tools=tools,
                                    add_generation_prompt=add and not prefill,
                                    variables=variables)
    except Exception as exc:  # noqa: BLE001 - a template refusing the messages is the client's
        raise APIError(400, f"messages: the chat template rejected them: {exc}",
                       code="invalid_value", param="messages") from exc
    if prefill:     # templates close every turn; the prefill must stay open
        text = messages[-1]["content"]
        end = prompt.rfind(text)
        if text and end >= 0:
            prompt = prompt[:end + len(text)]
    return prompt


def prepare_chat(engine: Any, req: ChatCompletionRequest,
                 defaults: SamplingParams | None = None, reasoning: str = "auto",
                 reasoning_format: str = "auto", *, limits: Limits | None = None) -> Prepared:
    if limits is not None:               # grammars and schemas, before any is converted
        check_request(req, limits)
    tools = req.tool_dicts()
    if tools:
        structured.check_tool_schemas(tools)
    choice = req.tool_choice_value()
    if choice == "none":
        tools = None
    source = engine.chat_template.source
    fmt = structured.tool_format(source) if tools else None
    template_tools = structured.template_knows_tools(source)
    messages = structured.history_messages(req.message_dicts(), fmt or structured.ToolFormat.HERMES,
                                           template_tools=template_tools, tools=tools)
    output_grammar = structured.grammar_for_output(req.response_format, req.json_schema,
                                                   req.grammar)
    functions = structured.selected_functions(tools, choice) if tools else None
    if functions is not None and output_grammar is not None:
        raise APIError(400, "tool_choice: a required or named tool call cannot be combined "
                            "with response_format, json_schema or grammar",
                       code="invalid_value", param="tool_choice")
    grammar = structured.call_grammar(functions, fmt) if functions is not None else output_grammar
    images = chat_images(engine, req)
    prompt = render_prompt(engine, messages, tools=tools if template_tools else None,
                           add_generation_prompt=req.add_generation_prompt,
                           variables=template_variables(reasoning, req.template_kwargs()))
    text = prompt
    if images:
        prompt = media_prompt(engine, text, images, "messages")
        n_prompt = len(prompt)
    else:
        n_prompt = len(engine.tokenize(prompt, add_special=True))
    max_tokens = check_context(engine, n_prompt, req.requested_max_tokens(), None, "messages",
                               limits)
    _check_bias(engine, req)
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    params = sampling_params(req, max_tokens, logprobs=logprobs, defaults=defaults,
                             grammar=checked_grammar(engine, grammar, "grammar"))
    params.lora = checked_lora(engine, req.lora)
    split = (req.reasoning_format or reasoning_format) != "none"
    return Prepared(prompt, n_prompt, params, req.n, tool_format=fmt,
                    progress=req.return_progress, cache_prompt=req.cache_prompt is not False,
                    id_slot=checked_slot(engine, req.id_slot),
                    thinking=thinking_forced_open(text) if split else None)


def chat_images(engine: Any, req: ChatCompletionRequest) -> list[bytes]:
    """The bytes of the request's image parts, in prompt order; a 400 when there are some and
    the server has no projector, or one is not inline base64."""
    found = [(f"messages.{i}.content.{j}", part) for i, m in enumerate(req.messages)
             if isinstance(m.content, list)
             for j, part in enumerate(m.content) if isinstance(part, ImagePart)]
    if found:
        require_projector(engine, found[0][0])
    return [image_bytes(part.url, f"{where}.image_url.url", url=True)
            for where, part in found]


def prepare_completion(engine: Any, req: CompletionRequest,
                       defaults: SamplingParams | None = None, *,
                       limits: Limits | None = None) -> Prepared:
    if limits is not None:               # grammars and schemas, before any is converted
        check_request(req, limits)
    prompt = req.prompt_input()
    if isinstance(prompt, list):
        check_prompt_tokens(len(prompt), limits, "prompt")
        prompt = checked_ids(prompt, engine_vocab(engine), "prompt")
        n_prompt = len(prompt)
    else:
        n_prompt = len(engine.tokenize(prompt, add_special=True))
    max_tokens = check_context(engine, n_prompt, req.max_tokens,
                               DEFAULT_COMPLETION_MAX_TOKENS, "prompt", limits)
    _check_bias(engine, req)
    grammar = structured.grammar_for_output(req.response_format, req.json_schema, req.grammar)
    params = sampling_params(req, max_tokens, logprobs=req.logprobs, defaults=defaults,
                             grammar=checked_grammar(engine, grammar, "grammar"))
    params.lora = checked_lora(engine, req.lora)
    echo = "" if not req.echo else (prompt if isinstance(prompt, str)
                                    else engine.detokenize(prompt))
    return Prepared(prompt, n_prompt, params, req.n, echo_text=echo,
                    cache_prompt=req.cache_prompt is not False,
                    id_slot=checked_slot(engine, req.id_slot))


async def json_object(request: Request) -> dict:
    """The request's body as a JSON object (an empty body is ``{}``), or a 400."""
    try:
        body = json.loads(await request.body() or b"{}")
    except (ValueError, RecursionError) as exc:    # (body_guard.py bounds the depth first)
        raise APIError(400, f"We could not parse the JSON body of your request ({exc}).",
                       code="invalid_json") from exc
    if not isinstance(body, dict):
        raise APIError(400, "The request body must be a JSON object.", code="invalid_json")
    return body
