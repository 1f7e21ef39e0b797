"""Webhook signing secrets encrypted at rest: AES-256-GCM with a key from the environment.

Whoever can read Redis (a cache client, a backup, a replica) must not be able to sign webhooks
as the service. So a secret is stored as ``enc:v1:<key id>:<base64(nonce + ciphertext)>``,
sealed with a 256-bit key that only the service's processes hold
(``RAG_JOBS__WEBHOOK_SECRET_KEY``), and with the tenant's name as associated data: a sealed
secret copied to another tenant's record does not open there.

The setting holds one key, or several separated by commas: the first seals, every one opens (by
the key id in the stored value), so the key can be rotated without losing the stored secrets.
A stored value without the ``enc:`` prefix is a plaintext secret from before a key was set; it
is read as it is (and sealed on first use once a key is set).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import secrets
from typing import Final

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

SEALED_PREFIX: Final = "enc:v1:"
KEY_BYTES: Final = 32
NONCE_BYTES: Final = 12


class SecretUnreadable(Exception):
    """A stored secret cannot be opened with the keys this process has."""


def parse_keys(text: str) -> list[bytes]:
    """The keys of the setting: base64 (standard or URL-safe) of 32 bytes each, comma-separated.
    Raises ``ValueError`` naming the position of a bad one, never its value."""
    keys = []
    for position, item in enumerate((part.strip() for part in text.split(",")), start=1):
        if not item:
            continue
        standard = item.replace("-", "+").replace("_", "/").rstrip("=")
        try:
            raw = base64.b64decode(standard + "=" * (-len(standard) % 4), validate=True)
        except (binascii.Error, ValueError):
            raw = b""
        if len(raw) != KEY_BYTES:
            raise ValueError(
                f"key {position} of RAG_JOBS__WEBHOOK_SECRET_KEY is not the base64 of 32 bytes "
                "(make one with: openssl rand -base64 32)"
            )
        keys.append(raw)
    if not keys:
        raise ValueError("RAG_JOBS__WEBHOOK_SECRET_KEY is empty")
    return keys


def key_id(key: bytes) -> str:
    """A short public name of a key (not a way to recover it), stored with what it sealed."""
    return hashlib.sha256(b"rag webhook secret key id\x00" + key).hexdigest()[:12]


def new_key() -> str:
    return base64.b64encode(secrets.token_bytes(KEY_BYTES)).decode()


class SecretBox:
    """Seals and opens tenants' webhook secrets with the configured keys."""

    def __init__(self, keys: list[bytes]) -> None:
        if not keys:
            raise ValueError("a SecretBox needs at least one key")
        self._keys = {key_id(key): AESGCM(key) for key in keys}
        self._sealing = key_id(keys[0])

    @classmethod
    def from_setting(cls, text: str | None) -> SecretBox | None:
        return cls(parse_keys(text)) if text else None

    def seal(self, tenant: str, secret: str) -> str:
        nonce = secrets.token_bytes(NONCE_BYTES)
        sealed = self._keys[self._sealing].encrypt(nonce, secret.encode(), tenant.encode())
        return f"{SEALED_PREFIX}{self._sealing}:{base64.b64encode(nonce + sealed).decode()}"

    def open(self, tenant: str, stored: str) -> str:
        if not is_sealed(stored):
            return stored
        kid, _, payload = stored.removeprefix(SEALED_PREFIX).partition(":")
        aead = self._keys.get(kid)
        if aead is None:
            raise SecretUnreadable(
                f"the webhook secret of tenant {tenant!r} was sealed with key {kid}, which "
                "RAG_JOBS__WEBHOOK_SECRET_KEY does not hold"
            )
        try:
            data = base64.b64decode(payload, validate=True)
            return aead.decrypt(data[:NONCE_BYTES], data[NONCE_BYTES:], tenant.encode()).decode()
        except (binascii.Error, ValueError, InvalidTag):
            raise SecretUnreadable(
                f"the webhook secret of tenant {tenant!r} does not open with its key "
                "(altered, or copied from another tenant)"
            ) from None


def is_sealed(stored: str) -> bool:
    return stored.startswith(SEALED_PREFIX)


def open_stored(box: SecretBox | None, tenant: str, stored: str) -> str:
    """The plaintext of a stored secret; a sealed one needs a box."""
    if box is not None:
        return box.open(tenant, stored)
    if is_sealed(stored):
        raise SecretUnreadable(
            f"the webhook secret of tenant {tenant!r} is encrypted, and this process has no "
            "key to open it: set RAG_JOBS__WEBHOOK_SECRET_KEY"
        )
    return stored
