"""Cheap checks of a JSON schema before the engine's grammar process compiles it: the mistakes
xgrammar would accept silently or turn into a grammar that never ends (a negative minItems, a
`$ref` loop), and the shapes too big to compile within the budget (nesting: xgrammar's
conversion grows with its cube), refused by name. One walk over the parsed schema, linear in its
size (which MAX_GRAMMAR_CHARS bounds), so it runs with the other request checks; the compile
itself, with its time budget, is the grammar process's (engine/grammar/process.py).

Errors are InvalidRequest("<field>: <what> at <JSON pointer>"), the field as the caller names
it (structured_output.json_schema, tools[0].function.parameters, ...).
"""
from __future__ import annotations

import json
from typing import Any

from specserve.server.errors import InvalidRequest

# Schemas nested deeper than this are refused (xgrammar's conversion took 0.04 s at 50 levels
# and 0.3-0.45 s at 100 on the CI machine, growing with the cube of the depth).
MAX_SCHEMA_DEPTH = 32

_TYPES = frozenset({"object", "array", "string", "number", "integer", "boolean", "null"})
_COUNTS = ("minItems", "maxItems", "minLength", "maxLength", "minProperties", "maxProperties")
_BOUNDS = (("minItems", "maxItems"), ("minLength", "maxLength"),
           ("minProperties", "maxProperties"), ("minimum", "maximum"))
# Keywords holding one subschema, a map of them, or a list of them.
_ONE = ("items", "additionalProperties", "not", "contains", "propertyNames",
        "unevaluatedProperties", "unevaluatedItems", "if", "then", "else")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_LIST = ("allOf", "anyOf", "oneOf", "prefixItems")
# Keywords through which a schema is all of other ones, consuming no input: a cycle of these
# (and $ref) never produces a value.
_DIRECT = ("allOf",)


def check_json_schema_text(source: str, field: str) -> None:
    """A JSON schema given as text (structured_output.json_schema)."""
    try:
        schema = json.loads(source)
    except ValueError as e:
        raise InvalidRequest(f"{field}: not valid JSON ({e})") from None
    check_json_schema(schema, field)


def check_json_schema(schema: Any, field: str) -> None:
    """InvalidRequest naming `field` for a schema that cannot compile to a grammar."""
    if not isinstance(schema, (dict, bool)):
        raise InvalidRequest(f"{field}: a JSON schema is an object, got {type(schema).__name__}")
    _SchemaWalk(schema, field).check()


class _SchemaWalk:
    def __init__(self, root: Any, field: str):
        self.root = root
        self.field = field
        self.refs: dict[str, list[str]] = {}   # pointer -> the pointers it is directly

    def fail(self, what: str, at: str) -> None:
        raise InvalidRequest(f"{self.field}: {what} at {at or '#'}")

    def check(self) -> None:
        # Iterative (a deep schema must not hit Python's recursion limit before the depth
        # check): (schema, its JSON pointer, its depth).
        stack = [(self.root, "#", 1)]
        while stack:
            schema, at, depth = stack.pop()
            if isinstance(schema, bool):
                continue
            if not isinstance(schema, dict):
                self.fail(f"a schema must be an object or a boolean, got {type(schema).__name__}", at)
            if depth > MAX_SCHEMA_DEPTH:
                self.fail(f"nested deeper than {MAX_SCHEMA_DEPTH} levels (too complex to compile)", at)
            self._keywords(schema, at)
            for key in _ONE:
                if key in schema:
                    sub = schema[key]
                    if key == "items" and isinstance(sub, list):  # draft 4's tuples
                        stack += [(s, f"{at}/items/{i}", depth + 1) for i, s in enumerate(sub)]
                    else:
                        stack.append((sub, f"{at}/{key}", depth + 1))
            for key in _MAP:
                if key in schema:
                    if not isinstance(schema[key], dict):
                        self.fail(f"{key} must be an object", at)
                    stack += [(sub, f"{at}/{key}/{_escape(name)}", depth + 1)
                              for name, sub in schema[key].items()]
            for key in _LIST:
                if key in schema:
                    if not isinstance(schema[key], list) or (key != "prefixItems" and not schema[key]):
                        self.fail(f"{key} must be a non-empty list", at)
                    stack += [(sub, f"{at}/{key}/{i}", depth + 1) for i, sub in enumerate(schema[key])]
                    if key in _DIRECT:
                        self.refs.setdefault(at, []).extend(
                            f"{at}/{key}/{i}" for i in range(len(schema[key])))
            if "$ref" in schema:
                self.refs.setdefault(at, []).append(self._resolve(schema["$ref"], at))
        self._check_ref_cycles()

    def _keywords(self, schema: dict, at: str) -> None:
        for key in _COUNTS:
            value = schema.get(key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                self.fail(f"{key} must be a non-negative integer, got {value!r}", at)
        for low, high in _BOUNDS:
            a, b = schema.get(low), schema.get(high)
            if isinstance(a, (int, float)) and isinstance(b, (int, float)) and a > b:
                self.fail(f"{low} ({a!r}) is greater than {high} ({b!r})", at)
        kind = schema.get("type")
        kinds = kind if isinstance(kind, list) else [kind] if kind is not None else []
        bad = [k for k in kinds if not isinstance(k, str) or k not in _TYPES]
        if bad or (isinstance(kind, list) and not kind):
            self.fail(f"type must be one of {', '.join(sorted(_TYPES))} (or a list of them), "
                      f"got {kind!r}", at)
        required = schema.get("required")
        if required is not None and (not isinstance(required, list)
                                     or not all(isinstance(r, str) for r in required)):
            self.fail("required must be a list of property names", at)
        enum = schema.get("enum")
        if enum is not None and (not isinstance(enum, list) or not enum):
            self.fail("enum must be a non-empty list", at)
        pattern = schema.get("pattern")
        if pattern is not None and not isinstance(pattern, str):
            self.fail("pattern must be a string", at)

    def _resolve(self, ref: Any, at: str) -> str:
        """The JSON pointer a local $ref names, once it is known to exist."""
        if not isinstance(ref, str) or not ref.startswith("#"):
            self.fail(f"$ref {ref!r} is not supported (only references inside the schema, "
                      f"'#...')", at)
        node = self.root
        for part in ref[1:].split("/")[1:]:
            part = part.replace("~1", "/").replace("~0", "~")
            if isinstance(node, dict) and part in node:
                node = node[part]
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            else:
                self.fail(f"$ref {ref!r} names nothing in the schema", at)
        return "#" + ref[1:].rstrip("/") if ref != "#" else "#"

    def _check_ref_cycles(self) -> None:
        """A schema that is (through $ref and allOf) itself, before any structure (properties,
        items) consumes input: no value can end it."""
        done: set[str] = set()
        for start in self.refs:
            if start in done:
                continue
            path: list[str] = []
            on_path: set[str] = set()
            stack: list[tuple[str, bool]] = [(start, False)]
            while stack:
                node, leaving = stack.pop()
                if leaving:
                    on_path.discard(path.pop())
                    done.add(node)
                    continue
                if node in on_path:
                    cycle = path[path.index(node):] + [node]
                    self.fail(f"$ref cycle {' -> '.join(cycle)} (a schema that is only itself)",
                              cycle[0])
                if node in done:
                    continue
                path.append(node)
                on_path.add(node)
                stack.append((node, True))
                stack += [(nxt, False) for nxt in self.refs.get(node, ())]


def _escape(name: str) -> str:
    return name.replace("~", "~0").replace("/", "~1")
