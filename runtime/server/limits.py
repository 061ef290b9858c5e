"""What one request may ask of the server: body size and depth, prompt tokens, grammar and
schema size, stop strings, tokenize / detokenize size.

Each limit is checked before the work it bounds starts, and a request over one is a 400
``limit_exceeded`` that names the limit and the flag that raises it (the body's size is
checked by body_guard.py). Why these: llama-cpp-python's
JSON-schema converter writes a repetition out in full (``minLength: 100000000`` is a 100-million
element rule: 20 s and 3 GB before llama.cpp sees it), and llama.cpp's grammar parser then
expands each ``{m,n}`` into rules; both run while other slots wait.
"""
from __future__ import annotations

import re
from json import dumps
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from runtime.engine.sampling import outside_literals
from runtime.server.errors import APIError

# JSON-schema keywords that count repetitions (the converter writes each out in full)
COUNT_KEYWORDS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties",
                  "maxProperties", "minContains", "maxContains")
TOTAL_REPEAT_FACTOR = 16       # the whole schema/grammar may repeat 16x the per-count limit
MAX_SCHEMA_DEPTH = 64          # nested schema objects/lists


@dataclass(frozen=True, slots=True)
class Limits:
    """Per-request limits (``serve`` flags in brackets)."""

    max_body_bytes: int = 16 << 20        # bytes of one request body (--max-body-mib)
    max_prompt_tokens: int | None = None  # None: the context decides (--max-prompt-tokens)
    max_grammar_bytes: int = 256 << 10    # bytes of a grammar or a schema (--max-grammar-kib)
    # one count: minLength, maxItems, x{m,n} (--max-grammar-repeat); llama.cpp's grammar parser
    # refuses the converter's nested optional rules past ~1000 (maxLength 1024 fails there)
    max_repeat: int = 1000
    # nested arrays/objects in a JSON body, checked before anything parses it (Python's parser
    # recurses once per level: 100k levels were a RecursionError); a tool schema at
    # MAX_SCHEMA_DEPTH sits about 70 deep (--max-json-depth)
    max_json_depth: int = 128
    # stop strings: each is searched for in the text after every token, on the thread that
    # steps every slot (--max-stop-strings, --max-stop-bytes: their UTF-8 bytes together)
    max_stop_strings: int = 64
    max_stop_bytes: int = 4096
    # /tokenize's content (--max-tokenize-kib) and /detokenize's ids (--max-detokenize-tokens)
    max_tokenize_bytes: int = 1 << 20
    max_detokenize_tokens: int = 1 << 18

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "max_grammar_bytes", "max_repeat", "max_json_depth",
                     "max_stop_strings", "max_stop_bytes", "max_tokenize_bytes",
                     "max_detokenize_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.max_prompt_tokens is not None and self.max_prompt_tokens < 1:
            raise ValueError("max_prompt_tokens must be >= 1")

    @property
    def max_total_repeat(self) -> int:
        return self.max_repeat * TOTAL_REPEAT_FACTOR


def _over(param: str, what: str, value: int, limit: int, flag: str) -> APIError:
    return APIError(400, f"{param}: {what} {value} is over this server's limit of {limit} "
                         f"({flag})", code="limit_exceeded", param=param)


def check_prompt_tokens(n_prompt: int, limits: Limits | None, param: str) -> None:
    if limits is not None and limits.max_prompt_tokens is not None \
            and n_prompt > limits.max_prompt_tokens:
        raise _over(param, "a prompt of", n_prompt, limits.max_prompt_tokens,
                    "prompt tokens, --max-prompt-tokens")


# a regex / GBNF repetition: {m}, {m,}, {m,n}
_REPEAT = re.compile(r"\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}")


def _repeats(text: str) -> Iterator[int]:
    for m in _REPEAT.finditer(text):
        yield max(int(m.group(1)), int(m.group(2) or 0))


def _walk(node: Any, path: str, depth: int = 0) -> Iterator[tuple[str, Any, int]]:
    """(path, node, depth) of every dict and list in a schema, depth first, iteratively."""
    stack = [(path, node, depth)]
    while stack:
        path, node, depth = stack.pop()
        yield path, node, depth
        items = node.items() if isinstance(node, dict) else \
            enumerate(node) if isinstance(node, list) else ()
        for key, child in items:
            if isinstance(child, (dict, list)):
                stack.append((f"{path}.{key}", child, depth + 1))


