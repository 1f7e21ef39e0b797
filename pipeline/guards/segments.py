"""Where redaction may cut a text: the tail a match could still extend, and fixed split points
inside very long runs, shared by the streaming and the one-call redactor so both cut alike.

Two characters other than spaces are *joinable* when some PII pattern can have them side by
side: word characters and ``.%+-@():_/[]{}<>`` next to each other. A space is *linked* to its
neighbours when some pattern can cross it, which the characters around it tell:

- a digit, a capital or ")" before and a digit, a capital, "(" or "+" after ("4111 1111",
  "+44 20", "DE89 3704", "AB 12 34 56 C");
- a digit on one side and a letter or digit on the other ("de89 3704", "gb82 west 1234");
- a bracket or "@" on either side, or a dot with spaces on both sides ("name [at] example",
  "name @ example . com"; not the space after a full stop);
- the word "at" or "dot" on either side ("name at example dot com").

A *run* is a maximal stretch of characters joined or linked pair by pair; no match crosses the
end of a run, so ordinary prose is a chain of short runs (a word, a few words around "at", a
number with its neighbours) and the redactor holds back the last one. Whether a space is linked
can depend on up to `LINK_AHEAD` characters after it ("x a" may become "x at y"), so a space at
the very end counts as linked until they arrive: the word before a final space waits for the
next character.

A run longer than `RUN_LIMIT` (no real match is: the longest pattern is `pii.MAX_MATCH`) is
split every `RUN_LIMIT` characters counted from its start, at the next boundary between
original characters. Both redactors scan each piece on its own, so the stream never holds back
more than about two pieces, whatever the text (a long hash, base64, digits, "a at b at c...";
the exact bound is `StreamingRedactor.max_holdback`). The price: a match that straddles such a
split point, which only a run of more than `RUN_LIMIT` characters can produce, is not found.
"""

from __future__ import annotations

from collections.abc import Sequence

from pipeline.guards import pii

LOOKAHEAD = 3  # the most characters after a match that a pattern's lookahead reads
RUN_LIMIT = pii.MAX_MATCH + LOOKAHEAD + 1
MAX_EXPANSION = 18  # the most canonical characters one original character becomes ("ﷺ")
LINK_AHEAD = len("dot ")  # the most characters after a space that decide whether it is linked
_LINK_BEHIND = len(" dot")  # ... and before it
_SPACE_BEFORE = frozenset("0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ)")
_SPACE_AFTER = frozenset("0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ(+")
_MARKS = frozenset("[](){}<>@")  # an obfuscated e-mail's brackets and "@" (for " . ", below)
_DIGITS = frozenset("0123456789")
_AHEAD = ("at ", "dot ", ". ")
_BEHIND = (" at", " dot")
_MATCH_PUNCT = frozenset(".%+-@():_/[]{}<>")


def member(c: str) -> bool:
    """Can this character (not a space: see `space_linked`) be part of some PII match?"""
    return c.isalnum() or c in _MATCH_PUNCT


def joinable(left: str, right: str) -> bool:
    """Can these two characters (neither a space) sit side by side inside some PII match?"""
    return member(left) and member(right)


def space_linked(text: str, i: int, *, final: bool = False) -> bool | None:
    """Is the space at `text[i]` inside a run? None when characters that decide it have not
    arrived yet (`final`: none will)."""
    n = len(text)
    if i + 1 >= n:
        return False if final else None
    left, right = text[i - 1] if i > 0 else "", text[i + 1]
    if (left in _SPACE_BEFORE and right in _SPACE_AFTER) or left in _MARKS or right in _MARKS:
        return True
    if (left in _DIGITS and right.isalnum()) or (right in _DIGITS and left.isalnum()):
        return True
    if left == "." and text[i - 2 : i - 1] == " ":
        return True  # the second space of " . "
    if left in "tT":  # " at" or " dot" before, or the word opening the text
        behind = text[max(0, i - _LINK_BEHIND) : i].lower()
        if any(behind.endswith(w) or (i == len(w) - 1 and behind == w[1:]) for w in _BEHIND):
            return True
    if right not in "aAdD.":
        return False
    ahead = text[i + 1 : i + 1 + LINK_AHEAD].lower()
    if any(ahead.startswith(word) for word in _AHEAD):
        return True  # " at ", " dot ", or the first space of " . "
    if final or i + 1 + len(ahead) < n:
        return False
    # The text ends within the characters that decide: " a", " do", " ." may still be.
    return None if any(word.startswith(ahead) for word in _AHEAD) else False


