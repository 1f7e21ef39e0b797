"""Where redaction may cut: run tails, and split points inside runs longer than the limit."""

from __future__ import annotations

from hypothesis import example, given, settings
from hypothesis import strategies as st

from pipeline.guards import pii
from pipeline.guards.normalize import canonicalize
from pipeline.guards.output import redact_answer
from pipeline.guards.pii import find_pii
from pipeline.guards.segments import (
    RunSplitter,
    joinable,
    linked_at,
    pii_tail_start,
    space_linked,
    split_points,
)
from tests.support.fuzzing import examples


def test_spaces_link_digits_capitals_and_obfuscations_but_not_lowercase_words() -> None:
    linked = ["1 2", "4 +", "A B", "1 a", "a 1", "gb82 west", "x [at", "x @ y", "x . y", "x at y"]
    for text in [*linked, "x dot y", "at home"]:
        assert any(space_linked(text, i) for i, c in enumerate(text) if c == " "), text
    for text in ["a b", "a. B", "that y", "x .5", "a, b", "meet atlas"]:
        assert not any(space_linked(text, i) for i, c in enumerate(text) if c == " "), text
    assert joinable("x", "@") and joinable("x", "[") and not joinable("x", ",")


def test_a_space_at_the_end_is_linked_only_once_its_next_characters_say_so() -> None:
    assert space_linked("done ", 4) is None
    assert space_linked("done [", 4) is True
    assert space_linked("done a", 4) is None  # "done at ..."
    assert space_linked("done ab", 4) is False
    assert space_linked("done ", 4, final=True) is False


def test_the_tail_of_prose_is_its_last_word_and_of_a_number_the_whole_number() -> None:
    assert pii_tail_start("hello brave new world", 0) == len("hello brave new ")
    text = "call +44 20 7946 09"
    assert pii_tail_start(text, 0) == text.index("+")
    assert pii_tail_start("done. ", 0) == 0  # "done. [at] example [dot] com" may follow
    assert pii_tail_start("done! ", 0) == len("done! ")
    assert pii_tail_start("mail name at exa", 0) == len("mail ")


def test_runs_longer_than_the_limit_are_split_every_limit_characters() -> None:
    text = "x " + "7" * 25 + ", " + "8" * 9  # the run is "x 777...7" (a space by a digit)
    canon = canonicalize(text)
    assert split_points(canon.text, canon.origin, limit=10) == [10, 20]


def test_a_split_point_never_falls_inside_one_original_character() -> None:
    text = "1" * 9 + "\ufdfa" + "1" * 30  # U+FDFA expands to 18 canonical characters
    canon = canonicalize(text)
    points = split_points(canon.text, canon.origin, limit=10)
    assert all(canon.origin[p] != canon.origin[p - 1] for p in points)


def test_the_incremental_splitter_agrees_with_the_whole_text() -> None:
    canon = canonicalize("ab " + "Z9" * 40 + " end " + "q" * 33)
    splitter = RunSplitter(limit=16)
    pushed = [p for i, c in enumerate(canon.text) for p in splitter.push(c, canon.origin[i])]
    pushed += splitter.finish()
    assert pushed == split_points(canon.text, canon.origin, limit=16)
    assert len(pushed) > 4


def test_outside_long_runs_one_call_redaction_equals_find_pii() -> None:
    text = "Mail ana@example.com, card 4111 1111 1111 1111, from 10.0.0.1 today."
    redacted, _ = redact_answer(text)
    assert redacted == "Mail [EMAIL], card [CARD], from [IP] today."
    assert len(find_pii(text)) == 3


def test_the_documented_price_a_match_straddling_a_split_point_is_not_found() -> None:
    text = "a" * 250 + ":ana@example.com"  # one unbroken run of 266 pattern characters
    assert [f.kind for f in find_pii(text)] == ["email"]
    assert redact_answer(text)[0] == text


_CROSSING_TEXT = st.lists(
    st.sampled_from(
        [
            "ana [at] example [dot] com", "jo.ana at example dot com", "x @ y . com", "(at)",
            "de89 3704 0044 0532 0130 00", "gb82 west 1234 5698 7654 32", "4111.1111/1111_1111",
            " ", "at", "dot", "[", "]", ".", "@", "a", "B", "7", "x", "-", "(", "AT", " . ",
        ]
    ),
    max_size=30,
).map("".join)  # fmt: skip


@settings(max_examples=examples(300), deadline=None)
@given(_CROSSING_TEXT)
@example("mail me: jo.ana at example dot com or gb82 west 1234 5698 7654 32")
def test_no_match_of_any_pattern_crosses_the_end_of_a_run(text: str) -> None:
    canon = canonicalize(text).text
    found = pii.scan(canon)
    for start, end in found.extents + [(c.start, c.end) for c in found.found]:
        for i in range(start + 1, end):
            assert linked_at(canon, i, final=True), (canon[start:end], i - start)
