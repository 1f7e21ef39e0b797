"""Salts for the model server's prefix cache, so that no caller can learn from how fast its own
prompts are answered what another caller, who may see what it may not, has sent.

vLLM keeps the KV cache of the prompts it has seen and reuses it for any later prompt that
starts the same way: such a prompt's first token comes several times sooner. Shared by every
caller, that is a timing oracle: a hostile review (2026-12-05) had tenant A send tenant B's
prompt template with guessed secrets in it, and the right guess answered in 0.15 s against
1.5 s for the others. vLLM's ``cache_salt`` keys the cache by a string as well: requests with
different salts share no cached block.

A salt is the tenant's and the caller's access scope in the tenant's index (``access``: the
groups some access list names, and the user where a list names that user;
``retrieval.access.AccessIndex.scope``), the scope the response cache keys by: two callers with
equal scopes may see exactly the same documents, so a prompt of one holds nothing the other may
not read. A review of the first version, salted by the key's groups only, found a document
listed for one user timed by another user of its tenant. Where the service has no index, the
key's groups stand for the scope. The salt is an HMAC with the deployment's secret
(``RAG_LLM__PREFIX_CACHE_SECRET``), so it cannot be guessed from the names by anyone who can
reach the model server itself.

Users of one tenant with the same scope still share the cache (a second question over the same
sources reuses their KV: ``pipeline.model.prompt``), so one of them can tell by timing whether
another sent a given text: within a scope, prompts are not secret from each other.

The model server keeps a second cache keyed by what callers send: the grammar it compiles from
each JSON schema (``response_format``; xgrammar's cache, keyed by the schema's text), 6 ms for
an invoice schema of four fields against 0.02 ms once kept. ``salted_schema`` puts the request's
salt in the schema's ``$comment``, which constrains nothing, so no caller's schema compiles
sooner for another tenant's or scope's having sent it.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Any

import orjson

from pipeline.context import AccessScope, Principal
from retrieval.access import Viewer, whole_viewer


class MemoScope:
    """The name under which a replica's memos keep what a request's texts gave (each passage's
    analysis, each word's stem and token count, the input guard's verdicts): the request's
    tenant, and where the tenant's index has access lists, the caller's access scope in it, as
    the prompt's salt. A request never finds what a request of another tenant, or of a caller
    who may see documents it may not, left: its texts would be handled sooner for it, and by
    timing its own requests (``rag.explain`` gives each stage's time) a caller could learn
    whether the other's passages or prompts hold a text it guesses. Tenant names hold none of
    the separator (``[A-Za-z0-9_.-]``).

    Where the access scope cannot be read (the tenant's snapshot is damaged, its backend does
    not answer), the scope is the caller's own user and groups: finer than its access scope,
    so still safe, and the request goes on to whatever it would have met without memos (a
    request with retrieval off is answered; a review found these failing as a 500). On Milvus
    the access scope is always the whole viewer, so there every user keeps memos of its own."""

    def __init__(self, access_scope: AccessScope | None = None) -> None:
        self._access_scope = access_scope

    def __call__(self, principal: Principal) -> str:
        if self._access_scope is None:
            return principal.tenant
        try:
            access = self._access_scope(principal)[1]
        except Exception:  # a memo's key never fails a request: the finest one instead
            access = whole_viewer(Viewer(principal.user, principal.groups))
        if access is None:  # no access lists: every caller of the tenant sees the same
            return principal.tenant
        return f"{principal.tenant}\x1f{orjson.dumps(access, option=orjson.OPT_SORT_KEYS).decode()}"


class PrefixCacheSalt:
    def __init__(self, secret: bytes = b"", access_scope: AccessScope | None = None) -> None:
        self._secret = secret
        self._access_scope = access_scope

    def __call__(self, principal: Principal) -> str:
        scope: object
        if self._access_scope is not None:
            scope = self._access_scope(principal)[1]
        else:
            scope = {"groups": sorted(principal.groups)}
        material = orjson.dumps([principal.tenant, scope], option=orjson.OPT_SORT_KEYS)
        return hmac.new(self._secret, material, hashlib.sha256).hexdigest()


def salted_schema(request: dict[str, Any]) -> dict[str, Any]:
    """``request`` with the JSON schema of its ``response_format`` keyed by its ``cache_salt``
    (the schema's ``$comment``, which JSON Schema leaves to its readers: the answer is held to
    the same constraints); ``request`` itself where it has no salt or no schema."""
    salt = request.get("cache_salt")
    response_format = request.get("response_format")
    if not isinstance(salt, str) or not isinstance(response_format, dict):
        return request
    json_schema = response_format.get("json_schema")
    if not isinstance(json_schema, dict) or not isinstance(json_schema.get("schema"), dict):
        return request
    schema = {**json_schema["schema"], "$comment": f"cache salt {salt}"}
    return {
        **request,
        "response_format": {**response_format, "json_schema": {**json_schema, "schema": schema}},
    }
