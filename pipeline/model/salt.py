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
"""

from __future__ import annotations

import hashlib
import hmac

import orjson

from pipeline.context import AccessScope, Principal


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
