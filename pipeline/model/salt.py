"""Salts for the model server's prefix cache, so that no caller can learn another tenant's
prompts from how fast its own are answered.

vLLM keeps the KV cache of the prompts it has seen and reuses it for any later prompt that
starts the same way: such a prompt's first token comes several times sooner. Shared by every
caller, that is a timing oracle: a hostile review (2026-12-05) had tenant A send tenant B's
prompt template with guessed secrets in it, and the right guess answered in 0.15 s against
1.5 s for the others. vLLM's ``cache_salt`` keys the cache by a string as well: requests with
different salts share no cached block.

A salt is the tenant's and the key's groups' (the groups decide which documents' text may be in
a prompt: ``retrieval.access``), as an HMAC with the deployment's secret
(``RAG_LLM__PREFIX_CACHE_SECRET``), so it cannot be guessed from the names by anyone who can
reach the model server itself. Callers of one tenant with the same groups still share the
cache: a second question over the same sources reuses their KV (``pipeline.model.prompt``).
"""

from __future__ import annotations

import hashlib
import hmac
from functools import lru_cache

from pipeline.context import Principal


class PrefixCacheSalt:
    def __init__(self, secret: bytes = b"") -> None:
        self._secret = secret

    def __call__(self, principal: Principal) -> str:
        return self._salt(principal.tenant, principal.groups)

    @lru_cache(maxsize=4096)  # noqa: B019 (one per process, made at start-up)
    def _salt(self, tenant: str, groups: frozenset[str]) -> str:
        scope = "\n".join([tenant, *sorted(groups)]).encode()
        return hmac.new(self._secret, scope, hashlib.sha256).hexdigest()
