"""Extractive prompt compression: keep the passages' sentences that matter, under a token budget.

Each passage is split into sentences; each sentence is scored by its overlap with the query's
BM25 terms (retrieval.tokenize's stems), weighted by IDF (the tenant index's when given, else
one computed over the passages' own sentences); the best sentence of every passage is kept
first, so each source stays in the prompt, then the best of the rest while the budget lasts.
Kept sentences come out in their original order, grouped by passage, each with its source ids,
so `[doc-id]` citations survive. Tokens are counted with the generation model's tokenizer
(pipeline.model.tokens). Cost and what it keeps on SciFact: `python -m bench.compress_bench`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import cache, update_wrapper
from typing import Concatenate, Generic, ParamSpec, TypeVar

import numpy as np

from pipeline.context import Passage
from pipeline.kept import Kept, KeptByScope
from pipeline.model.tokens import TokenCounter, load_token_counter
from retrieval.tokenize import LONGEST_CACHED, tokenize

DEFAULT_BUDGET_TOKENS = 512
# A "sentence" of more tokens than this (a table, a list without full stops) is cut into pieces,
# at a space where one is near, so one run-on sentence can neither take the whole budget nor be
# lost whole. SciFact's 46,976 sentences: median 30 tokens, 99th percentile 105; 1.4% are cut.
MAX_SENTENCE_TOKENS = 96

# Words after which a full stop does not end a sentence (lower case, without the stop).
ABBREVIATIONS = frozenset(
    """al approx ca cf dr e.g eg esp et fig figs eq eqs i.e ie inc jr ltd mr mrs ms no nos pp prof
    ref refs resp sr st viz vol vs""".split()  # noqa: SIM905
)
# Candidate ends: a run of terminators and closing quotes/brackets before whitespace; CJK,
# Devanagari and Arabic terminators need no space; a blank line always ends a sentence.
# (Written to start with one character class, which lets the regex engine skip to candidates:
# six times faster than the plain alternation on SciFact abstracts.)
# Linear time: a run of terminators is taken only from its first character (the lookbehinds
# `(?<![.!?…].)` refuse a start inside it) and the repeats are possessive (they never give
# back), so a run of 40,000 dots (a table of contents' leaders) is read once, not once per dot.
_END = re.compile(
    r"[.!?…。！？।؟\n](?:(?<![.!?…].)(?<=[.!?…])[.!?…]*+[\"'”’)\]]*+(?=\s)"
    r"|(?<![。！？].)(?<=[。！？])[。！？]*+[」』”’)]*+|(?<![।؟].)(?<=[।؟])[।؟]*+|(?<=\n)[ \t]*+\n)"
)
_LAST_WORD = re.compile(r"(\S+)$")
_NEXT_WORD = re.compile(r"\s*(\S+)")
_INITIALS = re.compile(r"(?:[a-z]\.)+[a-z]")
_OPENERS = "([\"'“‘"
_CLOSERS = ".,;:!?)]\"'”’"
# Words that abbreviate before a number only ("p. 561"), and end sentences otherwise.
NUMBER_ABBREVIATIONS = frozenset({"p", "pp", "no", "nos", "vol", "fig", "figs", "ref", "refs"})


def _ends_sentence(text: str, start: int, end: int) -> bool:
    if "." not in text[start:end]:
        return True
    # Only the words either side of the stop matter: bounded windows, not the whole text.
    before = _LAST_WORD.search(text, max(0, start - 40), start)
    word = before.group(1).lstrip(_OPENERS) if before else ""
    after = _NEXT_WORD.match(text, end, end + 40)
    if after is None:
        return True
    nxt = after.group(1).lstrip(_OPENERS).rstrip(_CLOSERS)
    if word.lower() in ABBREVIATIONS or _INITIALS.fullmatch(word.lower()):
        return False
    if word.lower() in NUMBER_ABBREVIATIONS and nxt[:1].isdigit():  # "p. 561", "No. 5"
        return False
    # An initial before a capitalised word ("B. Demple", "S. Aureus") is taken for a name; this
    # also joins "vitamin D. Deficiency ...", but on SciFact it agrees with pysbd more often.
    if len(word) == 1 and word.isupper() and nxt[:1].isupper():
        return False
    # "et al. reported", "S. cerevisiae": a plain lower-case word continues the sentence; one
    # with a capital or a digit inside (mRNA, p53, iPSCs) may well start the next.
    return not (nxt.isalpha() and nxt.islower())


def stripped(text: str, start: int, end: int) -> tuple[int, int]:
    """``(start, end)`` narrowed to leave out the whitespace at either end."""
    while start < end and text[start].isspace():
        start += 1
    while end > start and text[end - 1].isspace():
        end -= 1
    return start, end


def sentence_spans(text: str) -> list[tuple[int, int]]:
    """(start, end) of each sentence of `text`, in order, without surrounding whitespace."""
    spans: list[tuple[int, int]] = []
    start = 0
    for match in _END.finditer(text):
        stop, end = match.span()
        if _ends_sentence(text, stop, end):
            spans.append(stripped(text, start, end))
            start = end
    spans.append(stripped(text, start, len(text)))
    return [(a, b) for a, b in spans if b > a]


def split_sentences(text: str) -> list[str]:
    """The sentences of `text` (see `sentence_spans`)."""
    return [text[a:b] for a, b in sentence_spans(text)]


def _pieces(
    text: str, span: tuple[int, int], offsets: list[int], limit: int
) -> list[tuple[int, int, int]]:
    """(start, end, tokens) of a sentence, cut into pieces of at most `limit` tokens, each cut
    before a token that starts with a space if one is in the second half of the window."""
    start, end = span
    pieces = []
    i = 0
    while len(offsets) - i > limit:
        j = i + limit
        for k in range(i + limit, i + limit // 2, -1):
            if text[offsets[k]].isspace():
                j = k
                break
        pieces.append((*stripped(text, max(start, offsets[i]), offsets[j]), j - i))
        i = j
    pieces.append((*stripped(text, max(start, offsets[i]) if i else start, end), len(offsets) - i))
    return [(a, b, n) for a, b, n in pieces if b > a]


_WORD = re.compile(r"\w\w+")  # retrieval.tokenize's words (its \b...\b is implied)
# Passages longer than this are analysed each time, not kept; and the analyses kept hold at
# most KEPT_ITEMS items (sentences and their distinct stems, ~80-110 bytes each) in each cache,
# compression's and citations'. A passage's length and density are its writer's: a SciFact
# chunk is ~86 items a cache (so 4,096 of them fit, as before), one as dense as the chunker
# allows (a sentence per word) ~1,300, and 4,096 of those held 1.1 GB.
LONGEST_KEPT_TEXT = 8192
KEPT_ITEMS = 360_000

P = ParamSpec("P")
R = TypeVar("R")


class _KeptIfShort(Generic[P, R]):
    """``fn``, its results kept (4,096, least recently used out; ``KEPT_ITEMS`` of their
    ``weight`` in all) for a text (its last argument) up to ``LONGEST_KEPT_TEXT`` characters,
    and worked out each time for a longer one (a chunk of one 200,000-character "word" kept
    1 MB in compression's cache, 0.5 MB in citations').

    ``fn``'s first argument is the memo scope of the request whose text it is (its tenant, and
    its access scope where the tenant's index has access lists: ``pipeline.model.salt.MemoScope``):
    each scope's results are kept apart, so a request never finds an analysis that a request of
    another tenant, or of a caller who may see what it may not, left (how fast a passage is
    analysed would say whether that caller's text holds it)."""

    def __init__(self, fn: Callable[Concatenate[str, P], R], weight: Callable[[R], int]) -> None:
        self._fn = fn
        self._weight = weight
        self.kept: Kept[Hashable, R] = Kept(4096, budget=KEPT_ITEMS)
        update_wrapper(self, fn)

    def __call__(self, scope: str, /, *args: P.args, **kwargs: P.kwargs) -> R:
        text = args[-1]
        if not isinstance(text, str) or len(text) > LONGEST_KEPT_TEXT:
            return self._fn(scope, *args, **kwargs)
        key = (scope, args, tuple(sorted(kwargs.items())))
        return self.kept.remembered(key, lambda: self._fn(scope, *args, **kwargs), self._weight)

    def cache_clear(self) -> None:
        self.kept.clear()


def kept_if_short(
    weight: Callable[[R], int],
) -> Callable[[Callable[Concatenate[str, P], R]], _KeptIfShort[P, R]]:
    """Keep ``fn``'s results for texts of ordinary length, by ``weight`` (see
    ``_KeptIfShort``)."""
    return lambda fn: _KeptIfShort(fn, weight)


# Each memo scope's words apart (a word stemmed sooner would say that another scope's text held
# it: SECURITY.md), within one bound for all: 200,000 words and 2,000,000 characters of words
# and stems (200,000 words of 64 astral letters, an ingest key's chunks analysed when
# retrieved, held 135 MB; ordinary words are far shorter). Past it the least recently used
# scopes' words are let go (``pipeline.kept.KeptByScope``).
STEMS: KeptByScope[str] = KeptByScope(
    200_000, 2_000_000, weight=lambda word, stem: len(word) + len(stem)
)


def word_stems(scope: str, text: str) -> frozenset[str]:
    """`set(tokenize(text))`, stemming each distinct word once for each memo scope: a request's
    sentences are mostly words seen before, and a dict lookup is far cheaper than the stemmer."""
    words = set(_WORD.findall(text.lower()))
    kept = STEMS.words(scope)
    found = {word: kept.get(word) for word in words}
    stems = {stem for stem in found.values() if stem is not None}
    # The words this read did not find, whatever another thread has added since (a word it
    # added between the read and a second look was skipped, and its stem lost: a review's find).
    new: list[tuple[str, str]] = []
    for word in (word for word, stem in found.items() if stem is None):
        stemmed = tokenize(word)  # [] for a stop word
        stem = stemmed[0] if stemmed else ""
        stems.add(stem)
        if len(word) <= LONGEST_CACHED:  # longer: not kept (a "word" of any length)
            new.append((word, stem))
    if new:
        STEMS.add(scope, new)
    stems.discard("")
    return frozenset(stems)


def _overlap_scores(
    terms: set[str], stems: Sequence[frozenset[str]], idf: Mapping[str, float] | None
) -> list[float]:
    n = len(stems)
    if not terms or not n:
        return [0.0] * n
    weights = {}
    for t in terms:
        given = idf.get(t) if idf is not None else None
        if given is None:
            df = sum(1 for s in stems if t in s)
            given = math.log(1 + n / df) if df else 0.0
        weights[t] = max(given, 0.0)
    total = sum(weights.values())
    if total <= 0:
        return [0.0] * n
    return [sum(weights[t] for t in terms & s) / total for s in stems]


def lexical_scores(
    query: str, sentences: Sequence[str], idf: Mapping[str, float] | None = None, *, scope: str
) -> list[float]:
    """Share of the query's IDF mass found in each sentence, in [0, 1].

    `idf` maps stems to IDF (the index's); None (or a term it lacks) uses an IDF computed over
    `sentences` themselves, `ln(1 + n / df)`. `scope`: the memo scope whose sentences these are
    (their words' stems are kept for it alone).
    """
    return _overlap_scores(set(tokenize(query)), [word_stems(scope, s) for s in sentences], idf)


@dataclass(frozen=True)
class KeptSentence:
    """A sentence in the compressed context and where it came from."""

    document_id: str
    chunk_id: str
    position: int
    text: str
    score: float


@dataclass(frozen=True)
class Compressed:
    """The compressed context: `passages` holds each passage that kept a sentence, in the
    given order, its text replaced by its kept sentences (original order, space-joined).
    `tokens_before`/`tokens_after` count the passages' texts before and after."""

    passages: list[Passage]
    sentences: list[KeptSentence]
    tokens_before: int
    tokens_after: int
    budget_tokens: int
    dropped: list[Passage] = field(default_factory=list)
    exact_tokens: bool = True

    @property
    def ratio(self) -> float:
        """tokens_before / tokens_after (1.0 when nothing was there)."""
        return self.tokens_before / self.tokens_after if self.tokens_after else 1.0


@dataclass
class _Unit:
    passage: int
    position: int
    text: str
    tokens: int
    score: float


@cache
def default_counter() -> TokenCounter:
    """The SmolLM2 tokenizer found by pipeline.model.tokens, loaded once per process."""
    return load_token_counter()


def compress(
    query: str,
    passages: Sequence[Passage],
    *,
    scope: str,
    budget_tokens: int = DEFAULT_BUDGET_TOKENS,
    counter: TokenCounter | None = None,
    idf: Mapping[str, float] | None = None,
    represent_all: bool = True,
) -> Compressed:
    """Keep the sentences of `passages` most relevant to `query` within `budget_tokens`.

    `scope`: the memo scope of the request whose passages these are (their analyses, and the
    counter's pieces, are kept for it alone: ``pipeline.model.salt.MemoScope``).
    `idf`: the index's IDF of the query's stems (`BM25Index.idf_of`), if at hand.
    `represent_all`: first keep the best sentence of each passage (while they fit), so every
    source stays cited; then fill by score. Sentences with no query term are only kept as a
    passage's representative. A piece longer than the remaining budget is skipped, never cut.
    """
    counter = (counter if counter is not None else default_counter()).for_scope(scope)
    units, before = _units(scope, query, passages, counter, idf)
    chosen = _select(units, len(passages), budget_tokens, represent_all=represent_all)
    texts = _render(units, chosen, len(passages))
    after_each = counter.count_many([t for t in texts if t])
    # Sentences were counted where they stand in their passage; joined by a space, the token at
    # a junction can differ (a space before CJK text is a token of its own), so the total of
    # the texts as sent is counted and the last-chosen sentence given back while over budget.
    while chosen and sum(after_each) > budget_tokens:
        chosen.pop()
        texts = _render(units, chosen, len(passages))
        after_each = counter.count_many([t for t in texts if t])
    return _result(passages, units, chosen, texts, before, sum(after_each), budget_tokens, counter)


@dataclass(frozen=True)
class _Analysis:
    """A passage text cut into units (sentences, or pieces of overlong ones): their texts,
    token counts and stems; and the text's total tokens."""

    texts: tuple[str, ...]
    tokens: tuple[int, ...]
    stems: tuple[frozenset[str], ...]
    total: int


def _items(analysis: _Analysis) -> int:
    return len(analysis.texts) + sum(map(len, analysis.stems))


# Retrieval hands the same chunks over again and again; their analysis does not depend on the
# query. Keyed by (memo scope, counter, text).
@kept_if_short(_items)
def _analyse(scope: str, counter: TokenCounter, text: str) -> _Analysis:
    """Each token is credited to the unit its first character falls in (a boundary token, the
    space before a sentence, goes to the sentence)."""
    ((starts, sizes),) = counter.token_runs([text])
    spans = sentence_spans(text)
    if not spans:
        return _Analysis((), (), (), sum(sizes))
    ends = np.array([b for _, b in spans])
    ends[-1] = len(text)
    at = np.searchsorted(ends, np.asarray(starts, dtype=np.int64), side="right")
    counts = np.bincount(at, weights=sizes, minlength=len(spans)).astype(int).tolist()
    pieces: list[tuple[int, int, int]] = []
    for pos, (span, n) in enumerate(zip(spans, counts, strict=False)):
        if n <= MAX_SENTENCE_TOKENS:
            pieces.append((*span, n))
        else:
            where = at.tolist()
            own = [o for o, w, k in zip(starts, where, sizes, strict=True) if w == pos
                   for _ in range(k)]  # fmt: skip
            pieces.extend(_pieces(text, span, own, MAX_SENTENCE_TOKENS))
    texts = tuple(text[a:b] for a, b, _ in pieces)
    stems = tuple(word_stems(scope, t) for t in texts)
    return _Analysis(texts, tuple(n for *_, n in pieces), stems, sum(sizes))


def clear_passage_cache() -> None:
    """Forget the per-passage analyses (benchmarks measure the cost of a passage seen first)."""
    _analyse.cache_clear()


def _units(
    scope: str,
    query: str,
    passages: Sequence[Passage],
    counter: TokenCounter,
    idf: Mapping[str, float] | None,
) -> tuple[list[_Unit], int]:
    """The units of all passages, scored against the query; and the passages' total tokens."""
    analyses = [_analyse(scope, counter, p.text) for p in passages]
    owners = [(i, pos) for i, a in enumerate(analyses) for pos in range(len(a.texts))]
    scores = _overlap_scores(set(tokenize(query)), [s for a in analyses for s in a.stems], idf)
    units = [
        _Unit(i, pos, analyses[i].texts[pos], analyses[i].tokens[pos], score)
        for (i, pos), score in zip(owners, scores, strict=True)
    ]
    return units, sum(a.total for a in analyses)


def _select(units: list[_Unit], n_passages: int, budget: int, *, represent_all: bool) -> list[int]:
    """Indexes into `units`, in the order they were chosen."""
    order = sorted(
        range(len(units)), key=lambda u: (-units[u].score, units[u].passage, units[u].position)
    )
    chosen: list[int] = []
    used = 0
    if represent_all:
        best_of: dict[int, int] = {}
        for u in order:
            best_of.setdefault(units[u].passage, u)
        for p in range(n_passages):
            u_best = best_of.get(p)
            if u_best is not None and used + units[u_best].tokens <= budget:
                chosen.append(u_best)
                used += units[u_best].tokens
    taken = set(chosen)
    for u in order:
        if units[u].score <= 0:
            break
        if u not in taken and used + units[u].tokens <= budget:
            chosen.append(u)
            used += units[u].tokens
    return chosen


def _render(units: list[_Unit], chosen: list[int], n_passages: int) -> list[str]:
    by_passage: list[list[_Unit]] = [[] for _ in range(n_passages)]
    for u in sorted(chosen):
        by_passage[units[u].passage].append(units[u])
    return [" ".join(unit.text for unit in group) for group in by_passage]


def _result(
    passages: Sequence[Passage],
    units: list[_Unit],
    chosen: list[int],
    texts: list[str],
    before: int,
    after: int,
    budget: int,
    counter: TokenCounter,
) -> Compressed:
    kept = [
        replace(p, text=t, source_text=p.text if p.source_text is None else p.source_text)
        for p, t in zip(passages, texts, strict=True)
        if t
    ]
    dropped = [p for p, t in zip(passages, texts, strict=True) if not t]
    sentences = [
        KeptSentence(
            passages[units[u].passage].document_id,
            passages[units[u].passage].chunk_id,
            units[u].position,
            units[u].text,
            units[u].score,
        )
        for u in sorted(chosen)
    ]
    return Compressed(kept, sentences, before, after, budget, dropped, counter.exact)