def check_schema(schema: Any, limits: Limits, param: str) -> None:
    """400 when a JSON schema is too big, too deep, or repeats too much (each count and
    each ``pattern`` repetition against ``max_repeat``, their sum against 16x that)."""

    size = len(dumps(schema))
    if size > limits.max_grammar_bytes:
        raise _over(param, "a schema of", size, limits.max_grammar_bytes,
                    "bytes, --max-grammar-kib")
    total = 0
    for path, node, depth in _walk(schema, param):
        if depth > MAX_SCHEMA_DEPTH:
            raise _over(path, "nesting depth", depth, MAX_SCHEMA_DEPTH, "levels")
        if not isinstance(node, dict):
            continue
        counts = [(k, node[k]) for k in COUNT_KEYWORDS if k in node]
        if isinstance(node.get("pattern"), str):
            # the converter writes a regex's nested repetitions out inside each other: the
            # product counts (all of them multiplied: an upper bound)
            product = 1
            for n in _repeats(node["pattern"]):
                product = min(product * max(n, 1), limits.max_repeat + 1)
            counts.append(("pattern repetition", product))
        for key, value in counts:
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise APIError(400, f"{path}.{key}: must be a non-negative integer",
                               code="invalid_value", param=param)
            if value > limits.max_repeat:
                raise _over(f"{path}", key, value, limits.max_repeat,
                            "repetitions, --max-grammar-repeat")
            total += value
    if total > limits.max_total_repeat:
        raise _over(param, "repetitions adding up to", total, limits.max_total_repeat,
                    "16x --max-grammar-repeat")


def check_grammar(grammar: str, limits: Limits, param: str) -> None:
    """400 when a GBNF grammar is too big or repeats too much (each ``{m,n}``)."""
    size = len(grammar.encode("utf-8", "surrogatepass"))
    if size > limits.max_grammar_bytes:
        raise _over(param, "a grammar of", size, limits.max_grammar_bytes,
                    "bytes, --max-grammar-kib")
    total = 0
    for n in _repeats(outside_literals(grammar)):
        if n > limits.max_repeat:
            raise _over(param, "a repetition of", n, limits.max_repeat,
                        "--max-grammar-repeat")
        total += n
    if total > limits.max_total_repeat:
        raise _over(param, "repetitions adding up to", total, limits.max_total_repeat,
                    "16x --max-grammar-repeat")


def check_stop(stop: list[str], limits: Limits, param: str = "stop") -> None:
    """400 when a request's stop strings are too many or too long together."""
    if len(stop) > limits.max_stop_strings:
        raise _over(param, "a list of", len(stop), limits.max_stop_strings,
                    "stop strings, --max-stop-strings")
    size = sum(len(s.encode("utf-8", "surrogatepass")) for s in stop)
    if size > limits.max_stop_bytes:
        raise _over(param, "stop strings of", size, limits.max_stop_bytes,
                    "bytes together, --max-stop-bytes")


def check_tokenize(content: str, limits: Limits) -> None:
    size = len(content.encode("utf-8", "surrogatepass"))
    if size > limits.max_tokenize_bytes:
        raise _over("content", "a text of", size, limits.max_tokenize_bytes,
                    "bytes, --max-tokenize-kib")


def check_detokenize(tokens: list, limits: Limits) -> None:
    if len(tokens) > limits.max_detokenize_tokens:
        raise _over("tokens", "a list of", len(tokens), limits.max_detokenize_tokens,
                    "token ids, --max-detokenize-tokens")


def check_request(body: Any, limits: Limits) -> None:
    """Every grammar, schema and stop string a completion request carries, before any is
    converted: ``grammar``, ``json_schema``, ``response_format``'s schema, each tool's
    parameters, ``stop``."""
    stop = getattr(body, "stop", None)
    if stop:
        check_stop([stop] if isinstance(stop, str) else list(stop), limits)
    grammar = getattr(body, "grammar", None)
    if isinstance(grammar, str):
        check_grammar(grammar, limits, "grammar")
    schema = getattr(body, "json_schema", None)
    if schema is not None:
        check_schema(schema, limits, "json_schema")
    fmt = getattr(body, "response_format", None)
    if isinstance(fmt, dict):
        spec = fmt.get("json_schema")
        if isinstance(spec, dict) and "schema" in spec:
            check_schema(spec["schema"], limits, "response_format.json_schema.schema")
        if "schema" in fmt:
            check_schema(fmt["schema"], limits, "response_format.schema")
    for i, tool in enumerate(getattr(body, "tools", None) or ()):
        params = tool.function.parameters
        if params is not None:
            check_schema(params, limits, f"tools.{i}.function.parameters")
