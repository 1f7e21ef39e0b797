"""Blocked terms: whole-word, case-insensitive matching on canonical text, and the tail of a
stream that could still be the start of a term."""

from __future__ import annotations

import re
from collections.abc import Iterable

from pipeline.guards import pii
from pipeline.guards.normalize import CanonicalText

_WORD = re.compile(r"\w")


def lower(text: str) -> str:
    """Lower-case, one character for one (so offsets stay valid)."""
    lowered = text.lower()
    if len(lowered) == len(text):
        return lowered
    return "".join(c if len(c.lower()) != 1 else c.lower() for c in text)


def canonical_term(term: str) -> str:
    """How a blocked term is matched: canonical (homoglyphs, zero-width...) and lower-case."""
    return lower(CanonicalText(term).text.strip())


class TermMatcher:
    """Whole-word, case-insensitive matching of a list of blocked terms on canonical text."""

    def __init__(self, terms: Iterable[str]) -> None:
        self.terms = sorted({t for t in map(canonical_term, terms) if t}, key=len, reverse=True)
        self._prefixes = {t[:k] for t in self.terms for k in range(1, len(t) + 1)}
        self.longest = len(self.terms[0]) if self.terms else 0
        body = "|".join(map(re.escape, self.terms))
        self._pattern = re.compile(rf"(?<!\w)(?:{body})(?!\w)") if self.terms else None

    def scan(self, lowered: str, pos: int, result: pii.Scan) -> None:
        """Add each term occurrence from `pos` on to `result` (kind "blocked")."""
        if self._pattern is None:
            return
        for m in self._pattern.finditer(lowered, pos):
            result.extents.append(m.span())
            result.found.append(pii.Candidate("blocked", *m.span(), 1.0, m.group()))

    def tail_start(self, lowered: str, floor: int) -> int:
        """Start of the longest tail, at a word start, that is the beginning of some term."""
        n = len(lowered)
        for k in range(min(self.longest, n - floor), 0, -1):
            start = n - k
            if lowered[start:] in self._prefixes and not (
                start > 0 and _WORD.match(lowered[start - 1])
            ):
                return start
        return n
