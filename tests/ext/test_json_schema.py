"""ext/json_schema.py: object schemas closed as llama.cpp's and vLLM's grammars read them."""
from __future__ import annotations

import json

import jsonschema
import pytest

from ext.json_schema import closed_objects

PERSON = {"type": "object", "properties": {"name": {"type": "string"},
                                           "home": {"type": "object", "properties": {"city": {"type": "string"}}}},
          "required": ["name"]}


def test_listed_properties_close_an_object_at_every_depth_and_the_input_is_not_changed():
    before = json.dumps(PERSON)
    closed = closed_objects(PERSON)
    assert json.dumps(PERSON) == before
    assert closed["additionalProperties"] is False
    assert closed["properties"]["home"]["additionalProperties"] is False
    jsonschema.validate({"name": "a", "home": {"city": "b"}}, closed)
    for extra in ({"name": "a", "age": 3}, {"name": "a", "home": {"city": "b", "zip": 1}}):
        jsonschema.validate(extra, PERSON)                  # JSON Schema's own default: open
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(extra, closed)


@pytest.mark.parametrize("schema", [
    {"type": "object"},                                                   # json_object: any object
    {"type": "object", "properties": {"a": {}}, "additionalProperties": True},
    {"type": "object", "properties": {"a": {}}, "additionalProperties": {"type": "integer"}},
    {"type": "object", "properties": {"a": {}}, "patternProperties": {"^x": {}}},
    {"type": "object", "properties": {"a": {}}, "unevaluatedProperties": False},
    True, False,
])
def test_a_schema_that_says_what_others_do_keeps_its_rule(schema):
    assert closed_objects(schema) == schema


def test_definitions_arrays_and_alternatives_are_walked_but_all_of_branches_are_not():
    schema = {"$defs": {"P": {"type": "object", "properties": {"x": {}}}},
              "type": "object",
              "properties": {"list": {"type": "array", "items": {"$ref": "#/$defs/P"}},
                             "either": {"anyOf": [{"type": "object", "properties": {"y": {}}},
                                                  {"type": "null"}]},
                             "both": {"allOf": [{"type": "object", "properties": {"a": {}}},
                                                {"type": "object", "properties": {"b": {}}}]}}}
    closed = closed_objects(schema)
    assert closed["$defs"]["P"]["additionalProperties"] is False
    assert closed["properties"]["either"]["anyOf"][0]["additionalProperties"] is False
    assert closed["properties"]["both"] == schema["properties"]["both"]
    jsonschema.validate({"both": {"a": 1, "b": 2}, "list": [{"x": 1}]}, closed)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"list": [{"x": 1, "z": 2}]}, closed)


def test_a_deep_schema_is_walked_without_recursion():
    deep: dict = {"type": "object", "properties": {}}
    node = deep
    for _ in range(5000):
        child: dict = {"type": "object", "properties": {}}
        node["properties"]["n"] = child
        node = child
    closed = closed_objects(deep)
    node = closed
    for _ in range(5000):
        assert node["additionalProperties"] is False
        node = node["properties"]["n"]


B = {"type": "object", "properties": {"b": {"type": "integer"}}}


@pytest.mark.parametrize("schema", [
    {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a", "b"]},
    {"type": "object", "properties": {"a": {"type": "integer"}}, "allOf": [B]},
    {"type": "object", "properties": {"a": {"type": "integer"}}, "anyOf": [B, {"required": ["a"]}]},
    {"type": "object", "properties": {"a": {"type": "integer"}}, "oneOf": [B]},
    {"type": "object", "properties": {"a": {}}, "if": {"required": ["a"]}, "then": B},
    {"type": "object", "properties": {"a": {"type": "integer"}}, "$ref": "#/$defs/B", "$defs": {"B": B}},
    {"$defs": {"B": B}, "allOf": [{"$ref": "#/$defs/B"}, {"properties": {"a": {"type": "integer"}}}]},
    {"definitions": {"B": B}, "allOf": [{"$ref": "#/definitions/B"}, {"properties": {"a": {}}}]},
])
def test_keys_a_schema_names_elsewhere_than_its_properties_stay_allowed(schema):
    # required keys it does not list, and properties its allOf/anyOf/$ref siblings add
    # (a base model's $ref extended in an allOf): closing must not refuse what the schema names
    jsonschema.validate({"a": 1, "b": 2}, schema)
    jsonschema.validate({"a": 1, "b": 2}, closed_objects(schema))


def test_a_lone_all_of_branch_is_a_whole_object():
    # pydantic's field of a model type with a description: the model's definition is closed
    schema = {"$defs": {"B": B}, "type": "object",
              "properties": {"x": {"allOf": [{"$ref": "#/$defs/B"}], "description": "d"}}}
    assert closed_objects(schema)["$defs"]["B"]["additionalProperties"] is False
