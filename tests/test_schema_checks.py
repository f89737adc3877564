"""The JSON-schema checks the server runs before a schema reaches the grammar process
(server/text/schema_checks.py), and the schema tool_choice "required" makes of the tools
(server/text/tool_calls.py): each mistake refused by field and place, valid schemas (recursive
ones, references, tuples) accepted, tools with $defs compile and validate."""
from __future__ import annotations

import json

import jsonschema
import pytest

from specserve.engine.config import GrammarSpec
from specserve.engine.grammar.compiler import parse_grammar
from specserve.server.errors import InvalidRequest
from specserve.server.text.schema_checks import MAX_SCHEMA_DEPTH, check_json_schema, check_json_schema_text
from specserve.server.text.tool_calls import required_calls_schema

FIELD = "response_format.json_schema.schema"


def _nested(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for i in range(depth - 1):
        schema = {"type": "object", "properties": {f"k{i}": schema}}
    return schema


@pytest.mark.parametrize("schema, says", [
    ({"type": "array", "minItems": -1}, "minItems must be a non-negative integer, got -1 at #"),
    ({"properties": {"a": {"type": "string", "maxLength": 2.5}}},
     "maxLength must be a non-negative integer, got 2.5 at #/properties/a"),
    ({"type": "array", "minItems": True}, "minItems must be a non-negative integer"),
    ({"type": "string", "minLength": 5, "maxLength": 2}, "minLength (5) is greater than maxLength (2)"),
    ({"type": "integer", "minimum": 9, "maximum": 1}, "minimum (9) is greater than maximum (1)"),
    ({"type": "objectx"}, "type must be one of"),
    ({"type": []}, "type must be one of"),
    ({"type": "object", "required": "a"}, "required must be a list of property names"),
    ({"enum": []}, "enum must be a non-empty list"),
    ({"anyOf": []}, "anyOf must be a non-empty list"),
    ({"properties": []}, "properties must be an object"),
    ({"items": 3}, "a schema must be an object or a boolean, got int at #/items"),
    ({"type": "string", "pattern": 5}, "pattern must be a string"),
    ({"$ref": "https://example.com/s.json"}, "is not supported"),
    ({"$ref": "#/$defs/missing"}, "names nothing in the schema"),
    ({"$defs": {"A": {"$ref": "#/$defs/B"}, "B": {"$ref": "#/$defs/A"}}, "$ref": "#/$defs/A"},
     "$ref cycle"),
    ({"$ref": "#"}, "$ref cycle # -> #"),
    ({"$defs": {"A": {"allOf": [{"$ref": "#/$defs/A"}, {"type": "object"}]}},
      "properties": {"x": {"$ref": "#/$defs/A"}}}, "$ref cycle"),
    (_nested(MAX_SCHEMA_DEPTH + 1), f"nested deeper than {MAX_SCHEMA_DEPTH} levels"),
    ([1], "a JSON schema is an object"),
])
def test_bad_schemas_are_refused_by_field_and_place(schema, says):
    with pytest.raises(InvalidRequest) as e:
        check_json_schema(schema, FIELD)
    assert str(e.value).startswith(f"{FIELD}: ") and says in str(e.value)
    assert e.value.field == FIELD


@pytest.mark.parametrize("schema", [
    True,
    {"type": "object", "properties": {"v": {"type": "integer"}, "next": {"$ref": "#"}}},  # a list
    {"$defs": {"Node": {"type": "object", "properties": {
        "kids": {"type": "array", "items": {"$ref": "#/$defs/Node"}}}}}, "$ref": "#/$defs/Node"},
    {"type": "array", "items": [{"type": "string"}, {"type": "integer"}]},
    {"type": ["string", "null"], "minLength": 0, "maxLength": 0},
    {"properties": {"a/b": {"type": "string"}}, "required": ["a/b"], "$defs": {"x~y": {"type": "null"}},
     "anyOf": [{"$ref": "#/$defs/x~0y"}, {"$ref": "#/properties/a~1b"}]},
    _nested(MAX_SCHEMA_DEPTH),
])
def test_valid_schemas_pass(schema):
    check_json_schema(schema, FIELD)


def test_schema_text_that_is_not_json_is_named():
    with pytest.raises(InvalidRequest, match=r"^structured_output.json_schema: not valid JSON"):
        check_json_schema_text("{", "structured_output.json_schema")


LOCATION = {"type": "object", "properties": {"loc": {"$ref": "#/$defs/Loc"}}, "required": ["loc"],
            "$defs": {"Loc": {"type": "object", "properties": {"city": {"type": "string"}},
                              "required": ["city"], "additionalProperties": False}}}
TREE = {"type": "object", "required": ["v"], "properties": {
    "v": {"type": "integer"}, "kids": {"type": "array", "items": {"$ref": "#"}}}}


def test_required_calls_schema_keeps_each_tools_references():
    """Each tool's parameters keep their own $defs and root references once inside the
    calls' array: the schema passes the checks, compiles, and validates exactly the calls
    each tool's own schema does."""
    tools = [{"name": "where", "parameters": LOCATION}, {"name": "tree", "parameters": TREE},
             {"name": "none"}]
    schema = required_calls_schema(tools)
    check_json_schema(schema, "tools")
    parse_grammar(GrammarSpec("json_schema", json.dumps(schema)))
    jsonschema.validate([{"name": "where", "parameters": {"loc": {"city": "Oslo"}}},
                         {"name": "tree", "parameters": {"v": 1, "kids": [{"v": 2, "kids": []}]}},
                         {"name": "none", "parameters": {}}], schema)
    for bad in ([{"name": "where", "parameters": {"loc": {"town": "Oslo"}}}],
                [{"name": "tree", "parameters": {"v": 1, "kids": [{"kids": []}]}}], []):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    assert tools[0]["parameters"] == LOCATION   # the caller's schema is left as it was
