"""A cheap guess of a message's language from its stopwords (en, pt, es, fr, de).

Good enough to learn a user's usual language from many requests, which is all the request log
needs; one short message may be guessed wrong or not at all. Only the guess is logged, never
the text. Words that several of the lists share ("que", "en", "in") count for none of them.
"""

from __future__ import annotations

import re
from collections import Counter


def _words(*lines: str) -> frozenset[str]:
    return frozenset(" ".join(lines).split())


_WORDS: dict[str, frozenset[str]] = {
    "en": _words(
        "the and is are was were of to in that it for with on this what how why which who "
        "you your can does do have has be not from at by an or"
    ),
    "pt": _words(
        "o os as um uma é são do da dos das no na nos nas em que não para com por como qual "
        "quais você seu sua isso este esta ao pelo pela foi tem"
    ),
    "es": _words(
        "el los las un una es son del al en que no para con por como cuál cuáles usted su "
        "esto este esta fue tiene y muy pero qué cómo"
    ),
    "fr": _words(
        "le les un une est sont du des au aux et que qui ne pas pour avec sur dans ce cette "
        "vous votre quel quelle comment il elle je nous"
    ),
    "de": _words(
        "der die das und ist sind ein eine nicht zu mit auf für von den dem des im ich sie "
        "wie was warum welche kann wir auch oder"
    ),
}

_LISTED = Counter(word for words in _WORDS.values() for word in words)
STOPWORDS: dict[str, frozenset[str]] = {
    code: frozenset(w for w in words if _LISTED[w] == 1) for code, words in _WORDS.items()
}
_WORD = re.compile(r"[^\W\d_]+")


def guess_language(text: str, *, minimum: int = 2) -> str | None:
    """The language whose stopwords the text uses most, if at least ``minimum`` of them and
    more than any other language's; otherwise None."""
    words = [w.lower() for w in _WORD.findall(text[:4000])]
    scores = Counter({code: sum(w in stop for w in words) for code, stop in STOPWORDS.items()})
    ranked = scores.most_common(2)
    if not ranked or ranked[0][1] < minimum:
        return None
    if len(ranked) > 1 and ranked[1][1] == ranked[0][1]:
        return None
    return ranked[0][0]
