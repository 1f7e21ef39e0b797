"""ApiKeyStore.is_active: how a queued job learns that the key that submitted it was revoked."""

from __future__ import annotations

from pipeline.keys import ApiKeyStore
from pipeline.kv import KeyValueStore


async def test_a_key_is_active_until_it_is_revoked(kv: KeyValueStore, prefix: str) -> None:
    keys = ApiKeyStore(kv, prefix=f"{prefix}apikey:")
    raw = await keys.create("acme", "alice")
    principal = await keys.resolve(raw)
    assert principal is not None and principal.key_id == raw.split(".")[0]
    assert await keys.is_active(principal.key_id)
    assert not await keys.is_active("rag-00000000"), "an unknown id is not active"
    assert await keys.revoke(raw)
    assert not await keys.is_active(principal.key_id)
    assert await kv.get(f"{prefix}apikey:id:{principal.key_id}") is None, "index removed"


async def test_revoking_a_key_leaves_a_newer_key_with_the_same_id_active(
    kv: KeyValueStore, prefix: str
) -> None:
    keys = ApiKeyStore(kv, prefix=f"{prefix}apikey:")
    old = await keys.create("acme", "alice", raw_key="team-key.first-secret")
    new = await keys.create("acme", "alice", raw_key="team-key.second-secret")
    assert await keys.revoke(old)
    assert await keys.is_active("team-key"), "the index points at the newer key"
    assert await keys.revoke(new)
    assert not await keys.is_active("team-key")
