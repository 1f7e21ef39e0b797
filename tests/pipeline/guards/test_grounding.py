"""The grounding check of a finished answer: unknown citations and lexical support."""

from __future__ import annotations

from pipeline.guards.grounding import check_grounding, citations

PASSAGES = [
    "Vitamin D deficiency is associated with a higher risk of bone fractures in older adults.",
    "Regular aerobic exercise lowers resting blood pressure in people with hypertension.",
]


def test_citations_are_found_in_single_multiple_and_adjacent_brackets() -> None:
    answer = "A [doc-1]. B [doc-2, 4983; doc-3][doc-4]. Again [doc-1]."
    assert citations(answer) == ["doc-1", "doc-2", "4983", "doc-3", "doc-4"]


def test_markdown_links_and_redaction_tokens_are_not_citations() -> None:
    answer = "See [the guide](https://x.example) or mail [EMAIL]; [BLOCKED] [a b] [doc-9]."
    assert citations(answer) == ["doc-9"]


def test_citations_of_documents_not_in_the_context_are_reported() -> None:
    answer = "Vitamin D deficiency raises fracture risk [doc-1]. Exercise helps [doc-7]."
    report = check_grounding(answer, ["doc-1", "doc-2"], PASSAGES)
    assert report.cited == ("doc-1", "doc-7")
    assert report.unknown_citations == ("doc-7",)


def test_sentences_backed_by_a_passage_count_as_supported() -> None:
    answer = (
        "Vitamin D deficiency is linked to more bone fractures in older adults [doc-1]. "
        "Aerobic exercise lowers blood pressure in hypertension [doc-2]. "
        "Quantum computers will replace laptops next year. Yes."
    )
    report = check_grounding(answer, ["doc-1", "doc-2"], PASSAGES)
    assert (report.sentences, report.supported) == (3, 2)
    assert report.support == 2 / 3
    assert report.unsupported == ("Quantum computers will replace laptops next year.",)


def test_an_answer_with_nothing_to_judge_has_no_support_share() -> None:
    report = check_grounding("Yes. [doc-1]", ["doc-1"], PASSAGES)
    assert report.sentences == 0 and report.support is None
    assert report.unknown_citations == ()


def test_without_passages_nothing_is_supported() -> None:
    report = check_grounding("The capital of France is Paris, a large city.", [], [])
    assert (report.sentences, report.supported) == (1, 0)
