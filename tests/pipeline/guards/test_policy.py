"""Per-tenant guard policy: defaults, JSON overrides, validation, verdicts, the cache token."""

from __future__ import annotations

import json

import pytest

from pipeline.guards.pii import PiiFinding
from pipeline.guards.policy import GuardPolicy, PolicyBook, PolicyError


def test_defaults_block_injection_and_redact_every_pii_kind() -> None:
    policy = GuardPolicy()
    assert policy.injection == "block"
    assert policy.kinds_with("redact") == {"email", "phone", "card", "iban", "ip", "national_id"}
    assert policy.kinds_with("block") == frozenset()


def test_tenant_overrides_merge_over_the_star_defaults() -> None:
    book = PolicyBook.from_json(
        json.dumps(
            {
                "*": {"pii": {"card": "block"}, "version": "7"},
                "acme": {"pii": {"email": "allow"}, "injection": "allow", "max_input_tokens": 900},
                "globex": {"blocked_output_terms": ["Project X"]},
            }
        )
    )
    acme = book.for_tenant("acme")
    assert (acme.pii_action("email"), acme.pii_action("card"), acme.pii_action("ip")) == (
        "allow",
        "block",
        "redact",
    )
    assert (acme.injection, acme.max_input_tokens, acme.version) == ("allow", 900, "7")
    assert book.for_tenant("globex").blocked_output_terms == ("Project X",)
    assert book.for_tenant("someone-else") == book.default
    assert book.default.pii_action("card") == "block"


def test_no_settings_give_the_defaults() -> None:
    assert PolicyBook.from_json(None).for_tenant("t") == GuardPolicy()
    assert PolicyBook.from_json("").for_tenant("t") == GuardPolicy()


@pytest.mark.parametrize(
    "data",
    [
        "{not json",
        '["a list"]',
        '{"t": 3}',
        '{"t": {"pii": {"passport": "block"}}}',
        '{"t": {"pii": {"email": "delete"}}}',
        '{"t": {"injection": "redact"}}',
        '{"t": {"max_input_tokens": 0}}',
        '{"t": {"max_input_tokens": true}}',
        '{"t": {"blocked_output_terms": "x"}}',
        '{"t": {"version": ""}}',
        '{"t": {"pi": {}}}',
    ],
)
def test_unusable_settings_are_refused(data: str) -> None:
    with pytest.raises(PolicyError):
        PolicyBook.from_json(data)


def test_the_verdict_is_the_strongest_action_and_lists_what_to_redact() -> None:
    policy = GuardPolicy().with_overrides({"pii": {"card": "block", "ip": "allow"}})
    email = PiiFinding("email", 0, 5, 0.9)
    ip = PiiFinding("ip", 6, 14, 0.8)
    card = PiiFinding("card", 15, 31, 0.95)
    assert policy.pii_verdict([]).action == "allow"
    assert policy.pii_verdict([ip]).action == "allow"
    verdict = policy.pii_verdict([email, ip])
    assert (verdict.action, verdict.rule, verdict.redact) == ("redact", "pii.email", (email,))
    blocked = policy.pii_verdict([email, card])
    assert (blocked.action, blocked.rule) == ("block", "pii.card")


def test_the_cache_token_changes_with_any_effective_change() -> None:
    base = GuardPolicy()
    assert base.cache_token == GuardPolicy().cache_token
    assert base.cache_token.startswith("1:")
    changed = [
        base.with_overrides({"pii": {"email": "allow"}}),
        base.with_overrides({"injection": "allow"}),
        base.with_overrides({"max_input_tokens": 10}),
        base.with_overrides({"blocked_output_terms": ["x"]}),
        base.with_overrides({"version": "2"}),
    ]
    assert len({base.cache_token, *(p.cache_token for p in changed)}) == 6
