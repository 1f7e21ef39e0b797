"""API keys: stored hashed in Redis, resolved to a principal, never logged.

Redis holds, under the SHA-256 of the whole key, the tenant, user, scopes, a key id and the
hash itself; the lookup is by hash, and the stored hash is compared to the computed one with
``hmac.compare_digest``. The raw key is printed once at creation and kept nowhere, not even in
part: the key id is random (``key_`` + 96 random bits), never cut from the key's text, so two
keys cannot share an id and a job, a log line or the id index (``id:{key id}`` -> hash, which
lets a queued job ask whether its key still exists) reveals nothing of the key. A set per
tenant (``tenant:{tenant}``: the hashes of its keys, kept by create and revoke) is what
``rag keys list`` reads, so a listing costs the tenant's keys, not every key in Redis.

Records written before ids were random carry an id cut from the key (the text before its first
"."). They keep working: ``resolve`` gives such a record a random id the first time it sees it,
and leaves the old id index in place for ``legacy_id_grace`` seconds so that jobs queued under
the old id still pass their re-check; then it expires.

Resolved principals are kept in-process for ``cache_ttl`` seconds, and while Redis is down a
principal seen within ``stale_ttl`` is still accepted, so an outage of Redis does not lock out
callers who were just served.

Revoking a key, or changing its limits, reaches every replica at once: the change is published
on ``{prefix}changed`` (the key's hash), and each process's ``listen`` task drops that entry
from its cache. While a process is not subscribed (Redis down, the channel lost, not started)
its cache entries live ``unsubscribed_ttl`` (1 s) instead of ``cache_ttl``, and when it
subscribes again it forgets every entry, since it may have missed a message meanwhile.

A key record may carry its own ``rpm`` and ``tpm`` (``pipeline.store.limits``), and the
``groups`` the key belongs to (comma-separated; ``retrieval.access``): which documents with an
access list its searches may see. Changing them (``set_groups``) is announced like a revocation,
so every replica resolves the key afresh on its next request.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import hmac
import logging
import math
import re
import secrets
import time
from collections import Counter
from itertools import pairwise
from typing import Any, Final

from redis.asyncio.client import PubSub

from pipeline.context import Principal
from pipeline.errors import StoreUnavailable
from pipeline.looptime import Bound
from pipeline.store.kv import UNREACHABLE, KeyValueStore, glob_escaped
from pipeline.telemetry import metrics
from retrieval.access import AccessError, check_names
from retrieval.tenants import check_tenant

log = logging.getLogger(__name__)

TENANT_PATTERN = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
DEFAULT_SCOPES = frozenset({"chat", "retrieve"})
# admin: sees and cancels the jobs of every user of its own tenant (never another tenant's).
KNOWN_SCOPES = frozenset({"chat", "retrieve", "ingest", "admin"})

KEY_ID_PATTERN: Final = re.compile(r"^key_[0-9a-f]{24}$")
MIN_CUSTOM_KEY_CHARS: Final = 32
MAX_CUSTOM_KEY_CHARS: Final = 256
MIN_DISTINCT_CHARS: Final = 10
MIN_ESTIMATED_BITS: Final = 96.0

# KEYS: record, id index, the tenant's key set.  ARGV: hash, key id, tenant, then the
# record's field/value pairs.  Returns 1 (created) or the existing record's fields (it exists;
# put in its tenant's set again if it is this tenant's, in case a version without sets made it).
# The set is written first: should it not be a set, nothing is written.
_CREATE: Final = """
local existing = redis.call('HGETALL', KEYS[1])
if #existing > 0 then
  if redis.call('HGET', KEYS[1], 'tenant') == ARGV[3] then redis.pcall('SADD', KEYS[3], ARGV[1]) end
  return existing
