"""The `rag` command: keys and ingestion from files, run as a user would run it."""

from __future__ import annotations

import asyncio
import fcntl
import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import redis
from opentelemetry import trace

from pipeline.answer.completion import Completion
from pipeline.stages.cache import ResponseCache
from pipeline.store.keys import ApiKeyStore
from pipeline.store.kv import KeyValueStore
from retrieval import Document, HybridRetriever, IndexStore
from tests.support.cli import rag
from tests.support.servers import free_port


def own_redis(redis_server) -> dict[str, str]:
    """The test's Redis, under a prefix of its own (a delete erases cached answers there)."""
    return {
        "RAG_REDIS__URL": redis_server.url,
        "RAG_REDIS__KEY_PREFIX": f"cli{uuid.uuid4().hex[:6]}:",
    }


async def store_answers(url: str, prefix: str, names: list[str]) -> None:
    """Cached answers under ``names``, stored as the service stores them (named in their
    tenant's entries, which a delete's erasure reads)."""
    kv = KeyValueStore.from_url(url, trace.NoOpTracer(), timeout=5.0)
    try:
        cache = ResponseCache(kv, prefix=prefix)
        answer = Completion(model="smollm2", content="Tides.", finish_reason="stop")
        for name in names:
            assert await cache.put(name.removeprefix(prefix), answer)
    finally:
        await kv.aclose()


def test_keys_create_prints_a_key_that_resolves_to_the_principal(redis_server) -> None:
    env = {"RAG_REDIS__URL": redis_server.url, "RAG_REDIS__KEY_PREFIX": "cli-test:"}
    done = rag("keys", "create", "--tenant", "dev", "--user", "ann", "--scopes", "chat", env=env)
    assert done.returncode == 0, done.stderr
    raw = done.stdout.strip()
    assert raw.startswith("rag-") and "\n" not in raw

    async def resolve() -> object:
        kv = KeyValueStore.from_url(redis_server.url, trace.NoOpTracer())
        try:
            return await ApiKeyStore(kv, prefix="cli-test:apikey:").resolve(raw)
        finally:
            await kv.aclose()

    principal = asyncio.run(resolve())
    assert principal is not None
    assert (principal.tenant, principal.user, principal.scopes) == ("dev", "ann", {"chat"})
    # A path, and names of only dots: the index store could not give them a directory (every
    # document request with such a key was a 500).
    for tenant in ("../etc", "..", "."):
        bad = rag("keys", "create", "--tenant", tenant, "--user", "x", env=env)
        assert bad.returncode == 2 and "tenant" in bad.stderr, (tenant, bad.stderr)


def test_keys_create_refuses_no_scopes_and_weak_custom_keys_and_revoke_takes_the_raw_key(
    redis_server,
) -> None:
    env = {"RAG_REDIS__URL": redis_server.url, "RAG_REDIS__KEY_PREFIX": "cli-keys:"}
    who = ("keys", "create", "--tenant", "dev", "--user", "ann")
    empty = rag(*who, "--scopes", "", env=env)
    assert empty.returncode == 2 and "at least one scope" in empty.stderr
    assert empty.stdout == ""
    weak = rag(*who, "--key", "rag-dev.s3cret", env=env)
    assert weak.returncode == 2 and "too weak" in weak.stderr and "at least 32" in weak.stderr
    assert "s3cret" not in weak.stderr, "the key is not echoed"
    strong = "team.Zq7-vP2mL9xK4tR8wB1nC6yH3jF5sD0gA"
    made = rag(*who, "--scopes", "chat,admin", "--key", strong, env=env)
    assert made.returncode == 0 and made.stdout.strip() == strong

    async def stored() -> tuple[object, list[bytes]]:
        kv = KeyValueStore.from_url(redis_server.url, trace.NoOpTracer())
        try:
            principal = await ApiKeyStore(kv, prefix="cli-keys:apikey:").resolve(strong)
            return principal, await kv.client.keys("cli-keys:*")
        finally:
            await kv.aclose()

    principal, names = asyncio.run(stored())
    assert principal is not None and getattr(principal, "scopes", None) == {"chat", "admin"}
    assert not any(b"team" in name for name in names), "no part of the key in Redis' key names"
    revoked = rag("keys", "revoke", strong, env=env)
    assert revoked.returncode == 0, revoked.stderr
    assert asyncio.run(stored())[0] is None
    again = rag("keys", "revoke", strong, env=env)
    assert again.returncode == 1 and "no such key" in again.stderr


