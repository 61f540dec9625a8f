"""JSON schemas as constrained decoding reads them: objects closed unless they say otherwise.

JSON Schema allows properties an object schema does not list unless it says
`"additionalProperties": false`. A grammar that follows that lets a model add keys of its
own invention (a random model does so until max_tokens), which no caller of a function or
reader of a structured answer wants. llama.cpp's JSON-schema-to-grammar converter and
vLLM's default (xgrammar's strict mode) therefore treat an object schema with
`properties` and no `additionalProperties` as closed; `closed_objects` does the same for
the grammars moed compiles (tool-call arguments, response_format). A schema that sets
`additionalProperties` (true, false or a schema), or `patternProperties` /
`unevaluatedProperties`, keeps its own rule; an object schema without `properties`
(`{"type": "object"}`, json_object mode) stays open. A closed object takes the keys its
`required` names too (as any value when `properties` does not list them).

Only a schema that describes its object alone is closed. One that is a part of an
object's description stays open, as closing it would refuse the keys the other parts
list (a grammar of an unsatisfiable schema, or a required call refused): the branches of
`allOf` (but a lone one), `if`/`then`/`else`, `dependentSchemas` and `not`; the `anyOf`/`oneOf` branches
of a schema that lists `properties` itself; a schema with `properties` beside `allOf`,
`anyOf`, `oneOf`, `$ref` or `if`; and a schema that such a part names by `$ref` (a base
model's definition extended in an `allOf`, as pydantic and zod write inheritance).
"""
from __future__ import annotations

from typing import Any

# The keywords whose value is one schema, a list of schemas, or a name -> schema map
# (JSON Schema 2020-12 and draft 7's `definitions`, `items` as a list): each of a
# whole object of its own (`_ONE`, `_LIST`, `_MAP`) or a part of its parent's (`_PARTS`).
_ONE = ("items", "additionalItems", "contains", "additionalProperties", "propertyNames",
        "unevaluatedItems")
_LIST = ("anyOf", "oneOf", "prefixItems", "items")
_MAP = ("properties", "patternProperties", "$defs", "definitions")
_PARTS = ("allOf", "if", "then", "else", "not", "dependentSchemas")
_OPEN = ("additionalProperties", "patternProperties", "unevaluatedProperties")
_COMPOSED = ("allOf", "anyOf", "oneOf", "$ref", "if")


def closed_objects(schema: Any) -> Any:
    """`schema` (a JSON schema: a dict or a boolean) with every object schema that lists
    `properties`, says nothing of others and describes its object alone given
    `"additionalProperties": false` (and its `required` keys it does not list as
    properties of any value); a new value, `schema` is not changed. Walks with a stack
    (no recursion limit), so a deeply nested schema costs its size and nothing more."""
    if not isinstance(schema, dict):
        return schema
    root = dict(schema)
    stack: list[tuple[dict, str, bool]] = [(root, "#", True)]   # (schema, pointer, whole)
    candidates: list[tuple[dict, str]] = []
    parts_named: set[str] = set()        # $ref targets of parts: left open
    while stack:
        node, at, whole = stack.pop()
        listed = isinstance(node.get("properties"), dict)
        if not whole or (listed and any(k in node for k in _COMPOSED)):
            if isinstance(node.get("$ref"), str):
                parts_named.add(node["$ref"])
        if whole and listed and not any(k in node for k in _OPEN + _COMPOSED):
            candidates.append((node, at))
        children: list[tuple[dict, str, bool]] = []
        for key in _ONE + _PARTS:
            if isinstance(node.get(key), dict) and key != "dependentSchemas":
                node[key] = dict(node[key])
                children.append((node[key], f"{at}/{key}", key in _ONE))
        for key in _LIST + ("allOf",):
            if isinstance(node.get(key), list):
                node[key] = [dict(s) if isinstance(s, dict) else s for s in node[key]]
                # alternatives are whole objects, and so is allOf's one branch (pydantic's
                # {"allOf": [{"$ref": ...}], "description": ...}), unless properties join them
                own = key not in ("allOf", "anyOf", "oneOf") or not listed and (
                    key != "allOf" or len(node[key]) == 1)
                children += [(s, f"{at}/{key}/{i}", own) for i, s in enumerate(node[key])
                             if isinstance(s, dict)]
        for key in _MAP + ("dependentSchemas",):
            if isinstance(node.get(key), dict):
                node[key] = {k: dict(s) if isinstance(s, dict) else s for k, s in node[key].items()}
                children += [(s, f"{at}/{key}/{_escape(k)}", key != "dependentSchemas")
                             for k, s in node[key].items() if isinstance(s, dict)]
        stack += children
    for node, at in candidates:
        if at in parts_named:
            continue
        required = node.get("required")
        missing = [k for k in required if isinstance(k, str) and k not in node["properties"]] \
            if isinstance(required, list) else []
        if missing:
            node["properties"] = {**node["properties"], **dict.fromkeys(missing, {})}
        node["additionalProperties"] = False
    return root


def _escape(name: str) -> str:
    """A JSON Pointer reference token (RFC 6901): "~" as "~0", "/" as "~1"."""
    return name.replace("~", "~0").replace("/", "~1")
