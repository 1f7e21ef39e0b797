"""The response cache: an exact-match lookup before the work, a store after it.

The key is the SHA-256 of the canonical JSON of everything that decides the answer: tenant,
model, normalised messages, sampling parameters, RAG options, the tenant's index version and
the prompt version. The tenant is in the Redis key name too, so one tenant can never read
another's entry. Redis trouble never fails a request: the cache is skipped and the span says why.
"""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator, Callable
from typing import Any

import orjson

from pipeline import attributes as attr
from pipeline.context import ChatParams, Completion, Principal, RequestContext
from pipeline.kv import KeyValueStore, StoreUnavailable
from pipeline.prompt import PROMPT_VERSION

IndexVersion = Callable[[str], str]


def _normalise_content(content: Any) -> Any:
    # Only edge whitespace is dropped: inner whitespace can matter (code, tables).
    if isinstance(content, str):
        return content.strip()
    if isinstance(content, list):
        texts = [p.get("text") for p in content if isinstance(p, dict) and p.get("type") == "text"]
        if len(texts) == len(content):
            return "".join(str(t) for t in texts).strip()
    return content


def normalise_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages with edge whitespace, null fields and text-part lists made canonical."""
    normalised = []
    for message in messages:
        item = {k: v for k, v in message.items() if v is not None}
        item["role"] = str(item.get("role", "")).lower()
        if "content" in item:
            item["content"] = _normalise_content(item["content"])
        normalised.append(item)
    return normalised


def cache_key(params: ChatParams, principal: Principal, index_version: str) -> str:
    material = {
        "prompt_version": PROMPT_VERSION,
        "tenant": principal.tenant,
        "model": params.model,
        "messages": normalise_messages(params.messages),
        "sampling": params.sampling,
        "rag": {
            "enabled": params.rag.enabled,
            "top_k": params.rag.top_k,
            "filters": params.rag.filters,
        },
        "index_version": index_version,
    }
    digest = hashlib.sha256(orjson.dumps(material, option=orjson.OPT_SORT_KEYS)).hexdigest()
    return f"{principal.tenant}:{digest}"


class ResponseCache:
    """Complete answers in Redis, under ``{prefix}{tenant}:{sha256}``, with a TTL."""

    def __init__(self, kv: KeyValueStore, *, ttl: int = 3600, prefix: str = "rag:cache:") -> None:
        self.kv = kv
        self.ttl = ttl
        self.prefix = prefix

    async def get(self, key: str) -> Completion | None:
        raw = await self.kv.get(self.prefix + key)
        return None if raw is None else Completion.from_dict(orjson.loads(raw))

    async def put(self, key: str, completion: Completion) -> None:
        await self.kv.set(self.prefix + key, orjson.dumps(completion.to_dict()), ttl=self.ttl)


def no_index(tenant: str) -> str:
    return "none"


class CacheLookup:
    name = "cache_lookup"

    def __init__(self, cache: ResponseCache, index_version: IndexVersion = no_index) -> None:
        self.cache = cache
        self.index_version = index_version

    async def __call__(self, ctx: RequestContext) -> RequestContext:
        assert ctx.principal is not None, "auth runs before the cache"
        version = self.index_version(ctx.principal.tenant)
        ctx.cache_key = cache_key(ctx.params, ctx.principal, version)
        if ctx.cache_control.no_cache:
            ctx.cache_status = "bypass"
        else:
            try:
                hit = await self.cache.get(ctx.cache_key)
            except StoreUnavailable as exc:
                ctx.cache_status = "error"
                ctx.annotate(**{attr.CACHE_ERROR: str(exc)})
            else:
                ctx.cache_status = "miss" if hit is None else "hit"
                if hit is not None:
                    ctx.respond(hit)
        ctx.annotate(**{attr.CACHE_STATUS: ctx.cache_status})
        return ctx


class CacheStore:
    """Stores the answer once it is complete; a streamed answer is stored when its stream ends."""

    name = "cache_store"

    def __init__(self, cache: ResponseCache) -> None:
        self.cache = cache

    async def __call__(self, ctx: RequestContext) -> RequestContext:
        if ctx.cache_control.no_store or ctx.cache_key is None:
            ctx.annotate(**{attr.CACHE_STORED: False})
            return ctx
        if ctx.stream is not None:
            ctx.stream = self._store_when_done(ctx, ctx.stream)
            ctx.annotate(**{attr.CACHE_STORED: "after_stream"})
        else:
            ctx.annotate(**{attr.CACHE_STORED: await self._store(ctx)})
        return ctx

    async def _store_when_done(
        self, ctx: RequestContext, inner: AsyncIterator[str]
    ) -> AsyncIterator[str]:
        async for piece in inner:
            yield piece
        await self._store(ctx)

    async def _store(self, ctx: RequestContext) -> bool:
        completion = ctx.completion
        if ctx.cache_key is None or completion is None:
            return False
        if completion.finish_reason not in ("stop", "length"):
            return False
        try:
            await self.cache.put(ctx.cache_key, completion)
        except StoreUnavailable:
            return False
        return True