def test_ingest_reads_a_folder_and_beir_jsonl_and_skips_what_it_cannot_read(
    tmp_path: Path, shared_embedder, redis_server
) -> None:
    docs = tmp_path / "docs"
    (docs / "sub").mkdir(parents=True)
    (docs / "volcano.md").write_text("# Volcanoes\n\nMagma rises through the crust and erupts.\n")
    (docs / "sub" / "tides.txt").write_text("Tides are caused by the gravity of the Moon.\n")
    (docs / "latin1.txt").write_bytes("Caf\xe9 cr\xe8me br\xfbl\xe9e".encode("latin-1"))
    (docs / "ignored.png").write_bytes(b"\x89PNG")
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(
        "\n".join(
            [
                json.dumps(
                    {
                        "_id": "b1",
                        "title": "Aspirin",
                        "text": "Aspirin thins blood.",
                        "metadata": {},
                    }
                ),
                "{not json",
                json.dumps({"_id": "b2", "title": "", "text": ""}),
                json.dumps({"_id": "b3", "title": "Statins", "text": "Statins lower LDL."}),
                # An integer past 64 bits was stored as the float 1.1805916207174113e+21.
                '{"_id": "b4", "text": "Big numbers.", "metadata": {"n": 1180591620717411303424}}',
                '{"_id": "b5", "text": 1e400}',  # was ingested as the text "inf"
            ]
        )
    )
    index_dir = tmp_path / "index"
    env = {"RAG_RETRIEVAL__INDEX_DIR": str(index_dir), **own_redis(redis_server)}

    folder = rag("ingest", str(docs), "--tenant", "files", env=env)
    assert folder.returncode == 0, folder.stderr
    assert "ingested 2 documents" in folder.stdout
    assert "latin1.txt: not UTF-8" in folder.stderr

    beir = rag("ingest", str(corpus), "--tenant", "files", "--quiet", env=env)
    assert beir.returncode == 0, beir.stderr
    assert beir.stdout == ""  # quiet: no summary, but the problems are still reported
    problems = beir.stderr.splitlines()
    assert len(problems) == 4 and all(line.startswith("skipped ") for line in problems)
    assert "corpus.jsonl:2: not JSON" in problems[0]
    assert "corpus.jsonl:3:" in problems[1]
    assert "corpus.jsonl:5:" in problems[2] and "64 bits" in problems[2]
    assert "corpus.jsonl:6:" in problems[3] and "must be strings" in problems[3]

    store = IndexStore(index_dir, shared_embedder)
    retriever = HybridRetriever(store)
    vector = shared_embedder.embed(["what causes tides"])[0]
    hits = retriever.search("files", "what causes tides", vector, top_k=1).hits
    assert hits[0].document_id == "sub/tides.txt"
    titles = {
        h.document_id: h.title
        for h in retriever.search("files", "magma aspirin statins", None, top_k=10).hits
    }
    assert titles["volcano.md"] == "Volcanoes"
    assert {"b1", "b3"} <= set(titles)

    deleted = rag("delete", "--tenant", "files", "b1", env=env)
    assert deleted.returncode == 0 and "deleted 1 documents" in deleted.stdout
    store = IndexStore(index_dir, shared_embedder)
    remaining = HybridRetriever(store).search("files", "aspirin", None, top_k=10).hits
    assert "b1" not in {h.document_id for h in remaining}


def test_ingest_quiet_prints_nothing_when_it_succeeds(tmp_path: Path, shared_embedder) -> None:
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "tides.txt").write_text("Tides are caused by the gravity of the Moon.\n")
    index_dir = tmp_path / "index"
    env = {"RAG_RETRIEVAL__INDEX_DIR": str(index_dir)}
    done = rag("ingest", str(docs), "--tenant", "calm", "--quiet", env=env)
    assert done.returncode == 0, done.stderr
    assert (done.stdout, done.stderr) == ("", "")
    hits = HybridRetriever(IndexStore(index_dir, shared_embedder)).search(
        "calm", "tides moon", None, top_k=1
    )
    assert [h.document_id for h in hits.hits] == ["tides.txt"]


