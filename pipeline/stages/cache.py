"""The response cache: an exact-match lookup before the work, a store after it.

The key is the SHA-256 of the canonical JSON of everything that decides the answer: tenant
(and user, when answers are personalised), model or route, normalised messages, sampling
parameters, tools, RAG options, the tenant's index version and the versions of the prompt
layout, the router and the policies; and the caller's access scope, so an answer built from a
document with an access list is never served to a user it does not admit (see ``cache_key``).
The tenant is in the Redis key name too, so one tenant can never read another's entry. Redis
trouble never fails a request: the cache is skipped and the span says why.
"""

from __future__ import annotations

import hashlib
import logging
import re
from collections.abc import Callable, Mapping
from typing import Any

import orjson

from pipeline.answer.completion import Completion, UnreadableCompletion
from pipeline.context import AccessScope, ChatParams, Principal, RequestContext
from pipeline.errors import StoreBusy, StoreUnavailable
from pipeline.model.messages import content_text
from pipeline.model.prompt import PROMPT_VERSION
from pipeline.runner import StageSpec
from pipeline.store.kv import KeyValueStore
from pipeline.telemetry import attributes as attr

log = logging.getLogger(__name__)

IndexVersion = Callable[[str], str]

# The most copies one entry keeps (the fast path's aliases: one per distinct body that got it):
# past it, a request of another body takes the full path. It bounds what replacing an entry
# deletes in one script.
MAX_COPIES = 256
# KEYS: the entry, its copies' set, the tenant's erasure mark, the tenant's entries (a sorted
# set of their digests, each scored by when its entry expires, in ms). ARGV: the answer, its TTL
# in seconds, the index version it was made from, the entry's digest, PRUNE_STEP.
#
# The answer replaces the entry and its copies go with it, together: a copy deleted apart could
# outlive a failed delete, unnamed, and answer the replaced answer for its TTL. (The copies are
# keys the script is not given: on Redis Cluster they need the entry's hash slot,
# docs/scaling.md.) Nothing is stored, -1, when a delete has erased the version: its number (the
# digits it starts with) is below the mark (``ResponseCache.erase``).
#
# The tenant's entries are what an erasure reads, instead of the whole keyspace: each put names
# its entry there and drops up to PRUNE_STEP names whose entries have expired, so the set holds
# about the tenant's live entries while puts go on, and it goes itself when they stop (it lasts
# as long as its longest-lived entry).
_PUT = """
local mark = tonumber(redis.call('GET', KEYS[3]) or '')
local made = tonumber(string.match(ARGV[3], '^%d+') or '')
if mark and made and made < mark then return -1 end
redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[2])
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
local life = tonumber(ARGV[2]) * 1000
local gone = redis.call('ZRANGEBYSCORE', KEYS[4], '-inf', '(' .. now, 'LIMIT', 0, tonumber(ARGV[5]))
if #gone > 0 then redis.call('ZREM', KEYS[4], unpack(gone)) end
redis.call('ZADD', KEYS[4], now + life, ARGV[4])
if redis.call('PTTL', KEYS[4]) < life then redis.call('PEXPIRE', KEYS[4], life) end
local copies = redis.call('SMEMBERS', KEYS[2])
for _, copy in ipairs(copies) do redis.call('DEL', copy) end
if #copies > 0 then redis.call('DEL', KEYS[2]) end
return #copies
"""
# KEYS: the entry, the copy, the entry's copies' set. ARGV: MAX_COPIES. A copy with the entry's
# TTL, named in the set; 0 and nothing when there is no entry or the set is full.
_COPY = """
local ttl = redis.call('PTTL', KEYS[1])
if ttl < 0 then return 0 end
if redis.call('SISMEMBER', KEYS[3], KEYS[2]) == 0
  and redis.call('SCARD', KEYS[3]) >= tonumber(ARGV[1]) then
  return 0
end
redis.call('COPY', KEYS[1], KEYS[2], 'REPLACE')
redis.call('SADD', KEYS[3], KEYS[2])
redis.call('PEXPIRE', KEYS[3], ttl)
return 1
"""
# KEYS: the tenant's erasure mark. ARGV: how long it lasts (seconds), the number of the index
# version a delete published: versions numbered below it are erased (a mark never goes down).
_ERASE_BELOW = """
local mark = tonumber(redis.call('GET', KEYS[1]) or '')
local below = tonumber(ARGV[2])
if mark and mark > below then below = mark end
redis.call('SET', KEYS[1], string.format('%d', below), 'EX', ARGV[1])
return below
"""
# KEYS: the tenant's entries (as ``_PUT`` names them), the name a sweep takes them under (one
# per tenant). What the tenant had named when the sweep began, renamed: answers stored later are
# named anew, and the sweep ends however fast they come. Nothing is renamed while names are
# still there from a sweep that failed part way, or one another replica is running: those are
# swept first, then the take is made again. {renamed: 1 or 0, how many names are to sweep}.
_TAKE = """
if redis.call('EXISTS', KEYS[2]) == 1 then return {0, redis.call('ZCARD', KEYS[2])} end
if redis.call('EXISTS', KEYS[1]) == 0 then return {1, 0} end
redis.call('RENAME', KEYS[1], KEYS[2])
return {1, redis.call('ZCARD', KEYS[2])}
"""
# KEYS: the names a sweep took (``_TAKE``). ARGV: the prefix of the entries' names (the
# tenant's), how many to drop. The first entries named there go, each with its copies and their
# set together (as ``_PUT`` replaces them), so that no copy outlives its entry, and their names
# with them. How many of them were still stored, and how many names are left. (The entries are
# keys the script is not given: on a Redis Cluster they share the set's hash slot, as the copies
# share their entry's.)
_DROP = """
local names = redis.call('ZRANGE', KEYS[1], 0, tonumber(ARGV[2]) - 1)
local dropped = 0
for _, name in ipairs(names) do
  local entry = ARGV[1] .. name
  for _, copy in ipairs(redis.call('SMEMBERS', entry .. ':copies')) do redis.call('DEL', copy) end
  dropped = dropped + redis.call('DEL', entry)
  redis.call('DEL', entry .. ':copies')
end
if #names > 0 then redis.call('ZREM', KEYS[1], unpack(names)) end
return {dropped, redis.call('ZCARD', KEYS[1])}
"""
# Entries dropped by one script: with their copies (at most MAX_COPIES each) a few thousand
# deletes, a few milliseconds of Redis's time.
DROP_BATCH = 32
# Expired names a put drops from its tenant's entries: more than the one it adds, so the set
# shrinks to the live entries while puts go on, and a put never pays for a long backlog at once.
PRUNE_STEP = 8
# The least time a delete's mark lasts: longer than any request that searched a version below
# it may take to store its answer (a replica still keyed on one, a long generation).
ERASED_AT_LEAST_S = 3600
# The number an index version starts with: both backends number versions in the order they are
# published (the embedded store's "00000012-3fa9c1", a Milvus tenant's counter "12").
_VERSION_NUMBER = re.compile(r"\d+")


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
    access: Mapping[str, Any] | None = None,
    tag: Callable[[str], str] | None = None,
) -> str:
    """The SHA-256 of everything that decides the answer, prefixed by the tenant (``tag``ged:
    ``KeyValueStore.tag``, a hash tag on a Redis Cluster, where a tenant's entries, their
    aliases and flights are one slot, so that one script may use an entry and its aliases).

    ``personalised``: the answer depends on the user's features, so the user is part of the
    key. ``versions`` are the versions of the prompt layout, the router and the features;
    ``parts`` what earlier stages of this request found decides it (the tenant's guard policy).

    ``access`` is the caller's access scope in the tenant's index (``AccessColumns.scope``),
    what decides which chunks its retrieval may see, and nothing more: None while the index
    has no access list (every user of the tenant shares entries, as before); else the caller's
    groups that some access list names, sorted (groups no list names change nothing), and the
    user only when some list names that user. So two callers share an entry exactly when they
    see the same chunks, and an answer built from a restricted document is never served to a
    caller who may not see it. The index version is in the key too: changing an access list
    (a re-ingest) publishes a new version, so no entry made under the old list is found.
    While a replica has not loaded the index's published snapshot, ``access`` is the whole
    viewer (``retrieval.access.whole_viewer``): finer than any scope, so that request's answer
    is keyed apart, never shared wider."""
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
        "access": dict(access) if access is not None else None,
    }
    digest = hashlib.sha256(orjson.dumps(material, option=orjson.OPT_SORT_KEYS)).hexdigest()
    return f"{tag(principal.tenant) if tag else principal.tenant}:{digest}"


