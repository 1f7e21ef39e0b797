"""Attribution on any text: it never raises, every span lies within the text it indexes, a stream
in any pieces cites exactly as the whole answer does, and the text held back is bounded (the
work per piece is, by construction)."""

from __future__ import annotations

import itertools

from hypothesis import example, given, settings
from hypothesis import strategies as st

from pipeline.answer.citations import (
    MAX_HELD,
    Attributor,
    CitationTracker,
    cite,
    source_text,
)
from pipeline.context import Passage
from tests.support.fuzzing import examples

# Pieces that make sentence ends, markers, lists and scripts without spaces likely.
PIECES = st.sampled_from(
    [
        "kiwi", "bird", "egg", "fjord", "glacier", "Moon", "e.g.", "Dr.", "al.", "mRNA", "3.5",
        ". ", "! ", "? ", "… ", ".\n", "\n", "\n\n", " ", "  ", "\t", "[1]", "[2]", "[9]",
        "[kiwi]", "[", "]", "。", "鸟类", "Über", "🐦", "ß", "\u0301", "-", "(", ")", '"', ",",
    ]
)  # fmt: skip
TEXTS = st.one_of(
    st.lists(PIECES, max_size=120).map("".join),
    st.text(max_size=300),
)


def passages_from(texts: list[str]) -> list[Passage]:
    return [Passage(f"d{i}", f"d{i}#0", "", t, 1.0) for i, t in enumerate(texts)]


def cuts(text: str, points: list[int]) -> list[str]:
    bounds = sorted({0, len(text), *(p % (len(text) + 1) for p in points)})
    return [text[a:b] for a, b in itertools.pairwise(bounds)]


@settings(max_examples=examples(300), deadline=None)
@given(
    answer=TEXTS,
    sources=st.lists(TEXTS, max_size=5),
    points=st.lists(st.integers(0, 10_000), max_size=40),
)
@example(answer="a. [1] b c. [2]", sources=["a b c"], points=[3, 5])
@example(answer="kiwi bird egg. " * 3, sources=[], points=[])
def test_attribution_never_raises_and_spans_stay_in_bounds(
    answer: str, sources: list[str], points: list[int]
) -> None:
    passages = passages_from(sources)
    whole = cite(answer, passages, scope="t")
    assert [c.sentence for c in whole] == list(range(len(whole)))
    previous_end = 0
    for citation in whole:
        assert previous_end <= citation.start < citation.end <= len(answer)
        assert answer[citation.start : citation.end].strip()
        previous_end = citation.end
        assert citation.supported == bool(citation.sources)
        for cited in citation.sources:
            passage = passages[cited.index - 1]
            assert (cited.document_id, cited.chunk_id) == (passage.document_id, passage.chunk_id)
            assert 0 <= cited.start < cited.end <= len(source_text(passage))
            assert 0.0 <= cited.score <= 1.0

    tracker = CitationTracker(Attributor(passages, scope="t"))
    streamed = []
    for piece in cuts(answer, points):
        streamed.extend(tracker.feed(piece))
        assert tracker.pending_chars <= MAX_HELD + len(piece)
    streamed.extend(tracker.end())
    assert streamed == whole


@settings(max_examples=examples(20), deadline=None)
@given(size=st.integers(1, 64), word=st.sampled_from(["kiwi ", "鸟", " ", ".", "[1]"]))
def test_a_long_answer_without_sentence_ends_is_held_back_boundedly(size: int, word: str) -> None:
    tracker = CitationTracker(Attributor(passages_from(["kiwi bird egg"]), scope="t"))
    text = word * (5_000 // len(word))
    cited = 0
    for start in range(0, len(text), size):
        cited += len(tracker.feed(text[start : start + size]))
        assert tracker.pending_chars <= MAX_HELD + size
    cited += len(tracker.end())
    assert cited == len(cite(text, passages_from(["kiwi bird egg"]), scope="t"))