def test_keys_list_shows_ids_not_keys_and_a_lost_key_is_revoked_by_its_id(redis_server) -> None:
    env = {"RAG_REDIS__URL": redis_server.url, "RAG_REDIS__KEY_PREFIX": "cli-list:"}
    ann = rag("keys", "create", "--tenant", "acme", "--user", "ann", env=env).stdout.strip()
    bob = rag(
        "keys", "create", "--tenant", "acme", "--user", "bob", "--groups", "eng", env=env
    ).stdout.strip()
    rag("keys", "create", "--tenant", "other", "--user", "zed", env=env)
    listed = rag("keys", "list", "--tenant", "acme", env=env)
    assert listed.returncode == 0, listed.stderr
    header, *rows = listed.stdout.splitlines()
    assert header.split("\t") == ["key_id", "user", "scopes", "groups", "rpm", "tpm", "created"]
    by_user = {row.split("\t")[1]: row.split("\t") for row in rows}
    assert set(by_user) == {"ann", "bob"}
    assert by_user["bob"][2:6] == ["chat,retrieve", "eng", "default", "default"]
    assert ann not in listed.stdout and bob not in listed.stdout

    ann_id = by_user["ann"][0]
    both = rag("keys", "revoke", ann, "--id", ann_id, env=env)
    assert both.returncode == 2 and "not allowed with argument" in both.stderr
    limited = rag("keys", "limits", "--id", ann_id, "--rpm", "7", env=env)
    assert limited.returncode == 0, limited.stderr
    assert f"key {ann_id} (tenant acme, user ann): rpm 7" in limited.stdout
    revoked = rag("keys", "revoke", "--id", ann_id, env=env)
    assert revoked.returncode == 0, revoked.stderr
    assert f"revoked key {ann_id} (tenant acme, user ann)" in revoked.stderr
    assert rag("keys", "revoke", "--id", ann_id, env=env).returncode == 1  # no such key
    after = rag("keys", "list", "--tenant", "acme", env=env).stdout
    assert ann_id not in after and by_user["bob"][0] in after


def test_delete_of_a_document_the_tenant_does_not_have_is_not_found_with_exit_code_1(
    tmp_path: Path, shared_embedder, redis_server
) -> None:
    index_dir = tmp_path / "index"
    store = IndexStore(index_dir, shared_embedder)
    store.upsert("ours", [Document(id=i, text=f"Document {i} about tides.") for i in ("a", "b")])
    store.upsert("theirs", [Document(id="c", text="Document c about volcanoes.")])
    redis_env = own_redis(redis_server)
    env = {"RAG_RETRIEVAL__INDEX_DIR": str(index_dir), **redis_env}
    cache = f"{redis_env['RAG_REDIS__KEY_PREFIX']}cache:"
    answers = [f"{cache}{tenant}:{n:064x}" for tenant in ("ours", "theirs") for n in (1, 2)]
    asyncio.run(store_answers(redis_server.url, cache, answers))

    other = rag("delete", "--tenant", "ours", "c", env=env)
    assert other.returncode == 1
    assert "document 'c' not found for tenant 'ours'" in other.stderr
    assert "deleted" not in other.stdout
    theirs = HybridRetriever(IndexStore(index_dir, shared_embedder)).search(
        "theirs", "volcanoes", None, top_k=10
    )
    assert [h.document_id for h in theirs.hits] == ["c"]
    with redis.Redis.from_url(redis_server.url) as client:
        assert client.exists(*answers) == 4, "nothing deleted, no answer erased"

    mixed = rag("delete", "--tenant", "ours", "a", "nope", env=env)
    assert mixed.returncode == 1
    assert "deleted 1 documents" in mixed.stdout  # the ids the tenant has are still deleted
    assert "2 cached answers erased" in mixed.stdout  # the tenant's, and no other's
    with redis.Redis.from_url(redis_server.url) as client:
        kept = sorted(k.decode() for k in client.keys(f"{cache}*"))
        assert kept == sorted(a for a in answers if ":theirs:" in a)
    assert "document 'nope' not found for tenant 'ours'" in mixed.stderr
    assert "'a' not found" not in mixed.stderr

    no_index = rag("delete", "--tenant", "nobody", "a", env=env)
    assert no_index.returncode == 1
    assert "document 'a' not found for tenant 'nobody'" in no_index.stderr

    # Redis down: the document is deleted all the same, and the command says what was not.
    unreachable = {**env, "RAG_REDIS__URL": f"redis://127.0.0.1:{free_port()}/0"}
    found = rag("delete", "--tenant", "ours", "b", env=unreachable)
    assert found.returncode == 0, found.stderr
    assert "deleted 1 documents" in found.stdout and "not found" not in found.stderr
    assert "cached answers not erased" in found.stdout
    assert "Redis could not be reached" in found.stderr and "Traceback" not in found.stderr
    left = HybridRetriever(IndexStore(index_dir, shared_embedder)).search(
        "ours", "document tides", None, top_k=10
    )
    assert left.hits == []


