"""Where redaction may cut a text: the tail a match could still extend, and fixed split points
inside very long runs, shared by the streaming and the one-call redactor so both cut alike.

Two characters are *joinable* when some PII pattern can have them side by side: word characters
and ``.%+-@():`` next to each other, and a space only after a digit, a capital or ")" and before
a digit, a capital, "(" or "+" (as in "4111 1111", "+44 20", "DE89 3704", "AB 12 34 56 C"). A
*run* is a maximal stretch of pairwise joinable characters; no match crosses the end of a run,
so ordinary prose is a chain of short runs (a word each) and the redactor holds back at most the
last one.

A run longer than `RUN_LIMIT` (no real match is: the longest pattern is `pii.MAX_MATCH`) is
split every `RUN_LIMIT` characters counted from its start, at the next boundary between
original characters. Both redactors scan each piece on its own, so the stream never holds back
more than about two pieces, whatever the text (a long hash, base64, digits; the exact bound is
`StreamingRedactor.max_holdback`). The
price: a match that straddles such a split point, which only a run of more than `RUN_LIMIT`
unbroken pattern characters can produce, is not found.
"""

from __future__ import annotations

from pipeline.guards import pii

LOOKAHEAD = 3  # the most characters after a match that a pattern's lookahead reads
RUN_LIMIT = pii.MAX_MATCH + LOOKAHEAD + 1
MAX_EXPANSION = 18  # the most canonical characters one original character becomes ("ﷺ")
_SPACE_BEFORE = frozenset("0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ)")
_SPACE_AFTER = frozenset("0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ(+")
_MATCH_PUNCT = frozenset(".%+-@():_")


def member(c: str) -> bool:
    """Can this character be part of some PII match?"""
    return c.isalnum() or c in _MATCH_PUNCT or c == " "


def joinable(left: str, right: str) -> bool:
    """Can these two characters sit side by side inside some PII match?"""
    if right == " ":
        return left in _SPACE_BEFORE
    if left == " ":
        return right in _SPACE_AFTER
    return (left.isalnum() or left in _MATCH_PUNCT) and (right.isalnum() or right in _MATCH_PUNCT)


def pii_tail_start(text: str, floor: int) -> int:
    """Start of the run at the end of `text` (not before `floor`), which a match could extend."""
    n = len(text)
    start = n
    if n > floor and member(text[-1]):
        start = n - 1
        while start > floor and joinable(text[start - 1], text[start]):
            start -= 1
    while start < n and text[start] == " ":  # no pattern starts with a space
        start += 1
    return start


class RunSplitter:
    """Finds the split points of long runs, one canonical character at a time.

    `push(c, origin)` takes the next canonical character and the index of the original
    character it came from; it returns True when a split point falls just before it.
    """

    def __init__(self, limit: int = RUN_LIMIT) -> None:
        self.limit = limit
        self._index = -1  # canonical index of the last character pushed
        self._prev = ""
        self._prev_origin = -1
        self._next = -1  # the next grid point of the current run (-1: no run)

    def push(self, c: str, origin: int) -> bool:
        """Take the next character; True if the text must be split before it."""
        self._index += 1
        split = False
        if self._next >= 0 and joinable(self._prev, c):
            if self._index >= self._next and origin != self._prev_origin:
                split = True
                self._next += self.limit
        else:
            self._next = self._index + self.limit if member(c) else -1
        self._prev, self._prev_origin = c, origin
        return split


def split_points(text: str, origin: list[int], limit: int = RUN_LIMIT) -> list[int]:
    """Every split point of a whole canonical text."""
    splitter = RunSplitter(limit)
    return [i for i, (c, o) in enumerate(zip(text, origin, strict=True)) if splitter.push(c, o)]
