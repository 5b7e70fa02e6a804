"""Structured outputs: grammars compiled to per-token bitmasks (xgrammar), one matcher per constrained request.

The engine holds a backend duck-typed (it stays pure Python): `add` compiles a request's grammar (cached by
its text) and starts its matcher, `accept` advances it with the tokens the request received, `bitmask` fills
the rows of a step's constrained requests on the host, and `remove` forgets a finished request.
"""
