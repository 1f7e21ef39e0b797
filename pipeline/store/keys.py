"""API keys: stored hashed in Redis, resolved to a principal, never logged.

Redis holds, under the SHA-256 of the whole key, the tenant, user, scopes, a key id and the
hash itself; the lookup is by hash, and the stored hash is compared to the computed one with
``hmac.compare_digest``. The raw key is printed once at creation and kept nowhere, not even in
part: the key id is random (``key_`` + 96 random bits), never cut from the key's text, so two
keys cannot share an id and a job, a log line or the id index (``id:{key id}`` -> hash, which
lets a queued job ask whether its key still exists) reveals nothing of the key.

Records written before ids were random carry an id cut from the key (the text before its first
"."). They keep working: ``resolve`` gives such a record a random id the first time it sees it,
and leaves the old id index in place for ``legacy_id_grace`` seconds so that jobs queued under
the old id still pass their re-check; then it expires.

Resolved principals are kept in-process for ``cache_ttl`` seconds, and while Redis is down a
principal seen within ``stale_ttl`` is still accepted, so an outage of Redis does not lock out
callers who were just served. Revoking a key takes effect within ``cache_ttl``.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import re
import secrets
import time
from collections import Counter
from itertools import pairwise
from typing import Final

from pipeline.context import Principal
from pipeline.errors import StoreUnavailable
from pipeline.store.kv import KeyValueStore

TENANT_PATTERN = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
DEFAULT_SCOPES = frozenset({"chat", "retrieve"})
# admin: sees and cancels the jobs of every user of its own tenant (never another tenant's).
KNOWN_SCOPES = frozenset({"chat", "retrieve", "ingest", "admin"})

KEY_ID_PATTERN: Final = re.compile(r"^key_[0-9a-f]{24}$")
MIN_CUSTOM_KEY_CHARS: Final = 32
MAX_CUSTOM_KEY_CHARS: Final = 256
MIN_DISTINCT_CHARS: Final = 10
MIN_ESTIMATED_BITS: Final = 96.0

# KEYS: record, id index.  ARGV: hash, key id, then the record's field/value pairs.
# Returns 1 (created) or the existing record's fields (the key already exists).
_CREATE: Final = """
local existing = redis.call('HGETALL', KEYS[1])
if #existing > 0 then return existing end
redis.call('HSET', KEYS[1], unpack(ARGV, 3))
redis.call('SET', KEYS[2], ARGV[1])
return 1
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
    ) -> None:
        self.kv = kv
        self.prefix = prefix
        self.cache_ttl = cache_ttl
        self.stale_ttl = stale_ttl
        self.max_seen = max_seen
        self.legacy_id_grace = legacy_id_grace
        self._seen: dict[str, tuple[float, Principal]] = {}
        self._create = kv.script(_CREATE)
        self._migrate = kv.script(_MIGRATE_ID)

    async def create(
        self,
        tenant: str,
        user: str,
        scopes: frozenset[str] = DEFAULT_SCOPES,
        *,
        raw_key: str | None = None,
    ) -> str:
        """Store a new key and return it; this is the only time the raw key is seen.

        A custom ``raw_key`` must be strong (``weak_key_reason``). Creating a custom key that
        already exists is a no-op when it is the same tenant, user and scopes (a script that
        re-creates its development key on every start), and refused otherwise.
        Raises ``ValueError`` with the reason.
        """
        validate_name("tenant", tenant)
        validate_name("user", user)
        validate_scopes(scopes)
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
        reply = await self.kv.run_script(
            "apikey_create",
            self._create,
            [self.prefix + digest, self._id_key(key_id)],
            [digest, key_id, *(item for pair in record.items() for item in pair)],
        )
        if reply == 1:
            return raw
        existing = dict(zip(reply[::2], reply[1::2], strict=True))
        same = all(existing.get(k.encode()) == record[k].encode() for k in ("tenant", "user"))
        if same and existing.get(b"scopes") == record["scopes"].encode():
            return raw
        raise ValueError("this key already exists for another principal; choose another key")

    async def revoke(self, raw: str) -> Principal | None:
        """Delete the key; the principal it had (None if there was no such key). The caller
        settles the key's queued jobs (``JobQueue.settle_revoked``)."""
        digest = hash_key(raw)
        self._seen.pop(digest, None)
        fields = await self.kv.hgetall(self.prefix + digest)
        # The record goes first: should the index outlive it, is_active still says False.
        if await self.kv.delete(self.prefix + digest) == 0 or not fields:
            return None
        principal = _principal(fields)
        id_key = self._id_key(principal.key_id)
        if await self.kv.get(id_key) == digest.encode():
            await self.kv.delete(id_key)
        return principal

    async def is_active(self, key_id: str) -> bool:
        """Whether the key with this id still exists (not revoked). Asks Redis every time: the
        in-process cache would let a revoked key act for up to ``cache_ttl`` more seconds.

        Raises ``StoreUnavailable`` when Redis is down.
        """
        if not key_id:
            return False
        digest = await self.kv.get(self._id_key(key_id))
        if digest is None:
            return False
        fields = await self.kv.hgetall(self.prefix + digest.decode())
        return hmac.compare_digest(fields.get(b"hash", b""), digest)

    def _id_key(self, key_id: str) -> str:
        return f"{self.prefix}id:{key_id}"

    async def resolve(self, raw: str) -> Principal | None:
        """The principal for a key, or None when the key is unknown.

        Raises ``StoreUnavailable`` when Redis is down and the key was not seen recently.
        """
        digest = hash_key(raw)
        now = time.monotonic()
        seen = self._seen.get(digest)
        if seen is not None and now - seen[0] < self.cache_ttl:
            return seen[1]
        try:
            fields = await self.kv.hgetall(self.prefix + digest)
        except StoreUnavailable:
            if seen is not None and now - seen[0] < self.stale_ttl:
                return seen[1]
            raise
        stored = fields.get(b"hash", b"").decode()
        if not fields or not hmac.compare_digest(stored, digest):
            self._seen.pop(digest, None)
            return None
        principal = _principal(fields)
        if not KEY_ID_PATTERN.fullmatch(principal.key_id):
            principal = await self._migrate_id(digest, principal)
        if len(self._seen) >= self.max_seen:
            # Forget the oldest half; a forgotten key costs one Redis lookup, nothing more.
            for old in sorted(self._seen, key=lambda d: self._seen[d][0])[: self.max_seen // 2]:
                del self._seen[old]
        self._seen[digest] = (now, principal)
        return principal

    async def _migrate_id(self, digest: str, principal: Principal) -> Principal:
        """A record of the old scheme (its id cut from the key's text) gets a random id."""
        reply = await self.kv.run_script(
            "apikey_migrate_id",
            self._migrate,
            [self.prefix + digest],
            [principal.key_id, new_key_id(), self._id_key(""), digest, self.legacy_id_grace],
        )
        key_id = bytes(reply).decode() if reply else principal.key_id
        return Principal(
            tenant=principal.tenant, user=principal.user, scopes=principal.scopes, key_id=key_id
        )


def _principal(fields: dict[bytes, bytes]) -> Principal:
    return Principal(
        tenant=fields[b"tenant"].decode(),
        user=fields[b"user"].decode(),
        scopes=frozenset(s for s in fields.get(b"scopes", b"").decode().split(",") if s),
        key_id=fields.get(b"key_id", b"").decode(),
    )
