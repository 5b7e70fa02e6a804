"""Length-bounded JSON strings in structured outputs stay JSON: the grammar a schema compiles to accepts an
object exactly when a JSON parser reads it and jsonschema validates it (the oracle) and, for a length-bounded
string, its content has no escape sequence (the bounded strings' rule is one character class, as xgrammar's own,
which keeps their masks fast); for contents that mix plain characters, raw control characters, escapes, quotes and
backslashes. Unbounded strings keep their escapes."""

import json
import random

import jsonschema
import pytest
import xgrammar as xgr

from kestrel.structured.compile import GrammarSource, compile_source
from kestrel.structured.json_strings import json_schema_grammar

PIECES = ["a", "z", "é", " ", "\x06", "\x1a", "\x00", "\n", "\t", '"', "\\", "\\n", "\\t", '\\"', "\\\\", "\\u00e9",
          "\\x", "\\u12"]
PLAIN = ["a", "z", "é", " "]
SCHEMAS = [
    {"type": "object", "properties": {"s": {"type": "string", "maxLength": 4}}, "required": ["s"]},
    {"type": "object", "properties": {"s": {"type": "string", "minLength": 2, "maxLength": 3}}, "required": ["s"]},
    {"type": "object", "properties": {"s": {"type": "array", "items": {"type": "string", "minLength": 1}}},
     "required": ["s"]},
    {"type": "object", "properties": {"s": {"type": "string"}}, "required": ["s"]},  # unbounded: unchanged
]


def bounded(schema: dict) -> bool:
    string = schema["properties"]["s"]
    string = string.get("items", string)
    return "minLength" in string or "maxLength" in string


def oracle(text: str, schema: dict) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema)
    except (json.JSONDecodeError, jsonschema.ValidationError):
        return False
    content = text[len('{"s": '):-1]
    return not (bounded(schema) and "\\" in content)  # a bounded string is written without escapes


def candidates(schema: dict, count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        content = "".join(rng.choice(PLAIN if rng.random() < 0.5 else PIECES) for _ in range(rng.randint(0, 5)))
        value = f'"{content}"'
        out.append('{"s": ' + (f"[{value}]" if schema["properties"]["s"]["type"] == "array" else value) + "}")
    return out


@pytest.mark.parametrize("index", range(len(SCHEMAS)))
def test_the_grammar_accepts_exactly_what_a_json_parser_and_the_schema_accept(index):
    schema = SCHEMAS[index]
    grammar = json_schema_grammar(json.dumps(schema), any_whitespace=True)
    texts = candidates(schema, 600, seed=index)
    verdicts = [(text, xgr.testing._is_grammar_accept_string(grammar, text), oracle(text, schema)) for text in texts]
    wrong = [(text, accepted) for text, accepted, valid in verdicts if accepted != valid]
    assert not wrong, wrong[:5]
    assert sum(valid for _, _, valid in verdicts) >= 20  # the candidates reach both verdicts
    assert sum(not valid for _, _, valid in verdicts) >= 20
    if not bounded(schema):
        assert any("\\" in text and valid for text, _, valid in verdicts)  # escapes reached and kept


def test_the_bounded_strings_rule_is_one_character_class():
    grammar = str(json_schema_grammar(json.dumps(SCHEMAS[0]), any_whitespace=False))
    rules = [line for line in grammar.splitlines() if line.startswith("root_prop_0_characters ::=")]
    assert rules and "|" not in rules[0], rules  # no alternative: xgrammar precomputes the masks inside the string


def test_a_request_schema_compiles_through_the_corrected_grammar():
    schema = SCHEMAS[0]
    source = GrammarSource("json", json.dumps(schema), any_whitespace=True)
    tokenizer_info = xgr.TokenizerInfo(["a", "\x06", '"', "{", "}", ":", " ", "s"])
    compiled = compile_source(xgr.GrammarCompiler(tokenizer_info), source)
    matcher = xgr.GrammarMatcher(compiled)
    for piece in ['{', '"', 's', '"', ':', ' ', '"', 'a']:
        assert matcher.accept_string(piece)
    assert not matcher.accept_string("\x06")  # the raw control character the uncorrected grammar let through


def test_a_refused_schema_names_the_problem_without_the_compilers_log_prefix():
    from kestrel.structured.compile import GrammarCompileError

    source = GrammarSource("json", json.dumps({"type": "foo"}), any_whitespace=True)
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo(["a", "b"]))
    with pytest.raises(GrammarCompileError) as caught:
        compile_source(compiler, source)
    message = str(caught.value)
    assert "foo" in message and ".cc:" not in message and not message.split(": ", 1)[1].startswith("["), message


def test_a_refused_tool_schema_names_the_problem_without_the_compilers_log_prefix():
    from kestrel.request import InvalidRequestError
    from kestrel.structured.tool_grammar import tool_call_grammar

    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "foo"}}}]
    with pytest.raises(InvalidRequestError) as caught:
        tool_call_grammar(tools, "required", None, "hermes")
    message = str(caught.value)
    assert caught.value.param == "tools" and "foo" in message and ".cc:" not in message, message
