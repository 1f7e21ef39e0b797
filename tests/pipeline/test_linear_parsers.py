"""Every parser of caller text outside the guards runs in linear time: the sentence splitter of
compression (a table of contents' leader dots once made it quadratic), chunking, the BM25
tokenizer, the token counters, the tool planner, grounding and language guessing. Each is held
to a CPU bound per KB on texts generated to be slow for it (`tests/support/adversarial.py`);
the guards' own rules are held to the same in tests/pipeline/guards/test_linear_time.py."""

from __future__ import annotations

import re
from collections.abc import Callable

import pytest

from pipeline.features.language import guess_language
from pipeline.guards.grounding import check_grounding
from pipeline.model import tokens
from pipeline.model.tokens import ApproximateTokenCounter, load_token_counter
from pipeline.sources import compress
from pipeline.tools.planner import ToolPlanner
from retrieval.documents import Document, chunk_document
from retrieval.tokenize import tokenize
from tests.support.adversarial import assert_linear, generic_inputs, inputs_for

SIZE = 32_768
# Patterns run over whole texts. (compress._LAST_WORD and _NEXT_WORD only ever read a window of
# 40 characters, so split_sentences below covers them.)
PATTERNS = {"compress._END": compress._END, "tokens._PIECE": tokens._PIECE}


@pytest.mark.parametrize("name", sorted(PATTERNS))
def test_every_pattern_scanning_caller_text_is_linear(name: str) -> None:
    pattern = PATTERNS[name]

    def scan(text: str) -> object:
        return list(pattern.finditer(text))

    assert_linear(scan, inputs_for(pattern.pattern, SIZE) + generic_inputs(SIZE), what=name)


def _planner() -> Callable[[str], object]:
    planner = ToolPlanner({"calculator", "clock", "profile", "search_documents"})
    return planner.plan


def _chunks(text: str) -> object:
    return chunk_document(Document(id="d", text=text + "x", title="t"))


PARSERS: dict[str, Callable[[], Callable[[str], object]]] = {
    "compress.split_sentences": lambda: compress.split_sentences,
    "retrieval.tokenize": lambda: tokenize,
    "retrieval.chunk_document": lambda: _chunks,
    "ApproximateTokenCounter.count": lambda: ApproximateTokenCounter().count,
    "model token counter": lambda: load_token_counter().count,
    "check_grounding": lambda: lambda text: check_grounding(text, {"doc-1"}, ["a passage"]),
    "guess_language": lambda: guess_language,
}


@pytest.mark.parametrize("name", sorted(PARSERS))
def test_every_parser_of_caller_text_is_linear(name: str) -> None:
    assert_linear(PARSERS[name](), generic_inputs(SIZE), what=name)


def test_the_planner_is_linear_within_the_text_it_reads() -> None:
    """The planner reads the first MAX_PLAN_CHARS characters: hold it to the bound there, where
    a quadratic pattern would hide in a per-KB figure over a longer text (2,000 zeros once cost
    110 ms)."""
    from pipeline.tools.planner import MAX_PLAN_CHARS

    # 8 ms/KB: the planner folds its text to NFKD first, which makes one "ﷺ" 18 characters.
    inputs = generic_inputs(MAX_PLAN_CHARS)
    assert_linear(_planner(), inputs, ms_per_kb=8.0, what="ToolPlanner.plan")


def test_the_old_sentence_splitter_fails_the_bound() -> None:
    """The test can fail: the splitter before the fix is quadratic on leader dots."""
    old = re.compile(
        r"[.!?…。！？।؟\n](?:(?<=[.!?…])[.!?…]*[\"'”’)\]]*(?=\s)|(?<=[。！？])[。！？]*[」』”’)]*"
        r"|(?<=[।؟])[।؟]*|(?<=\n)[ \t]*\n)"
    )
    with pytest.raises(AssertionError, match="ms of CPU per KB"):
        assert_linear(lambda t: list(old.finditer(t)), [("leader dots", "." * 4096 + "x")])


def test_the_approximate_counter_charges_every_character_class() -> None:
    """No body of whitespace or symbols passes an input-token cap for free."""
    counter = ApproximateTokenCounter()
    for unit in ("\n", " ", "\t", "\u3000", ".", "…", "\u200b", "é", "语"):
        text = unit * 40_000
        assert counter.count(text) >= 10_000, repr(unit)
    assert counter.count("Hello world") == counter.count("Hello") + counter.count("world")


def test_the_bound_catches_a_quadratic_parser() -> None:
    """The check itself can fail: a parser that rescans its prefix at every step (quadratic,
    about 8 times the cost per KB at 32 KB as at 4 KB) is over the bound and not excused as a
    slow constant."""

    def rescanning(text: str) -> object:
        return [text.count(".", 0, i) for i in range(0, len(text), 2)]

    with pytest.raises(AssertionError, match=r"over 2\.0 ms of CPU per KB"):
        assert_linear(rescanning, [("dots", "." * SIZE)], what="rescanning")
