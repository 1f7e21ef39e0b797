"""PII detection and output redaction run in time linear in the text: every pattern of `pii`
and `pii_email`, `find_pii`, `redact_answer` and the streaming redactor (fed 1 and 16
characters at a time), timed on adversarial texts (tests/support/adversarial.py: runs of the
characters each pattern loops on, its alternatives and literals repeated; plus the shapes PII
patterns chain on: digits with each separator, "[at]" and "at"/"dot" chains, IBAN prefixes,
characters that expand 18-fold), bounded in CPU milliseconds per KB.

Measured on a busy 2-core machine (CPU ms per KB, worst input): a pattern 0.3, `find_pii` 6,
`redact_answer` 16 ("ﷺ", 18 canonical characters each), the stream 44 (1-character chunks of
"ﷺ"; 16-character chunks 18). A quadratic path costs hundreds of ms per KB at these sizes.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import pytest

from pipeline.guards import pii, pii_email
from pipeline.guards.output import StreamingRedactor, redact_answer
from tests.support.adversarial import Input, assert_linear, fill, generic_inputs, inputs_for

PATTERN_SIZE = 32_768
TEXT_SIZE = 16_384
STREAM_SIZE = 8_192
PATTERN_MS_PER_KB = 2.0
FIND_MS_PER_KB = 50.0
REDACT_MS_PER_KB = 100.0
STREAM_MS_PER_KB = 250.0

PII_UNITS = [
    *(f"1{sep}" for sep in " ./_-"), "1 2.3-4/5_", "4111 ", "4111.", "4111/", "+1 ", "(1) ",
    "1.2.", "1,", "a:", "::", "a [at] ", "a at ", "x dot ", "at ", "dot ", "[at]", "(at)",
    "a [at] b [dot] ", "x at y dot ", "x . ", "a @ ", "@", "a@", "a@b.", "de00 ", "DE00 ",
    "gb82 west ", "ab12 ", "ﷺ", "é", "a ", "a\n",
]  # fmt: skip


def pii_inputs(size: int) -> list[Input]:
    return [(f"run of {unit!r}", fill(unit, size)) for unit in PII_UNITS]


def _patterns() -> list[tuple[str, re.Pattern[str]]]:
    return [
        (f"{module.__name__.rsplit('.', 1)[-1]}.{name}", value)
        for module in (pii, pii_email)
        for name, value in vars(module).items()
        if isinstance(value, re.Pattern)
    ]


PATTERNS = _patterns()


def test_every_pattern_of_the_pii_modules_is_timed() -> None:
    names = {name for name, _ in PATTERNS}
    assert {"pii._CARD_RUN", "pii._PHONE_RUN", "pii._IBAN_START", "pii_email._OBFUSCATED"} <= names
    assert len(PATTERNS) >= 15


@pytest.mark.parametrize("name, pattern", PATTERNS, ids=[name for name, _ in PATTERNS])
def test_every_pii_pattern_is_linear(name: str, pattern: re.Pattern[str]) -> None:
    inputs = inputs_for(pattern.pattern, PATTERN_SIZE, limit=40) + pii_inputs(PATTERN_SIZE)
    assert_linear(
        lambda text: sum(1 for _ in pattern.finditer(text)),
        inputs,
        ms_per_kb=PATTERN_MS_PER_KB,
        what=name,
    )


def test_find_pii_is_linear() -> None:
    inputs = pii_inputs(TEXT_SIZE) + generic_inputs(TEXT_SIZE)
    assert_linear(pii.find_pii, inputs, ms_per_kb=FIND_MS_PER_KB, what="find_pii")


def test_redact_answer_is_linear() -> None:
    inputs = pii_inputs(TEXT_SIZE) + generic_inputs(TEXT_SIZE)
    assert_linear(
        lambda text: redact_answer(text, blocked_terms=["secret project"]),
        inputs,
        ms_per_kb=REDACT_MS_PER_KB,
        what="redact_answer",
    )


def _streamed(size: int) -> Callable[[str], str]:
    def run(text: str) -> str:
        redactor = StreamingRedactor(blocked_terms=["secret project"])
        out = [redactor.feed(text[i : i + size]) for i in range(0, len(text), size)]
        return "".join(out) + redactor.end()

    return run


@pytest.mark.parametrize("chunk, size", [(1, STREAM_SIZE // 2), (16, STREAM_SIZE)])
def test_the_streaming_redactor_is_linear_whatever_the_chunks(chunk: int, size: int) -> None:
    inputs = pii_inputs(size) + generic_inputs(size)
    assert_linear(
        _streamed(chunk),
        inputs,
        ms_per_kb=STREAM_MS_PER_KB,
        what=f"StreamingRedactor in chunks of {chunk}",
    )
