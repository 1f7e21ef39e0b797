"""The response-cache key: everything that decides the answer, and nothing else."""

from __future__ import annotations

from dataclasses import replace

from pipeline.context import ChatParams, Principal, RagOptions
from pipeline.stages.cache import cache_key

ALICE = Principal(tenant="acme", user="alice", scopes=frozenset({"chat"}), key_id="k1")
PARAMS = ChatParams(
    model="smollm2",
    messages=[{"role": "user", "content": "Hello there"}],
    sampling={"temperature": 0.0, "max_tokens": 16},
)


def key(params: ChatParams = PARAMS, principal: Principal = ALICE, version: str = "v1") -> str:
    return cache_key(params, principal, version)


def test_key_is_stable_and_starts_with_the_tenant() -> None:
    assert key() == key()
    assert key().startswith("acme:")


def test_other_tenant_gets_another_key() -> None:
    other = replace(ALICE, tenant="globex")
    assert key(principal=other) != key()
    assert key(principal=other).startswith("globex:")


def test_same_tenant_other_user_shares_the_key_when_answers_are_not_personalised() -> None:
    assert key(principal=replace(ALICE, user="bob", key_id="k2")) == key()


def test_personalised_answers_put_the_user_in_the_key() -> None:
    def personal(principal: Principal) -> str:
        return cache_key(PARAMS, principal, "v1", personalised=True)

    bob = replace(ALICE, user="bob", key_id="k2")
    assert personal(bob) != personal(ALICE)
    assert personal(ALICE) == personal(replace(ALICE, key_id="k3"))  # another key of alice's
    assert personal(ALICE) != key()
    assert personal(ALICE).startswith("acme:")


def test_the_feature_set_version_is_part_of_the_key() -> None:
    def versioned(version: str) -> str:
        return cache_key(PARAMS, ALICE, "v1", personalised=True, versions={"features": version})

    assert versioned("1") == versioned("1")
    assert versioned("2") != versioned("1")


def test_everything_that_decides_the_answer_changes_the_key() -> None:
    variants = [
        replace(PARAMS, model="other"),
        replace(PARAMS, messages=[{"role": "user", "content": "Hello, there"}]),
        replace(PARAMS, messages=[{"role": "system", "content": "Hello there"}]),
        # Edge whitespace is rendered by the chat template: another prompt, another key.
        replace(PARAMS, messages=[{"role": "user", "content": "  Hello there\n"}]),
        replace(PARAMS, sampling={"temperature": 0.5, "max_tokens": 16}),
        replace(PARAMS, sampling={"temperature": 0.0, "max_tokens": 17}),
        replace(PARAMS, rag=RagOptions(top_k=9)),
        replace(PARAMS, rag=RagOptions(filters={"topic": "x"})),
        replace(PARAMS, rag=RagOptions(enabled=False)),
    ]
    keys = {key(v) for v in variants}
    assert len(keys) == len(variants) and key() not in keys
    assert key(version="v2") != key()


def test_what_does_not_decide_the_answer_keeps_the_key() -> None:
    same = [
        replace(PARAMS, stream=True, include_usage=True),
        replace(PARAMS, rag=RagOptions(explain=True)),
        replace(
            PARAMS,
            messages=[{"role": "user", "content": [{"type": "text", "text": "Hello there"}]}],
        ),
        replace(PARAMS, sampling={"max_tokens": 16, "temperature": 0.0}),
    ]
    assert {key(v) for v in same} == {key()}


def test_inner_whitespace_is_kept_because_it_can_matter() -> None:
    spaced = replace(PARAMS, messages=[{"role": "user", "content": "Hello    there"}])
    assert key(spaced) != key()
