"""JSON schema -> GBNF, through llama-cpp-python's converter with its ``$ref`` handling fixed.

The converter (``llama_cpp.llama_grammar.SchemaConverter``) stops looking for ``$ref``s at the
first object that has one, so a schema whose root is ``{"$ref": ..., "$defs": ...}`` leaves the
refs inside ``$defs`` unresolved and fails with a bare ``KeyError``: recursive schemas that
llama.cpp's own converter takes (a tree whose nodes hold a list of nodes) were refused.
Here every local ref is resolved first, and a ref loop that holds nothing before it refers back
to itself (``a -> b -> a`` through ``$ref``, ``anyOf`` or ``oneOf``: no JSON value could end it,
and llama.cpp refuses the left recursion it makes) is refused as a "recursive $ref".
"""
from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

from runtime.server.errors import APIError


def _target(schema: Any, ref: str, param: str) -> Any:
    if not isinstance(ref, str) or not ref.startswith("#/"):
        raise APIError(400, f"{param}: $ref {ref!r} is not supported (only local refs into "
                            "the schema, '#/...')", code="invalid_value", param=param)
    node = schema
    for part in ref[2:].split("/"):
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            raise APIError(400, f"{param}: $ref {ref!r} points to nothing in the schema",
                           code="invalid_value", param=param)
    if not isinstance(node, dict):
        raise APIError(400, f"{param}: $ref {ref!r} does not point to a schema object",
                       code="invalid_value", param=param)
    return node


def _head_refs(node: Any) -> list[str]:
    """The refs a schema may turn into before any character of its value is produced: its
    own ``$ref`` and those of its ``anyOf`` / ``oneOf`` alternatives (objects and arrays
    start with a bracket, so a ref under ``properties`` or ``items`` is not at the head)."""
    if not isinstance(node, dict):
        return []
    if isinstance(node.get("$ref"), str):
        return [node["$ref"]]
    refs: list[str] = []
    for key in ("anyOf", "oneOf"):
        for alt in node.get(key) or []:
            refs += _head_refs(alt)
    return refs


def _ref_nodes(node: Any) -> Iterator[dict]:
    """Every dict under ``node`` holding a string ``$ref`` (a property may be named "$ref":
    only a string is a reference), depth first."""
    stack = [node]
    while stack:
        n = stack.pop()
        if isinstance(n, dict):
            stack.extend(v for k, v in n.items() if k != "$ref")
            if isinstance(n.get("$ref"), str):
                yield n
        elif isinstance(n, list):
            stack.extend(n)


def _all_refs(node: Any) -> list[str]:
    return [n["$ref"] for n in _ref_nodes(node)]


def check_refs(schema: Any, param: str) -> None:
    """400 for a ref that is not local, points nowhere, or loops with nothing in between."""
    targets = {ref: _target(schema, ref, param) for ref in _all_refs(schema)}
    edges = {ref: _head_refs(target) for ref, target in targets.items()}
    done: set[str] = set()
    for start in [*_head_refs(schema), *edges]:
        path: list[str] = []
        on_path: set[str] = set()
        stack = [(start, False)]
        while stack:                  # iterative DFS over head refs; a back edge is a loop
            ref, leaving = stack.pop()
            if leaving:
                on_path.discard(ref)
                path.pop()
                done.add(ref)
                continue
            if ref in on_path:
                loop = " -> ".join([*path[path.index(ref):], ref])
                raise APIError(400, f"{param}: recursive $ref with nothing in between "
                                    f"({loop}): no JSON value can end it; a schema must hold "
                                    "an object or array before it refers back to itself",
                               code="invalid_value", param=param)
            if ref in done:
                continue
            on_path.add(ref)
            path.append(ref)
            stack.append((ref, True))
            stack.extend((r, False) for r in edges.get(ref, []))


def _converter():
    from llama_cpp.llama_grammar import SchemaConverter  # noqa: PLC0415

    class Converter(SchemaConverter):
        def resolve_refs(self, schema: dict, url: str) -> dict:
            """Every local ``$ref`` made absolute and registered, wherever it is."""
            for n in list(_ref_nodes(schema)):
                ref = n["$ref"]
                if ref.startswith("#/"):
                    n["$ref"] = f"{url}{ref}"
                    self._refs[n["$ref"]] = _target(schema, ref, "schema")
            return schema

    return Converter(prop_order={}, allow_fetch=False, dotall=False, raw_pattern=False)


def rebased(schema: Any, pointer: str) -> Any:
    """A copy of ``schema`` to be placed at JSON pointer ``pointer`` (``"/properties/x"``) of
    a bigger schema: its local refs (``#/$defs/a``, relative to its own root) rewritten to
    reach the same nodes from the bigger schema's root (``#/properties/x/$defs/a``), so a
    tool's recursive ``$defs`` work inside the call grammar as they do on their own."""
    schema = copy.deepcopy(schema)
    for node in _ref_nodes(schema):
        ref = node["$ref"]
        if ref == "#" or ref.startswith("#/"):
            node["$ref"] = f"#{pointer}{ref[1:]}"
    return schema


def schema_to_gbnf(schema: Any, param: str) -> str:
    """GBNF for ``schema``; a 400 naming ``param`` when it cannot be one."""
    if not isinstance(schema, dict):
        raise APIError(400, f"{param}: must be a JSON schema object", code="invalid_value",
                       param=param)
    check_refs(schema, param)
    schema = copy.deepcopy(schema)          # resolving rewrites the refs in place
    converter = _converter()
    try:
        converter.resolve_refs(schema, "stdin")
        converter.visit(schema, "")
        return converter.format_grammar()
    except APIError:
        raise
    except (Exception, RecursionError) as exc:  # noqa: BLE001 - the converter raises plain ones
        reason = str(exc).split("\n")[0][:300]
        raise APIError(400, f"{param}: this JSON schema cannot be turned into a grammar "
                            f"({type(exc).__name__}: {reason})", code="invalid_value",
                       param=param) from None
