"""PII detection: each kind's positives, the look-alikes that must pass, obfuscations, redaction."""

from __future__ import annotations

import pytest

from pipeline.guards.pii import find_pii, redact


def found(text: str) -> list[tuple[str, str]]:
    """(kind, original text) of each finding."""
    return [(f.kind, text[f.start : f.end]) for f in find_pii(text)]


@pytest.mark.parametrize(
    "text, value",
    [
        ("mail john.doe@example.com today", "john.doe@example.com"),
        ("write to maria_silva+rag@sub.empresa.com.br.", "maria_silva+rag@sub.empresa.com.br"),
        ("<ana@exemplo.pt>", "ana@exemplo.pt"),
    ],
)
def test_email_addresses_are_found(text: str, value: str) -> None:
    assert found(text) == [("email", value)]


@pytest.mark.parametrize(
    "value",
    [
        "+1 (555) 123-4567",
        "+44 20 7946 0958",
        "+55 11 91234-5678",
        "+351 912 345 678",
        "555-123-4567",
        "(555) 123-4567",
        "555.123.4567",
        "(11) 91234-5678",
        "020 7946 0958",
        "01 23 45 67 89",
        "912 345 678",
        "030 12345678",
        "0044 20 7946 0958",
    ],
)
def test_phone_numbers_international_and_national_are_found(value: str) -> None:
    assert found(f"call me on {value} please") == [("phone", value)]


@pytest.mark.parametrize("before", ["#", "ticket #", "order", "ref:"])
def test_an_international_number_is_a_phone_after_words_that_mark_other_numbers(
    before: str,
) -> None:
    """ "#12345678" or "order 555-123-4567" is not a phone, but a number with its country
    code is one whatever comes before it (a fuzz find: a JSON key "#")."""
    assert found(f"{before} +44 20 7946 0958") == [("phone", "+44 20 7946 0958")]
    assert found(f"{before} 555-123-4567") == []


def test_a_bare_digit_run_is_a_phone_only_after_a_phone_word() -> None:
    assert found("phone: 5551234567") == [("phone", "5551234567")]
    assert found("reference 5551234567") == []


@pytest.mark.parametrize(
    "value",
    ["4111 1111 1111 1111", "4111-1111-1111-1111", "5500005555555559", "378282246310005"],
)
def test_card_numbers_with_a_valid_luhn_check_are_found(value: str) -> None:
    assert found(f"card {value} exp 12/29") == [("card", value)]


def test_a_card_number_followed_by_its_security_code_is_still_found() -> None:
    assert found("4111 1111 1111 1111 123") == [("card", "4111 1111 1111 1111")]


@pytest.mark.parametrize(
    "value",
    ["DE89 3704 0044 0532 0130 00", "GB29NWBK60161331926819", "GB82 WEST 1234 5698 7654 32"],
)
def test_ibans_with_the_right_length_and_mod_97_are_found(value: str) -> None:
    assert found(f"IBAN {value}, thanks") == [("iban", value)]


def test_an_iban_with_a_wrong_check_or_length_is_not_found() -> None:
    assert found("IBAN DE89 3704 0044 0532 0130 01") == []
    assert found("IBAN DE89 3704 0044 0532 0130") == []


@pytest.mark.parametrize("value", ["192.168.1.20", "8.8.8.8", "2001:db8::8a2e:370:7334", "fe80::1"])
def test_ip_addresses_are_found(value: str) -> None:
    assert found(f"the host at {value} is down") == [("ip", value)]


@pytest.mark.parametrize(
    "text, value, detail",
    [
        ("SSN 123-45-6789", "123-45-6789", "us_ssn"),
        ("my ssn is 123456789", "123456789", "us_ssn"),
        ("CPF 529.982.247-25", "529.982.247-25", "br_cpf"),
        ("cpf: 52998224725", "52998224725", "br_cpf"),
        ("NI number AB 12 34 56 C", "AB 12 34 56 C", "uk_nino"),
        ("NINO JG103759A", "JG103759A", "uk_nino"),
    ],
)
def test_national_ids_are_found(text: str, value: str, detail: str) -> None:
    findings = find_pii(text)
    assert [(f.kind, text[f.start : f.end], f.detail) for f in findings] == [
        ("national_id", value, detail)
    ]


@pytest.mark.parametrize(
    "text",
    [
        "SSN 666-12-3456",  # area 666 is never issued
        "SSN 912-34-5678",  # 9xx areas are not SSNs
        "SSN 123-00-4567",  # group 00
        "CPF 529.982.247-26",  # wrong check digit
        "CPF 111.111.111-11",  # all digits equal
        "NINO GB 12 34 56 A",  # GB prefix is never issued
    ],
)
def test_national_id_look_alikes_with_invalid_numbers_pass(text: str) -> None:
    assert found(text) == []


@pytest.mark.parametrize(
    "text",
    [
        "Order #123-456-7890 has shipped",
        "order number 2024-000123",
        "invoice 555-123-4567 is overdue",
        "pedido nº 912 345 678 atrasado",
        "meeting on 2024-01-15 at 10:30:00",
        "due 15/01/2024 or 01.15.2024",
        "running version 1.2.3.4 of the agent",
        "upgrade to v10.0.19041.1234",
        "build 4.18.0.240",
        "ISBN 978-3-16-148410-0",
        "ISBN 9783161484100",
        "ISBN 0-306-40615-2",
        "ISBN 0306406152",
        "timestamp 1700000000 and 1700000000123",
        "price $1,299.99 or 1 299,99 €",
        "the numbers 10 20 30 40 50 60",
        "localhost is 127.0.0.1 and ::1",
        "call std::vector or a::b in C++",
        "it costs 4111 dollars and 1111 cents",
    ],
)
def test_look_alikes_of_pii_pass(text: str) -> None:
    assert found(text) == []


def test_obfuscated_numbers_are_found_and_redacted_in_the_original() -> None:
    text = "card ４１１１\u200b1111 1111 1111 and mail ｊｏｈｎ@example.com"
    assert redact(text, find_pii(text)) == "card [CARD] and mail [EMAIL]"


def test_redact_replaces_every_kind_with_its_token() -> None:
    text = (
        "a@b.co, +44 20 7946 0958, 4111111111111111, DE89370400440532013000, 10.0.0.1, 123-45-6789"
    )
    assert redact(text, find_pii(text)) == ("[EMAIL], [PHONE], [CARD], [IBAN], [IP], [NATIONAL_ID]")


def test_findings_carry_a_confidence_and_sorted_spans() -> None:
    findings = find_pii("x@y.io then 4111 1111 1111 1111")
    assert [f.kind for f in findings] == ["email", "card"]
    assert all(0 < f.score <= 1 for f in findings)
    assert findings[0].end <= findings[1].start


def test_a_card_that_also_fits_a_phone_shape_is_reported_once_as_a_card() -> None:
    assert found("+4111111111111111") == [("card", "4111111111111111")]


def test_kinds_can_be_restricted() -> None:
    assert find_pii("a@b.co 10.0.0.1", kinds=["ip"])[0].kind == "ip"
    assert len(find_pii("a@b.co 10.0.0.1", kinds=["ip"])) == 1
