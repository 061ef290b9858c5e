"""Structured output and tool calls: request fields in, a GBNF grammar (enforced by llama.cpp's
grammar sampler) and a parser of the model's tool calls out.

JSON schemas become GBNF through llama-cpp-python's converter (schema_grammar.py).
Tool calls follow the format the model's chat template teaches (``ToolFormat``): Hermes / Qwen
``<tool_call>{json}</tool_call>``, Mistral ``[TOOL_CALLS][{...}]``, Llama 3.x bare
``{"name": ..., "parameters": ...}``. A template that knows no tools (ChatML, our synthetic
models) gets the tools in a Hermes-style system message. ``tool_choice`` ``required`` or a named
function constrains decoding to one call of the allowed function(s) with arguments that match
its parameters' schema, so even a random-weight model answers with a valid call.
"""
from __future__ import annotations

import enum
import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from runtime.server.errors import APIError
from runtime.server.schema_grammar import rebased, schema_to_gbnf


class ToolFormat(enum.Enum):
    HERMES = "hermes"       # <tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>
    MISTRAL = "mistral"     # [TOOL_CALLS][{"name": ..., "arguments": {...}}]
    LLAMA3 = "llama3"       # {"name": ..., "parameters": {...}}


@dataclass(frozen=True, slots=True)
class ToolCall:
    id: str
    name: str
    arguments: str          # JSON text, as OpenAI returns it

    def to_openai(self, index: int | None = None) -> dict:
        out: dict[str, Any] = {"id": self.id, "type": "function",
                               "function": {"name": self.name, "arguments": self.arguments}}
        if index is not None:
            out = {"index": index} | out
        return out


def _gbnf(schema: Any, param: str) -> str:
    grammar = schema_to_gbnf(schema, param)
    # JSON strings hold no raw control characters; the converter's [^"\\] lets them through
    # (llama.cpp's own converter excludes them the same way)
    return grammar.replace('char ::= [^"\\\\]', 'char ::= [^"\\\\\\x7F\\x00-\\x1F]', 1)


def grammar_for_output(response_format: dict | None, json_schema: Any,
                       grammar: str | None) -> str | None:
    """The GBNF for ``response_format`` / llama.cpp's ``json_schema`` / ``grammar`` (at most
    one of them may constrain the answer), or None."""
    given = [name for name, v in (("response_format", response_format), ("json_schema",
             json_schema), ("grammar", grammar)) if v is not None and not (
             name == "response_format" and v.get("type") == "text")]
    if len(given) > 1:
        raise APIError(400, f"{given[1]}: only one of response_format, json_schema and grammar "
                            "may be given", code="invalid_value", param=given[1])
    if grammar is not None:
        return grammar
    if json_schema is not None:
        return _gbnf(json_schema, "json_schema")
    if response_format is None:
        return None
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":           # llama-server also takes a "schema" here
        return _gbnf(response_format.get("schema") or {"type": "object"},
                     "response_format.schema")
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise APIError(400, "response_format.json_schema: needs an object with a 'schema'",
                           code="invalid_value", param="response_format.json_schema")
        return _gbnf(spec["schema"], "response_format.json_schema.schema")
    raise APIError(400, f"response_format.type: {kind!r} is not one of 'text', 'json_object', "
                        "'json_schema'", code="invalid_value", param="response_format.type")


# -- tools --------------------------------------------------------------------------------

def tool_format(template_source: str) -> ToolFormat:
    """The call format a chat template teaches (Hermes when it teaches none)."""
    if "[TOOL_CALLS]" in template_source:
        return ToolFormat.MISTRAL
    if "<tool_call>" in template_source:
        return ToolFormat.HERMES
    if "<|python_tag|>" in template_source or "ipython" in template_source:
        return ToolFormat.LLAMA3
    return ToolFormat.HERMES


def template_knows_tools(template_source: str) -> bool:
    return "tools" in template_source


def tools_system_text(tools: list[dict]) -> str:
    """The Hermes-style system text for a template that does not render tools itself."""
    lines = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n"
            f"<tools>\n{lines}\n</tools>\n\nFor each function call, return a json object with "
            "function name and arguments within <tool_call></tool_call> XML tags:\n"
            '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n'
            "</tool_call>")


def check_tool_schemas(tools: list[dict]) -> None:
    """400 for a tool whose parameters are no JSON schema the grammar converter takes, even
    when no call is forced (``auto``): it would be accepted silently, and a later forced call
    with it would fail."""
    for i, tool in enumerate(tools):
        params = tool.get("function", {}).get("parameters")
        if params is not None:
            _gbnf(params, f"tools.{i}.function.parameters")


def selected_functions(tools: list[dict], tool_choice: Any) -> list[dict] | None:
    """The functions decoding must call (required / named), or None (auto / none)."""
    if tool_choice in (None, "auto", "none"):
        return None
    functions = [t["function"] for t in tools]
    if tool_choice == "required":
        return functions
    name = tool_choice["function"]["name"]
    chosen = [f for f in functions if f["name"] == name]
    if not chosen:
        raise APIError(400, f"tool_choice.function.name: {name!r} is not among the tools",
                       code="invalid_value", param="tool_choice.function.name")
    return chosen