def test_an_unreadable_index_refuses_ingest_and_restore_brings_back_the_last_readable_one(
    tmp_path: Path, shared_embedder
) -> None:
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "volcano.md").write_text("# Volcanoes\n\nMagma rises through the crust and erupts.\n")
    index_dir = tmp_path / "index"
    env = {"RAG_RETRIEVAL__INDEX_DIR": str(index_dir)}
    assert rag("ingest", str(docs), "--tenant", "files", env=env).returncode == 0
    good = (index_dir / "files" / "CURRENT").read_text().strip()
    (docs / "tides.txt").write_text("Tides are caused by the gravity of the Moon.\n")
    assert rag("ingest", str(docs), "--tenant", "files", env=env).returncode == 0
    bad = (index_dir / "files" / "CURRENT").read_text().strip()
    (index_dir / "files" / bad / "chunks.json").write_text("{not json")
    refused = rag("ingest", str(docs), "--tenant", "files", env=env)
    assert refused.returncode == 1, refused.stderr
    assert "the index of tenant 'files'" in refused.stderr and "Traceback" not in refused.stderr
    assert "`rag restore --tenant files`" in refused.stderr

    done = rag("restore", "--tenant", "files", env=env)
    assert done.returncode == 0, done.stderr
    assert f"version '{bad}' could not be read; version {good} is published again" in done.stdout
    assert "(1 documents, 1 chunks)" in done.stdout and "Traceback" not in done.stderr
    again = rag("ingest", str(docs), "--tenant", "files", env=env)
    assert again.returncode == 0, again.stderr
    hits = HybridRetriever(IndexStore(index_dir, shared_embedder)).search(
        "files", "moon gravity tides", None, top_k=1
    )
    assert [h.document_id for h in hits.hits] == ["tides.txt"]
    readable = rag("restore", "--tenant", "files", env=env)
    assert readable.returncode == 0 and "can be read; nothing to restore" in readable.stdout
    none = rag("restore", "--tenant", "nobody", env=env)
    assert none.returncode == 0 and "tenant nobody: no index; nothing to restore" in none.stdout

    newest = (index_dir / "files" / "CURRENT").read_text().strip()
    back = rag("restore", "--tenant", "files", "--version", good, env=env)  # take an ingest back
    assert back.returncode == 0, back.stderr
    assert f"version {good} (1 documents, 1 chunks) is published in place of {newest}" in (
        back.stdout
    )
    missing = rag("restore", "--tenant", "files", "--version", "00000099-abcdef", env=env)
    assert missing.returncode == 2 and f"(there are: {newest}, {good})" in missing.stderr

    (index_dir / "files" / "CURRENT").unlink()  # an operator's slip: not "no index"
    assert rag("ingest", str(docs), "--tenant", "files", env=env).returncode == 1
    pointed = rag("restore", "--tenant", "files", env=env)
    assert pointed.returncode == 0 and "CURRENT named no version; version" in pointed.stdout
    assert not (index_dir / "nobody").exists()

    for version in [p for p in (index_dir / "files").iterdir() if p.name[0].isdigit()]:
        (version / "chunks.json").write_text("")
    lost = rag("restore", "--tenant", "files", env=env)
    assert lost.returncode == 1
    assert "no kept version of tenant 'files' can be read" in lost.stderr
    assert "Traceback" not in lost.stderr
    (tmp_path / "a-file").write_text("")  # a fault of the machine, not of the index: said
    broken = rag(
        "restore",
        "--tenant",
        "files",
        env={"RAG_RETRIEVAL__INDEX_DIR": str(tmp_path / "a-file" / "index")},
    )
    assert broken.returncode == 1 and "rag: [Errno 20] Not a directory" in broken.stderr
    assert "Traceback" not in broken.stderr


def test_ingest_while_another_writer_holds_the_tenant_gives_up_in_time_saying_so(
    tmp_path: Path, shared_embedder
) -> None:
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "tides.txt").write_text("Tides are caused by the gravity of the Moon.\n")
    index_dir = tmp_path / "index"
    (index_dir / "busy").mkdir(parents=True)
    env = {
        "RAG_RETRIEVAL__INDEX_DIR": str(index_dir),
        "RAG_RETRIEVAL__WRITE_LOCK_WAIT_SECONDS": "0.5",
    }
    with (index_dir / "busy" / ".lock").open("a") as stalled:
        fcntl.flock(stalled, fcntl.LOCK_EX)  # a writer that stopped holding it
        busy = rag("ingest", str(docs), "--tenant", "busy", env=env)
    assert busy.returncode == 1, busy.stderr
    assert "held it for 0.5 s without progress" in busy.stderr, busy.stderr
    assert "0 documents were ingested before it" in busy.stderr
    assert "Traceback" not in busy.stderr
    assert not (index_dir / "busy" / "CURRENT").exists()  # nothing was published
    assert rag("ingest", str(docs), "--tenant", "busy", env=env).returncode == 0


