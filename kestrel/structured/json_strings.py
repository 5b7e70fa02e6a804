"""JSON-schema grammars whose length-bounded strings stay valid JSON.

xgrammar (0.2.9) builds a string with `minLength` / `maxLength` from a character rule that leaves out only the
quote, the backslash, CR and LF: the other control characters (U+0000-U+001F), which JSON allows in a string only
escaped, pass raw, and a model that picks one (greedy decoding does) writes text no JSON parser reads. Its unbounded
strings are right. Here such a grammar's character rules are replaced by JSON's own string character (any
character but the quote, the backslash and the controls, or an escape sequence, which counts as one character, as
the schema's lengths count the decoded string), and the grammar is built again from the corrected text.

xgrammar is imported inside the functions (this module is imported by the server's request path).
"""

from __future__ import annotations

import re
from typing import Any

# A bounded string's character rule as xgrammar prints it: `<name> ::= (([^\"\\\r\n]))`.
_BOUNDED_CHARACTER_RULE = re.compile(r'^(\S+) ::= \(\(\[\^\\"\\\\\\r\\n\]\)\)$', re.MULTILINE)
# One character of a JSON string's content, escapes included.
_JSON_STRING_CHARACTER = (r'(([^\0-\x1f\"\\]) | ("\\" (([\"\\/bfnrt]) | '
                          r'("u" [A-Fa-f0-9] [A-Fa-f0-9] [A-Fa-f0-9] [A-Fa-f0-9]))))')


def json_schema_grammar(schema: str, *, any_whitespace: bool, max_whitespace_cnt: int | None = None) -> Any:
    """The xgrammar Grammar of a JSON schema's text, with its length-bounded strings' characters corrected."""
    import xgrammar as xgr

    grammar = xgr.Grammar.from_json_schema(schema, any_whitespace=any_whitespace,
                                           max_whitespace_cnt=max_whitespace_cnt)
    text = str(grammar)
    corrected, count = _BOUNDED_CHARACTER_RULE.subn(lambda m: f"{m.group(1)} ::= {_JSON_STRING_CHARACTER}", text)
    return xgr.Grammar.from_ebnf(corrected) if count else grammar
