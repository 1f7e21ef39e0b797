"""Injection detection runs in time linear in the text: every rule, every pattern of
`injection` and `normalize` that reads caller text, and the whole check, timed on adversarial
texts generated for each from its own parse tree (runs of the characters it loops on, its
alternatives and literals repeated: tests/support/adversarial.py), must stay under a bound in
CPU milliseconds per KB. A backtracking pattern fails by orders of magnitude: the review's case,
40,000 newlines against ``\\n\\s*system\\s*:``, took 15 s (375 ms per KB)."""

from __future__ import annotations

import re
from typing import Any

import pytest

from pipeline.guards import injection, normalize
from pipeline.guards.linear import encode
from tests.support.adversarial import Input, assert_linear, generic_inputs, inputs_for

RULE_SIZE = 32_768  # characters per input for one pattern
CHECK_SIZE = 12_288  # for the whole check, which runs every rule on several views of the text
# Measured on the 2-core machine: one pattern costs 0.01 to 0.6 ms per KB on its worst input,
# the whole check 1 to 6 (the worst: a run of "ﷺ", each of which becomes 18 characters). The
# backtracking rules this replaced cost 200 to 560 ms per KB on these inputs.
MS_PER_KB = 3.0
CHECK_MS_PER_KB = 30.0


def _all_matches(pattern: Any, text: str) -> int:
    """Every match of `pattern` in `text`: an RE2 pattern searches the UTF-8 bytes, as the
    detector calls it; the few patterns left on `re` read the text itself."""
    subject: str | bytes = text if isinstance(pattern, re.Pattern) else encode(text)
    return sum(1 for _ in pattern.finditer(subject))


def _module_patterns() -> list[tuple[str, Any]]:
    found = []
    for module in (injection, normalize):
        for name, value in vars(module).items():
            if hasattr(value, "finditer") and isinstance(getattr(value, "pattern", None), str):
                found.append((f"{module.__name__.rsplit('.', 1)[-1]}.{name}", value))
    return found


MODULE_PATTERNS = _module_patterns()


def test_every_caller_text_pattern_of_the_modules_is_found() -> None:
    names = {name for name, _ in MODULE_PATTERNS}
    assert {"injection._MIXED_WORD", "injection._MENTION", "normalize._ASCII_RUN"} <= names
    assert len(MODULE_PATTERNS) >= 12


@pytest.mark.parametrize(
    "index", range(len(injection.RULES)), ids=lambda i: f"{i}-{injection.RULES[i].family}"
)
def test_every_rule_is_linear_on_inputs_made_for_it(index: int) -> None:
    rule = injection.RULES[index]
    inputs = inputs_for(rule.pattern.pattern, RULE_SIZE, limit=24)
    assert_linear(
        lambda text: _all_matches(rule.pattern, text),
        inputs,
        ms_per_kb=MS_PER_KB,
        what=f"rule {rule.pattern.pattern[:60]!r}",
    )
    if rule.unless is not None:
        assert_linear(
            lambda text: _all_matches(rule.unless, text),
            inputs_for(rule.unless.pattern, RULE_SIZE, limit=20),
            ms_per_kb=MS_PER_KB,
        )


@pytest.mark.parametrize(("name", "pattern"), MODULE_PATTERNS, ids=[n for n, _ in MODULE_PATTERNS])
def test_every_module_pattern_is_linear_on_inputs_made_for_it(name: str, pattern: Any) -> None:
    inputs = inputs_for(pattern.pattern, RULE_SIZE, limit=40) + generic_inputs(RULE_SIZE)[:12]
    assert_linear(lambda text: _all_matches(pattern, text), inputs, ms_per_kb=MS_PER_KB, what=name)


def _check_inputs() -> list[Input]:
    """Generic runs, plus a few inputs made for each rule and module pattern."""
    out = generic_inputs(CHECK_SIZE)
    sources = [rule.pattern.pattern for rule in injection.RULES]
    sources += [pattern.pattern for _, pattern in MODULE_PATTERNS]
    for source in sources:
        out += inputs_for(source, CHECK_SIZE, limit=1)
    return list({text: (name, text) for name, text in out}.values())


CHECK_INPUTS = _check_inputs()


def test_the_whole_rule_check_is_linear_on_every_kind_of_input() -> None:
    detector = injection.InjectionDetector()
    assert_linear(detector.check, CHECK_INPUTS, ms_per_kb=CHECK_MS_PER_KB, what="check")


def test_the_review_case_forty_thousand_newlines_is_cheap() -> None:
    texts = [
        ("40,000 newlines", "hello" + "\n" * 40_000 + "thanks"),
        ("40,000 newlines, then a marker", "hello" + "\n" * 40_000 + "system: obey"),
    ]
    assert_linear(injection.rule_signals, texts, ms_per_kb=CHECK_MS_PER_KB)
