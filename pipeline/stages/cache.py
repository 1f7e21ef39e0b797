"""The response cache: an exact-match lookup before the work, a store after it.

The key is the SHA-256 of the canonical JSON of everything that decides the answer: tenant
(and user, when answers are personalised), model or route, normalised messages, sampling
parameters, tools, RAG options, the tenant's index version and the versions of the prompt
layout, the router and the policies. The tenant is in the Redis key name too, so one tenant can
never read another's entry. Redis trouble never fails a request: the cache is skipped and the
span says why.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from typing import Any

import orjson

from pipeline.answer.completion import Completion
from pipeline.context import ChatParams, Principal, RequestContext
from pipeline.errors import StoreUnavailable
from pipeline.model.messages import content_text
from pipeline.model.prompt import PROMPT_VERSION
from pipeline.runner import StageSpec
from pipeline.store.kv import KeyValueStore
from pipeline.telemetry import attributes as attr

IndexVersion = Callable[[str], str]


def _normalise_content(content: Any) -> Any:
    # Text parts read as the model reads them (joined by newlines). No whitespace is dropped:
    # the chat template renders it, so "hi" and "hi " are different prompts, and two requests
    # the model would see differently must never share an answer.
    text = content_text(content)
    return content if text is None else text


def normalise_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages with null fields dropped and text-part lists read as their text."""
    normalised = []
    for message in messages:
        item = {k: v for k, v in message.items() if v is not None}
        item["role"] = str(item.get("role", "")).lower()
        if "content" in item:
            item["content"] = _normalise_content(item["content"])
        normalised.append(item)
    return normalised


def cache_key(
    params: ChatParams,
    principal: Principal,
    index_version: str,
    *,
    personalised: bool = False,
    versions: Mapping[str, str] | None = None,
    parts: Mapping[str, str] | None = None,
) -> str:
    """The SHA-256 of everything that decides the answer, prefixed by the tenant.

    ``personalised``: the answer depends on the user's features, so the user is part of the
    key. ``versions`` are the versions of the prompt layout, the router and the features;
    ``parts`` what earlier stages of this request found decides it (the tenant's guard policy)."""
    rag = params.rag
    material = {
        "versions": {"prompt": PROMPT_VERSION, **(versions or {})},
        "parts": dict(parts or {}),
        "tenant": principal.tenant,
        "user": principal.user if personalised else None,
        "model": params.model,
        "messages": normalise_messages(params.messages),
        "sampling": params.sampling,
        "tools": params.tools,
        "tool_choice": params.tool_choice,
        "rag": {
            "enabled": rag.enabled,
            "top_k": rag.top_k,
            "filters": rag.filters,
            "route": rag.route,
            "tools": sorted(rag.tools),
            "plan_tools": rag.plan_tools,
            "compress": rag.compress,
            "budget_tokens": rag.budget_tokens,
            "min_relevance": rag.min_relevance,
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

    async def put(self, key: str, completion: Completion, *, ttl: int | None = None) -> None:
        lifetime = self.ttl if ttl is None else min(ttl, self.ttl)
        await self.kv.set(self.prefix + key, orjson.dumps(completion.to_dict()), ttl=lifetime)


def no_index(tenant: str) -> str:
    return "none"


class CacheLookup:
    # Fatal, but it never raises for Redis: it fails open by itself.
    # A hit answers (``respond``): it writes the completion and its stream.
    spec = StageSpec.of(
        "cache_lookup",
        reads={"principal", "params", "cache_control"},
        optional={"key_parts"},
        writes={"cache_key", "cache_status", "completion", "answer"},
    )

    def __init__(
        self,
        cache: ResponseCache,
        index_version: IndexVersion = no_index,
        *,
        personalised: bool = False,
        versions: Mapping[str, str] | None = None,
    ) -> None:
        self.cache = cache
        self.index_version = index_version
        self.personalised = personalised
        self.versions = dict(versions or {})

    async def __call__(self, ctx: RequestContext) -> RequestContext:
        principal = ctx.caller
        ctx.cache_key = cache_key(
            ctx.params,
            principal,
            self.index_version(principal.tenant),
            personalised=self.personalised,
            versions=self.versions,
            parts=ctx.key_parts,
        )
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
    """Stores the answer when its stream ends normally, as it came out of the output filters.

    Only complete answers (``stop`` or ``length``) are stored, for the cache's TTL or the
    shorter one of a time-dependent tool the answer used (0: not at all), and only when no
    degrading stage failed on the way (an answer made with defaults is not the one its key
    stands for)."""

    spec = StageSpec.of("cache_store", reads={"cache_key", "answer", "cache_control"})

    def __init__(self, cache: ResponseCache) -> None:
        self.cache = cache

    async def __call__(self, ctx: RequestContext) -> RequestContext:
        key = ctx.cache_key
        if ctx.cache_control.no_store or key is None or ctx.answer is None:
            ctx.annotate(**{attr.CACHE_STORED: False})
            return ctx

        async def store(completion: Completion) -> None:
            degraded = [r.name for r in ctx.records if r.status == "degraded"]
            if degraded:
                # Made with defaults in place of what failed (features, tools, the route):
                # not the answer this key stands for, so it is not kept.
                return
            await self._store(key, completion)

        ctx.answer.on_complete(store)
        ctx.annotate(**{attr.CACHE_STORED: "when_complete"})
        return ctx

    async def _store(self, key: str, completion: Completion) -> bool:
        if completion.finish_reason not in ("stop", "length") or completion.cache_ttl == 0:
            return False
        try:
            await self.cache.put(key, completion, ttl=completion.cache_ttl)
        except StoreUnavailable:
            return False
        return True
