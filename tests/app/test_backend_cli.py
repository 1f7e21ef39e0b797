"""`rag backend move`: a tenant's index moved between the embedded snapshots and Milvus Lite,
run as a user runs it, and `rag ingest` / `rag delete` following the tenant to its backend."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import redis

from retrieval import Embedder, HybridRetriever, IndexStore
from retrieval.backends.embedded import EmbeddedBackend
from retrieval.backends.moves import MoveFence
from tests.retrieval.backends_support import milvus_backend
from tests.support.cli import rag
from tests.support.servers import RedisServer, free_port

DOCS = [
    {"id": "paris", "title": "Paris", "text": "Paris is the capital of France."},
    {"id": "rome", "title": "Rome", "text": "Rome is the capital of Italy."},
    {"id": "tides", "title": "Tides", "text": "The Moon's pull causes ocean tides."},
]


def test_a_tenant_moves_to_milvus_and_back_and_every_command_follows_it(
    tmp_path: Path, redis_server: RedisServer, shared_embedder: Embedder
) -> None:
    prefix = f"mv{uuid.uuid4().hex[:6]}:"
    env = {
        "RAG_REDIS__URL": redis_server.url,
        "RAG_REDIS__KEY_PREFIX": prefix,
        "RAG_RETRIEVAL__INDEX_DIR": str(tmp_path / "indexes"),
        "RAG_RETRIEVAL__MILVUS_URI": str(tmp_path / "milvus.db"),
        "RAG_RETRIEVAL__MILVUS_COLLECTION": "moved",
    }
    corpus = tmp_path / "docs.jsonl"
    corpus.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    for tenant in ("big", "small"):
        done = rag("ingest", str(corpus), "--tenant", tenant, "--quiet", env=env)
        assert done.returncode == 0, done.stderr
    shown = rag("backend", "show", "--tenant", "big", env=env)
    assert "big: embedded" in shown.stdout and "3 documents" in shown.stdout, shown.stderr
    assert not (tmp_path / "milvus.db").exists()  # no command so far needed Milvus Lite

    moved = rag("backend", "move", "--tenant", "big", "--to", "milvus", env=env)
    assert moved.returncode == 0, moved.stderr
    assert "from embedded to milvus: 3 documents, 3 chunks" in moved.stdout
    override = redis.Redis.from_url(redis_server.url).hget(f"{prefix}retrieval-backend", "big")
    assert override == b"milvus"
    assert "big: milvus" in rag("backend", "show", "--tenant", "big", env=env).stdout
    again = rag("backend", "move", "--tenant", "big", "--to", "milvus", env=env)
    assert again.returncode == 0 and "already on milvus" in again.stdout

    # Deleted from the embedded index; the other tenant untouched there.
    store = IndexStore(tmp_path / "indexes", shared_embedder)
    embedded = EmbeddedBackend(store, HybridRetriever(store))
    assert embedded.document_ids("big") == set()
    assert embedded.document_ids("small") == {"paris", "rome", "tides"}

    # Ingest and delete now go to Milvus.
    deleted = rag("delete", "--tenant", "big", "rome", env=env)
    assert deleted.returncode == 0, deleted.stderr
    missing = rag("delete", "--tenant", "big", "rome", env=env)
    assert missing.returncode == 1 and "not found" in missing.stderr
    milvus = milvus_backend(
        tmp_path, shared_embedder, redis_server.url, collection="moved", versions_prefix=prefix
    )
    try:
        assert milvus.document_ids("big") == {"paris", "tides"}
        assert milvus.document_ids("small") == set()
        query = "capital of France"
        hits = milvus.search("big", query, shared_embedder.embed([query])[0], top_k=1).hits
        assert hits[0].document_id == "paris"
        version = milvus.version("big")
        assert int(version) >= 2  # the move's copy, then the delete
    finally:
        milvus.close()

    back = rag("backend", "move", "--tenant", "big", "--to", "embedded", env=env)
    assert back.returncode == 0, back.stderr
    assert "from milvus to embedded: 2 documents, 2 chunks" in back.stdout
    assert embedded.document_ids("big") == {"paris", "tides"}
    shown = rag("backend", "show", "--tenant", "big", env=env)
    assert "big: embedded" in shown.stdout and "2 documents" in shown.stdout


def test_a_move_to_milvus_without_a_milvus_uri_is_refused(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    env = {
        "RAG_REDIS__URL": redis_server.url,
        "RAG_RETRIEVAL__INDEX_DIR": str(tmp_path / "indexes"),
    }
    done = rag("backend", "move", "--tenant", "big", "--to", "milvus", env=env)
    assert done.returncode == 2 and "RAG_RETRIEVAL__MILVUS_URI" in done.stderr


def test_a_milvus_that_cannot_be_reached_fails_only_the_commands_that_need_it(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    env = {
        "RAG_REDIS__URL": redis_server.url,
        "RAG_REDIS__KEY_PREFIX": f"mu{uuid.uuid4().hex[:6]}:",
        "RAG_RETRIEVAL__INDEX_DIR": str(tmp_path / "indexes"),
        "RAG_RETRIEVAL__MILVUS_URI": f"http://127.0.0.1:{free_port()}",
        "RAG_RETRIEVAL__MILVUS_TIMEOUT_SECONDS": "1",
    }
    corpus = tmp_path / "docs.jsonl"
    corpus.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    done = rag("ingest", str(corpus), "--tenant", "small", "--quiet", env=env)
    assert done.returncode == 0, done.stderr  # an embedded tenant: Milvus is not needed
    refused = rag("backend", "move", "--tenant", "small", "--to", "milvus", env=env)
    assert refused.returncode == 1 and "Traceback" not in refused.stderr, refused.stderr
    said = refused.stderr.strip().splitlines()[-1]
    assert said.startswith("rag: The milvus retrieval backend cannot be reached"), said
    assert said.endswith("Run it again later.")
    deleted = rag("delete", "--tenant", "small", "rome", env=env)  # the move's fence is lifted
    assert deleted.returncode == 0, deleted.stderr
    there = rag("backend", "move", "--tenant", "small", "--to", "embedded", env=env)
    assert there.returncode == 0 and "tenant small is already on embedded" in there.stdout
    assert "could not look for documents of tenant small left on milvus" in there.stdout


def test_rag_ingest_and_delete_during_a_move_exit_1_saying_so_and_succeed_after(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    prefix = f"mf{uuid.uuid4().hex[:6]}:"
    env = {
        "RAG_REDIS__URL": redis_server.url,
        "RAG_REDIS__KEY_PREFIX": prefix,
        "RAG_RETRIEVAL__INDEX_DIR": str(tmp_path / "indexes"),
        "RAG_RETRIEVAL__MILVUS_URI": str(tmp_path / "milvus.db"),
    }
    corpus = tmp_path / "docs.jsonl"
    corpus.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    client = redis.Redis.from_url(redis_server.url)
    fence = MoveFence(client, prefix, f"{prefix}retrieval-backend")
    token = fence.begin("big")
    try:
        refused = rag("ingest", str(corpus), "--tenant", "big", "--quiet", env=env)
        assert refused.returncode == 1, refused.stderr
        assert "being moved" in refused.stderr and "0 documents were ingested" in refused.stderr
        gone = rag("delete", "--tenant", "big", "rome", env=env)
        assert gone.returncode == 1 and "being moved" in gone.stderr
        assert "Traceback" not in refused.stderr + gone.stderr
    finally:
        fence.end("big", token)
    done = rag("ingest", str(corpus), "--tenant", "big", "--quiet", env=env)
    assert done.returncode == 0, done.stderr
    client.close()