class ResponseCache:
    """Complete answers in Redis, under ``{prefix}{tenant}:{sha256}``, with a TTL.

    An entry may have copies under other names (``copy``: the fast path's aliases, under
    ``alias_prefix``), listed in ``{entry}:copies``: an answer stored under the entry's key (a
    ``Cache-Control: no-cache`` refresh, or two misses racing) deletes them, so that no copy
    serves the answer it replaced.

    A delete of documents erases the tenant's cached answers (``erase``), and no answer made
    from an index version before the one it published is stored after it.
    """

    def __init__(self, kv: KeyValueStore, *, ttl: int = 3600, prefix: str = "rag:cache:") -> None:
        self.kv = kv
        self.ttl = ttl
        self.prefix = prefix
        self._base = prefix.rstrip(":")  # the names of the copies and marks start alike
        self.alias_prefix = f"{self._base}-alias:"
        self._put = kv.script(_PUT)
        self._copy = kv.script(_COPY)
        # Recorded even with Redis out of memory: it is small, and it is what keeps a deleted
        # document out of answers stored later.
        self._erase_below = kv.script(_ERASE_BELOW, when_full="run")
        self._take = kv.script(_TAKE)
        self._drop = kv.script(_DROP)

    def _tenants(self, kind: str, tag: str) -> str:
        """The name of a tenant's ``kind`` of cache record: its erasure mark ("erased"), the
        names of its entries ("entries"), those a sweep took ("erasing")."""
        return f"{self._base}-{kind}:{tag}"

    async def get(self, key: str) -> Completion | None:
        """The stored answer; None where there is none, or where what is stored cannot be read
        (another version's entry, or a damaged one): a miss, whose answer then replaces it."""
        raw = await self.kv.get(self.prefix + key)
        if raw is None:
            return None
        try:
            return Completion.from_stored(raw)
        except UnreadableCompletion as exc:
            log.warning("a cached answer cannot be read (%s): taken as a miss", exc)
            return None

    async def put(
        self, key: str, completion: Completion, *, ttl: int | None = None, version: str = ""
    ) -> bool:
        """Store the answer under ``key`` and delete the copies of the one it replaces; False,
        and nothing stored, when the index ``version`` it was made from has been erased."""
        lifetime = self.ttl if ttl is None else min(ttl, self.ttl)
        entry = self.prefix + key
        answer = orjson.dumps(completion.to_dict())
        tag, _, digest = key.rpartition(":")  # the key's tenant part (tagged), its digest
        tenants = [self._tenants("erased", tag), self._tenants("entries", tag)]
        keys = [entry, entry + ":copies", *tenants]
        done = await self.kv.run_script(
            "cache_put", self._put, keys, [answer, lifetime, version, digest, PRUNE_STEP]
        )
        return bool(done != -1)

    async def erase(self, tenant: str, version: str) -> int:
        """Delete every cached answer of ``tenant`` and their copies (how many answers), after
        marking every index version numbered below ``version`` (the one a delete published)
        erased: from then on, for at least the cache's TTL, no answer made from one is stored
        (a request that searched one before the delete, ending after it). A version that
        starts with no number marks nothing.

        The tenant's other answers go too (one miss each), since an entry's key does not say
        which version made it. Marked first, then swept: an answer stored meanwhile is refused,
        swept, or made from the version the delete published. The sweep reads the entries the
        tenant's puts named, so it costs the tenant's answers, not the keyspace's (a walk of
        every key cost about a second per million keys: ``bench.cache_erase``)."""
        tag = self.kv.tag(tenant)
        number = _VERSION_NUMBER.match(version)
        if number is not None:
            lifetime = max(self.ttl, ERASED_AT_LEAST_S)
            mark = [self._tenants("erased", tag)]
            await self.kv.run_script(
                "cache_erase_below", self._erase_below, mark, [lifetime, int(number.group())]
            )
        # What the tenant's puts have named so far, taken under the sweep's name: answers
        # stored from then on were made from the new version (or refused), and are left. One
        # name per tenant: what a sweep that failed part way left (or one still running on
        # another replica has yet to drop) is swept first, so a later erasure finishes it.
        taken = self._tenants("erasing", tag)
        keys = [self._tenants("entries", tag), taken]
        dropped, prefix, took = 0, f"{self.prefix}{tag}:", 0
        while not took:
            reply = await self.kv.run_script("cache_take", self._take, keys, [])
            took, left = int(reply[0]), int(reply[1])
            while left:
                found = await self.kv.run_script(
                    "cache_drop", self._drop, [taken], [prefix, DROP_BATCH]
                )
                dropped, left = dropped + int(found[0]), int(found[1])
        return dropped

    async def copy(self, key: str, name: str) -> bool:
        """Copy the entry under ``key`` to ``name``, with its TTL, until an answer replaces it
        (see the class docstring); False when there is no entry, or it has ``MAX_COPIES``."""
        entry = self.prefix + key
        done = await self.kv.run_script(
            "cache_copy", self._copy, [entry, name, entry + ":copies"], [MAX_COPIES]
        )
        return bool(done)


