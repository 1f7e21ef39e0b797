"""Where redaction may cut: run tails, and split points inside runs longer than the limit."""

from __future__ import annotations

from pipeline.guards.normalize import canonicalize
from pipeline.guards.output import redact_answer
from pipeline.guards.pii import find_pii
from pipeline.guards.segments import RunSplitter, joinable, pii_tail_start, split_points


def test_spaces_join_digits_and_capitals_but_not_lowercase_words() -> None:
    assert joinable("1", " ") and joinable(" ", "2") and joinable(" ", "+")
    assert joinable("A", " ") and joinable(" ", "B")
    assert not joinable("a", " ") and not joinable(" ", "b")
    assert joinable("x", "@") and not joinable("x", ",")


def test_the_tail_of_prose_is_its_last_word_and_of_a_number_the_whole_number() -> None:
    assert pii_tail_start("hello brave new world", 0) == len("hello brave new ")
    text = "call +44 20 7946 09"
    assert pii_tail_start(text, 0) == text.index("+")
    assert pii_tail_start("done. ", 0) == len("done. ")


def test_runs_longer_than_the_limit_are_split_every_limit_characters() -> None:
    text = "x " + "7" * 25 + ", " + "8" * 9  # the run is " 777...7" (a space before a digit)
    canon = canonicalize(text)
    assert split_points(canon.text, canon.origin, limit=10) == [11, 21]


def test_a_split_point_never_falls_inside_one_original_character() -> None:
    text = "1" * 9 + "\ufdfa" + "1" * 30  # U+FDFA expands to 18 canonical characters
    canon = canonicalize(text)
    points = split_points(canon.text, canon.origin, limit=10)
    assert all(canon.origin[p] != canon.origin[p - 1] for p in points)


def test_the_incremental_splitter_agrees_with_the_whole_text() -> None:
    canon = canonicalize("ab " + "Z9" * 40 + " end " + "q" * 33)
    splitter = RunSplitter(limit=16)
    pushed = [i for i, c in enumerate(canon.text) if splitter.push(c, canon.origin[i])]
    assert pushed == split_points(canon.text, canon.origin, limit=16)


def test_outside_long_runs_one_call_redaction_equals_find_pii() -> None:
    text = "Mail ana@example.com, card 4111 1111 1111 1111, from 10.0.0.1 today."
    redacted, _ = redact_answer(text)
    assert redacted == "Mail [EMAIL], card [CARD], from [IP] today."
    assert len(find_pii(text)) == 3


def test_the_documented_price_a_match_straddling_a_split_point_is_not_found() -> None:
    text = "a" * 250 + ":ana@example.com"  # one unbroken run of 266 pattern characters
    assert [f.kind for f in find_pii(text)] == ["email"]
    assert redact_answer(text)[0] == text