def test_delete_while_another_writer_holds_the_tenant_says_run_it_again_later(
    tmp_path: Path, shared_embedder, redis_server
) -> None:
    index_dir = tmp_path / "index"
    IndexStore(index_dir, shared_embedder).upsert("busy", [Document(id="a", text="Tides.")])
    env = {
        **own_redis(redis_server),
        "RAG_RETRIEVAL__INDEX_DIR": str(index_dir),
        "RAG_RETRIEVAL__WRITE_LOCK_WAIT_SECONDS": "0.5",
    }
    with (index_dir / "busy" / ".lock").open("a") as stalled:
        fcntl.flock(stalled, fcntl.LOCK_EX)  # a writer that stopped holding it
        busy = rag("delete", "--tenant", "busy", "a", env=env)
    assert busy.returncode == 1, busy.stderr
    said = busy.stderr.strip().splitlines()[-1]  # after the development settings' notes
    assert said.startswith("rag: ") and said.endswith("Run it again later."), busy.stderr
    assert "Traceback" not in busy.stderr
    assert rag("delete", "--tenant", "busy", "a", env=env).returncode == 0


# Run in a child process: the modules a `rag` command loaded, once it has finished.
_LOADED = """
import json, sys
from app.cli import main
try:
    status = main(sys.argv[1:])
except SystemExit as exc:  # --help, and argparse's own refusals
    status = exc.code
print("LOADED " + json.dumps(sorted(sys.modules)))
sys.exit(status)
"""

# What only serving, the index or the web framework needs: a key command loads none of it.
_HEAVY = ("fastapi", "uvicorn", "faiss", "scipy", "onnxruntime", "torch", "app.services")


def _loaded(*args: str, env: dict[str, str]) -> tuple[int, set[str]]:
    done = subprocess.run(
        [sys.executable, "-c", _LOADED, *args],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = [x for x in done.stdout.splitlines() if x.startswith("LOADED ")]
    assert lines, f"rag {' '.join(args)} did not finish: {done.stderr[-2000:]}"
    return done.returncode, set(json.loads(lines[0].removeprefix("LOADED ")))


def test_key_and_feature_commands_load_neither_the_web_framework_nor_the_index_code(
    redis_server, tmp_path: Path
) -> None:
    env = {"RAG_REDIS__URL": redis_server.url, "RAG_REDIS__KEY_PREFIX": "cli-light:"}
    status, help_loaded = _loaded("--help", env=env)
    assert status == 0
    status, created = _loaded("keys", "create", "--tenant", "t", "--user", "u", env=env)
    assert status == 0
    status, refused = _loaded("keys", "create", "--tenant", "../t", "--user", "u", env=env)
    assert status == 2  # the error path too
    status, revoked = _loaded("keys", "revoke", "rag-no.such-key", env=env)
    assert status == 1  # "no such key", after asking Redis and the job queue
    status, secret = _loaded("webhooks", "secret", "--tenant", "t", env=env)
    assert status == 0
    status, listed = _loaded("keys", "list", "--tenant", "t", "--rescan", env=env)
    assert status == 0
    rows = tmp_path / "features.jsonl"
    rows.write_text('{"tenant": "t", "user": "u", "language": "en"}\n')
    status, features_loaded = _loaded("features", "load", str(rows), "--quiet", env=env)
    assert status == 0
    log = tmp_path / "log.jsonl"
    log.write_text('{"tenant": "t", "user": "u", "ts": 1, "filters": ["year=2020"]}\n')
    out = str(tmp_path / "derived.jsonl")
    status, computed = _loaded("features", "compute", "--log", str(log), "--out", out, env=env)
    assert status == 0
    assert "retrieval.filters" in computed  # the request log reads filters: the grammar alone
    # A copy to a Redis that does not answer: exit status 1, after its own imports.
    status, copied = _loaded("redis", "copy", "--to", "redis://127.0.0.1:1/0", env=env)
    assert status == 1
    commands = (
        *(help_loaded, created, refused, revoked, secret, listed, features_loaded, computed),
        copied,
    )
    for loaded in commands:
        assert not {m for m in loaded if m.split(".")[0] in _HEAVY or m in _HEAVY}
    assert "app.settings" not in help_loaded  # --help reads no settings
    assert {"app.cli.keys", "pipeline.store.keys", "redis"} <= created
    # The proof that the check can fail: the command that needs the index loads it.
    _, ingest = _loaded("ingest", "/nonexistent", "--tenant", "t", env=env)
    assert "app.services" in ingest and "faiss" in ingest
