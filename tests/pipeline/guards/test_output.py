"""Streaming redaction: PII and blocked terms are redacted across chunk boundaries, prose flows
with little held back, and any chunking gives exactly the whole-answer redaction."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from pipeline.guards.output import StreamingRedactor, redact_answer
from pipeline.guards.segments import RUN_LIMIT
from tests.support.fuzzing import examples

ANSWER = (
    "Contact Ana at ana.silva@example.com or +44 20 7946 0958. Pay with 4111 1111 1111 1111 "
    "or IBAN DE89 3704 0044 0532 0130 00. The Secret Project ships in version 1.2.3.4 "
    "from 10.0.0.1."
)
EXPECTED = (
    "Contact Ana at [EMAIL] or [PHONE]. Pay with [CARD] or IBAN [IBAN]. The [BLOCKED] ships in "
    "version 1.2.3.4 from [IP]."
)


def stream(text: str, size: int, **options: object) -> tuple[list[str], StreamingRedactor]:
    redactor = StreamingRedactor(**options)  # type: ignore[arg-type]
    pieces = [redactor.feed(text[i : i + size]) for i in range(0, len(text), size)]
    pieces.append(redactor.end())
    return pieces, redactor


def test_pii_split_across_every_chunk_size_is_redacted() -> None:
    for size in range(1, 12):
        pieces, redactor = stream(ANSWER, size, blocked_terms=["secret project"])
        assert "".join(pieces) == EXPECTED, size
        assert [v.rule for v in redactor.violations] == ["blocked_term"]


def test_the_first_text_is_emitted_long_before_the_answer_ends() -> None:
    text = "Sure. " + ANSWER * 5
    redactor = StreamingRedactor()
    first = next(i for i in range(0, len(text), 4) if redactor.feed(text[i : i + 4]))
    assert first < 12 < len(text) // 50


def test_prose_is_emitted_with_at_most_the_last_two_words_held_back() -> None:
    # The word before the last space waits for the next character: "name [at] ..." would make
    # it an address.
    redactor = StreamingRedactor()
    text = "the quick brown fox jumps over the lazy dog and keeps running far away "
    emitted = ""
    for i in range(0, len(text), 4):
        emitted += redactor.feed(text[i : i + 4])
        received = text[: i + 4]
        assert len(received) - len(emitted) <= len(" ".join(received.split(" ")[-2:]))
    assert emitted + redactor.end() == text


def test_with_nothing_to_find_every_chunk_is_emitted_as_it_comes() -> None:
    # A policy that allows every PII kind and blocks no term: no word is held for the next
    # token (a stream's first word would otherwise wait one inter-token gap).
    redactor = StreamingRedactor(redact_kinds=(), blocked_terms=())
    assert redactor.passes_all
    for i in range(0, len(ANSWER), 3):
        assert redactor.feed(ANSWER[i : i + 3]) == ANSWER[i : i + 3]
        assert redactor.held == 0
    assert redactor.end() == ""
    assert redactor.emitted == len(ANSWER) and not redactor.violations
    # One kind or one term to find, and the last word waits again.
    for options in ({"redact_kinds": ("email",)}, {"redact_kinds": (), "blocked_terms": ["x"]}):
        redactor = StreamingRedactor(**options)  # type: ignore[arg-type]
        assert not redactor.passes_all
        assert redactor.feed("Contact") == ""


def test_a_blocked_term_is_a_violation_with_its_offset() -> None:
    text = "Our internal codename is Bluebird, do not share."
    pieces, redactor = stream(text, 3, blocked_terms=["bluebird", "  "])
    assert "".join(pieces) == "Our internal codename is [BLOCKED], do not share."
    assert [(v.rule, v.detail, v.offset) for v in redactor.violations] == [
        ("blocked_term", "bluebird", text.index("Bluebird"))
    ]


def test_blocked_terms_match_whole_words_through_homoglyphs_and_zero_width() -> None:
    text = "Bluebirds fly. But Вluе\u200bbird is hidden."
    assert redact_answer(text, blocked_terms=["bluebird"])[0] == (
        "Bluebirds fly. But [BLOCKED] is hidden."
    )


def test_a_term_at_the_very_end_is_held_until_its_word_boundary_is_known() -> None:
    redactor = StreamingRedactor(blocked_terms=["bird"])
    assert redactor.feed("a bird") == "a "
    assert redactor.feed("s fly") == "birds "
    assert redactor.end() == "fly"
    assert redactor.violations == []


def test_a_blocked_pii_kind_is_redacted_and_reported() -> None:
    pieces, redactor = stream("card 4111111111111111.", 2, block_kinds=["card"])
    assert "".join(pieces) == "card [CARD]."
    assert [v.rule for v in redactor.violations] == ["pii.card"]


def test_overlapping_matches_are_redacted_as_one_and_each_blocked_one_counts() -> None:
    text = "mail jane.doe@example.com now"
    redacted, found = redact_answer(text, block_kinds=["email"], blocked_terms=["example.com"])
    assert redacted == "mail [BLOCKED] now"  # not "jane.doe@[BLOCKED]"
    assert sorted(v.rule for v in found) == ["blocked_term", "pii.email"]


def test_kinds_not_asked_for_are_left_alone() -> None:
    text = "mail a@b.co from 10.0.0.1"
    assert redact_answer(text, redact_kinds=["ip"])[0] == "mail a@b.co from [IP]"


@pytest.mark.parametrize(
    "text",
    [
        "DE00 " * 300,  # every word could start an IBAN: overlapping candidates all the way
        "y@555 7x@" * 200,  # e-mail and phone runs overlapping in a chain
        "1" * 3000,
        "+1 555 123 4567" + "a" * 58 + "@" + "b" * 180 + ".com:" + "c" * 400,
    ],
)
def test_long_unbroken_runs_never_hold_back_more_than_the_bound(text: str) -> None:
    for size in (1, 5, 64):
        pieces, redactor = stream(text, size)
        assert "".join(pieces) == redact_answer(text)[0]
    redactor = StreamingRedactor()
    most = max(_held_after(redactor, text[i : i + 3]) for i in range(0, len(text), 3))
    assert RUN_LIMIT - 5 <= most <= redactor.max_holdback


def _held_after(redactor: StreamingRedactor, chunk: str) -> int:
    redactor.feed(chunk)
    return redactor.held


_PIECES = st.one_of(
    st.sampled_from(
        [
            "ana@example.com", "+44 20 7946 0958", "4111 1111 1111 1111", "(11) 91234-5678",
            "DE89 3704 0044 0532 0130 00", "10.0.0.1", "fe80::1", "123-45-6789",
            "529.982.247-25", "AB 12 34 56 C", "version ", "order ", "Secret Project", " ",
            "\u200b", "４", "ﷺ", "\ud800", "1" * 40, "x@" + "b." * 80 + "com",
            "DE00 " * 70, "y@555 7x@" * 40, "4111 " * 70, "a" * 300,
            "ana [at] example [dot] com", "jo.ana at example dot com", "email me: x at y dot io",
            "n(at)ex(dot)pt", "x @ y . com", " [at] ", " at ", " dot ", " [dot] ", "[", "(at",
            "4111.1111.1111.1111", "4111/1111/1111/1111", "4111_1111-1111.1111",
            "de89 3704 0044 0532 0130 00", "gb82 west 1234 5698 7654 32", "gb82 ",
            "a [at] " * 40, "x at y dot " * 30, "de00 " * 60, "1/" * 100,
        ]
    ),
    st.text(alphabet="0123456789 .-+()@:ABCDEab#\u200b\n", max_size=30),
    st.text(alphabet="at do[]()@. xyzcom0123/_", max_size=30),
    st.text(max_size=8),
)  # fmt: skip


@settings(max_examples=examples(400), deadline=None, suppress_health_check=list(HealthCheck))
@given(st.lists(_PIECES, max_size=20), st.lists(st.integers(1, 12), min_size=1, max_size=30))
@example(["+44 20 7946 0958", "ana@example.com", "ﷺ", "DE00 " * 70], [1])  # held 293 > 292 once
# Matches that crossed runs once chained their extents and held the whole text back.
@example(["de00 " * 180], [1])
@example(["gb82 west 1234 5698 7654 32@" * 12, "a [at] b [dot] com@" * 20], [3])
@example(["ana [at] example [dot] com", "jo.ana at example dot com"], [1])
def test_any_chunking_gives_the_whole_text_redaction_within_the_holdback_bound(
    parts: list[str], sizes: list[int]
) -> None:
    text = "".join(parts)
    options = {"blocked_terms": ["secret project", "secret"], "block_kinds": ["iban"]}
    expected, violations = redact_answer(text, **options)  # type: ignore[arg-type]
    redactor = StreamingRedactor(**options)  # type: ignore[arg-type]
    out, start, turn = [], 0, 0
    while start < len(text):
        size = sizes[turn % len(sizes)]
        out.append(redactor.feed(text[start : start + size]))
        start, turn = start + size, turn + 1
        assert redactor.held <= redactor.max_holdback
    out.append(redactor.end())
    assert "".join(out) == expected
    assert redactor.violations == violations
    assert redactor.held == 0
