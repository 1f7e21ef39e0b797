"""Grounding of a finished answer: are its citations real, and is it backed by the context?

Citations: every ``[id]`` (also ``[a, b]`` and ``[a][b]``; not Markdown links ``[text](url)``,
not our own redaction tokens such as ``[EMAIL]``) must name a document that was in the context;
the others are reported as unknown.

Support, a cheap lexical rule: the answer is split into sentences; a sentence with at least
`MIN_WORDS` content words (words of 3+ letters, not stop words, cut to their first 6 letters as
a crude stem that works across English and Portuguese inflections) is *supported* when some
context passage contains at least `threshold` (default 0.5) of its content words. The share of
supported sentences is the signal; sentences too short to judge ("Yes.", "In short:") are not
counted. It cannot see paraphrase or negation: it is an attribute to watch, not a verdict.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Iterable
from dataclasses import dataclass

from pipeline.guards.pii import TOKENS

MIN_WORDS = 3
STEM = 6
_CITATION = re.compile(r"\[([^\[\]\n]{1,300})\](?!\()")
_ID = re.compile(r"[\w.:/#@+-]{1,128}")
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+|\n+")
_WORD = re.compile(r"[^\W\d_]{3,}")
_STOP = frozenset(
    """the and for are but not you all any can had her was one our out has have this that with
    from they will would there their what which when where who whom been were into than then them
    these those such only also about over more most some very just like other its it's your our
    é são uma para com não por mais mas como dos das nos nas pelo pela isso esse essa este esta
    que ele ela eles elas seu sua seus suas ser ter foi há também quando onde qual quais""".split()  # noqa: SIM905
)
_OUR_TOKENS = frozenset(t.strip("[]") for t in TOKENS.values())


@dataclass(frozen=True, slots=True)
class GroundingReport:
    """Citations found and unknown, and how many judged sentences the context supports."""

    cited: tuple[str, ...]
    unknown_citations: tuple[str, ...]
    sentences: int
    supported: int
    unsupported: tuple[str, ...] = ()

    @property
    def support(self) -> float | None:
        """Share of judged sentences that are supported (None when none could be judged)."""
        return self.supported / self.sentences if self.sentences else None


def citations(answer: str) -> list[str]:
    """The document ids cited in `answer`, in order of first appearance."""
    seen: dict[str, None] = {}
    for match in _CITATION.finditer(answer):
        for part in re.split(r"[,;]\s*", match.group(1)):
            token = part.strip()
            if _ID.fullmatch(token) and token not in _OUR_TOKENS:
                seen.setdefault(token, None)
    return list(seen)


def content_words(text: str) -> set[str]:
    """Stems of the words that carry content."""
    return {w[:STEM] for w in _WORD.findall(text.lower()) if w not in _STOP}


def sentences(answer: str) -> list[str]:
    """The answer's sentences, citations removed."""
    plain = _CITATION.sub(" ", answer)
    return [s.strip() for s in _SENTENCE_END.split(plain) if s.strip()]


def check_grounding(
    answer: str,
    context_ids: Collection[str],
    passages: Iterable[str],
    *,
    threshold: float = 0.5,
) -> GroundingReport:
    """Check the citations of `answer` against `context_ids` and its sentences against
    `passages` (the texts that were in the prompt)."""
    cited = citations(answer)
    known = set(context_ids)
    passage_words = [content_words(p) for p in passages]
    judged = supported = 0
    unsupported = []
    for sentence in sentences(answer):
        words = content_words(sentence)
        if len(words) < MIN_WORDS:
            continue
        judged += 1
        best = max((len(words & p) for p in passage_words), default=0)
        if best >= threshold * len(words):
            supported += 1
        else:
            unsupported.append(sentence)
    unknown = tuple(c for c in cited if c not in known)
    return GroundingReport(tuple(cited), unknown, judged, supported, tuple(unsupported))
