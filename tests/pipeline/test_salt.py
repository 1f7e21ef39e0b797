"""What a request's salt keys at the model server: the prompt (``cache_salt``) and the grammar
of its JSON schema (``salted_schema``); and what a replica's memos keep its texts by
(``MemoScope``)."""

from __future__ import annotations

import copy
from typing import Any

from pipeline.context import Principal
from pipeline.model.salt import MemoScope, PrefixCacheSalt, salted_schema

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
FORMAT = {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA, "strict": True}}


def test_a_schema_is_keyed_by_the_requests_salt_and_nothing_else_changes() -> None:
    salt = PrefixCacheSalt(b"secret")(Principal("acme", "alice", frozenset({"chat"}), "k"))
    request = {"model": "m", "cache_salt": salt, "response_format": FORMAT, "max_tokens": 5}
    before = copy.deepcopy(request)
    salted = salted_schema(request)
    assert request == before, "the caller's request is not changed"
    schema = salted["response_format"]["json_schema"]["schema"]
    assert schema == {**SCHEMA, "$comment": f"cache salt {salt}"}
    assert {k: v for k, v in salted.items() if k != "response_format"} == {
        k: v for k, v in request.items() if k != "response_format"
    }
    assert salted["response_format"]["json_schema"]["strict"] is True
    other = PrefixCacheSalt(b"secret")(Principal("beta", "alice", frozenset({"chat"}), "k"))
    again = salted_schema({**request, "cache_salt": other})
    assert again["response_format"]["json_schema"]["schema"]["$comment"] != schema["$comment"]


def test_a_callers_own_comment_gives_way_to_the_salt() -> None:
    own = {**SCHEMA, "$comment": "written by the caller"}
    request = {"cache_salt": "s", "response_format": {**FORMAT, "json_schema": {"schema": own}}}
    assert salted_schema(request)["response_format"]["json_schema"]["schema"]["$comment"] == (
        "cache salt s"
    )


def test_a_request_without_a_salt_or_a_schema_goes_as_it_is() -> None:
    for request in (
        {"response_format": FORMAT},  # the salt off: one cache for all, as the prompt's
        {"cache_salt": "s"},
        {"cache_salt": "s", "response_format": {"type": "json_object"}},
        {"cache_salt": "s", "response_format": {"type": "json_schema", "json_schema": None}},
        {"cache_salt": "s", "response_format": {"type": "json_schema", "json_schema": {}}},
        {"cache_salt": "s", "response_format": {**FORMAT, "json_schema": {"schema": True}}},
    ):
        assert salted_schema(request) is request


def test_memos_are_kept_by_tenant_and_by_access_scope_where_lists_decide_what_is_seen() -> None:
    def principal(tenant: str, user: str) -> Principal:
        return Principal(tenant, user, frozenset({"chat"}), "k")

    assert MemoScope()(principal("acme", "alice")) == "acme", "no index: the tenant"
    unlisted = MemoScope(lambda p: ("v1", None))
    assert unlisted(principal("acme", "alice")) == unlisted(principal("acme", "bob")) == "acme"

    def access(p: Principal) -> tuple[str, dict[str, Any] | None]:
        named = p.user if p.user == "carol" else None
        return "v1", {"user": named, "groups": []}

    listed = MemoScope(access)
    carol, dave, erin = (listed(principal("beta", u)) for u in ("carol", "dave", "erin"))
    assert carol != dave == erin, "callers who see the same documents share, no others"
    assert carol.startswith("beta\x1f") and listed(principal("acme", "carol")) != carol
