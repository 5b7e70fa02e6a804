"""Structured outputs: grammars compiled to per-token bitmasks (xgrammar), one matcher per constrained request.

The engine holds a backend duck-typed (it stays pure Python): `add` starts a request's matcher on the grammar it
is handed compiled (the server compiles off the engine: entrypoints/grammar_pool.py), else on the grammar it
compiles itself within `limits` (cached by its text, the cache bounded in bytes), `accept` advances it with the
tokens the request received, `bitmask` fills the rows of a step's constrained requests on the host, and `remove`
forgets a finished request. `limits` checks a grammar's size before any compiling; `compile` turns a request's
grammar into the compiler's input (`GrammarSource`), compiles it, caches compiled grammars (LRU by bytes and
entries) and holds what a compile worker process runs.
"""