def keyed_version(ctx: RequestContext) -> str | None:
    """The index version the request's cache key holds (None: no lookup ran)."""
    for record in ctx.records:
        if record.name == "cache_lookup":
            version = record.info.get(attr.info_key(attr.CACHE_INDEX_VERSION))
            return None if version is None else str(version)
    return None


def searched_the_keyed_version(ctx: RequestContext) -> bool:
    """Whether every search of the request (the retrieve stage's, if it ran, and each
    ``search_documents`` call, in ``ctx.index_versions``) searched the index version the cache
    key holds: a tool searches whatever index is current when it runs, which an ingest may
    have replaced since the lookup."""
    keyed = keyed_version(ctx)
    if keyed is None:
        return True
    searched = set(ctx.index_versions)
    info = {record.name: record.info for record in ctx.records}
    retrieved = info.get("retrieve", {}).get(attr.info_key(attr.RETRIEVAL_INDEX_VERSION))
    if retrieved is not None:
        searched.add(retrieved)
    return searched <= {keyed}


def degraded(ctx: RequestContext) -> list[str]:
    """The stages that degraded on this request, sorted: they ran past their budget or failed,
    and the answer is made with their defaults."""
    return sorted({r.name for r in ctx.records if r.status == "degraded"})


def not_kept(ctx: RequestContext, *, count_degraded: bool = True) -> str | None:
    """Why the cache store will not keep this request's answer, as far as is known before the
    answer ends (None: it will, if ``storable``); see ``CacheStore``. ``count_degraded=False``
    leaves degraded stages out of the reasons (request coalescing shares such answers among
    requests degraded alike: see ``unshareable``)."""
    stages = degraded(ctx) if count_degraded else []
    if stages:
        # Made with defaults in place of what failed (features, tools, the route): not the
        # answer this key stands for.
        return f"degraded: {', '.join(stages)}"
    if not searched_the_keyed_version(ctx):
        return "another index version was searched"
    if any(run.cache_ttl == 0 for run in ctx.tool_runs):
        return "a time-dependent tool ran"
    return None


