"""Sentence-level attribution: which passage and which span of it supports each answer sentence,
in a plain answer, in a stream (after the output filters) and in a cached one."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence

from pipeline.answer.citations import (
    MAX_SENTENCE_CHARS,
    Attributor,
    CitationTracker,
    cite,
    segments,
)
from pipeline.answer.completion import Completion
from pipeline.answer.events import (
    AnswerEvent,
    Citation,
    ContentDelta,
    Finish,
    StreamEvent,
    Usage,
)
from pipeline.answer.stream import AnswerStream
from pipeline.context import Passage
from pipeline.model.prompt import SOURCE_CHARS
from pipeline.sources.compress import compress

KIWI = (
    "The kiwi is a flightless bird endemic to New Zealand. It lays an egg that is very large "
    "for its body. Kiwis forage at night for worms and insects."
)
FJORD = "A fjord is a long, narrow inlet with steep sides. Glaciers carved most fjords in Norway."
MOON = "The Moon orbits the Earth once every 27 days. Its surface is covered in craters."
PASSAGES = [
    Passage("kiwi", "kiwi#0", "Kiwi", KIWI, 0.9),
    Passage("fjord", "fjord#0", "Fjords", FJORD, 0.5),
    Passage("moon", "moon#0", "Moon", MOON, 0.4),
]


def source_of(citation: Citation, index: int = 0) -> str:
    """The cited span of the source text, as a user would look it up."""
    cited = citation.sources[index]
    passage = PASSAGES[cited.index - 1]
    return passage.text[cited.start : cited.end]


def test_a_copied_sentence_cites_its_passage_and_sentence() -> None:
    answer = "Kiwis forage at night for worms and insects."
    (citation,) = cite(answer, PASSAGES, scope="t")
    assert citation.supported and (citation.start, citation.end) == (0, len(answer))
    assert [s.index for s in citation.sources] == [1]
    assert citation.sources[0].document_id == "kiwi" and citation.sources[0].chunk_id == "kiwi#0"
    assert source_of(citation) == "Kiwis forage at night for worms and insects."
    assert citation.sources[0].score == 1.0


def test_a_paraphrase_cites_the_sentence_it_paraphrases() -> None:
    answer = "In Norway, most fjords were carved by glaciers."
    (citation,) = cite(answer, PASSAGES, scope="t")
    assert [s.index for s in citation.sources] == [2]
    assert source_of(citation) == "Glaciers carved most fjords in Norway."


def test_a_sentence_no_source_makes_is_unsupported() -> None:
    answer = "Paris is the capital of France and hosts the Louvre museum."
    (citation,) = cite(answer, PASSAGES, scope="t")
    assert not citation.supported and citation.sources == ()


def test_each_sentence_is_cited_on_its_own() -> None:
    answer = (
        "The kiwi is a flightless bird from New Zealand. Paris is the capital of France. "
        "The Moon is covered in craters."
    )
    found = cite(answer, PASSAGES, scope="t")
    assert [c.sentence for c in found] == [0, 1, 2]
    assert [c.supported for c in found] == [True, False, True]
    assert [answer[c.start : c.end] for c in found] == [
        "The kiwi is a flightless bird from New Zealand.",
        "Paris is the capital of France.",
        "The Moon is covered in craters.",
    ]
    assert found[0].sources[0].index == 1 and found[2].sources[0].index == 3
    assert source_of(found[2]) == "Its surface is covered in craters."


def test_attribution_needs_no_markers_and_ignores_a_wrong_one() -> None:
    plain = cite("Glaciers carved the fjords of Norway.", PASSAGES, scope="t")
    wrong = cite("Glaciers carved the fjords of Norway [3].", PASSAGES, scope="t")
    wrong_id = cite("Glaciers carved the fjords of Norway [moon].", PASSAGES, scope="t")
    for found in (plain, wrong, wrong_id):
        assert [s.index for s in found[0].sources] == [2]


def test_a_marker_decides_between_two_sources_that_support_a_sentence_alike() -> None:
    twins = [
        Passage("a", "a#0", "", "Vitamin D is made in the skin under sunlight.", 0.5),
        Passage("b", "b#0", "", "Vitamin D is made in the skin under sunlight.", 0.5),
    ]
    assert [
        s.index for s in cite("Skin makes vitamin D in sunlight.", twins, scope="t")[0].sources
    ] == [1, 2]
    for marker in ("[2]", "[b]"):
        marked = cite(f"Skin makes vitamin D in sunlight {marker}.", twins, scope="t")[0].sources
        assert [s.index for s in marked] == [2, 1], marker
        assert marked[0].score > marked[1].score


def test_a_marker_after_the_full_stop_belongs_to_the_sentence_before() -> None:
    answer = "Kiwis lay very large eggs. [1] The Moon has craters. [3]"
    found = cite(answer, PASSAGES, scope="t")
    assert [answer[c.start : c.end] for c in found] == [
        "Kiwis lay very large eggs. [1]",
        "The Moon has craters. [3]",
    ]
    assert [c.sources[0].index for c in found] == [1, 3]


def test_spans_are_code_point_offsets_in_unicode_text() -> None:
    source = "Über 🐦 Vögel: Der Kiwi lebt in Neuseeland und legt große Eier. 鸟类很有趣。"
    passages = [Passage("de", "de#0", "", source, 1.0)]
    answer = "Zuerst 🙂 etwas. Der Kiwi legt große Eier in Neuseeland!\n鸟类很有趣。"
    found = cite(answer, passages, scope="t")
    texts = [answer[c.start : c.end] for c in found]
    assert texts == ["Zuerst 🙂 etwas.", "Der Kiwi legt große Eier in Neuseeland!", "鸟类很有趣。"]
    cited = found[1].sources[0]
    assert source[cited.start : cited.end] == (
        "Über 🐦 Vögel: Der Kiwi lebt in Neuseeland und legt große Eier."
    )


def test_an_empty_answer_has_no_citations() -> None:
    assert cite("", PASSAGES, scope="t") == []
    assert cite("   \n\n ", PASSAGES, scope="t") == []


def test_without_passages_every_sentence_is_unsupported() -> None:
    found = cite("The kiwi is a bird. It lays eggs.", [], scope="t")
    assert [(c.sentence, c.supported, c.sources) for c in found] == [(0, False, ()), (1, False, ())]


def test_a_sentence_of_one_content_word_claims_nothing_checkable() -> None:
    (citation,) = cite("Kiwi.", PASSAGES, scope="t")
    assert not citation.supported


def test_spans_index_the_chunks_own_text_when_the_prompt_had_an_extract() -> None:
    extract = "Kiwis forage at night for worms and insects."
    compressed = [Passage("kiwi", "kiwi#0", "Kiwi", extract, 0.9, source_text=KIWI)]
    (citation,) = cite("At night kiwis forage for worms.", compressed, scope="t")
    cited = citation.sources[0]
    assert KIWI[cited.start : cited.end] == extract
    assert cited.start == KIWI.index(extract)


def test_compression_keeps_the_chunks_own_text_for_the_citations() -> None:
    chunk = KIWI + " " + " ".join(f"Fjord {i} was carved by a glacier long ago." for i in range(60))
    compressed = compress(
        "how large is the kiwi egg", [Passage("kiwi", "kiwi#0", "", chunk, 1.0)], scope="t"
    )
    (passage,) = compressed.passages
    assert len(passage.text) < len(chunk) and passage.source_text == chunk
    (citation,) = cite(
        "The kiwi lays an egg that is very large for its body.", [passage], scope="t"
    )
    cited = citation.sources[0]
    assert chunk[cited.start : cited.end] == "It lays an egg that is very large for its body."


def test_only_what_the_prompt_held_of_a_source_supports_an_answer() -> None:
    """The prompt holds an extract (compression) cut at SOURCE_CHARS: a sentence of the chunk
    the model never saw cites nothing, even where its words match."""
    filler = " ".join(f"Fjord {i} was carved by a glacier long ago." for i in range(40))
    long_chunk = filler + " " + KIWI  # the kiwi sentences lie past the prompt's cut
    assert long_chunk.index(KIWI) > SOURCE_CHARS
    (cut,) = cite(
        "Kiwis forage at night for worms and insects.",
        [Passage("k", "k#0", "", long_chunk, 1.0)],
        scope="t",
    )
    assert not cut.supported
    extract = "Kiwis forage at night for worms and insects."
    compressed = [Passage("kiwi", "kiwi#0", "Kiwi", extract, 0.9, source_text=KIWI)]
    (unseen,) = cite("The kiwi is a flightless bird endemic to New Zealand.", compressed, scope="t")
    assert not unseen.supported, "that sentence was left out of the extract"
    (seen,) = cite("Kiwis forage at night for worms and insects.", compressed, scope="t")
    assert seen.supported


def test_a_run_on_sentence_is_cut_into_bounded_pieces() -> None:
    answer = " ".join(["kiwi bird egg"] * 400)  # 5,599 characters, no full stop
    spans = segments(answer)
    assert len(spans) > 1
    assert all(0 < end - start <= MAX_SENTENCE_CHARS for start, end in spans)
    found = cite(answer, PASSAGES, scope="t")
    assert [(c.start, c.end) for c in found] == spans


def test_a_stream_cites_a_sentence_as_soon_as_the_next_word_is_complete() -> None:
    tracker = CitationTracker(Attributor(PASSAGES, scope="t"))
    assert tracker.feed("Kiwis forage at night for worms and insects.") == []
    assert tracker.feed(" The") == []  # "The" may still grow: not yet known to start a sentence
    (first,) = tracker.feed(" Moon")
    assert (first.sentence, first.start, first.end) == (0, 0, 44) and first.supported
    assert tracker.feed(" orbits the Earth.") == []
    (last,) = tracker.end()
    assert last.sentence == 1 and last.sources[0].index == 3
    assert tracker.end() == [] and tracker.feed("more") == []


def test_a_stream_in_any_pieces_cites_as_the_whole_answer_does() -> None:
    answer = (
        "The kiwi lays a large egg [1]. Fjords have steep sides. [2]\n"
        "- Glaciers carved fjords\n- Paris is in France. The Moon orbits the Earth."
    )
    whole = cite(answer, PASSAGES, scope="t")
    for size in (1, 2, 3, 5, 8, 13, len(answer)):
        tracker = CitationTracker(Attributor(PASSAGES, scope="t"))
        pieces = [answer[i : i + size] for i in range(0, len(answer), size)]
        streamed = [c for piece in pieces for c in tracker.feed(piece)] + tracker.end()
        assert streamed == whole, size


# --- in the answer stream ---------------------------------------------------------------


def base() -> Completion:
    return Completion(content="", finish_reason="stop", model="m")


async def play(events: Sequence[AnswerEvent]) -> AsyncIterator[AnswerEvent]:
    for event in events:
        yield event


ANSWER: list[StreamEvent] = [
    ContentDelta("Kiwis forage at night "),
    ContentDelta("for worms. Paris is "),
    ContentDelta("in France."),
    Finish("stop"),
    Usage(10, 8),
]


async def test_the_stream_yields_each_citation_after_the_text_that_completes_it() -> None:
    answer = AnswerStream(play(ANSWER), base)
    answer.cite(CitationTracker(Attributor(PASSAGES, scope="t")))
    out = [event async for event in answer.events()]
    kinds = [type(e).__name__ for e in out]
    assert kinds == [
        "ContentDelta",
        "ContentDelta",
        "Citation",  # the first sentence, as soon as "Paris " had come
        "ContentDelta",
        "Citation",  # the last, when the answer finished
        "Finish",
        "Usage",
    ]
    completion = answer.completion
    assert completion is not None
    assert completion.content == "Kiwis forage at night for worms. Paris is in France."
    assert completion.citations == [e for e in out if isinstance(e, Citation)]
    first, second = completion.citations
    assert first.supported and first.sources[0].index == 1 and not second.supported
    assert completion.content[second.start : second.end] == "Paris is in France."


class Redact:
    """A filter that rewrites text, as the output guard may: the client reads 'XXXX'."""

    name = "redact"

    def feed(self, event: StreamEvent) -> Sequence[StreamEvent]:
        if isinstance(event, ContentDelta):
            return [ContentDelta(event.text.replace("Kiwis", "XXXX XXXX XXXX"))]
        return [event]

    def end(self) -> Sequence[StreamEvent]:
        return []


async def test_citations_index_the_text_the_filters_let_out() -> None:
    answer = AnswerStream(play(ANSWER), base)
    answer.add_filter(Redact())
    answer.cite(CitationTracker(Attributor(PASSAGES, scope="t")))
    completion = await answer.drain()
    assert completion.content.startswith("XXXX XXXX XXXX forage")
    spans = [completion.content[c.start : c.end] for c in completion.citations]
    assert spans == ["XXXX XXXX XXXX forage at night for worms.", "Paris is in France."]


async def test_a_cached_answer_replays_its_citations() -> None:
    answer = AnswerStream(play(ANSWER), base)
    answer.cite(CitationTracker(Attributor(PASSAGES, scope="t")))
    completion = await answer.drain()
    stored = Completion.from_dict(completion.to_dict())
    assert stored.citations == completion.citations
    replay = AnswerStream.replay(stored)
    out = [event async for event in replay.events()]
    assert [e for e in out if isinstance(e, Citation)] == completion.citations
    assert replay.completion is not None and replay.completion.citations == completion.citations


async def test_an_answer_cut_off_by_a_filter_cites_what_was_let_out() -> None:
    class Block:
        name = "block"

        def feed(self, event: StreamEvent) -> Sequence[StreamEvent]:
            if isinstance(event, ContentDelta) and "Paris" in event.text:
                return [Finish("content_filter", "blocked_term")]
            return [event]

        def end(self) -> Sequence[StreamEvent]:
            return []

    answer = AnswerStream(play(ANSWER), base)
    answer.add_filter(Block())
    answer.cite(CitationTracker(Attributor(PASSAGES, scope="t")))
    out = [event async for event in answer.events()]
    assert isinstance(out[-1], Finish) and out[-1].reason == "content_filter"
    assert answer.completion is not None
    assert answer.completion.content == "Kiwis forage at night "
    (citation,) = answer.completion.citations
    assert (citation.start, citation.end) == (0, len("Kiwis forage at night"))
