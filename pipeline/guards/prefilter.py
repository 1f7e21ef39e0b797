"""A cheap pre-check for regex rules: the literal strings every match must start with.

With ~200 rules, calling each on every text would be most of the cost of injection detection.
`literal_prefixes` reads a pattern's parse tree (`sre_parse` reads RE2's syntax too, as far as
the rules use it) and returns a set of short literals such that every match begins with one of
them (or None when the pattern can begin with an open class such as ``\\w``). A rule whose
literals do not occur in the text cannot match, so it is not run.
"""

from __future__ import annotations

import re._constants as sre
import re._parser as sre_parse
from typing import Any

from pipeline.guards.linear import literal_set

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
    """Which of many rules could match a text at all: those one of whose literals occurs in it,
    found by one pass of an RE2 set of all the literals over the text's bytes (linear time, a
    single call), plus the rules without literals. Each candidate is then searched once."""

    def __init__(self, prefixes: list[frozenset[str] | None]) -> None:
        self._always = [i for i, p in enumerate(prefixes) if p is None]
        rules_of: dict[str, list[int]] = {}
        for index, literals in enumerate(prefixes):
            for literal in literals or ():
                rules_of.setdefault(literal, []).append(index)
        self._literals = sorted(rules_of)
        self._rules_of = [rules_of[literal] for literal in self._literals]
        # The sentinel, appended to every text, must always be found: if it is not, the set's
        # automaton ran out of memory (RE2 then reports no match at all) and every rule is tried.
        self._sentinel = len(self._literals)
        self._set = literal_set([*self._literals, _SENTINEL.decode()])
        self._every = sorted(set(self._always).union(*self._rules_of))

    def candidates(self, data: bytes) -> list[int]:
        """Indices of the rules whose literals occur in `data` (UTF-8), in rule order."""
        found = self._set.Match(data + _SENTINEL) or ()
        if self._sentinel not in found:
            return self._every
        rules = set(self._always)
        for literal in found:
            if literal != self._sentinel:
                rules.update(self._rules_of[literal])
        return sorted(rules)


_SENTINEL = b"\x00\x01\x02end"  # control bytes: never in folded text, which drops them
