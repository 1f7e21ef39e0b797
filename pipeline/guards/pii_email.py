"""E-mail addresses, plain and obfuscated, and where an address still being written may start.

Plain: ``local@domain.tld`` (the local part and each domain label of a usable length, the last
label alphabetic). Obfuscated: the same with the "@" or the dots written out, alone or mixed
with plain ones, any case:

- in brackets: ``name [at] example [dot] com``, ``name(at)example(dot)com``, ``{at}``, ``<at>``,
  ``[@]``, ``(.)``, with or without spaces around;
- spaced: ``name @ example . com`` (a lone ``". "`` is a sentence end, never a dot here);
- as words: ``name at example dot com``. Prose says "at" all the time ("meet at the dot com
  bubble", "I work at google dot com"), so this form counts only when it is plainly an
  address, and no domain label is a word like "the" or "my": its local part has a character
  names in prose do not (a digit, ``.``, ``_``, ``%``, ``+``, ``-``), or an e-mail word comes
  just before ("email", "write to", "contact", ...), or its top-level domain is a common one
  and its local part is not a word prose puts before "at" ("work", "meet", "me", "shop"...);
  its top-level domain is a common one or a country's, and its local part not a bare number
  ("RFC 2822 at www dot ietf dot org") unless an e-mail word comes before.

Matching is linear: every quantifier is bounded and possessive or followed by a character that
ends it, and a match can only start where a local part starts (the lookbehind), so each start
is tried once and gives up at the first character that does not fit.

Streaming: the spaces an obfuscated address crosses are next to a bracket, "@", "." or the word
"at" or "dot", which is what makes `segments` link a space into a run, so an address never
crosses the end of a run, as the other patterns do not.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Final

from pipeline.guards.pii_checks import context_before

MAX_LOCAL: Final = 64
MAX_LABEL: Final = 63
MAX_DOTS: Final = 3  # an obfuscated domain has at most four labels (mail.example.co.uk)

_PLAIN = re.compile(r"(?<![\w.%+@-])[\w.%+-]{1,64}@[\w.-]{1,190}(?![\w.%+@-])")

_LOCAL = rf"(?<![\w.%+-])(?P<local>[\w.%+-]{{1,{MAX_LOCAL}}}+)"
_OPEN, _CLOSE = r"[\[({<]", r"[\])}>]"
_LABEL = rf"[\w-]{{1,{MAX_LABEL}}}+(?![\w-])"
_AT_WORD = " at "
_AT = rf"(?: ?{_OPEN} ?(?:at|@) ?{_CLOSE} ?| @ ?|@ |@|{_AT_WORD})"
_DOT = rf"(?: ?{_OPEN} ?(?:dot|\.) ?{_CLOSE} ?| \. |\.| dot )"
_OBFUSCATED = re.compile(
    rf"{_LOCAL}(?P<at>{_AT})(?P<domain>{_LABEL}(?:{_DOT}{_LABEL}){{1,{MAX_DOTS}}})", re.I
)
_DOT_SPLIT = re.compile(_DOT, re.I)
_OBFUSCATION = frozenset(" []{}()<>")


_EMAIL_WORD = re.compile(
    r"\b(?:e-?mail|mail|mailto|contact|reach|write(?: to)?|send(?: it)? to|address|inbox"
    r"|correio|endereco|escreva|contato|correo|contacto|courriel|adresse|schreiben)\b"
    r"(?:\W+\w+){0,3}?\W{0,4}$"
)
_STOP_LABELS = frozenset(
    [
        "a", "an", "the", "this", "that", "these", "those", "my", "your", "our", "their", "his",
        "her", "its", "some", "any", "all", "no", "one", "least", "once", "first", "last", "home",
        "work", "noon", "night",
    ]
)  # fmt: skip
_PLAIN_LOCAL = re.compile(r"[^\W\d_]+")  # letters only: a word, as far as prose can tell
# Top-level domains common enough that "name at example dot com" without an e-mail word is
# still read as an address, unless the "name" is a word prose puts before "at".
_COMMON_TLDS = frozenset(
    [
        "com", "org", "net", "edu", "gov", "io", "co", "uk", "de", "fr", "es", "it", "pt", "br",
        "nl", "be", "ch", "at", "ca", "au", "us", "info", "biz", "me", "ai", "dev", "app",
    ]
)  # fmt: skip
_PROSE_BEFORE_AT = frozenset(
    [
        "i", "me", "you", "he", "him", "she", "her", "it", "we", "us", "they", "them", "who", "one",
        "be", "is", "am", "are", "was", "were", "been", "being", "meet", "meets", "met", "meeting",
        "work", "works", "worked", "working", "live", "lives", "lived", "living", "stay", "stayed",
        "look", "looked", "looking", "arrive", "arrived", "arriving", "shop", "shops", "shopped",
        "shopping", "buy", "bought", "sell", "sold", "find", "found", "see", "seen", "saw", "visit",
        "visited", "available", "sale", "online", "posted", "listed", "hosted", "published",
        "registered", "signed", "sign", "log", "login", "launched", "founded", "started", "job",
        "internship", "intern", "employed", "engineer", "manager", "here", "there", "home", "born",
        "raised", "studied", "study", "studying", "staff", "team", "people", "everyone", "someone",
        "anyone", "price", "prices", "cheaper", "deals", "deal", "in", "on", "up", "out", "off",
        "back", "over", "into", "onto", "and", "or", "but", "so", "if", "as", "by", "for", "from",
        "to", "of", "with", "this", "that", "these", "those", "what", "which", "when", "where",
        "there", "here", "all", "any", "each", "some", "more", "most", "less", "both", "either",
        "neither", "not", "only", "also", "just", "still", "even", "ever",
    ]
)  # fmt: skip


def _labels_ok(labels: list[str]) -> bool:
    return (
        len(labels) >= 2
        and all(0 < len(x) <= MAX_LABEL and x[0] != "-" and x[-1] != "-" for x in labels)
        and labels[-1].isalpha()
        and 2 <= len(labels[-1]) <= 24
    )


def _local_ok(local: str) -> bool:
    return local[0] != "." and local[-1] != "." and ".." not in local


def plain(text: str, pos: int) -> Iterator[tuple[int, int, int | None]]:
    """(match start, match end, end of the valid address or None) of each plain match."""
    for m in _PLAIN.finditer(text, pos):
        address = m.group().rstrip(".-")
        local, _, domain = address.partition("@")
        valid = _local_ok(local) and ".." not in domain and _labels_ok(domain.split("."))
        yield m.start(), m.end(), m.start() + len(address) if valid else None


def obfuscated(text: str, pos: int) -> Iterator[tuple[int, int, bool]]:
    """(start, end, valid) of each match of the obfuscated shape; valid ones are addresses
    that are not also plain ones (those are `plain`'s)."""
    for m in _OBFUSCATED.finditer(text, pos):
        yield m.start(), m.end(), _obfuscated_ok(text, m)


def _obfuscated_ok(text: str, m: re.Match[str]) -> bool:
    if _OBFUSCATION.isdisjoint(m.group()):
        return False  # a plain address
    local = m.group("local")
    labels = _DOT_SPLIT.split(m.group("domain"))
    if not (_local_ok(local) and _labels_ok(labels)):
        return False
    if m.group("at").lower() != _AT_WORD:
        return True
    if any(label.lower() in _STOP_LABELS for label in labels):
        return False
    tld = labels[-1].lower()
    if not (tld in _COMMON_TLDS or len(tld) == 2):
        return False  # "notes.md at home dot txt"
    if _EMAIL_WORD.search(context_before(text, m.start())):
        return True
    if local.isdigit():
        return False  # "RFC 2822 at www dot ietf dot org", "item 4 at store dot com"
    if not _PLAIN_LOCAL.fullmatch(local):
        return True
    return tld in _COMMON_TLDS and local.lower() not in _PROSE_BEFORE_AT
