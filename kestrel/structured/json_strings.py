"""JSON-schema grammars whose length-bounded strings stay valid JSON, and fast to match.

xgrammar (0.2.9) builds a string with `minLength` / `maxLength` as a bounded repetition of a character rule that
leaves out only the quote, the backslash, CR and LF: the other control characters (U+0000-U+001F), which JSON allows
in a string only escaped, pass raw, and a model that picks one (greedy decoding does) writes text no JSON parser
reads. Its unbounded strings are right. Here such a grammar's character rule becomes one character class: any
character but the quote, the backslash and the controls. Like xgrammar's own rule it has no escape sequences, so a
length-bounded string holds no quote, backslash or control character; everything it holds is valid JSON within the
schema's lengths. An escape alternative would cost far more than it gives: with any multi-character alternative in
the repeated rule, xgrammar can no longer precompute the token masks inside the string, and filling a 128k
vocabulary's mask there took up to 200 ms per row instead of well under 1 ms (docs/benchmarks.md, "Structured
outputs").

xgrammar is imported inside the functions (this module is imported by the server's request path).
"""

from __future__ import annotations

import re
from typing import Any

# A bounded string's character rule as xgrammar prints it: `<name> ::= (([^\"\\\r\n]))`.
_BOUNDED_CHARACTER_RULE = re.compile(r'^(\S+) ::= \(\(\[\^\\"\\\\\\r\\n\]\)\)$', re.MULTILINE)
# One character of a length-bounded JSON string: a single class, which keeps xgrammar's bounded repetition fast.
BOUNDED_STRING_CHARACTER = r'([^\0-\x1f\"\\])'


def json_schema_grammar(schema: str, *, any_whitespace: bool, max_whitespace_cnt: int | None = None) -> Any:
    """The xgrammar Grammar of a JSON schema's text, with its length-bounded strings' character rule corrected."""
    import xgrammar as xgr

    grammar = xgr.Grammar.from_json_schema(schema, any_whitespace=any_whitespace,
                                           max_whitespace_cnt=max_whitespace_cnt)
    text = str(grammar)
    corrected, count = _BOUNDED_CHARACTER_RULE.subn(lambda m: f"{m.group(1)} ::= {BOUNDED_STRING_CHARACTER}", text)
    return xgr.Grammar.from_ebnf(corrected) if count else grammar


# xgrammar's C++ errors open with its log prefix: "[01:36:58] /project/cpp/json_schema_converter.cc:5082: ".
_COMPILER_LOG_PREFIX = re.compile(r"^\[[0-9:]+\] \S+\.(?:cc|cpp|h):\d+: ")


def compiler_reason(error: BaseException) -> str:
    """A grammar compiler's error as a client reads it: its first line, without xgrammar's log prefix (the time
    and the C++ source line mean nothing to a client)."""
    text = str(error).strip()
    return _COMPILER_LOG_PREFIX.sub("", text.splitlines()[0]) if text else type(error).__name__
