"""Tool-call arguments are redacted as JSON: PII and blocked terms inside strings (keys too),
numbers and anything else, the JSON kept valid whatever the fragments, escapes never cut."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import example, given, settings
from hypothesis import strategies as st

from pipeline.guards.arguments import ArgumentsGuard, JsonArgumentsRedactor, redactor_factory
from pipeline.guards.policy import GuardPolicy, PolicyBook
from tests.support.fuzzing import examples

POLICY = GuardPolicy()
PLANTED = [
    "ana@example.com", "ana [at] example [dot] com", "+44 20 7946 0958", "4111 1111 1111 1111",
    "de89 3704 0044 0532 0130 00", "123-45-6789",
]  # fmt: skip


def redact(arguments: str, sizes: list[int] | None = None, policy: GuardPolicy = POLICY) -> str:
    redactor = JsonArgumentsRedactor(redactor_factory(policy))
    out, start, turn = [], 0, 0
    while start < len(arguments):
        size = (sizes or [len(arguments)])[turn % len(sizes or [1])]
        out.append(redactor.feed(arguments[start : start + size]))
        start, turn = start + size, turn + 1
    return "".join(out) + redactor.end()


def test_pii_in_string_values_and_keys_becomes_tokens_and_the_json_stays_valid() -> None:
    arguments = json.dumps(
        {"to": "ana@example.com", "note": "call +44 20 7946 0958", "ana@example.com": [1, "x"]}
    )
    assert json.loads(redact(arguments)) == {
        "to": "[EMAIL]",
        "note": "call [PHONE]",
        "[EMAIL]": [1, "x"],
    }


def test_a_number_that_is_pii_becomes_a_string_token() -> None:
    assert json.loads(redact('{"card": 4111111111111111, "n": 12}')) == {"card": "[CARD]", "n": 12}


def test_a_value_is_read_with_its_key_as_context() -> None:
    assert json.loads(redact('{"phone": "5551234567", "id": "5551234567"}')) == {
        "phone": "[PHONE]",
        "id": "5551234567",
    }


def test_escaped_pii_is_decoded_before_it_is_matched() -> None:
    arguments = r'{"q": "\u0061na\u0040example\u002ecom, caf\u00e9 \ud83d\ude00 \"x\""}'
    assert json.loads(redact(arguments)) == {"q": '[EMAIL], café 😀 "x"'}


def test_text_that_is_not_json_loses_its_pii_too() -> None:
    out = redact("Sure: mail ana@example.com, card 4111 1111 1111 1111")
    assert out == 'Sure: "mail [EMAIL]", "card [CARD]"'


def test_a_blocked_term_or_kind_in_the_arguments_is_a_violation() -> None:
    policy = PolicyBook.from_json(
        '{"*": {"pii": {"email": "block"}, "blocked_output_terms": ["project x"]}}'
    ).default
    guard = ArgumentsGuard(policy)
    assert guard('{"q": "ana@example.com"}').blocked == "pii.email"
    blocked = guard('{"q": "about Project X"}')
    assert blocked.blocked == "blocked_term" and json.loads(blocked.text) == {
        "q": "about [BLOCKED]"
    }
    assert guard('{"q": "fine"}').blocked is None


JSON_TEXT = st.text(alphabet=st.characters(codec="utf-8", exclude_characters="\x00"), max_size=12)
DOCUMENTS = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(10**20), 10**20)
    | JSON_TEXT
    | st.sampled_from(PLANTED),
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(JSON_TEXT | st.sampled_from(PLANTED), inner, max_size=4)
    ),
    max_leaves=12,
)


@settings(max_examples=examples(300), deadline=None)
@given(DOCUMENTS, st.booleans(), st.lists(st.integers(1, 9), min_size=1, max_size=8))
@example({"a": "ana [at] example [dot] com", "\ud800": "\\"}, True, [1])
@example({"x": "4111 1111 1111 1111"}, True, [3, 1])
@example({"#": "+44 20 7946 0958"}, False, [1])  # a fuzz find: "#" was read as "number"
def test_any_fragments_give_the_same_valid_json_without_the_planted_pii(
    document: Any, ascii_only: bool, sizes: list[int]
) -> None:
    arguments = json.dumps(document, ensure_ascii=ascii_only)
    whole = redact(arguments)
    assert redact(arguments, sizes) == whole
    json.loads(whole)  # valid JSON
    for value in PLANTED:
        assert value not in whole


SAFE = st.text(alphabet='abc XYZ\n\t"\\/é😀\u2028', max_size=10)
SAFE_DOCUMENTS = st.recursive(
    st.none() | st.booleans() | st.floats(allow_nan=False, allow_infinity=False) | SAFE,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(SAFE, inner, max_size=3),
    max_leaves=10,
)


@settings(max_examples=examples(200), deadline=None)
@given(SAFE_DOCUMENTS, st.booleans(), st.lists(st.integers(1, 5), min_size=1, max_size=5))
@example(2.2719650530458397e296, False, [1])  # its digits once passed for a card
def test_arguments_without_pii_read_back_as_the_same_json(
    document: Any, ascii_only: bool, sizes: list[int]
) -> None:
    arguments = json.dumps(document, ensure_ascii=ascii_only)
    assert json.loads(redact(arguments, sizes)) == document
