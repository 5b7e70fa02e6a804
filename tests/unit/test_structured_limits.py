"""Grammar limits checked before any compiling (kestrel.structured.limits), the compile cache's bounds and the
compile pool's threads: each limit refused by name with its flag, nested schemas and $defs counted, the cache
within its entries and bytes whatever is compiled, and the engine's own backend under the same default limits."""

import asyncio
import json

import pytest

from kestrel.request import InvalidRequestError
from kestrel.sampling_params import StructuredOutputsParams
from kestrel.structured.compile import GrammarCache, GrammarSource
from kestrel.structured.limits import GrammarLimits, check_structured_outputs, check_tool_schemas

LIMITS = GrammarLimits(max_bytes=2000, max_choices=10, max_properties=8, max_depth=6)


def refused(spec: StructuredOutputsParams, limits: GrammarLimits = LIMITS) -> InvalidRequestError:
    with pytest.raises(InvalidRequestError) as caught:
        check_structured_outputs(spec, "structured_outputs.x", limits)
    assert caught.value.param == "structured_outputs.x"
    return caught.value


def obj(properties: dict, **more) -> dict:
    return {"type": "object", "properties": properties, **more}


@pytest.mark.parametrize("schema, flag", [
    ({"enum": list(range(11))}, "--max-grammar-choices"),
    ({"anyOf": [{"const": i} for i in range(11)]}, "--max-grammar-choices"),
    (obj({"a": {"oneOf": [{"const": i} for i in range(11)]}}), "--max-grammar-choices"),
    ({"$defs": {"colour": {"enum": [str(i) for i in range(11)]}}, "$ref": "#/$defs/colour"}, "--max-grammar-choices"),
    (obj({f"p{i}": {"type": "integer"} for i in range(9)}), "--max-schema-properties"),
    # Properties of every object count together: nested ones, array items', $defs', tuples' positions.
    (obj({"a": obj({f"p{i}": {} for i in range(4)}),
          "b": {"type": "array", "items": obj({"x": {}, "y": {}, "z": {}})}}), "--max-schema-properties"),
    ({"$defs": {"t": obj({f"p{i}": {} for i in range(9)})}}, "--max-schema-properties"),
    ({"type": "array", "prefixItems": [{"type": "integer"}] * 9}, "--max-schema-properties"),
    ({"type": "string", "description": "x" * 3000}, "--max-grammar-bytes"),
])
def test_each_schema_limit_is_refused_naming_its_flag(schema, flag):
    for given in (schema, json.dumps(schema)):  # an object, or its JSON text
        assert flag in str(refused(StructuredOutputsParams(json=given)))


def test_a_schema_nested_too_deeply_is_refused_however_deep():
    deep: dict = {"type": "integer"}
    for _ in range(7):
        deep = {"type": "array", "items": deep}
    assert "6 levels" in str(refused(StructuredOutputsParams(json=deep)))
    text = '{"items":' * 100_000 + "{}" + "}" * 100_000  # deeper than Python's parser goes
    assert "levels" in str(refused(StructuredOutputsParams(json=text), GrammarLimits(max_bytes=1 << 20)))


def test_within_the_limits_passes_and_property_names_are_not_keywords():
    schema = obj({"enum": {"type": "string"}, "anyOf": {"type": "integer"}, "properties": {"type": "boolean"}},
                 required=["enum"])
    check_structured_outputs(StructuredOutputsParams(json=schema), "p", LIMITS)
    check_structured_outputs(StructuredOutputsParams(json={"enum": list(range(10))}), "p", LIMITS)
    check_structured_outputs(StructuredOutputsParams(choice=[str(i) for i in range(10)]), "p", LIMITS)


def test_choice_regex_and_grammar_limits():
    assert "--max-grammar-choices" in str(refused(StructuredOutputsParams(choice=[str(i) for i in range(11)])))
    assert "--max-grammar-bytes" in str(refused(StructuredOutputsParams(choice=["y" * 1000, "z" * 1000])))
    assert "--max-grammar-bytes" in str(refused(StructuredOutputsParams(regex="a" * 2001)))
    # Bytes, not characters: "root ::= " and 700 three-byte characters are 2,109 bytes.
    assert "2,109 bytes" in str(refused(StructuredOutputsParams(grammar="root ::= " + "€" * 700)))


