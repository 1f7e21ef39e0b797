"""The prompt layout: fixed instructions, then sources tagged by document id, then the messages."""

from __future__ import annotations

from pipeline.context import Passage
from pipeline.prompt import INSTRUCTIONS, build_messages

MESSAGES = [{"role": "user", "content": "Why is the sky blue?"}]


def passage(doc: str, text: str) -> Passage:
    return Passage(document_id=doc, chunk_id=f"{doc}#0", title=doc.title(), text=text, score=1.0)


def test_without_passages_the_messages_go_through_untouched() -> None:
    assert build_messages(MESSAGES, []) is MESSAGES


def test_sources_come_first_each_tagged_with_its_document_id() -> None:
    built = build_messages(
        MESSAGES, [passage("rayleigh", "Short wavelengths scatter more."), passage("sun", "Hot.")]
    )
    assert built[1:] == MESSAGES
    system = built[0]
    assert system["role"] == "system"
    assert system["content"].startswith(INSTRUCTIONS)
    assert "[rayleigh] Rayleigh: Short wavelengths scatter more." in system["content"]
    assert system["content"].index("[rayleigh]") < system["content"].index("[sun]")


def test_the_prefix_is_byte_stable_across_questions() -> None:
    sources = [passage("a", "alpha")]
    one = build_messages([{"role": "user", "content": "q1"}], sources)
    two = build_messages([{"role": "user", "content": "q2"}], sources)
    assert one[0] == two[0]
