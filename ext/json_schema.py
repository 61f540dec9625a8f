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
(`{"type": "object"}`, json_object mode) stays open. Branches of `allOf` are left as
they are: each branch lists only some of the object's properties, and closing them
would refuse every object that has the others.
"""
from __future__ import annotations

from typing import Any

# The keywords whose value is one schema, a list of schemas, or a name -> schema map
# (JSON Schema 2020-12 and draft 7's `definitions`, `items` as a list).
_ONE = ("items", "additionalItems", "not", "if", "then", "else", "contains",
        "additionalProperties", "propertyNames", "unevaluatedItems")
_LIST = ("anyOf", "oneOf", "prefixItems", "items")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_OPEN = ("additionalProperties", "patternProperties", "unevaluatedProperties")


def closed_objects(schema: Any) -> Any:
    """`schema` (a JSON schema: a dict or a boolean) with every object schema that lists
    `properties` and says nothing of others given `"additionalProperties": false`, outside
    `allOf` branches; a new value, `schema` is not changed. Walks with a stack (no
    recursion limit), so a deeply nested schema costs its size and nothing more."""
    if not isinstance(schema, dict):
        return schema
    root = dict(schema)
    stack = [root]
    while stack:
        node = stack.pop()
        if "properties" in node and isinstance(node["properties"], dict) \
                and not any(k in node for k in _OPEN):
            node["additionalProperties"] = False
        children = []
        for key in _ONE:
            if isinstance(node.get(key), dict):
                node[key] = dict(node[key])
                children.append(node[key])
        for key in _LIST:
            if isinstance(node.get(key), list):
                node[key] = [dict(s) if isinstance(s, dict) else s for s in node[key]]
                children += [s for s in node[key] if isinstance(s, dict)]
        for key in _MAP:
            if isinstance(node.get(key), dict):
                node[key] = {k: dict(s) if isinstance(s, dict) else s for k, s in node[key].items()}
                children += [s for s in node[key].values() if isinstance(s, dict)]
        stack += children
    return root
