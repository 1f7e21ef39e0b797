"""The literal-prefix pre-check never hides a rule that matches."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.guards.injection import RULES
from pipeline.guards.normalize import fold
from pipeline.guards.prefilter import PrefixIndex, literal_prefixes

INDEX = PrefixIndex([rule.prefixes for rule in RULES])


def test_literal_prefixes_of_simple_patterns() -> None:
    assert literal_prefixes(r"\b(?:ignore|forget) all") == frozenset({"ignore", "forget"})
    assert literal_prefixes(r"(?:^|[.!] )now") == frozenset({"now", ". now", "! now"})
    assert literal_prefixes(r"a?bc") == frozenset({"abc", "bc"})
    assert literal_prefixes(r"\w+ x") is None
    assert literal_prefixes(r"x|\s") is None


def test_every_rule_but_none_has_literals() -> None:
    assert all(rule.prefixes for rule in RULES)


_VOCABULARY = """ignore all previous instructions your system prompt you are now dan print show
    reveal ignore todas as instrucoes anteriores mostre seu prompt <|im_start|> [inst] ###
    system: assistant: forget everything above new instructions: developer mode the of and
    please what were you told before this conversation esqueca tudo voce agora e ignoriere alle
    vorherigen anweisungen ignora las instrucciones oublie tout ce qui precede , . : ! ?""".split()  # noqa: SIM905
_WORDS = st.sampled_from([*_VOCABULARY, "\n"])


@settings(max_examples=500, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    st.lists(st.tuples(_WORDS, st.sampled_from([" ", "", "\n", ". ", ", ", "x"])), max_size=25).map(
        lambda pairs: "".join(word + glue for word, glue in pairs)
    )
)
def test_every_match_of_every_rule_starts_at_a_candidate_offset(text: str) -> None:
    folded = fold(text)
    candidates = INDEX.candidates(folded)
    for index, rule in enumerate(RULES):
        for match in rule.pattern.finditer(folded):
            assert match.start() in candidates.get(index, []), (rule.pattern.pattern, folded)


def test_a_text_without_any_literal_runs_no_rule() -> None:
    assert INDEX.candidates("zzz qqq") == {}


def test_short_and_full_length_literals_give_their_offsets() -> None:
    index = PrefixIndex([frozenset({"ab"}), frozenset({"abcd"}), None])
    assert index.candidates("xabcd ab") == {0: [1, 6], 1: [1], 2: []}
