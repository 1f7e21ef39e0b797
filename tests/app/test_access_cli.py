"""The `rag` command and access lists: keys with groups, changing a key's groups, and JSONL
documents with an access list, run as a user runs them."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from opentelemetry import trace

from pipeline.context import Principal
from pipeline.store.keys import ApiKeyStore
from pipeline.store.kv import KeyValueStore
from retrieval import HybridRetriever, IndexStore
from retrieval.access import AccessList, Viewer
from tests.support.cli import rag


def resolve(redis_url: str, prefix: str, raw: str) -> Principal | None:
    async def run() -> Principal | None:
        kv = KeyValueStore.from_url(redis_url, trace.NoOpTracer())
        try:
            return await ApiKeyStore(kv, prefix=f"{prefix}apikey:").resolve(raw)
        finally:
            await kv.aclose()

    return asyncio.run(run())


def test_keys_carry_groups_and_rag_keys_groups_changes_them(redis_server) -> None:
    env = {"RAG_REDIS__URL": redis_server.url, "RAG_REDIS__KEY_PREFIX": "cli-groups:"}
    who = ("keys", "create", "--tenant", "acme", "--user", "ann")
    made = rag(*who, "--groups", "finance, legal", env=env)
    assert made.returncode == 0, made.stderr
    raw = made.stdout.strip()
    principal = resolve(redis_server.url, "cli-groups:", raw)
    assert principal is not None and principal.groups == {"finance", "legal"}

    changed = rag("keys", "groups", raw, "--set", "sales", env=env)
    assert changed.returncode == 0, changed.stderr
    assert "groups sales" in changed.stdout
    principal = resolve(redis_server.url, "cli-groups:", raw)
    assert principal is not None and principal.groups == {"sales"}

    cleared = rag("keys", "groups", raw, "--clear", env=env)
    assert cleared.returncode == 0 and "groups none" in cleared.stdout
    principal = resolve(redis_server.url, "cli-groups:", raw)
    assert principal is not None and principal.groups == frozenset()

    # Each run starts a process (seconds): one bad name per command; the rules are unit-tested.
    refused = rag(*who, "--groups", "fin ance", env=env)
    assert refused.returncode == 2 and "group" in refused.stderr and refused.stdout == ""
    assert rag("keys", "groups", raw, "--set", "a#b", env=env).returncode == 2
    blank = rag("keys", "groups", raw, "--set", " , ", env=env)
    assert blank.returncode == 2 and "--clear" in blank.stderr
    unknown = rag("keys", "groups", "rag-no-such-key", "--set", "x", env=env)
    assert unknown.returncode == 1 and "no such key" in unknown.stderr


def test_ingest_jsonl_keeps_access_lists_and_skips_bad_ones(
    tmp_path: Path, shared_embedder
) -> None:
    corpus = tmp_path / "docs.jsonl"
    lines = [
        {"id": "memo", "text": "Merger terms for the finance team.", "access": {"groups": ["fin"]}},
        {"id": "open", "text": "The merger party is on Friday."},
        {"id": "bad", "text": "Merger rumours.", "access": {"groups": ["a b"]}},
    ]
    corpus.write_text("\n".join(json.dumps(line) for line in lines) + "\n", "utf-8")
    index_dir = tmp_path / "index"
    done = rag(
        "ingest", str(corpus), "--tenant", "acme", env={"RAG_RETRIEVAL__INDEX_DIR": str(index_dir)}
    )
    assert done.returncode == 0, done.stderr
    assert "ingested 2 documents" in done.stdout
    assert "docs.jsonl:3:" in done.stderr and "access" in done.stderr

    store = IndexStore(index_dir, shared_embedder)
    index = store.current("acme")
    assert index is not None
    assert dict(zip(index.records.document_id, index.records.access, strict=True)) == {
        "memo": AccessList(groups=frozenset({"fin"})),
        "open": None,
    }
    retriever = HybridRetriever(store)
    found = {
        h.document_id for h in retriever.search("acme", "merger", None, viewer=Viewer("x")).hits
    }
    assert found == {"open"}
    member = Viewer("x", frozenset({"fin"}))
    assert {
        h.document_id for h in retriever.search("acme", "merger", None, viewer=member).hits
    } == {
        "memo",
        "open",
    }
