"""A grammar as the compiler takes it (`GrammarSource`: kind, canonical text, options; hashable, picklable, the key
of every cache), its compilation against a vocabulary, the bounded cache of compiled grammars, and the functions a
compile worker process runs.

xgrammar is imported inside the functions that need it: the engine and the server's request path only import this
module's names.
"""

from __future__ import annotations

import ctypes
import json
import re
import sys
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from kestrel.request import InvalidRequestError
from kestrel.sampling_params import StructuredOutputsParams
from kestrel.structured.json_strings import compiler_reason, json_schema_grammar
from kestrel.structured.tool_grammar import tool_call_grammar

# The longest whitespace run allowed between JSON tokens: room for indented, pretty-printed JSON, and a bound on
# a model that would otherwise pad an object with whitespace until max_tokens.
JSON_MAX_WHITESPACE = 16
_DESCRIPTIONS = {"json": "JSON schema", "regex": "regex", "grammar": "grammar", "tool_call": "tool call grammar"}


class GrammarCompileError(ValueError):
    """The compiler refused the grammar (its message says why); crosses process boundaries."""


@dataclass(frozen=True)
class GrammarSource:
    """`kind`: json (a JSON schema's text), regex, grammar (EBNF, also a choice list's), or tool_call (the JSON text
    of [tools, tool_choice mode, named tool, tool-call format]: its grammar is built from the tools' schemas)."""

    kind: str
    text: str
    any_whitespace: bool = True

    @classmethod
    def of(cls, spec: StructuredOutputsParams) -> GrammarSource:
        kind = spec.kind
        if kind in ("json", "json_object"):  # json_object: any JSON object (not any JSON value)
            schema = spec.json if kind == "json" else {"type": "object"}
            if isinstance(schema, str):  # the same schema, however it is spaced, is one cache entry
                schema = json.loads(schema)
            return cls("json", json.dumps(schema, separators=(",", ":")), not spec.disable_any_whitespace)
        if kind == "choice":
            return cls("grammar", choice_grammar(spec.choice or []))
        return cls(kind, getattr(spec, kind))

    @classmethod
    def tool_call(cls, tools: list[dict[str, Any]], tool_choice: str, named_tool: str | None,
                  fmt: str) -> GrammarSource:
        return cls("tool_call", json.dumps([tools, tool_choice, named_tool, fmt], separators=(",", ":")))


def compile_source(compiler: Any, source: GrammarSource) -> Any:
    """The xgrammar CompiledGrammar of `source`; a grammar the compiler refuses is a GrammarCompileError."""
    try:
        if source.kind == "json":
            return compiler.compile_grammar(json_schema_grammar(source.text, any_whitespace=source.any_whitespace,
                                                                max_whitespace_cnt=JSON_MAX_WHITESPACE))
        if source.kind == "regex":
            return compiler.compile_regex(source.text)
        if source.kind == "tool_call":
            tools, tool_choice, named_tool, fmt = json.loads(source.text)
            return compiler.compile_grammar(tool_call_grammar(tools, tool_choice, named_tool, fmt))
        return compiler.compile_grammar(source.text)
    except InvalidRequestError as error:  # a tool's schema, named by the tool grammar
        raise GrammarCompileError(str(error)) from None
    except (RuntimeError, ValueError, TypeError) as error:
        raise GrammarCompileError(f"the {_DESCRIPTIONS[source.kind]} could not be compiled: "
                                  f"{compiler_reason(error)[:500]}") from None


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar whose language is exactly the given strings."""
    return "root ::= " + " | ".join(_ebnf_literal(c) for c in choices)


def _ebnf_literal(text: str) -> str:
    escaped = re.sub(r'["\\]', lambda m: "\\" + m.group(0), text)
    escaped = escaped.replace("\n", "\\n").replace("\r", "\\r").replace("\t", "\\t")
    return f'"{escaped}"'


# ----- memory -----------------------------------------------------------------------------------------

_libc: Any = None


def release_memory() -> None:
    """Give the heap's free pages back to the host (glibc's malloc_trim): freed grammars otherwise stay in the
    process's resident memory until malloc reuses them."""
    global _libc
    if not sys.platform.startswith("linux"):
        return
    try:
        _libc = _libc or ctypes.CDLL("libc.so.6")
        _libc.malloc_trim(0)
    except (OSError, AttributeError):
        pass


class GrammarCache:
    """Compiled grammars by source, least recently used dropped first, within `max_entries` and `max_bytes` (each
    entry's size as xgrammar reports it, CompiledGrammar.memory_size_bytes). A grammar larger than the whole budget
    is not kept. Evicting `TRIM_BYTES` or more returns the freed memory to the host."""

    TRIM_BYTES = 16 << 20

    def __init__(self, max_bytes: int, max_entries: int) -> None:
        self.max_bytes = max_bytes
        self.max_entries = max_entries
        self._entries: OrderedDict[GrammarSource, tuple[Any, int]] = OrderedDict()
        self.num_bytes = 0
        self.hits = 0
        self.misses = 0
        self.evictions = 0
        self._evicted_bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, source: GrammarSource) -> Any | None:
        entry = self._entries.get(source)
        if entry is None:
            self.misses += 1
            return None
        self._entries.move_to_end(source)
        self.hits += 1
        return entry[0]

    def put(self, source: GrammarSource, grammar: Any, size: int) -> None:
        if source in self._entries or self.max_entries < 1 or size > self.max_bytes:
            return
        self._entries[source] = (grammar, size)
        self.num_bytes += size
        while len(self._entries) > self.max_entries or self.num_bytes > self.max_bytes:
            _, (_, evicted) = self._entries.popitem(last=False)
            self.num_bytes -= evicted
            self.evictions += 1
            self._evicted_bytes += evicted
        if self._evicted_bytes >= self.TRIM_BYTES:
            self._evicted_bytes = 0
            release_memory()

    def clear(self) -> None:
        self._entries.clear()
        self.num_bytes = 0


# ----- the compile worker process -----------------------------------------------------------------------

_worker_compiler: Any = None


def start_compile_worker(tokenizer_info_json: str, max_threads: int) -> None:
    """A compile worker's initializer: the vocabulary from its serialized TokenizerInfo (no tokenizer to load),
    and a compiler without a cache (the serving process keeps the cache)."""
    global _worker_compiler
    import xgrammar as xgr

    info = xgr.TokenizerInfo.deserialize_json(tokenizer_info_json)
    _worker_compiler = xgr.GrammarCompiler(info, max_threads=max_threads, cache_enabled=False)


def trial_compile(source: GrammarSource) -> int:
    """Compile `source` in a worker and drop the result; its size in bytes (memory_size_bytes). The worker proves
    that the grammar compiles within the deadline; the serving process then compiles it for itself (a compiled
    grammar's serialized form grows with the square of a schema's properties, and takes longer to write and read
    than the compile)."""
    compiled = compile_source(_worker_compiler, source)
    size = int(compiled.memory_size_bytes)
    del compiled
    if size >= GrammarCache.TRIM_BYTES:
        release_memory()
    return size