def linked_at(text: str, i: int, *, final: bool = False) -> bool | None:
    """Are `text[i - 1]` and `text[i]` in one run (None: not known yet)?"""
    left, right = text[i - 1], text[i]
    if right == " ":
        return member(left) and space_linked(text, i, final=final)
    if left == " ":
        return member(right) and space_linked(text, i - 1, final=final)
    return joinable(left, right)


def member_at(text: str, i: int, *, final: bool = False) -> bool | None:
    """Can `text[i]` be part of a run (None: not known yet)?"""
    if text[i] == " ":
        return space_linked(text, i, final=final)
    return member(text[i])


def pii_tail_start(text: str, floor: int, *, decided: int = 0, run_start: int = 0) -> int:
    """Start of the run at the end of `text` (not before `floor`), which a match could extend.

    `decided` and `run_start` are a `RunSplitter`'s view of the same text, which spares the
    walk back: every boundary before `decided` is known, and the run that holds the character
    before it starts at `run_start`."""
    n = len(text)
    start = n
    if n > floor and member_at(text, n - 1) is not False:
        start = n - 1
        while start > floor and linked_at(text, start) is not False:
            start -= 1
            if start < decided:
                start = max(floor, run_start)
                break
    while start < n and text[start] == " ":  # no pattern starts with a space
        start += 1
    return start


class RunSplitter:
    """Finds the split points of long runs, one canonical character at a time.

    `push(c, origin)` takes the next canonical character and the index of the original
    character it came from, and returns the split points (canonical offsets counted from the
    first character pushed) that are known now: a split point falls just before its offset.
    Whether a space is linked can wait for `LINK_AHEAD` more characters, so the answer for an
    offset may come a few pushes later; `finish()` gives the rest once the text is complete.
    `decided` and `run_start` spare `pii_tail_start` a walk back over what is decided.
    """

    def __init__(self, limit: int = RUN_LIMIT) -> None:
        self.limit = limit
        self._text = ""  # the characters from offset `_base` on
        self._origins: list[int] = []
        self._base = 0
        self.decided = 0  # the next offset to decide
        self._next = -1  # the next grid point of the current run (-1: no run)
        self.run_start = 0  # where the run holding the last decided character starts

    def push(self, c: str, origin: int) -> list[int]:
        """Take the next character; the split points decided now."""
        return self.extend(c, (origin,))

    def extend(self, chars: str, origins: Sequence[int]) -> list[int]:
        """Take the next characters (and their origins); the split points decided now."""
        self._text += chars
        self._origins.extend(origins)
        return self._decide(final=False)

    def finish(self) -> list[int]:
        """The text is complete: the split points not decided yet."""
        return self._decide(final=True)

    def _decide(self, *, final: bool) -> list[int]:
        text, origins, base, limit = self._text, self._origins, self._base, self.limit
        decided, grid, run_start = self.decided, self._next, self.run_start
        splits = []
        end = base + len(text)
        while decided < end:
            i = decided - base
            c = text[i]
            if decided == 0:
                member: bool | None = member_at(text, i, final=final)
                linked: bool | None = False
            elif c != " " and text[i - 1] != " ":  # no space to decide: at once
                member = c.isalnum() or c in _MATCH_PUNCT
                linked = member and (text[i - 1].isalnum() or text[i - 1] in _MATCH_PUNCT)
            else:
                member = member_at(text, i, final=final)
                linked = linked_at(text, i, final=final)
            if member is None or linked is None:
                break
            if grid >= 0 and linked:
                if decided >= grid and origins[i] != origins[i - 1]:
                    splits.append(decided)
                    grid += limit
            else:
                grid = decided + limit if member else -1
                run_start = decided if member else decided + 1
            decided += 1
        self.decided, self._next, self.run_start = decided, grid, run_start
        keep = decided - base - _LINK_BEHIND - 1  # what is next still reads these
        if keep > 0:
            self._text = text[keep:]
            del self._origins[:keep]
            self._base += keep
        return splits


def split_points(text: str, origin: list[int], limit: int = RUN_LIMIT) -> list[int]:
    """Every split point of a whole canonical text."""
    if len(text) != len(origin):
        raise ValueError("a canonical text and its origins differ in length")
    splitter = RunSplitter(limit)
    return splitter.extend(text, origin) + splitter.finish()
