"""Fixtures' helpers for the backend tests: a Milvus Lite backend that fails loudly (never
skips) when it cannot start, and unique tenant names on a shared collection."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest

from retrieval.backends.milvus import MilvusBackend, MilvusUnavailable, connect
from retrieval.backends.versions import RedisVersions
from retrieval.embeddings import Embedder


def milvus_backend(
    path: Path,
    embedder: Embedder,
    redis_url: str,
    collection: str = "contract",
    versions_prefix: str | None = None,
    **options: Any,
) -> MilvusBackend:
    """A Milvus Lite backend on a database file under `path` (`collection` in it), versions
    in the tests' Redis (under `versions_prefix`: another process's, else a prefix of its own)."""
    try:
        client = connect(str(path / "milvus.db"))
    except MilvusUnavailable as exc:
        pytest.fail(f"Milvus Lite did not start: {exc}. Install it with `make install`.")
    prefix = versions_prefix or f"t{uuid.uuid4().hex[:8]}:"
    versions = RedisVersions(redis_url, prefix, reload_interval_s=0.0)
    return MilvusBackend(client, collection, embedder, versions, **options)


def new_tenant(prefix: str = "t") -> str:
    return f"{prefix}{uuid.uuid4().hex[:10]}"
