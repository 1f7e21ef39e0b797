"""Arbitrary text (any script, lone surrogates, zero-width characters, look-alikes, encodings)
always gets a decision from every detector: nothing raises."""

from __future__ import annotations

import contextlib
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.guards.grounding import check_grounding
from pipeline.guards.injection import ExemplarIndex, InjectionDecision, InjectionDetector
from pipeline.guards.normalize import canonicalize, fold, hidden_views
from pipeline.guards.output import StreamingRedactor
from pipeline.guards.pii import find_pii, redact
from pipeline.guards.policy import PolicyBook, PolicyError
from retrieval import Embedder
from tests.support.fuzzing import examples

_TRICKY = [
    "\ud800", "\udfff", "\u200b", "\u202e", "\ufeff", "\u2060", "а", "ο", "４", "𝐢", "ﷺ", "ß",
    "İ", "\U000e0041", "%41", "\\u0041", "\\x41", "aWdub3Jl", "0x41", "+1 555", "@x.co",
    "[doc-1]", "<|im_start|>", "\n", "\r\n", "ignore", "4111", "DE89", "::", "1.2.3.4", " ",
    "[at]", " at ", " dot ", "(at)", "de89", "4111.", "_", "/",
]  # fmt: skip
TEXTS = st.one_of(
    st.text(),
    st.text(alphabet=st.characters(codec=None, min_codepoint=0, max_codepoint=0x10FFFF)),
    st.lists(st.sampled_from(_TRICKY), max_size=40).map("".join),
    st.lists(st.one_of(st.sampled_from(_TRICKY), st.text(max_size=5)), max_size=20).map("".join),
)
FUZZ = settings(max_examples=examples(300), deadline=None, suppress_health_check=list(HealthCheck))
RULES_ONLY = InjectionDetector()


@FUZZ
@given(TEXTS)
def test_pii_detection_and_redaction_never_raise(text: str) -> None:
    findings = find_pii(text)
    assert all(0 <= f.start < f.end <= len(text) for f in findings)
    assert isinstance(redact(text, findings), str)


@FUZZ
@given(TEXTS)
def test_injection_rules_always_decide(text: str) -> None:
    decision = RULES_ONLY.check(text)
    assert isinstance(decision, InjectionDecision)
    assert 0.0 <= decision.score <= 1.0
    assert decision.flagged == (decision.score >= RULES_ONLY.threshold)


@FUZZ
@given(TEXTS, st.integers(1, 9))
def test_the_streaming_redactor_never_raises_and_returns_everything(text: str, size: int) -> None:
    redactor = StreamingRedactor(blocked_terms=["ignore", "ﷺ", "\u200b"])
    out = "".join(redactor.feed(text[i : i + size]) for i in range(0, len(text), size))
    out += redactor.end()
    assert redactor.held == 0
    assert isinstance(out, str)


@FUZZ
@given(TEXTS, st.lists(TEXTS, max_size=3))
def test_grounding_and_normalisation_never_raise(text: str, passages: list[str]) -> None:
    report = check_grounding(text, ["doc-1"], passages)
    assert report.supported <= report.sentences
    assert isinstance(fold(text), str)
    assert all(isinstance(v, str) for _, v in hidden_views(text, canonicalize(text).text))


@FUZZ
@given(st.recursive(st.none() | st.booleans() | st.integers() | st.text(), lambda c: (
    st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=20), c, max_size=4))))  # fmt: skip
def test_any_policy_json_is_either_accepted_or_refused_with_a_policy_error(data: object) -> None:
    with contextlib.suppress(PolicyError):
        PolicyBook.from_json(json.dumps(data))


@pytest.fixture(scope="module")
def similarity_detector(shared_embedder: Embedder) -> InjectionDetector:
    return InjectionDetector(ExemplarIndex.from_file(shared_embedder))


@settings(max_examples=examples(25), deadline=None, suppress_health_check=list(HealthCheck))
@given(TEXTS)
def test_the_similarity_signal_decides_any_text_with_the_real_embedder(
    similarity_detector: InjectionDetector, text: str
) -> None:
    decision = similarity_detector.check(text)
    assert isinstance(decision.flagged, bool)
