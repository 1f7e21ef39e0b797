"""The shape of a prompt-injection rule and helpers to write rules (see `rules/__init__`)."""

from __future__ import annotations

from typing import NamedTuple

from pipeline.guards.linear import Regex, compile_linear
from pipeline.guards.prefilter import literal_prefixes


class Rule(NamedTuple):
    """One RE2 pattern: the family it reports as, how much it alone says, the literals one of
    which every match starts with (None: no such set), so it only runs where one occurs, and
    `unless`: a pattern that, matching right where a match ends, makes that match not count
    (what a negative lookahead said in Python's syntax; RE2 has no lookaround)."""

    family: str
    score: float
    pattern: Regex
    prefixes: frozenset[str] | None
    unless: Regex | None = None


def alt(*words: str) -> str:
    """A non-capturing alternation of regex fragments."""
    return "(?:" + "|".join(words) + ")"


def rules(family: str, score: float, *patterns: str, unless: str | None = None) -> list[Rule]:
    """Compile patterns of one family and score (and the same `unless` for each)."""
    after = compile_linear(unless) if unless is not None else None
    return [Rule(family, score, compile_linear(p), literal_prefixes(p), after) for p in patterns]
