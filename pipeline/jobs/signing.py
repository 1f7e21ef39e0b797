"""Webhook signatures: HMAC-SHA256 over ``timestamp + "." + body`` with the tenant's secret.

Header: ``X-RAG-Signature: t=<unix seconds>,v1=<hex>[,v1=<hex>]``. There are two ``v1`` values
while a rotated secret's grace period runs (the new secret's first). A receiver accepts the
delivery when one ``v1`` matches its secret and ``t`` is within its tolerance of its clock,
which is what makes a captured delivery useless to replay later.

Each tenant has its own secret, kept in Redis and created on first use; ``rag webhooks secret
--tenant T`` prints it (and ``--rotate`` replaces it). A secret derived from one server-wide
master key would need no storage, but could not be rotated for one tenant alone.

At rest the secrets are sealed (``secret_box``: AES-256-GCM, the key from
``RAG_JOBS__WEBHOOK_SECRET_KEY``), so reading Redis does not let anyone sign as the service.
Without a key (development, tests) they are stored in plaintext and a warning says so; production
refuses to start without one. A plaintext secret found once a key is set is sealed on first use.
A stored value that cannot be read (not UTF-8, a grace period's end that is not a number) is
``SecretUnreadable`` too: a delivery records it as a failed attempt, it never ends the worker.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import logging
import math
import secrets
import time
from typing import Final

from pipeline.jobs.secret_box import SecretBox, SecretUnreadable, is_sealed, open_stored
from pipeline.store.kv import KeyValueStore

__all__ = ["SIGNATURE_HEADER", "SecretUnreadable", "WebhookSecrets", "signature_header", "verify"]

log = logging.getLogger("rag.jobs")

SIGNATURE_HEADER: Final = "X-RAG-Signature"
DEFAULT_TOLERANCE: Final = 300

_GET_OR_CREATE: Final = """
redis.call('HSETNX', KEYS[1], 'current', ARGV[1])
return redis.call('HGET', KEYS[1], 'current')
"""
_ROTATE: Final = """
local current = redis.call('HGET', KEYS[1], 'current')
if current then redis.call('HSET', KEYS[1], 'previous', current, 'previous_until', ARGV[2]) end
redis.call('HSET', KEYS[1], 'current', ARGV[1])
return ARGV[1]
"""
# KEYS: the tenant's secrets.  ARGV: field, the stored value read, the same secret sealed.
_RESEAL: Final = """
if redis.call('HGET', KEYS[1], ARGV[1]) == ARGV[2] then
  redis.call('HSET', KEYS[1], ARGV[1], ARGV[3])
end
return 1
"""


def new_secret() -> str:
    return "whsec_" + base64.urlsafe_b64encode(secrets.token_bytes(32)).decode().rstrip("=")


def sign(secret: str, timestamp: int, body: bytes) -> str:
    message = str(timestamp).encode() + b"." + body
    return hmac.new(secret.encode(), message, hashlib.sha256).hexdigest()


def signature_header(secrets_in_use: list[str], timestamp: int, body: bytes) -> str:
    return ",".join([f"t={timestamp}", *(f"v1={sign(s, timestamp, body)}" for s in secrets_in_use)])


def verify(
    header: str,
    body: bytes,
    secret: str,
    *,
    tolerance: int = DEFAULT_TOLERANCE,
    now: float | None = None,
) -> bool:
    """Whether ``header`` signs ``body`` with ``secret`` and is fresh (receivers do this)."""
    timestamp: int | None = None
    candidates: list[str] = []
    for part in header.split(","):
        name, _, value = part.strip().partition("=")
        if name == "t" and value.isdigit():
            timestamp = int(value)
        elif name == "v1":
            candidates.append(value)
    if timestamp is None or not candidates:
        return False
    if abs((time.time() if now is None else now) - timestamp) > tolerance:
        return False
    expected = sign(secret, timestamp, body)
    return any(hmac.compare_digest(expected, candidate) for candidate in candidates)


class WebhookSecrets:
    """Per-tenant signing secrets in Redis: created on first use, rotated with a grace period,
    sealed at rest by ``box`` (plaintext, with a warning, when there is none)."""

    def __init__(
        self,
        kv: KeyValueStore,
        *,
        prefix: str = "rag:",
        grace_seconds: int = 86_400,
        box: SecretBox | None = None,
    ) -> None:
        self.kv = kv
        self.prefix = f"{prefix}webhook-secret:"
        self.grace_seconds = grace_seconds
        self.box = box
        self._get_or_create = kv.script(_GET_OR_CREATE)
        self._rotate = kv.script(_ROTATE)
        self._reseal = kv.script(_RESEAL)
        if box is None:
            log.warning(
                "webhook signing secrets are stored in Redis in plaintext: set "
                "RAG_JOBS__WEBHOOK_SECRET_KEY to encrypt them (production refuses to start "
                "without it)"
            )

    async def current(self, tenant: str) -> str:
        """The tenant's secret (created now if it has none). Raises ``SecretUnreadable``."""
        value = await self.kv.run_script(
            "webhook_secret",
            self._get_or_create,
            [self.prefix + tenant],
            [self._seal(tenant, new_secret())],
        )
        return await self._open(tenant, "current", _text(tenant, "current", bytes(value)))

    async def rotate(self, tenant: str) -> str:
        """A new secret; the old one keeps signing (as a second ``v1``) for the grace period."""
        until = int(time.time()) + self.grace_seconds
        secret = new_secret()
        await self.kv.run_script(
            "webhook_secret_rotate",
            self._rotate,
            [self.prefix + tenant],
            [self._seal(tenant, secret), until],
        )
        return secret

    async def signing(self, tenant: str) -> list[str]:
        """The secrets that sign now: the current one, then the previous one within its grace.
        Raises ``SecretUnreadable`` when a stored secret does not open with this box."""
        fields = await self.kv.hgetall(self.prefix + tenant)
        if b"current" not in fields:
            return [await self.current(tenant)]
        in_use = [await self._open(tenant, "current", _text(tenant, "current", fields[b"current"]))]
        until = _until(tenant, fields.get(b"previous_until"))
        if b"previous" in fields and time.time() < until:
            previous = _text(tenant, "previous", fields[b"previous"])
            in_use.append(await self._open(tenant, "previous", previous))
        return in_use

    def _seal(self, tenant: str, secret: str) -> str:
        return self.box.seal(tenant, secret) if self.box is not None else secret

    async def _open(self, tenant: str, field: str, stored: str) -> str:
        secret = open_stored(self.box, tenant, stored)
        if self.box is not None and not is_sealed(stored):  # from before the key: seal it now
            await self.kv.run_script(
                "webhook_secret_reseal",
                self._reseal,
                [self.prefix + tenant],
                [field, stored, self.box.seal(tenant, secret)],
            )
        return secret


def _text(tenant: str, field: str, stored: bytes) -> str:
    try:
        return stored.decode()
    except UnicodeDecodeError:
        raise SecretUnreadable(
            f"the webhook secret ({field}) of tenant {tenant!r} is not text: damaged"
        ) from None


def _until(tenant: str, stored: bytes | None) -> float:
    """When the previous secret stops signing (0: it does not)."""
    try:
        until = float(stored or 0)
    except ValueError:
        until = math.nan
    if math.isnan(until):
        raise SecretUnreadable(
            f"the end of the grace period of tenant {tenant!r}'s previous webhook secret is "
            "not a number: damaged"
        )
    return until