end
redis.call('SADD', KEYS[3], ARGV[1])
redis.call('HSET', KEYS[1], unpack(ARGV, 4))
redis.call('SET', KEYS[2], ARGV[1])
return 1
"""

# KEYS: record, id index, the tenant's key set.  ARGV: hash, the key id the record was read
# with.  Returns 1 (deleted) or 0 (no such record, or one with another id since: revoked and
# created again meanwhile). One step: a create of the same key between the record's deletion
# and the set's would otherwise leave a record that no listing finds. The set last, and its
# error ignored (a damaged set: the next listing drops the entry), so a revoke always ends.
_REVOKE: Final = """
if (redis.call('HGET', KEYS[1], 'key_id') or '') ~= ARGV[2] then return 0 end
redis.call('DEL', KEYS[1])
if redis.call('GET', KEYS[2]) == ARGV[1] then redis.call('DEL', KEYS[2]) end
redis.pcall('SREM', KEYS[3], ARGV[1])
return 1
"""

# KEYS: a tenant's key set.  ARGV: record prefix, tenant, then entries of the set that were
# not the tenant's key records when read.  Each is checked again here, in one step with its
# removal, so that a key created since stays listed (pcall: a name that is not a hash is no
# record of the tenant's).
_PRUNE: Final = """
for i = 3, #ARGV do
  if redis.pcall('HGET', ARGV[1] .. ARGV[i], 'tenant') ~= ARGV[2] then
    redis.call('SREM', KEYS[1], ARGV[i])
  end
end
return 0
"""

# KEYS: record.  ARGV: the id the record had, the new id, index prefix, hash, grace seconds.
# Returns the record's id after the call (the new one, or one another call gave it first).
_MIGRATE_ID: Final = """
if redis.call('EXISTS', KEYS[1]) == 0 then return '' end
local current = redis.call('HGET', KEYS[1], 'key_id') or ''
if current ~= ARGV[1] then return current end
redis.call('HSET', KEYS[1], 'key_id', ARGV[2])
redis.call('SET', ARGV[3] .. ARGV[2], ARGV[4])
local old = ARGV[3] .. ARGV[1]
if ARGV[1] ~= '' and redis.call('GET', old) == ARGV[4] then
  redis.call('EXPIRE', old, ARGV[5])
