"""A cheap pre-check for regex rules: the literal strings every match must start with.

Python's regex engine tries a pattern at every offset; with ~150 rules that is most of the cost
of injection detection. `literal_prefixes` reads a pattern's parse tree and returns a set of
short literals such that every match begins with one of them (or None when the pattern can
begin with an open class such as ``\\w``). A rule whose literals do not occur in the text cannot
match, so it is not run; one whose literals do occur is only tried where they occur.
"""

from __future__ import annotations

import re
import re._constants as sre
import re._parser as sre_parse
from typing import Any

PREFIX_LENGTH = 6  # longer literals are cut: enough to be selective, few n-gram sizes to index
_MAX_CLASS = 32  # a character class wider than this ends a literal
_ZERO_WIDTH = (sre.AT, sre.ASSERT, sre.ASSERT_NOT)
_REPEATS = (sre.MAX_REPEAT, sre.MIN_REPEAT, sre.POSSESSIVE_REPEAT)


def _class_chars(items: Any) -> list[str] | None:
    chars: list[str] = []
    for op, av in items:
        if op is sre.LITERAL:
            chars.append(chr(av))
        elif op is sre.RANGE and av[1] - av[0] < _MAX_CLASS:
            chars.extend(chr(c) for c in range(av[0], av[1] + 1))
        else:
            return None
    return chars if len(chars) <= _MAX_CLASS else None


def _walk(items: list[Any], current: set[str]) -> set[str]:
    for index, (op, av) in enumerate(items):
        if all(len(p) >= PREFIX_LENGTH for p in current):
            return current
        rest = items[index + 1 :]
        if op in _ZERO_WIDTH:
            continue
        if op is sre.LITERAL:
            current = {p + chr(av) for p in current}
        elif op is sre.IN and (chars := _class_chars(av)) is not None:
            current = {p + c for p in current for c in chars}
        elif op is sre.SUBPATTERN:
            return _walk(list(av[-1]) + rest, current)
        elif op is sre.BRANCH:
            return set().union(*(_walk(list(alt) + rest, current) for alt in av[1]))
        elif op in _REPEATS:
            low, high, sub = av
            once = _walk(list(sub) + (rest if high == 1 else []), current)
            return once | _walk(rest, current) if low == 0 else once
        else:
            return current
    return current


def literal_prefixes(pattern: str) -> frozenset[str] | None:
    """Literals (at most `PREFIX_LENGTH` long) one of which starts every match; None if none."""
    found = {p[:PREFIX_LENGTH] for p in _walk(list(sre_parse.parse(pattern)), {""})}
    return None if "" in found else frozenset(found)


class PrefixIndex:
    """Where each of many rules could match a text: the offsets at which one of its literals
    occurs. A rule is then tried only there (an anchored match) instead of at every offset."""

    def __init__(self, prefixes: list[frozenset[str] | None]) -> None:
        self._always = [i for i, p in enumerate(prefixes) if p is None]
        self._rules_of: dict[str, list[int]] = {}
        for index, literals in enumerate(prefixes):
            for literal in literals or ():
                self._rules_of.setdefault(literal, []).append(index)
        self._short = [lit for lit in self._rules_of if len(lit) < PREFIX_LENGTH]
        self._full = frozenset(lit for lit in self._rules_of if len(lit) == PREFIX_LENGTH)

    def candidates(self, text: str) -> dict[int, list[int]]:
        """Rule index -> sorted offsets where it could match (`ALL` for rules without literals)."""
        offsets: dict[int, set[int]] = {i: ALL for i in self._always}
        size = PREFIX_LENGTH
        starts = {text[m.start() : m.start() + size] for m in _MATCH_START.finditer(text)}
        grams = {literal: _occurrences(text, literal) for literal in self._full & starts}
        for literal in self._short:
            found = _occurrences(text, literal)
            if found:
                grams[literal] = found
        for literal, places in grams.items():
            for index in self._rules_of[literal]:
                offsets.setdefault(index, set()).update(places)
        return {i: sorted(o) if o is not ALL else [] for i, o in sorted(offsets.items())}


# Where a rule's match can begin: every pattern starts with a word boundary, a line start or a
# non-word character, never inside a word (tests/pipeline/guards/test_prefilter.py checks it).
_MATCH_START = re.compile(r"\b\w|[^\w ]")
ALL: set[int] = set()  # marker: try the rule everywhere (a search, not anchored matches)


def _occurrences(text: str, literal: str) -> list[int]:
    out, at = [], text.find(literal)
    while at != -1:
        out.append(at)
        at = text.find(literal, at + 1)
    return out