def storable(completion: Completion) -> bool:
    """Whether a finished answer may be cached: complete, and not made with a tool whose
    result changes with time."""
    return completion.finish_reason in ("stop", "length") and completion.cache_ttl != 0


def unshareable(ctx: RequestContext) -> str | None:
    """Why identical concurrent requests may not share this request's answer (request
    coalescing, ``pipeline.store.singleflight``), or None: they share exactly what the cache
    would serve them a moment later (a looked-up miss that may be stored), and the key
    decides who may share. Requests offering client tools do not coalesce either: their
    answers are often tool calls, which are never stored, and followers would wait for the
    leader only to generate alone.

    A request made after a degraded stage may share too, though the cache will not keep its
    answer: a burst that makes the router or the feature lookup run late is when coalescing
    matters most. It shares only with requests degraded in the same stages (``degraded``:
    the same defaults, so the answer each would have made alone), or follows a flight of its
    key under way without them, in this process or on another replica (the answer the cache
    would serve it a moment later); it never leads that flight."""
    if ctx.cache_key is None or ctx.cache_status != "miss":
        return f"cache {ctx.cache_status}"  # bypass (no-cache) or error (Redis)
    if ctx.cache_control.no_store:
        return "no-store"
    if ctx.params.tools:
        return "client tools"
    return not_kept(ctx, count_degraded=False)


