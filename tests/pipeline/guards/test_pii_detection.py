"""PII detection measured on a small labelled set (`pii_cases`): the share of positives found
exactly (kind and span) and the share of benign look-alikes with any finding.

Figures (this commit): recall 1.00 on 50 positives, false positives 0.00 on 64 look-alikes;
before the separators, lower-case IBANs and obfuscated addresses: recall 0.12 (6 of 50), false
positives 0.03 (2 of 64: a decimal's digits read as a card number). On the held-out cases
(written after the rules were settled): recall 1.00 (16 of 16), false positives 0.00 (0 of 18).
"""

from __future__ import annotations

from pipeline.guards.output import redact_answer
from pipeline.guards.pii import find_pii
from tests.pipeline.guards.pii_cases import (
    BENIGN,
    HELD_OUT_BENIGN,
    HELD_OUT_POSITIVES,
    POSITIVES,
)

MIN_RECALL = 0.95
MAX_FALSE_POSITIVES = 0.05


def _found(text: str) -> list[tuple[str, str]]:
    return [(f.kind, text[f.start : f.end]) for f in find_pii(text)]


def test_the_labelled_positives_are_found_with_their_kind_and_span() -> None:
    missed = [
        (text, _found(text)) for text, kind, value in POSITIVES if _found(text) != [(kind, value)]
    ]
    recall = 1 - len(missed) / len(POSITIVES)
    assert recall >= MIN_RECALL, f"recall {recall:.2f}; missed: {missed}"


def test_the_benign_look_alikes_are_left_alone() -> None:
    flagged = [(text, _found(text)) for text in BENIGN if _found(text)]
    rate = len(flagged) / len(BENIGN)
    assert rate <= MAX_FALSE_POSITIVES, f"false positives {rate:.2f}: {flagged}"


def test_the_output_redaction_redacts_every_labelled_positive() -> None:
    for text, kind, value in POSITIVES:
        redacted, _ = redact_answer(text)
        assert value not in redacted and f"[{kind.upper()}]" in redacted, text


def test_the_labelled_set_covers_every_new_shape() -> None:
    values = [value for _, _, value in POSITIVES]
    for separator in "./_":
        assert any(kind == "card" and separator in v for _, kind, v in POSITIVES), separator
        assert any(kind == "iban" and separator in v for _, kind, v in POSITIVES), separator
    assert any(v[:2].islower() for _, kind, v in POSITIVES if kind == "iban")
    for marker in ("[at]", "(at)", " at ", " @ ", " dot ", "[.]"):
        assert any(marker in v for v in values), marker
    assert len(BENIGN) >= 50 and len(POSITIVES) >= 40


def test_the_held_out_cases_score_as_well() -> None:
    missed = [t for t, kind in HELD_OUT_POSITIVES if [f.kind for f in find_pii(t)] != [kind]]
    flagged = [t for t in HELD_OUT_BENIGN if find_pii(t)]
    assert 1 - len(missed) / len(HELD_OUT_POSITIVES) >= MIN_RECALL, missed
    assert len(flagged) / len(HELD_OUT_BENIGN) <= MAX_FALSE_POSITIVES, flagged