def test_tool_schemas_count_one_by_one_and_their_bytes_together():
    def tool(name, parameters):
        return {"type": "function", "function": {"name": name, "parameters": parameters}}

    big = obj({"a": {"type": "string", "description": "d" * 900}})
    check_tool_schemas([tool("one", big), tool("two", {"enum": list(range(10))})], LIMITS)
    with pytest.raises(InvalidRequestError, match="together") as caught:
        check_tool_schemas([tool("one", big), tool("two", big), tool("three", big)], LIMITS)
    assert caught.value.param == "tools"
    with pytest.raises(InvalidRequestError, match="'two'.*--max-grammar-choices"):
        check_tool_schemas([tool("one", big), tool("two", {"enum": list(range(11))})], LIMITS)


def test_the_same_schema_however_spaced_is_one_source():
    spaced = StructuredOutputsParams(json='{ "type" : "object",\n "properties": {"a": {"type": "integer"}} }')
    compact = StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "integer"}}})
    assert GrammarSource.of(spaced) == GrammarSource.of(compact)
    tight = StructuredOutputsParams(json=compact.json, disable_any_whitespace=True)
    assert GrammarSource.of(tight) != GrammarSource.of(compact)  # the options are part of the key


def test_the_cache_stays_within_its_entries_and_bytes():
    cache = GrammarCache(max_bytes=1000, max_entries=3)
    for i in range(10):
        cache.put(GrammarSource("regex", f"a{i}"), object(), 300)
        assert len(cache) <= 3 and cache.num_bytes <= 1000
    assert cache.get(GrammarSource("regex", "a9")) is not None and cache.get(GrammarSource("regex", "a0")) is None
    cache.put(GrammarSource("regex", "huge"), object(), 1001)  # larger than the whole budget: not kept
    assert cache.get(GrammarSource("regex", "huge")) is None
    # Least recently used goes first: a9 was just read, so a7 and a8 make room for two more.
    cache.put(GrammarSource("regex", "b1"), object(), 300)
    cache.put(GrammarSource("regex", "b2"), object(), 300)
    assert cache.get(GrammarSource("regex", "a9")) is not None and cache.get(GrammarSource("regex", "a8")) is None
    assert (cache.hits, cache.misses, cache.evictions) == (2, 3, 9)


@pytest.fixture(scope="module")
def tiny_backend():
    from kestrel.loader.tokenizer import load_tokenizer
    from kestrel.structured.backend import GrammarBackend
    from kestrel.tiny import default_model_path

    tokenizer = load_tokenizer(str(default_model_path()))
    return GrammarBackend(tokenizer, len(tokenizer), frozenset({tokenizer.eos_token_id}))


def test_the_compile_pool_caches_within_its_bounds(tiny_backend):
    from kestrel.entrypoints.grammar_pool import GrammarCompilePool

    pool = GrammarCompilePool(tiny_backend.tokenizer_info, processes=0, timeout_s=30, limits=GrammarLimits(),
                              cache_bytes=400_000, cache_entries=4)

    def schema(i: int) -> StructuredOutputsParams:
        fields = {f"f{i}_{j}": {"type": "integer"} for j in range(16)}
        return StructuredOutputsParams(json=obj(fields, required=list(fields)))

    async def main() -> None:
        first = await pool.compile(pool.source(schema(0), "p"), "p")
        assert await pool.compile(pool.source(schema(0), "p"), "p") is first  # from the cache
        sizes = []
        for i in range(1, 12):
            compiled = await pool.compile(pool.source(schema(i), "p"), "p")
            sizes.append(compiled.memory_size_bytes)
            await asyncio.sleep(0)  # the cache is filled by a callback on the loop
            assert len(pool.cache) <= 4 and pool.cache.num_bytes <= 400_000
        assert pool.cache.hits == 1 and pool.cache.evictions >= 12 - 4
        assert len(pool.cache) == min(4, 400_000 // max(sizes))
        with pytest.raises(InvalidRequestError, match="could not be compiled") as caught:
            await pool.compile(pool.source(StructuredOutputsParams(regex="(open"), "structured_outputs.regex"),
                               "structured_outputs.regex")
        assert caught.value.param == "structured_outputs.regex"

    try:
        asyncio.run(main())
    finally:
        pool.close()


def test_the_engine_backend_applies_the_default_limits(tiny_backend):
    with pytest.raises(InvalidRequestError, match="--max-grammar-choices") as caught:
        tiny_backend.compile(StructuredOutputsParams(json={"enum": [f"v{i}" for i in range(5000)]}))
    assert caught.value.param == "structured_outputs.json"
    assert tiny_backend.compile(StructuredOutputsParams(choice=["yes", "no"])) is not None
    assert tiny_backend.compiler.cache_limit_bytes == 256 << 20  # the engine's own cache is bounded too