def call_grammar(functions: list[dict], fmt: ToolFormat) -> str:
    """GBNF for exactly one call of one of ``functions``, in ``fmt``."""
    key = "parameters" if fmt is ToolFormat.LLAMA3 else "arguments"
    # each function's parameters sit at .../properties/KEY of the call's schema: their refs
    # are rebased there (a recursive $defs tree resolves as it does on its own)
    at = [f"/properties/{key}" if len(functions) == 1 else f"/oneOf/{i}/properties/{key}"
          for i in range(len(functions))]
    alternatives = [{"type": "object",
                     "properties": {"name": {"const": f["name"]},
                                    key: rebased(f.get("parameters") or {"type": "object"},
                                                 pointer)},
                     "required": ["name", key]} for f, pointer in zip(functions, at)]
    schema = alternatives[0] if len(alternatives) == 1 else {"oneOf": alternatives}
    body = _gbnf(schema, "tools").replace("root ::=", "call ::=", 1)
    if fmt is ToolFormat.HERMES:
        root = 'root ::= "<tool_call>\\n" call "\\n</tool_call>"'
    elif fmt is ToolFormat.MISTRAL:
        root = 'root ::= "[" call "]"'      # after [TOOL_CALLS], a control token
    else:
        root = "root ::= call"
    return f"{root}\n{body}"


_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


def began_tool_call(text: str, fmt: ToolFormat) -> bool:
    """The answer opens a tool call in ``fmt``'s manner (whether or not it parses)."""
    if fmt is ToolFormat.HERMES:
        return "<tool_call>" in text
    return text.lstrip().startswith(("[TOOL_CALLS]", "<|python_tag|>", "{", "["))


def cut_call_note(max_tokens: int) -> str:
    """The hint on a choice that max_tokens ended inside a tool call (``finish_reason``
    "length"): OpenAI's answer has no field for it, so the choice gets a ``note``."""
    return (f"the answer reached max_tokens ({max_tokens}) inside a tool call: the unfinished "
            "call is left in content as text; raise max_tokens to get the whole call")


def parse_tool_calls(text: str, fmt: ToolFormat) -> tuple[str | None, list[ToolCall]]:
    """(content left over or None, calls) from a generated answer. Text that holds no
    well-formed call is all content."""
    calls: list[ToolCall] = []
    content = text
    if fmt is ToolFormat.HERMES and "<tool_call>" in text:
        for match in _HERMES.finditer(text):
            calls.extend(_calls_from_json(match.group(1)))
        content = _HERMES.sub("", text)
    else:
        stripped = text.strip()
        for marker in ("[TOOL_CALLS]", "<|python_tag|>"):
            stripped = stripped.removeprefix(marker).strip()
        if stripped[:1] in ("{", "["):
            calls = _calls_from_json(stripped)
            if calls:
                content = ""
    content = content.strip()
    return (content or None), calls


def _calls_from_json(text: str) -> list[ToolCall]:
    try:
        data = json.loads(text)
    except ValueError:
        return []
    items = data if isinstance(data, list) else [data]
    calls = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            return []
        args = item.get("arguments", item.get("parameters", {}))
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                return []
        calls.append(ToolCall(f"call_{uuid.uuid4().hex[:24]}", item["name"],
                              json.dumps(args, ensure_ascii=False)))
    return calls


def history_messages(messages: list[dict], fmt: ToolFormat, *, template_tools: bool,
                     tools: list[dict] | None) -> list[dict]:
    """Messages for the chat template: with a template that does not know tools, the tools
    go into the system message, earlier assistant calls become their text form and tool
    results stay ``tool`` messages; with one that does, calls keep OpenAI's structure (the
    arguments parsed into objects, as Hugging Face templates expect)."""
    out = []
    for m in messages:
        m = dict(m)
        calls = m.pop("tool_calls", None) or []
        if template_tools:
            if calls:
                m["tool_calls"] = [{"id": c.get("id"), "type": "function", "function": {
                    "name": c["function"]["name"],
                    "arguments": _loads_or_keep(c["function"].get("arguments", "{}"))}}
                    for c in calls]
            out.append(m)
            continue
        if calls:
            text = "\n".join(_call_text(c["function"]["name"],
                                        _loads_or_keep(c["function"].get("arguments", "{}")),
                                        fmt) for c in calls)
            m["content"] = ((m.get("content") or "") + ("\n" if m.get("content") else "")
                            + text)
        m.pop("tool_call_id", None)
        m.pop("name", None)
        m["content"] = m.get("content") or ""
        out.append(m)
    if tools and not template_tools:
        system = tools_system_text(tools)
        if out and out[0]["role"] == "system":
            out[0] = out[0] | {"content": out[0]["content"] + "\n\n" + system}
        else:
            out.insert(0, {"role": "system", "content": system})
    return out


def _loads_or_keep(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            return value
    return value


def _call_text(name: str, args: Any, fmt: ToolFormat) -> str:
    if fmt is ToolFormat.MISTRAL:
        return "[TOOL_CALLS]" + json.dumps([{"name": name, "arguments": args}])
    if fmt is ToolFormat.LLAMA3:
        return json.dumps({"name": name, "parameters": args})
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': args})}\n</tool_call>"
