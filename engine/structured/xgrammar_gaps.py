"""JSON schemas xgrammar (0.2.8) compiles but does not fully enforce.

Under "auto", `choose_backend` sends such a schema to llguidance, so an output never breaks a
constraint the request asked for. Each rule was found by comparing xgrammar's grammar with
`jsonschema` on strings the schema rejects: xgrammar accepted them (often with only a log line,
e.g. "format combined with minLength/maxLength is not supported; ignoring"). The unit tests keep
one such string per rule, so a newer xgrammar that closes a gap shows up there.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

# Keywords xgrammar ignores wherever they appear.
IGNORED_KEYWORDS = frozenset({"uniqueItems", "contains", "minContains", "maxContains",
                              "propertyNames", "patternProperties", "dependentRequired",
                              "dependentSchemas", "not", "if", "then", "else"})
# What may stand beside "$ref" without constraining anything (xgrammar drops every sibling).
_ANNOTATIONS = frozenset({"$ref", "$defs", "definitions", "$id", "$schema", "$anchor", "$comment",
                          "title", "description", "default", "examples", "deprecated",
                          "readOnly", "writeOnly"})
# Where subschemas live: maps of name -> schema, single schemas, lists of schemas.
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_VALUES = ("items", "additionalItems", "additionalProperties", "unevaluatedProperties",
                  "unevaluatedItems", "not", "if", "then", "else", "contains", "propertyNames")
_SCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems", "items")


def unenforced(schema: Any) -> str | None:
    """What xgrammar would leave unenforced in `schema` (the first found, in words), or None."""
    for node in _subschemas(schema):
        gap = _node_gap(node)
        if gap is not None:
            return gap
    return None


def _node_gap(node: dict[str, Any]) -> str | None:
    ignored = IGNORED_KEYWORDS.intersection(node)
    if ignored:
        return f"{min(ignored)}"
    if "multipleOf" in node and not (node.get("type") == "integer"
                                     and isinstance(node["multipleOf"], int)):
        return "multipleOf on a non-integer"  # xgrammar: "not supported for type:number"
    if isinstance(node.get("allOf"), list) and len(node["allOf"]) > 1:
        return "allOf of several schemas"  # xgrammar: "allOf with multiple options is ongoing"
    if ("pattern" in node or "format" in node) and ("minLength" in node or "maxLength" in node):
        return "minLength/maxLength beside pattern or format"
    if "$ref" in node and not _ANNOTATIONS.issuperset(node):
        return "keywords beside $ref"
    properties = node.get("properties")
    required = node.get("required")
    if isinstance(required, list) and any(
            not isinstance(properties, dict) or name not in properties for name in required):
        return "a required property that properties does not define"
    return None


def _subschemas(node: Any) -> Iterator[dict[str, Any]]:
    """`node` and every schema inside it (not the property names, which may be anything)."""
    if not isinstance(node, dict):
        return  # true / false schemas constrain nothing xgrammar could miss
    yield node
    for key in _SCHEMA_MAPS:
        value = node.get(key)
        if isinstance(value, dict):
            for sub in value.values():
                yield from _subschemas(sub)
    for key in _SCHEMA_VALUES:
        yield from _subschemas(node.get(key))
    for key in _SCHEMA_LISTS:
        value = node.get(key)
        if isinstance(value, list):
            for sub in value:
                yield from _subschemas(sub)
