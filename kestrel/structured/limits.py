"""The size limits a grammar must meet before anything compiles it: its text's bytes, the options of one enum, union
or choice list, the properties of a JSON schema (every object's, nested and in `$defs`, together) and how deeply
the schema nests. Pure Python (no xgrammar): the server checks requests on its event loop in microseconds per KB,
and the engine's backend applies the same checks to the grammars it compiles itself (the offline `LLM` path).

Each limit stops a known attack on the compiler: a 100,000-string enum took 146 s and 219 MB to compile, a schema
of 5,000 required properties 63 s. The limits do not bound compile time by themselves (a 40-byte pattern can take
seconds; see docs/security.md): the server's compile deadline does that.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from kestrel.request import InvalidRequestError
from kestrel.sampling_params import StructuredOutputsParams

# Keywords whose value is a map of names to subschemas, those whose value is one subschema (or a list of them: the
# old `items` form), and those whose value is a list of alternatives (each an option of a union).
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_VALUES = ("items", "additionalProperties", "additionalItems", "unevaluatedItems", "unevaluatedProperties",
                  "contains", "propertyNames", "not", "if", "then", "else")
_SCHEMA_UNIONS = ("anyOf", "oneOf", "allOf")
_COUNTED_MAPS = ("properties", "patternProperties")


@dataclass(frozen=True)
class GrammarLimits:
    """The defaults are the server's (`kestrel serve --max-grammar-bytes ...`) and the engine backend's."""

    max_bytes: int = 64 << 10
    max_choices: int = 4096
    max_properties: int = 1024
    # JSON-schema nesting (an object's property is one level down): the request body's own JSON nesting limit is 64
    # levels, and a schema sent as a JSON string must not go deeper than one sent as an object could.
    max_depth: int = 64

    def __post_init__(self) -> None:
        for name in ("max_bytes", "max_choices", "max_properties", "max_depth"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"GrammarLimits.{name}={value!r}: expected an integer >= 1")


def _too_many(param: str, what: str, count: int, limit: int, flag: str) -> InvalidRequestError:
    return InvalidRequestError(param, f"{what} has {count:,} options, more than the limit of {limit:,} ({flag})")


def check_structured_outputs(spec: StructuredOutputsParams, param: str, limits: GrammarLimits) -> None:
    """Refuse (InvalidRequestError naming `param`) a grammar beyond the limits, before any compiling."""
    kind = spec.kind
    if kind == "json":
        check_schema(spec.json, param, limits)
    elif kind == "choice":
        choices = spec.choice or []
        if len(choices) > limits.max_choices:
            raise _too_many(param, "the choice list", len(choices), limits.max_choices, "--max-grammar-choices")
        check_bytes(json.dumps(choices, ensure_ascii=False, separators=(",", ":")), param, "the choice list",
                    limits)
    elif kind in ("regex", "grammar"):
        check_bytes(getattr(spec, kind), param, f"the {kind}", limits)


def check_bytes(text: str, param: str, what: str, limits: GrammarLimits) -> int:
    """The UTF-8 size of `text`, refused beyond max_bytes."""
    size = len(text.encode("utf-8", "surrogatepass"))  # JSON strings may carry lone surrogates
    if size > limits.max_bytes:
        raise InvalidRequestError(param, f"{what} is {size:,} bytes, more than the limit of {limits.max_bytes:,} "
                                  "(--max-grammar-bytes)")
    return size


def check_schema(schema: Any, param: str, limits: GrammarLimits, what: str = "the JSON schema") -> int:
    """Refuse a JSON schema (a dict, or its JSON text) beyond the limits; returns its size in bytes (compact
    JSON). The text's size is checked before it is parsed, a parsed schema's counts before it is measured."""
    if isinstance(schema, str):
        size = check_bytes(schema, param, what, limits)
        try:
            schema = json.loads(schema)
        except RecursionError:
            raise InvalidRequestError(param, f"{what} nests more than {limits.max_depth} levels deep") from None
        except ValueError as error:
            raise InvalidRequestError(param, f"{what} is not valid JSON: {error}") from None
        count_schema(schema, param, limits, what)
        return size
    count_schema(schema, param, limits, what)
    return check_bytes(json.dumps(schema, ensure_ascii=False, separators=(",", ":")), param, what, limits)


def count_schema(schema: Any, param: str, limits: GrammarLimits, what: str = "the JSON schema") -> None:
    """Walk every subschema (iteratively: a deep schema cannot exhaust the stack) counting the properties of all
    objects together and the options of each enum and union; refuse the first limit passed."""
    properties = 0
    stack: list[tuple[Any, int]] = [(schema, 1)]
    while stack:
        node, depth = stack.pop()
        if not isinstance(node, dict):
            continue  # true / false schemas, and malformed values xgrammar itself refuses
        if depth > limits.max_depth:
            raise InvalidRequestError(param, f"{what} nests more than {limits.max_depth} levels deep")
        enum = node.get("enum")
        if isinstance(enum, list) and len(enum) > limits.max_choices:
            raise _too_many(param, f"an enum in {what}", len(enum), limits.max_choices, "--max-grammar-choices")
        for key in _SCHEMA_UNIONS:
            options = node.get(key)
            if isinstance(options, list):
                if len(options) > limits.max_choices:
                    raise _too_many(param, f"an {key} in {what}", len(options), limits.max_choices,
                                    "--max-grammar-choices")
                stack.extend((option, depth + 1) for option in options)
        items = node.get("prefixItems")
        if isinstance(items, list):
            properties += len(items)  # a tuple's positions cost what an object's required properties do
            stack.extend((item, depth + 1) for item in items)
        for key in _SCHEMA_MAPS:
            members = node.get(key)
            if isinstance(members, dict):
                if key in _COUNTED_MAPS:
                    properties += len(members)
                stack.extend((member, depth + 1) for member in members.values())
        if properties > limits.max_properties:
            raise InvalidRequestError(param, f"{what} declares more than the limit of {limits.max_properties:,} "
                                      "properties, all its objects together (--max-schema-properties)")
        for key in _SCHEMA_VALUES:
            value = node.get(key)
            if isinstance(value, list):
                stack.extend((item, depth + 1) for item in value)
            elif value is not None:
                stack.append((value, depth + 1))


def check_tool_schemas(tools: list[dict[str, Any]], limits: GrammarLimits, param: str = "tools") -> None:
    """The parameters schemas of a forced tool call's tools, checked one by one and their bytes together (the
    call's grammar joins them all)."""
    total = 0
    if len(tools) > limits.max_choices:
        raise _too_many(param, "the forced tool call", len(tools), limits.max_choices, "--max-grammar-choices")
    for tool in tools:
        function = tool.get("function") or {}
        schema = function.get("parameters") or {"type": "object"}
        total += check_schema(schema, param, limits, f"the parameters schema of tool {function.get('name')!r}")
        if total > limits.max_bytes:
            raise InvalidRequestError(param, f"the tools' parameters schemas are {total:,} bytes together, more "
                                      f"than the limit of {limits.max_bytes:,} (--max-grammar-bytes)")