def no_index(tenant: str) -> str:
    return "none"


class CacheLookup:
    # Fatal, but it never raises for Redis down: it fails open by itself. A full Redis pool
    # (StoreBusy: this process is overloaded) sheds the request instead.
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
        access_scope: AccessScope | None = None,
    ) -> None:
        self.cache = cache
        self.index_version = index_version
        self.personalised = personalised
        self.versions = dict(versions or {})
        self.access_scope = access_scope

    async def __call__(self, ctx: RequestContext) -> RequestContext:
        principal = ctx.caller
        if self.access_scope is not None:
            version, access = self.access_scope(principal)
        else:
            version, access = self.index_version(principal.tenant), None
        ctx.cache_key = cache_key(
            ctx.params,
            principal,
            version,
            personalised=self.personalised,
            versions=self.versions,
            parts=ctx.key_parts,
            access=access,
            tag=self.cache.kv.tag,
        )
        ctx.annotate(**{attr.CACHE_INDEX_VERSION: version})
        if ctx.cache_control.no_cache:
            ctx.cache_status = "bypass"
        else:
            try:
                hit = await self.cache.get(ctx.cache_key)
            except StoreBusy:
                # The process is overloaded: shed the request (503, Retry-After) rather than
                # fail open into a whole generation that a hit would have spared.
                raise
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
    stands for), and only when every search of the request (the retrieval, and each
    ``search_documents`` call of the tools stage or the generation loop) searched the index
    version the key was made with: an index published in between (a re-ingest that changed an
    access list) may let this caller's searches see what the key's other holders may not."""

    spec = StageSpec.of(
        "cache_store",
        reads={"cache_key", "answer", "cache_control"},
        optional={"index_versions", "tool_runs"},  # read when the answer completes
    )

    def __init__(self, cache: ResponseCache) -> None:
        self.cache = cache

    async def __call__(self, ctx: RequestContext) -> RequestContext:
        key = ctx.cache_key
        if ctx.cache_control.no_store or key is None or ctx.answer is None:
            ctx.annotate(**{attr.CACHE_STORED: False})
            return ctx

        async def store(completion: Completion) -> None:
            if not_kept(ctx) is None:
                await self._store(key, completion, keyed_version(ctx) or "")

        ctx.answer.on_complete(store)
        ctx.annotate(**{attr.CACHE_STORED: "when_complete"})
        return ctx

    async def _store(self, key: str, completion: Completion, version: str) -> bool:
        """Whether the answer was stored: not when it may not be (``storable``), when Redis is
        down, or when a delete has erased the version it was made from."""
        if not storable(completion):
            return False
        try:
            return await self.cache.put(key, completion, ttl=completion.cache_ttl, version=version)
        except StoreUnavailable:
            return False
