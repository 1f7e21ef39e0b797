"""The shape of a prompt-injection rule and helpers to write rules (see `rules/__init__`)."""

from __future__ import annotations

import re
from typing import NamedTuple

from pipeline.guards.prefilter import literal_prefixes


class Rule(NamedTuple):
    """One pattern: the family it reports as, how much it alone says, and the literals one of
    which every match starts with (None: no such set), so it only runs where one occurs."""

    family: str
    score: float
    pattern: re.Pattern[str]
    prefixes: frozenset[str] | None


def alt(*words: str) -> str:
    """A non-capturing alternation of regex fragments."""
    return "(?:" + "|".join(words) + ")"


def rules(family: str, score: float, *patterns: str) -> list[Rule]:
    """Compile patterns of one family and score."""
    return [Rule(family, score, re.compile(p), literal_prefixes(p)) for p in patterns]
