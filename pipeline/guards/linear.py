"""Linear-time regular expressions for caller text: RE2, searched over UTF-8 bytes.

Python's `re` backtracks: a pattern such as ``\\n\\s*(?:system|...)\\s*:`` tried at each of
40,000 newlines reads the rest of the text each time (seconds for one request). RE2 runs an
automaton instead, so a search costs time linear in the text whatever the pattern, at the price
of no lookaround and no backreferences (rules say what Python's lookahead said as a separate
pattern tried where a match ends: `Rule.unless`) and of ASCII-only ``\\w``, ``\\b`` and ``\\s``
(the rules read folded text: accents stripped, look-alikes folded to Latin).

How to call it so that it stays linear: the Python wrapper re-encodes a ``str`` argument to UTF-8
and walks to ``pos`` on every call, so `encode` the text once and pass the bytes; and search
each pattern once (or iterate its matches) rather than trying it at many offsets, which would
read runs again for each offset. Offsets of matches are then byte offsets.

Patterns that must read text with lone surrogates (which cannot be encoded to UTF-8) stay on
`re`, written so that no backtracking is possible: no quantifier, or possessive ones only
(`normalize` has the few there are); tests/pipeline/guards/test_linear_time.py times them all.
"""

from __future__ import annotations

from typing import Any

import re2

Regex = Any  # re2._Regexp: the wrapper ships no type information


def _options() -> Any:
    options = re2.Options()
    options.log_errors = False  # a bad pattern raises re2.error; nothing is printed to stderr
    return options


OPTIONS = _options()


def compile_linear(pattern: str) -> Regex:
    """An RE2 pattern (raises `re2.error` for syntax RE2 lacks, such as lookaround)."""
    return re2.compile(pattern, OPTIONS)


def compile_callers(pattern: str, *, max_mem: int) -> Regex:
    """A caller's RE2 pattern, compiled within ``max_mem`` bytes (past it, `re2.error`: "pattern
    too large") and not kept. ``re2.compile`` keeps every pattern it compiled in a module-level
    cache of 128, for ever: a caller's ``\\pL{400}`` is 4 MB there, so 32 requests of four
    patterns held 0.5 GB of a replica. The wrapper's own class compiles without that cache."""
    options = _options()
    options.max_mem = max_mem
    return re2._Regexp(pattern, options)


def encode(text: str) -> bytes:
    """The UTF-8 bytes RE2 patterns search (a lone surrogate, which UTF-8 cannot encode, becomes
    "?"; canonical text has none)."""
    return text.encode("utf-8", "replace")


def literal_set(literals: list[str]) -> Any:
    """An RE2 set of escaped literals: `.Match(data)` lists, in one pass over `data`, the
    indices of those that occur in it (None when none does)."""
    found = re2.Set.SearchSet(OPTIONS)
    for literal in literals:
        found.Add(re2.escape(literal))
    found.Compile()
    return found