end
return ARGV[2]
"""


_DIGEST = re.compile(r"[0-9a-f]{64}")


@dataclasses.dataclass(frozen=True)
class KeyInfo:
    """A key as ``rag keys list`` shows it: its principal and when it was created (Unix
    seconds; None for a record that does not say)."""

    principal: Principal
    created: int | None


def hash_key(raw: str) -> str:
    return hashlib.sha256(raw.encode("utf-8")).hexdigest()


def new_key_id() -> str:
    return "key_" + secrets.token_hex(12)


def new_raw_key() -> str:
    return "rag-" + secrets.token_urlsafe(32)


def validate_name(kind: str, value: str) -> str:
    if not TENANT_PATTERN.fullmatch(value):
        raise ValueError(f"{kind} must match {TENANT_PATTERN.pattern}, got {value!r}")
    return value


def validate_tenant(value: str) -> str:
    """A tenant's name: ``validate_name``'s rule and the index store's (``check_tenant``: not
    only dots, which name no directory of their own)."""
    return check_tenant(validate_name("tenant", value))


def validate_scopes(scopes: frozenset[str]) -> frozenset[str]:
    if not scopes:
        raise ValueError(
            f"a key needs at least one scope (known: {', '.join(sorted(KNOWN_SCOPES))})"
        )
    unknown = scopes - KNOWN_SCOPES
    if unknown:
        raise ValueError(
            f"unknown scopes: {sorted(unknown)} (known: {', '.join(sorted(KNOWN_SCOPES))})"
        )
    return scopes


def validate_groups(groups: frozenset[str]) -> frozenset[str]:
    """The groups of a key, by the access-list name rules (retrieval.access), else ValueError."""
    try:
        return check_names("group", groups)
    except AccessError as exc:
        raise ValueError(str(exc)) from None


def weak_key_reason(raw: str) -> str | None:
    """Why a custom key is too weak to accept, or None. Never echoes the key.

    A key is a password that an attacker may guess online; it must be long and look random:
    at least 32 printable ASCII characters without spaces, of at least 10 different kinds, with
    an estimated 96 bits or more (Shannon entropy of its characters times its length), and no
    short pattern repeated or counted up (``abcabc...``, ``1234...``).
    """
    if len(raw) < MIN_CUSTOM_KEY_CHARS:
        return f"it has {len(raw)} characters; a key needs at least {MIN_CUSTOM_KEY_CHARS}"
    if len(raw) > MAX_CUSTOM_KEY_CHARS:
        return f"it has {len(raw)} characters; a key may have at most {MAX_CUSTOM_KEY_CHARS}"
    if not all("!" <= c <= "~" for c in raw):
        return "a key may only contain printable ASCII characters, without spaces"
    counts = Counter(raw)
    if len(counts) < MIN_DISTINCT_CHARS:
        return (
            f"it uses only {len(counts)} different characters; "
            f"a key needs at least {MIN_DISTINCT_CHARS}"
        )
    bits = -sum(n * math.log2(n / len(raw)) for n in counts.values())
    if bits < MIN_ESTIMATED_BITS:
        return f"it carries about {bits:.0f} bits; a key needs at least {MIN_ESTIMATED_BITS:.0f}"
    trigrams = {raw[i : i + 3] for i in range(len(raw) - 2)}
    if len(trigrams) < 0.75 * (len(raw) - 2):
        return "it repeats a short pattern"
    steps = sum(1 for a, b in pairwise(raw) if abs(ord(a) - ord(b)) <= 1)
    if steps > 0.5 * (len(raw) - 1):
        return "it counts up or down through neighbouring characters"
    return None


class ApiKeyStore:
    def __init__(
        self,
        kv: KeyValueStore,
        *,
        prefix: str = "rag:apikey:",
        cache_ttl: float = 30.0,
        stale_ttl: float = 600.0,
        max_seen: int = 10_000,
        legacy_id_grace: int = 86_400,
        unsubscribed_ttl: float = 1.0,
    ) -> None:
        self.kv = kv
        # On a cluster every key record, id and tenant index is in one slot: the scripts
        # write a key's three together (a few hundred bytes a key: millions fit one node).
        # Given with it already (another store's ``prefix``), it is not added twice.
        slot = kv.slot("keys")
        self.prefix = prefix if prefix.endswith(slot) else prefix + slot
        self.cache_ttl = cache_ttl
        self.stale_ttl = stale_ttl
        self.max_seen = max_seen
        self.legacy_id_grace = legacy_id_grace
        self.unsubscribed_ttl = unsubscribed_ttl
        self.channel = f"{self.prefix}changed"
        self._listening = False
        self._rechecking: set[str] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._seen: dict[str, tuple[float, Principal]] = {}
        # Counts what was dropped from ``_seen``: a lookup whose read of Redis a drop overtook
        # does not cache what it read (it may be the record the drop was for).
        self._drops = 0
        # Keys cached before this moment (the change channel's last subscription) are asked
        # about again before they are trusted; while Redis cannot answer, they still serve as
        # keys seen lately (``stale_ttl``), as they would had the channel never been lost.
        self._doubted_before = 0.0
        self._subscribed = asyncio.Event()  # set at each subscription, cleared when it is lost
        self._create = kv.script(_CREATE)
        self._revoke = kv.script(_REVOKE)
        self._prune = kv.script(_PRUNE)
        self._migrate = kv.script(_MIGRATE_ID)

    async def create(
        self,
        tenant: str,
        user: str,
        scopes: frozenset[str] = DEFAULT_SCOPES,
        *,
        raw_key: str | None = None,
        rpm: int | None = None,
        tpm: int | None = None,
        groups: frozenset[str] = frozenset(),
    ) -> str:
        """Store a new key and return it; this is the only time the raw key is seen.

        A custom ``raw_key`` must be strong (``weak_key_reason``). Creating a custom key that
        already exists is a no-op when it is the same tenant, user and scopes (a script that
        re-creates its development key on every start), and refused otherwise.
        Raises ``ValueError`` with the reason.
        """
        validate_tenant(tenant)
        validate_name("user", user)
        validate_scopes(scopes)
        validate_groups(groups)
        if raw_key is not None:
            reason = weak_key_reason(raw_key)
            if reason:
                raise ValueError(f"the custom key is too weak: {reason}")
        raw = raw_key or new_raw_key()
        digest = hash_key(raw)
        key_id = new_key_id()
        record: dict[str, str] = {
            "hash": digest,
            "key_id": key_id,
            "tenant": tenant,
            "user": user,
            "scopes": ",".join(sorted(scopes)),
            "created": str(int(time.time())),
        }
        record.update(_limit_fields(rpm=rpm, tpm=tpm))
        if groups:
            record["groups"] = ",".join(sorted(groups))
        reply = await self.kv.run_script(
            "apikey_create",
            self._create,
            [self.prefix + digest, self._id_key(key_id), self._tenant_key(tenant)],
            [digest, key_id, tenant, *(item for pair in record.items() for item in pair)],
        )
        if reply == 1:
            return raw
        existing = dict(zip(reply[::2], reply[1::2], strict=True))
        same = all(existing.get(k.encode()) == record[k].encode() for k in ("tenant", "user"))
        if same and existing.get(b"scopes") == record["scopes"].encode():
            if any(existing.get(k.encode()) != _encoded(record.get(k)) for k in ("rpm", "tpm")):
                raise ValueError(
                    "this key exists with other limits; change them with `rag keys limits`"
                )
            if existing.get(b"groups") != _encoded(record.get("groups")):
                raise ValueError(
                    "this key exists with other groups; change them with `rag keys groups`"
                )
            return raw
        raise ValueError("this key already exists for another principal; choose another key")

    async def revoke(self, key: str, *, by_id: bool = False) -> Principal | None:
        """Delete the key (``key``: the raw key, or its id when ``by_id``); the principal it
        had (None if there was no such key). The caller settles the key's queued jobs
        (``JobQueue.settle_revoked``)."""
        found = await self._record(key, by_id)
        if found is None:
            return None
        digest, fields = found
        self._drop(digest)
        principal = _principal(fields, checked=False)
        deleted = await self.kv.run_script(
            "apikey_revoke",
            self._revoke,
            [
                self.prefix + digest,
                self._id_key(principal.key_id),
                self._tenant_key(principal.tenant),
            ],
            [digest, fields.get(b"key_id", b"")],
        )
        if not deleted:
            return None
        await self._announce(digest)
        return principal

    async def set_limits(
        self, key: str, *, rpm: int | None, tpm: int | None, by_id: bool = False
    ) -> Principal | None:
        """Set the key's own limits per minute (0: none; None: leave as is; a negative value:
        remove, so the tenant's default applies); the principal after, None if no such key.
        ``key``: the raw key, or its id when ``by_id``."""
        found = await self._record(key, by_id)
        if found is None:
            return None
        digest = found[0]
        key = self.prefix + digest
        changes = _limit_fields(rpm=rpm, tpm=tpm)
        if changes:
            await self.kv.hset(key, dict(changes))
        for name, value in (("rpm", rpm), ("tpm", tpm)):
            if value is not None and value < 0:
                await self.kv.hdel(key, name)
        await self._announce(digest)
        return _principal(await self.kv.hgetall(key), checked=False)

    async def set_groups(
        self, key: str, groups: frozenset[str], *, by_id: bool = False
    ) -> Principal | None:
        """Replace the key's groups (empty: none); the principal after, None if no such key.
        Every replica forgets its cached principal of the key at once (``_announce``).
        ``key``: the raw key, or its id when ``by_id``."""
        validate_groups(groups)
        found = await self._record(key, by_id)
        if found is None:
            return None
        digest = found[0]
        key = self.prefix + digest
        if groups:
            await self.kv.hset(key, {"groups": ",".join(sorted(groups))})
        else:
            await self.kv.hdel(key, "groups")
        await self._announce(digest)
        fields = await self.kv.hgetall(key)
        return _principal(fields, checked=False) if fields else None

    async def _record(self, key: str, by_id: bool) -> tuple[str, dict[bytes, bytes]] | None:
        """The key's record, as (its name: the key's hash, its fields); None when there is no
        such key. ``key`` is the raw key, or, ``by_id``, its id: then the record the id index
        names, when that record carries this very id. Ids of the old scheme are refused: two
        keys could share one (``rag keys list`` gives such a key a new id)."""
        if by_id:
            if not KEY_ID_PATTERN.fullmatch(key):
                raise ValueError(
                    "a key id is key_ and 24 hex digits (`rag keys list --tenant T` shows them)"
                )
            digest = await self._digest_of(key)
            if digest is None or not _DIGEST.fullmatch(digest):
                return None  # no key record of ours: a digest is 64 hex digits
        else:
            digest = hash_key(key)
        fields = await self.kv.hgetall(self.prefix + digest)
        if not fields or (by_id and fields.get(b"key_id") != key.encode()):
            return None
        return digest, fields

    async def keys_of(self, tenant: str, *, rescan: bool = False) -> list[KeyInfo]:
        """The tenant's keys, oldest first, as their records hold them (never a key or its
        hash), for an operator's command. Read through the tenant's key set, which create and
        revoke keep; entries whose record is gone or names another tenant are never shown, and
        are removed. Records the sets do not know of, written before there were sets, are
        found by one scan of every key name (SCAN, in steps): the first listing after an
        upgrade does it, and ``rescan`` does it again (keys created meanwhile by a replica
        of an older version)."""
        validate_tenant(tenant)
        if rescan or await self.kv.get(self._indexed_key()) is None:
            await self._index_every_key()
        tenant_key = self._tenant_key(tenant)
        found: list[KeyInfo] = []
        listed: set[bytes] = set()
        async for members in self.kv.sscan(tenant_key, count=500):  # 500 records a round trip
            batch = [m for m in members if m not in listed]  # SSCAN may give one twice
            listed.update(batch)
            # A member that is no hash names no record of ours: dropped unread.
            digests = {m: m.decode() for m in batch if _DIGEST.fullmatch(m.decode("latin-1"))}
            gone = [m for m in batch if m not in digests]
            records = await self._records(list(digests.values()))
            for member, fields in zip(digests, records, strict=True):
                if fields.get(b"tenant") != tenant.encode():
                    gone.append(member)  # as the set holds it
                    continue
                principal = _principal(fields, checked=False)
                if not KEY_ID_PATTERN.fullmatch(principal.key_id):
                    # An id of the old scheme is cut from the key's text: never shown. The
                    # record gets a random id, as on its first use (``resolve``).
                    principal = await self._migrate_id(digests[member], principal)
                    if not KEY_ID_PATTERN.fullmatch(principal.key_id):
                        continue  # revoked meanwhile
                created = fields.get(b"created", b"")
                found.append(KeyInfo(principal, int(created) if created.isdigit() else None))
            if gone:
                await self.kv.run_script(
                    "apikey_prune", self._prune, [tenant_key], [self.prefix, tenant, *gone]
                )
        return sorted(found, key=lambda k: (k.created or 0, k.principal.key_id))

    async def _index_every_key(self) -> None:
        """Put every key record in its tenant's key set (one SCAN of all key names), then mark
        the sets complete."""
        names = await self.kv.scan(glob_escaped(self.prefix) + "[0-9a-f]" * 64, kind="hash")
        for start in range(0, len(names), 500):
            batch = [name[-64:].decode() for name in names[start : start + 500]]
            members: list[tuple[str, str]] = []
            for digest, fields in zip(batch, await self._records(batch), strict=True):
                tenant = fields.get(b"tenant", b"").decode("utf-8", "replace")
                if TENANT_PATTERN.fullmatch(tenant):
                    members.append((self._tenant_key(tenant), digest))

            async def queue(pipe: Any, members: list[tuple[str, str]] = members) -> None:
                for key, digest in members:
                    pipe.sadd(key, digest)

            await self.kv.pipeline("apikey_index", queue)
        await self.kv.set(self._indexed_key(), b"1")

    async def _records(self, digests: list[str]) -> list[dict[bytes, bytes]]:
        """The key records of these hashes, in one round trip (empty where there is none, or
        where the name holds something other than a hash)."""

        async def queue(pipe: Any) -> None:
            for digest in digests:
                pipe.hgetall(self.prefix + digest)

        replies = await self.kv.pipeline("apikey_list", queue, errors_in_place=True)
        return [reply if isinstance(reply, dict) else {} for reply in replies]

    async def _announce(self, digest: str) -> None:
        """Tell every replica to forget its cached entry of this key."""
        self._drop(digest)
        await self.kv.publish(self.channel, digest)

    def forget(self, digest: str) -> None:
        if self._drop(digest):
            metrics.key_invalidated("message")

    def _drop(self, digest: str) -> bool:
        """Forget one cached key (whether it was cached), and any lookup of it under way."""
        self._drops += 1
        return self._seen.pop(digest, None) is not None

    def _doubt_all(self) -> int:
        """Ask Redis about every cached key before trusting it again, and cache no lookup under
        way; how many were cached. They are not dropped: on a Redis Cluster the channel can be
        back while the keys' node is not (or the circuit breaker still open), and a key dropped
        then was a 503 for a caller whose key was seen a second before (a failover's find)."""
        self._drops += 1
        self._doubted_before = time.monotonic()
        return len(self._seen)

    async def listen(self, *, retry_seconds: float = 0.5, ping_seconds: float = 0.5) -> None:
        """Follow the change channel until ``stop_listening`` (a task of the app's lifespan):
        each message drops one cached key. The connection is pinged every ``ping_seconds``; a
        channel that stops answering counts as lost, and the cache falls back to
        ``unsubscribed_ttl`` until it is back.

        The loop checks a flag as well as taking cancellation: redis-py's read with a timeout
        can swallow a cancellation that lands as its timeout fires, and a listener that missed
        its cancellation would hold the app's shutdown for ever."""
        self._listening = True
        try:
            while self._listening:
                try:
                    await self._follow(ping_seconds)
                except asyncio.CancelledError:
                    raise
                except (*UNREACHABLE, Exception):  # any loss: subscribe again
                    pass
                if self._listening:
                    await asyncio.sleep(retry_seconds)
        finally:
            self._subscribed.clear()

    async def stop_listening(self, task: asyncio.Task[None], *, wait: float = 2.0) -> None:
        """End ``task`` (running ``listen``): at once if it takes its cancellation, else at its
        next look at the flag (within ``ping_seconds``)."""
        self._listening = False
        task.cancel()
        await asyncio.wait({task}, timeout=wait)

    async def _follow(self, ping_seconds: float) -> None:
        subscribed = False
        try:
            async with self.kv.subscription() as pubsub:
                try:
                    await self._listen_on(pubsub, ping_seconds)
                finally:
                    # At once, not after the connection's close: the cache falls back now.
                    subscribed = self.subscribed
                    self._subscribed.clear()
        except (*UNREACHABLE, Exception) as exc:
            # Said once per loss: while it lasts, each try to subscribe again fails unsaid.
            if subscribed:
                log.warning("key change channel lost (%s); retrying", type(exc).__name__)
            raise

    @property
    def subscribed(self) -> bool:
        """Whether the change channel is subscribed now (``listen``)."""
        return self._subscribed.is_set()

    async def wait_subscribed(self, within: float) -> bool:
        """Whether the change channel is subscribed within ``within`` seconds (``listen``
        running): the app serves once it is, so that no key looked up before is lost to the
        first subscription's forgetting."""
        try:
            async with asyncio.timeout(within):
                await self._subscribed.wait()
        except TimeoutError:
            return False
        return True

    async def _listen_on(self, pubsub: PubSub, ping_seconds: float) -> None:
        # Each call on the pub/sub connection has a bound of its own, as a command's: its
        # socket has no timeout, and a (re)connect's handshake happens inside subscribe,
        # get_message and ping.
        bound = self.kv.timeout
        async with Bound(bound):
            await pubsub.subscribe(self.channel)
        answered = time.monotonic()
        pinged = 0.0
        while self._listening:
            async with Bound(None if bound is None else ping_seconds / 2 + bound):
                message = await pubsub.get_message(timeout=ping_seconds / 2)
            now = time.monotonic()
            if message is not None:
                answered = now
                kind = message.get("type")
                if kind == "subscribe":
                    # The first confirmation, or one after redis-py connected again and
                    # subscribed again by itself (inside get_message or ping, raising nothing):
                    # what changed while the channel was down is unknown either way.
                    metrics.key_invalidated("resubscribed", self._doubt_all())
                    self._subscribed.set()
                elif kind == "message":
                    data = message.get("data")
                    if isinstance(data, bytes):
                        self.forget(data.decode("ascii", "replace"))
            if now - pinged >= ping_seconds:
                async with Bound(bound):
                    await pubsub.ping()
                pinged = now
            if now - answered > 2 * ping_seconds + 0.5:
                raise TimeoutError("no answer on the key change channel")

    async def is_active(self, key_id: str) -> bool:
        """Whether the key with this id still exists (not revoked). Asks Redis every time: the
        in-process cache would let a revoked key act for up to ``cache_ttl`` more seconds.

        Raises ``StoreUnavailable`` when Redis is down.
        """
        name = await self._digest_of(key_id)
        if name is None:
            return False
        fields = await self.kv.hgetall(self.prefix + name)
        return hmac.compare_digest(fields.get(b"hash", b""), name.encode())

    async def current(self, key_id: str) -> Principal | None:
        """The key with this id as it is now (its limits and groups changed since, included),
        or None when it is gone (revoked) or its records cannot be read. Asks Redis every time.

        Raises ``StoreUnavailable`` when Redis is down.
        """
        name = await self._digest_of(key_id)
        # The index is ours: an id of the old scheme still names its key, migrated or not.
        return None if name is None else await self._lookup(name)

    async def _digest_of(self, key_id: str) -> str | None:
        """The digest the id index names for ``key_id``; None when there is none we can read."""
        if not key_id:
            return None
        digest = await self.kv.get(self._id_key(key_id))
        if digest is None:
            return None
        try:
            return digest.decode("ascii")
        except UnicodeDecodeError:
            log.warning("the id index of key %s cannot be read: not active", key_id[:64])
            return None  # no key of ours: a digest is hex

    def _id_key(self, key_id: str) -> str:
        return f"{self.prefix}id:{key_id}"

    def _tenant_key(self, tenant: str) -> str:
        """The set of the hashes of a tenant's keys (``rag keys list``)."""
        return f"{self.prefix}tenant:{tenant}"

    def _indexed_key(self) -> str:
        """Set once every key record written before the tenant key sets is in its set."""
        return f"{self.prefix}tenant-index"

    async def resolve(self, raw: str) -> Principal | None:
        """The principal for a key, or None when the key is unknown.

        Raises ``StoreUnavailable`` when Redis is down and the key was not seen recently.
        While the change channel is lost, a key cached more than ``unsubscribed_ttl`` ago is
        checked again in the background and answered from the cache meanwhile: a revocation
        still lands within about a second, and a sick Redis (the likely reason the channel was
        lost) never makes a request wait for it.
        """
        digest = hash_key(raw)
        now = time.monotonic()
        seen = self._seen.get(digest)
        if seen is not None and now - seen[0] < self.cache_ttl and seen[0] > self._doubted_before:
            if not self.subscribed and now - seen[0] >= self.unsubscribed_ttl:
                self._recheck(digest)
            return seen[1]
        try:
            return await self._lookup(digest)
        except StoreUnavailable:
            if seen is not None and now - seen[0] < self.stale_ttl:
                return seen[1]
            raise

    def cached(self, raw: str) -> Principal | None:
        """The principal ``resolve`` would answer from this process's cache without asking
        Redis or scheduling a re-check (the cache-hit fast path's key check), else None."""
        seen = self._seen.get(hash_key(raw))
        if seen is None:
            return None
        age = time.monotonic() - seen[0]
        if age >= self.cache_ttl or (not self.subscribed and age >= self.unsubscribed_ttl):
            return None
        if seen[0] <= self._doubted_before:
            return None
        return seen[1]

    async def aclose(self) -> None:
        """Wait for the keys being checked again (before the store is closed)."""
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=2.0)

    def _recheck(self, digest: str) -> None:
        if digest in self._rechecking:
            return
        self._rechecking.add(digest)

        async def recheck() -> None:
            try:
                await self._lookup(digest)
            except StoreUnavailable:
                pass  # still cached; checked again on a later request
            finally:
                self._rechecking.discard(digest)

        task = asyncio.get_running_loop().create_task(recheck())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _lookup(self, digest: str) -> Principal | None:
        """Ask Redis for the key and cache what it says (forget the key if it is gone). What
        it read is not cached when a key was dropped meanwhile (a change message, a revoke):
        that read may be from before the change, and would be trusted for ``cache_ttl``."""
        drops = self._drops
        fields = await self.kv.hgetall(self.prefix + digest)
        if not fields or not hmac.compare_digest(fields.get(b"hash", b""), digest.encode()):
            self._seen.pop(digest, None)
            return None
        try:
            principal = _principal(fields)
        except (KeyError, ValueError):  # UnicodeDecodeError, a name that breaks the rules
            # Another version's record, or a damaged one: the key is refused as unknown (401)
            # until an operator looks, rather than every request with it being a 500.
            key_id = fields.get(b"key_id", b"?").decode(errors="replace")[:64]
            log.warning("the record of key %s cannot be read: refused as unknown", key_id)
            self._seen.pop(digest, None)
            return None
        if not KEY_ID_PATTERN.fullmatch(principal.key_id):
            principal = await self._migrate_id(digest, principal)
        if self._drops != drops:
            return principal  # as it was when read; asked again next time
        if len(self._seen) >= self.max_seen:
            # Forget the oldest half; a forgotten key costs one Redis lookup, nothing more.
            for old in sorted(self._seen, key=lambda d: self._seen[d][0])[: self.max_seen // 2]:
                del self._seen[old]
        self._seen[digest] = (time.monotonic(), principal)
        return principal

    async def _migrate_id(self, digest: str, principal: Principal) -> Principal:
        """A record of the old scheme (its id cut from the key's text) gets a random id."""
        reply = await self.kv.run_script(
            "apikey_migrate_id",
            self._migrate,
            [self.prefix + digest],
            [principal.key_id, new_key_id(), self._id_key(""), digest, self.legacy_id_grace],
        )
        key_id = bytes(reply).decode(errors="replace") if reply else principal.key_id
        return dataclasses.replace(principal, key_id=key_id)


def _principal(fields: dict[bytes, bytes], *, checked: bool = True) -> Principal:
    """The record's principal; KeyError or ValueError (UnicodeDecodeError included) where it
    cannot be read or its tenant or user breaks the rules that keys are created by (they name
    directories and Redis keys). Not ``checked``: read as it is, whatever it holds (an
    operator's command on a damaged record, a revoke above all, must still do its whole
    work)."""
    errors = "strict" if checked else "replace"

    def text(name: bytes, required: bool = False) -> str:
        value = fields[name] if checked and required else fields.get(name, b"")
        return value.decode(errors=errors)

    tenant, user = text(b"tenant", required=True), text(b"user", required=True)
    if checked:
        validate_tenant(tenant)
        validate_name("user", user)
    return Principal(
        tenant=tenant,
        user=user,
        scopes=frozenset(s for s in text(b"scopes").split(",") if s),
        key_id=text(b"key_id"),
        rpm=read_limit(fields.get(b"rpm")),
        tpm=read_limit(fields.get(b"tpm")),
        groups=frozenset(g for g in text(b"groups").split(",") if g),
    )


def read_limit(value: bytes | None) -> int | None:
    """A limit per minute as a record stores it (a key's, a job's); None where there is none or
    it is damaged: the tenant's default applies. One past what the script counts in is its
    business (``pipeline.store.limits``: it counts as ``MAX_PER_MINUTE``)."""
    if not value:
        return None
    try:
        return max(0, int(value))
    except ValueError:
        return None


def _encoded(value: str | None) -> bytes | None:
    return None if value is None else value.encode()


def _limit_fields(**limits: int | None) -> dict[str, str]:
    """The record fields for limits given as numbers (negative ones are removals, not fields)."""
    return {name: str(value) for name, value in limits.items() if value is not None and value >= 0}
