"""The grammar of a forced tool call: what follows the call's opening that the chat turn already starts with
(`tool_choice` "required" or a named function, see entrypoints/chat.py's forced_prefix), in the template's
format, with each function's arguments constrained by its parameters' JSON schema."""

from __future__ import annotations

import json
from typing import Any

from kestrel.request import InvalidRequestError
from kestrel.structured.json_strings import compiler_reason, json_schema_grammar

# What closes one call after its arguments object, per tool-call format.
_CLOSING = {"llama3_json": "}", "hermes": "}\n</tool_call>", "mistral": "}]"}


def tool_call_grammar(tools: list[dict[str, Any]], tool_choice: str, named_tool: str | None, fmt: str) -> str:
    """EBNF text (xgrammar's dialect). "required": one call of any of the tools, its name first (the opening
    ends inside the name's string); "named": the named function's arguments."""
    import xgrammar as xgr

    def literal(text: str) -> Any:
        return xgr.Grammar.from_ebnf("root ::= " + json.dumps(text))

    def arguments(tool: dict[str, Any]) -> Any:
        function = tool["function"]
        # No parameters (left out, or {}): OpenAI's function without arguments, whose call's arguments are {}.
        schema = function.get("parameters") or {"type": "object", "properties": {}}
        try:
            return json_schema_grammar(json.dumps(schema), any_whitespace=False)
        except (RuntimeError, ValueError) as error:
            raise InvalidRequestError("tools", f"the parameters schema of tool {function['name']!r} could not be "
                                      f"compiled: {compiler_reason(error)[:300]}") from None

    closing = literal(_CLOSING[fmt])
    by_name = {tool["function"]["name"]: tool for tool in tools}
    if tool_choice == "named":
        return str(xgr.Grammar.concat(arguments(by_name[named_tool]), closing))
    calls = [xgr.Grammar.concat(literal(json.dumps(name)[1:] + ', "arguments": '), arguments(tool), closing)
             for name, tool in by_name.items()]
    return str(calls[0] if len(calls) == 1 else xgr.Grammar.union(*calls))
