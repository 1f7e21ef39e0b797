"""API keys: stored hashed in Redis, resolved to a principal, never logged.

A key looks like ``rag-<key id>.<secret>``. Redis holds, under the SHA-256 of the whole key,
the tenant, user, scopes and the hash itself; the lookup is by hash, and the stored hash is
compared to the computed one with ``hmac.compare_digest``. The raw key is printed once at
creation and kept nowhere.

Resolved principals are kept in-process for ``cache_ttl`` seconds, and while Redis is down a
principal seen within ``stale_ttl`` is still accepted, so an outage of Redis does not lock out
callers who were just served. Revoking a key takes effect within ``cache_ttl``.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import time

from pipeline.context import Principal
from pipeline.kv import KeyValueStore, StoreUnavailable

TENANT_PATTERN = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
DEFAULT_SCOPES = frozenset({"chat", "retrieve"})
KNOWN_SCOPES = frozenset({"chat", "retrieve", "ingest"})


def hash_key(raw: str) -> str:
    return hashlib.sha256(raw.encode("utf-8")).hexdigest()


def validate_name(kind: str, value: str) -> str:
    if not TENANT_PATTERN.fullmatch(value):
        raise ValueError(f"{kind} must match {TENANT_PATTERN.pattern}, got {value!r}")
    return value


class ApiKeyStore:
    def __init__(
        self,
        kv: KeyValueStore,
        *,
        prefix: str = "rag:apikey:",
        cache_ttl: float = 30.0,
        stale_ttl: float = 600.0,
        max_seen: int = 10_000,
    ) -> None:
        self.kv = kv
        self.prefix = prefix
        self.cache_ttl = cache_ttl
        self.stale_ttl = stale_ttl
        self.max_seen = max_seen
        self._seen: dict[str, tuple[float, Principal]] = {}

    async def create(
        self,
        tenant: str,
        user: str,
        scopes: frozenset[str] = DEFAULT_SCOPES,
        *,
        raw_key: str | None = None,
    ) -> str:
        """Store a new key and return it; this is the only time the raw key is seen."""
        validate_name("tenant", tenant)
        validate_name("user", user)
        unknown = scopes - KNOWN_SCOPES
        if unknown:
            raise ValueError(f"unknown scopes: {sorted(unknown)}")
        raw = raw_key or f"rag-{secrets.token_hex(4)}.{secrets.token_urlsafe(32)}"
        digest = hash_key(raw)
        await self.kv.hset(
            self.prefix + digest,
            {
                "hash": digest,
                "key_id": raw.split(".", 1)[0],
                "tenant": tenant,
                "user": user,
                "scopes": ",".join(sorted(scopes)),
                "created": int(time.time()),
            },
        )
        # key id -> hash, so that work done later on a key's behalf (a queued job holds the
        # principal, never the key) can ask whether the key still exists: ``is_active``.
        await self.kv.set(self._id_key(raw.split(".", 1)[0]), digest.encode())
        return raw

    async def revoke(self, raw: str) -> bool:
        digest = hash_key(raw)
        self._seen.pop(digest, None)
        # The record goes first: should the index outlive it, is_active still says False.
        revoked = await self.kv.delete(self.prefix + digest) > 0
        id_key = self._id_key(raw.split(".", 1)[0])
        if await self.kv.get(id_key) == digest.encode():
            await self.kv.delete(id_key)
        return revoked

    async def is_active(self, key_id: str) -> bool:
        """Whether the key with this id still exists (not revoked). Asks Redis every time: the
        in-process cache would let a revoked key act for up to ``cache_ttl`` more seconds.

        Raises ``StoreUnavailable`` when Redis is down.
        """
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
        principal = Principal(
            tenant=fields[b"tenant"].decode(),
            user=fields[b"user"].decode(),
            scopes=frozenset(s for s in fields.get(b"scopes", b"").decode().split(",") if s),
            key_id=fields.get(b"key_id", b"").decode(),
        )
        if len(self._seen) >= self.max_seen:
            # Forget the oldest half; a forgotten key costs one Redis lookup, nothing more.
            for old in sorted(self._seen, key=lambda d: self._seen[d][0])[: self.max_seen // 2]:
                del self._seen[old]
        self._seen[digest] = (now, principal)
        return principal
