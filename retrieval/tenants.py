"""The one rule for a tenant's name. A tenant names a directory of index snapshots
(``retrieval.store``) and is part of Redis key names, so the key store checks new keys by it
and refuses records that break it."""

from __future__ import annotations

import re

_TENANT = re.compile(r"[A-Za-z0-9_.-]{1,64}")


def check_tenant(tenant: str) -> str:
    """Return `tenant` if it is a valid tenant name, else raise ValueError. Only dots (".",
    "..") is refused: such a name is no directory of its own."""
    if not isinstance(tenant, str) or not _TENANT.fullmatch(tenant) or set(tenant) == {"."}:
        raise ValueError(
            f"invalid tenant name {tenant!r}: use 1-64 of A-Z a-z 0-9 _ . -, not only dots"
        )
    return tenant
