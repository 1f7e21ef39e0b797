"""Sentence-level attribution: which sentence of which source supports each answer sentence.

It runs after generation, on the text the client receives (what came out of the output
filters), against the passages that were in the prompt (``ctx.passages``) and nothing else, so a
citation can only point at a chunk the caller was allowed to see. Spans index the chunk's own
text (``Passage.source_text`` where the prompt had a compressed extract of it), the text
``/v1/retrieve`` returns, so a user can check them.

Support is lexical. An answer sentence's content words (``retrieval.tokenize``: stemmed, stop
words out) are weighted by their IDF over the sources' sentences (a word no source has weighs as
much as the rarest one: an invented claim finds no support); a source sentence supports the
answer sentence by the share of that weight it holds. The best sentence of each passage stands
for the passage; passages at ``threshold`` or above, and within ``NEAR_BEST`` of the best, are
its sources. Embedding similarity was measured beside it on the labelled set and does not pay
for itself: alone it is less precise and less complete (F1 0.87 against 0.93), mixed in it adds
nothing, and embedding every answer and source sentence costs hundreds of times the 10 ms budget
on a CPU (BENCHMARKS.md, ``make bench-citations``).

``[n]`` or ``[doc-id]`` markers the model wrote are a hint, never the answer: a marked passage's
score is raised by ``MARKER_BOOST``, which decides near-ties, and a passage with no shared word
still scores 0. A sentence with fewer than ``MIN_TERMS`` content words ("Yes.") claims nothing
that can be checked and is unsupported.

Sentences are cut as the compressor cuts sources (``pipeline.sources.compress``), also at line
ends; markers that open a sentence belong to the one before ("... is low. [2] The ..."). In a
stream, a sentence is cited as soon as what follows can no longer change where it ends
(``CitationTracker``). Time is bounded by construction: a sentence longer than
``MAX_SENTENCE_CHARS`` is cut, a sentence costs its words times their postings among the
sources' sentences, and each source text is analysed once (cached by text).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from pipeline.answer.events import Citation, CitedSource
from pipeline.model.prompt import SOURCE_CHARS
from pipeline.sources.compress import kept_if_short, sentence_spans, stripped, word_stems
from retrieval.tokenize import tokenize

# Tuned on half of bench/data/citations.jsonl (python -m bench.citation_bench).
THRESHOLD = 0.375
NEAR_BEST = 0.6
MAX_SOURCES = 3
MARKER_BOOST = 1.1
MIN_TERMS = 2
MAX_SENTENCE_CHARS = 1000
# Part of the response cache key (a cached answer keeps its citations): bump it when what
# attribution finds changes.
VERSION = f"2:{THRESHOLD}:{NEAR_BEST}:{MAX_SOURCES}:{MARKER_BOOST}:{MIN_TERMS}"
# A boundary is final once this many characters follow it, whatever they are.
SETTLE_CHARS = 100
# A stream's text is cut again only when a piece may have ended a sentence for good (it holds a
# space or a terminator that needs none) or this many characters have come since the last cut.
RECHECK_CHARS = 32
_MAY_SETTLE = re.compile(r"[\s。！？।؟]")

_MARKER = re.compile(r"\[([^\[\]\s]{1,64})\]")
# At most 8 move: a sentence grows by a bounded run (a run of markers is text of its own).
_LEADING_MARKERS = re.compile(r"(?:\[[^\[\]\s]{1,64}\][ \t]{0,4}){1,8}")
MARKER_CHARS = 8 * 70
# What a stream's tracker keeps of the cited text, as the next sentence's context.
CONTEXT_CHARS = 100
# The most text a stream's tracker holds back, besides the last piece fed.
MAX_HELD = MAX_SENTENCE_CHARS + MARKER_CHARS + SETTLE_CHARS + RECHECK_CHARS
# After a boundary: any markers, then one whole word (whitespace after it). Linear: each
# repeat starts at a "[" and no part can match what the next one starts with.
_NEXT_WORD = re.compile(r"\s*+(?:\[[^\[\]\s]{1,64}\]\s*+)*+[^\s\[]\S*+\s")


class Source(Protocol):
    """What attribution reads of a passage (``pipeline.context.Passage`` is one)."""

    @property
    def document_id(self) -> str: ...

    @property
    def chunk_id(self) -> str: ...

    @property
    def text(self) -> str: ...

    @property
    def source_text(self) -> str | None: ...


def _bounded(text: str, start: int, end: int) -> Iterator[tuple[int, int]]:
    """The span, cut at a space into pieces of at most ``MAX_SENTENCE_CHARS``."""
    while end - start > MAX_SENTENCE_CHARS:
        limit = start + MAX_SENTENCE_CHARS
        cut = text.rfind(" ", start + MAX_SENTENCE_CHARS // 2, limit)
        cut = cut if cut > start else limit
        piece = stripped(text, start, cut)
        if piece[1] > piece[0]:
            yield piece
        start = stripped(text, cut, end)[0]
    if end > start:
        yield start, end


def segments(text: str, start: int = 0) -> list[tuple[int, int]]:
    """(start, end) of each sentence of ``text`` from ``start`` on (what comes before is only
    read as context: whether "al." ends a sentence depends on the word it ends): cut at
    sentence ends and line ends, long ones cut further, and leading ``[n]`` markers moved to the
    sentence before."""
    spans: list[tuple[int, int]] = []
    for line in re.finditer(r"[^\n]+", text):
        base = line.start()
        for a, b in sentence_spans(line.group()):
            a, b = max(base + a, start), base + b
            if b > a:
                spans.extend(_bounded(text, *stripped(text, a, b)))
    merged: list[tuple[int, int]] = []
    for start, end in spans:
        markers = _LEADING_MARKERS.match(text, start, end) if merged else None
        if markers is not None:
            marked_end = stripped(text, start, markers.end())[1]
            merged[-1] = (merged[-1][0], marked_end)
            start = stripped(text, markers.end(), end)[0]
            if start >= end:
                continue
        merged.append((start, end))
    return merged


@dataclass(frozen=True)
class _Analysis:
    spans: tuple[tuple[int, int], ...]
    terms: tuple[frozenset[str], ...]


def _items(analysis: _Analysis) -> int:
    return len(analysis.spans) + sum(map(len, analysis.terms))


# Retrieval hands the same chunks over again and again: each text is cut and stemmed once for
# each memo scope that holds it.
@kept_if_short(_items)
def _analyse(scope: str, text: str) -> _Analysis:
    spans = tuple(segments(text))
    return _Analysis(spans, tuple(word_stems(scope, text[a:b]) for a, b in spans))


def source_text(source: Source) -> str:
    """The text a citation's span indexes: the chunk's own, not a compressed extract of it."""
    return source.source_text if source.source_text is not None else source.text


class Attributor:
    """Finds the sources of one answer's sentences among one request's passages, which are
    ``scope``'s, the request's memo scope (their analyses are kept for it alone:
    ``pipeline.model.salt.MemoScope``)."""

    def __init__(
        self,
        sources: Sequence[Source],
        *,
        scope: str,
        threshold: float = THRESHOLD,
        near_best: float = NEAR_BEST,
    ) -> None:
        self.sources = tuple(sources)
        self.scope = scope
        self.threshold = threshold
        self.near_best = near_best
        self._owner: list[int] = []
        self._spans: list[tuple[int, int]] = []
        self._postings: dict[str, list[int]] = {}
        self._idf: dict[str, float] = {}
        self._unseen = 0.0
        self._ids: dict[str, set[int]] = {}
        self._built = False

    def _build(self) -> None:
        # Deferred to the first sentence: an answer with none (a tool call) costs nothing.
        if self._built:
            return
        for position, source in enumerate(self.sources):
            full = source_text(source)
            analysis = _analyse(self.scope, full)
            # Only what the prompt held of it (the extract compression kept, cut at
            # SOURCE_CHARS): a sentence the model never saw supports nothing it wrote.
            shown = source.text[:SOURCE_CHARS]
            for span, terms in zip(analysis.spans, analysis.terms, strict=True):
                unsure = full is not source.text or span[1] > SOURCE_CHARS
                if unsure and full[span[0] : span[1]].strip() not in shown:
                    continue
                sentence = len(self._spans)
                self._owner.append(position)
                self._spans.append(span)
                for term in terms:
                    self._postings.setdefault(term, []).append(sentence)
            for name in (source.document_id, source.chunk_id, str(position + 1)):
                self._ids.setdefault(name, set()).add(position)
        n = len(self._spans)
        self._idf = {t: math.log(1 + n / len(ids)) for t, ids in self._postings.items()}
        self._unseen = math.log(1 + n)
        self._built = True

    def _marked(self, sentence: str) -> set[int]:
        marked: set[int] = set()
        for match in _MARKER.finditer(sentence):
            marked |= self._ids.get(match.group(1), set())
        return marked

    def cite(self, sentence: str) -> tuple[CitedSource, ...]:
        """The sources that support ``sentence``, best first (empty: unsupported)."""
        return self.choose(self.support(sentence))

    def support(self, sentence: str) -> dict[int, float]:
        """How well each source sentence supports ``sentence``, in [0, 1], markers' hints
        included; keyed by its number among all the sources' sentences (``owners``, ``spans``).
        Source sentences that share no word with it are left out."""
        if not self.sources:
            return {}
        self._build()
        terms = set(tokenize(_MARKER.sub(" ", sentence)))
        if len(terms) < MIN_TERMS:
            return {}
        weights = {t: self._idf.get(t, self._unseen) for t in terms}
        total = sum(weights.values())
        held: dict[int, float] = {}
        for term, weight in weights.items():
            for sentence_id in self._postings.get(term, ()):
                held[sentence_id] = held.get(sentence_id, 0.0) + weight
        marked = self._marked(sentence)
        return {
            sid: min(weight / total * (MARKER_BOOST if self._owner[sid] in marked else 1.0), 1.0)
            for sid, weight in held.items()
        }

    def choose(self, support: Mapping[int, float]) -> tuple[CitedSource, ...]:
        """The passages whose best sentence reaches the threshold and is near the best one."""
        self._build()
        best: dict[int, tuple[float, int]] = {}  # passage -> (score, source sentence)
        for sentence_id, score in sorted(support.items()):
            passage = self._owner[sentence_id]
            if passage not in best or score > best[passage][0]:
                best[passage] = (score, sentence_id)
        if not best:
            return ()
        top = max(score for score, _ in best.values())
        if top < self.threshold:
            return ()
        floor = max(self.threshold, self.near_best * top)
        ranked = sorted((p for p in best if best[p][0] >= floor), key=lambda p: (-best[p][0], p))
        return tuple(self._cited(p, *best[p]) for p in ranked[:MAX_SOURCES])

    @property
    def owners(self) -> Sequence[int]:
        """The passage (from 0) of each source sentence."""
        self._build()
        return self._owner

    @property
    def spans(self) -> Sequence[tuple[int, int]]:
        """Each source sentence's span of its passage's ``source_text``."""
        self._build()
        return self._spans

    def _cited(self, passage: int, score: float, sentence_id: int) -> CitedSource:
        source = self.sources[passage]
        start, end = self._spans[sentence_id]
        return CitedSource(
            passage + 1, source.document_id, source.chunk_id, start, end, round(score, 4)
        )


def _settled(text: str, end: int) -> bool:
    """Whether the sentence ending at ``end`` ends there for good: what decides it (markers to
    move to it, the next word's case) has arrived."""
    return len(text) - end >= SETTLE_CHARS or _NEXT_WORD.match(text, end) is not None


class CitationTracker:
    """Cites an answer sentence by sentence as its text arrives: ``feed`` each piece of text,
    ``end`` when the answer has ended (the last sentence is cited then)."""

    def __init__(self, attributor: Attributor) -> None:
        self.attributor = attributor
        self._pending = ""  # the text after the last cited sentence
        self._offset = 0  # where it starts in the answer
        self._before = ""  # what comes before it (a little), read as context
        self._count = 0
        self._ended = False
        self._unchecked = 0  # characters come since the text was last cut

    def feed(self, text: str) -> list[Citation]:
        if self._ended or not text:
            return []
        self._pending += text
        self._unchecked += len(text)
        if self._unchecked < RECHECK_CHARS and _MAY_SETTLE.search(text) is None:
            return []  # nothing can have settled: spare cutting the pending text again
        self._unchecked = 0
        return self._cite(final=False)

    def end(self) -> list[Citation]:
        if self._ended:
            return []
        self._ended = True
        return self._cite(final=True)

    def _cite(self, *, final: bool) -> list[Citation]:
        text = self._pending
        context = len(self._before)
        spans = [(a - context, b - context) for a, b in segments(self._before + text, context)]
        citations: list[Citation] = []
        done = 0
        for position, (start, end) in enumerate(spans):
            if not final and (position == len(spans) - 1 or not _settled(text, end)):
                break
            sources = self.attributor.cite(text[start:end])
            citations.append(
                Citation(
                    self._count,
                    self._offset + start,
                    self._offset + end,
                    bool(sources),
                    sources,
                )
            )
            self._count += 1
            done = end
        # The next sentence starts at its first visible character.
        done = len(text) if final else len(text) - len(text[done:].lstrip())
        self._before = (self._before + text[:done])[-CONTEXT_CHARS:]
        self._pending = text[done:]
        self._offset += done
        return citations

    @property
    def pending_chars(self) -> int:
        """Characters held until their sentence is complete: at most ``MAX_HELD`` plus the
        last piece fed."""
        return len(self._pending)


def cite(
    answer: str, sources: Sequence[Source], *, scope: str, threshold: float = THRESHOLD
) -> list[Citation]:
    """The citations of a whole answer: the same as its stream gets, sentence by sentence."""
    tracker = CitationTracker(Attributor(sources, scope=scope, threshold=threshold))
    return [*tracker.feed(answer), *tracker.end()]
