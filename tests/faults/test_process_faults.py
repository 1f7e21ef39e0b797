"""SIGKILL in the middle of the work, on the real processes (`rag ingest`, `rag worker`):

- ingestion killed while it writes a snapshot, then again between two of its versions: after a
  restart the tenant's index is exactly one published version (its documents, its chunk count,
  searchable through the API), never a mix, and the next writer clears what the dead one left;
- a worker killed while a job runs on the real vLLM: the next worker takes the job over after
  the visibility timeout and finishes it; no job lost, none completed twice (one webhook each).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from app.stores import job_queue
from retrieval import Document, Embedder, IndexStore
from retrieval.versions import POINTER, read_pointer
from tests.app.test_jobs import auth, chat_body, finished, submit
from tests.conftest import AppHarness, make_settings
from tests.pipeline.jobs.receiver import Receiver
from tests.support.faultproxy import FaultProxy, hold_after_content
from tests.support.servers import ROOT, UNENDING, free_port

TENANT = "acme"
# Short passages on two topics; many documents share a text, so the index is large (the write
# of a snapshot takes long enough to be caught in the act) while the model embeds few texts.
OLD_TEXTS = [f"Aspirin trial {i} reduced heart attacks in older patients." for i in range(10)]
NEW_TEXTS = [f"Glacier survey {i} measured ice loss in alpine valleys." for i in range(12)]
OLD = [Document(f"old-{i}", OLD_TEXTS[i % len(OLD_TEXTS)]) for i in range(4_000)]
NEW = [{"id": f"new-{i}", "text": NEW_TEXTS[i % len(NEW_TEXTS)]} for i in range(2_000)]
BATCH = 1_000  # two versions per `rag ingest` run


def rag_process(*args: str, env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "app.cli", *args],
        cwd=ROOT,
        env={**os.environ, **env},
        text=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )


def kill_when(process: subprocess.Popen[str], check: Any, within: float, what: str) -> None:
    """SIGKILL ``process`` the moment ``check()`` holds (polled without sleeping)."""
    deadline = time.monotonic() + within
    try:
        while not check():
            if process.poll() is not None:
                _, stderr = process.communicate()
                raise AssertionError(f"the process ended before {what}: {stderr[-2000:]}")
            if time.monotonic() > deadline:
                raise AssertionError(f"{what} did not happen within {within} s")
    finally:
        process.send_signal(signal.SIGKILL)
        process.communicate(timeout=30)
    assert process.returncode == -signal.SIGKILL


def unpublished(directory: Path) -> list[str]:
    """Snapshots on disk that CURRENT does not name: what a killed writer left."""
    current = read_pointer(directory)
    return sorted(
        p.name
        for p in directory.iterdir()
        if p.is_dir() and p.name != current and (p.name.startswith(".tmp-") or p.name[0].isdigit())
    )


async def search_ids(h: AppHarness, key: str, query: str) -> tuple[str, set[str]]:
    response = await h.client.post(
        "/v1/retrieve",
        json={"query": query, "top_k": 50, "min_relevance": 0.0},
        headers=auth(key),
    )
    assert response.status_code == 200, response.text
    body = response.json()
    return body["index_version"], {hit["document_id"] for hit in body["data"]}


async def check_exactly(
    h: AppHarness, key: str, root: Path, embedder: Embedder, expected: set[str]
) -> str:
    """The tenant's index, read afresh as after a restart, is exactly ``expected``: its
    documents, one chunk each, and searches through the API see that version only."""
    fresh = IndexStore(root, embedder)
    index = fresh.current(TENANT)
    assert index is not None
    assert set(index.rows_by_document) == expected, "the documents of one published version"
    assert len(index) == index.documents == len(expected)
    for query, topic in (("glacier ice loss in alpine valleys", "new-"), ("aspirin", "old-")):
        version, found = await search_ids(h, key, query)
        assert version == index.version
        assert found <= expected, sorted(found - expected)[:5]
        assert bool(found) == any(d.startswith(topic) for d in expected), (query, len(found))
    return index.version


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    path = tmp_path / "new.jsonl"
    path.write_text("".join(json.dumps(d) + "\n" for d in NEW))
    return path


async def test_killed_ingest_leaves_exactly_one_published_version(
    make_app, redis_server, shared_embedder: Embedder, tmp_path: Path, corpus: Path
) -> None:
    root = tmp_path / "indexes"
    seeded = IndexStore(root, shared_embedder).upsert(TENANT, OLD).version
    directory = root / TENANT
    old_ids = {d.id for d in OLD}
    first_batch = old_ids | {d["id"] for d in NEW[:BATCH]}
    everything = old_ids | {d["id"] for d in NEW}
    env = {"RAG_RETRIEVAL__INDEX_DIR": str(root), "RAG_ENVIRONMENT": "test"}
    ingest = ("ingest", str(corpus), "--tenant", TENANT, "--batch", str(BATCH), "--quiet")
    settings = make_settings(
        redis_server.url,
        f"http://127.0.0.1:{free_port()}",  # search only: no model is called
        retrieval={"index_dir": str(root)},
        jobs={"workers": 0},
    )

    # 1. Killed while it writes its first snapshot (the temp directory has just appeared).
    writer = rag_process(*ingest, env=env)
    kill_when(
        writer,
        lambda: any(p.name.startswith(".tmp-") for p in directory.iterdir()),
        180,
        "the first snapshot's write",
    )
    left = unpublished(directory)
    assert left, "the kill landed while the snapshot was written, before it was published"
    async with make_app(settings) as h:
        key = await h.key(tenant=TENANT, scopes="retrieve")
        assert await check_exactly(h, key, root, shared_embedder, old_ids) == seeded

        # 2. Restarted, and killed the moment its first version is published.
        writer = rag_process(*ingest, env=env)
        kill_when(writer, lambda: read_pointer(directory) != seeded, 180, "the first version")
        # The first version, or the second if the kill came after it too: either one whole.
        expected = first_batch if _documents(root) == len(first_batch) else everything
        version = await check_exactly(h, key, root, shared_embedder, expected)
    assert version != seeded
    assert not set(left) & {p.name for p in directory.iterdir()}, "the next writer cleared them"
    assert (directory / POINTER).read_text() == version


def _documents(root: Path) -> int:
    """How many documents the published version holds, from its meta.json alone."""
    directory = root / TENANT
    meta = json.loads((directory / read_pointer(directory) / "meta.json").read_text())
    return int(meta["documents"])


def worker_env(settings: Any, vllm_url: str) -> dict[str, str]:
    return {
        "RAG_ENVIRONMENT": "test",
        "RAG_REDIS__URL": settings.redis.url,
        "RAG_REDIS__KEY_PREFIX": settings.redis.key_prefix,
        "RAG_LLM__BASE_URL": vllm_url,
        "RAG_RETRIEVAL__ENABLED": "false",
        "RAG_JOBS__POLL_SECONDS": "0.2",
        "RAG_JOBS__VISIBILITY_TIMEOUT_SECONDS": "1.5",
        "RAG_JOBS__WEBHOOK_ALLOW": "127.0.0.1/32",
    }


async def job_status(h: AppHarness, key: str, job_id: str) -> dict[str, Any]:
    response = await h.client.get(f"/v1/jobs/{job_id}", headers=auth(key))
    assert response.status_code == 200, response.text
    job: dict[str, Any] = response.json()
    return job


async def test_a_job_of_a_killed_rag_worker_is_finished_once_by_the_next(
    make_app, redis_server, vllm
) -> None:
    settings = make_settings(
        redis_server.url,
        vllm.url,
        jobs={"workers": 0, "webhook_allow": ["127.0.0.1/32"]},
        retrieval={"enabled": False},
    )
    env = worker_env(settings, vllm.url)
    async with make_app(settings) as h:
        key = await h.key()
        with Receiver() as receiver:
            long = chat_body(
                "Count from 1 to 200, separated by commas.",
                max_tokens=96,
                logit_bias=UNENDING,
                webhook_url=receiver.url,
            )
            ids = [(await submit(h, key, long)).json()["id"]]
            for n in range(2):
                short = chat_body(f"Say hello ({n}).", max_tokens=8, webhook_url=receiver.url)
                ids.append((await submit(h, key, short)).json()["id"])

            # The doomed worker's model answer is held after its first word, so the kill comes
            # mid-run however fast the model (it once wrote 64 tokens before a test could act).
            with FaultProxy(vllm.url) as llm:
                llm.rewrite(hold_after_content(llm, 1))
                doomed = rag_process(
                    "worker", "--concurrency", "1", env=worker_env(settings, llm.url)
                )
                try:
                    await _running(h, key, ids[0], doomed)
                    held = await asyncio.to_thread(
                        llm.holding_requests, b"/v1/chat/completions", 1, 180
                    )
                    assert held, "the doomed worker's model call did not start within 180 s"
                finally:
                    doomed.send_signal(signal.SIGKILL)
            await asyncio.to_thread(doomed.communicate, timeout=30)
            assert doomed.returncode == -signal.SIGKILL
            orphan = await job_status(h, key, ids[0])
            assert (orphan["status"], orphan["attempts"]) == ("running", 1), "killed mid-run"

            survivor = rag_process("worker", "--concurrency", "2", env=env)
            try:
                jobs = [await finished(h, key, job_id, within=240) for job_id in ids]
                assert await asyncio.to_thread(receiver.wait, len(ids), 30), "every webhook"
                await asyncio.sleep(1.0)  # a second delivery of any job would arrive now
            finally:
                survivor.send_signal(signal.SIGTERM)
                _, stderr = await asyncio.to_thread(survivor.communicate, timeout=60)
            assert survivor.returncode == 0, stderr
        backlog = await job_queue(h.services.settings, h.services.kv).backlog()
    assert [j["status"] for j in jobs] == ["succeeded"] * 3, jobs
    assert [j["attempts"] for j in jobs] == [2, 1, 1], "only the killed run was run again"
    assert all(j["result"]["choices"][0]["message"]["content"].strip() for j in jobs)
    delivered = [json.loads(r.body)["id"] for r in receiver.received]
    assert sorted(delivered) == sorted(ids), "one completion, one webhook, per job"
    assert backlog == 0


async def _running(h: AppHarness, key: str, job_id: str, process: subprocess.Popen[str]) -> None:
    """Wait until the job runs (in ``process``, the only worker)."""
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        job = await job_status(h, key, job_id)
        if job["status"] == "running":
            return
        assert job["status"] == "queued", job
        assert process.poll() is None, "the worker died by itself"
        await asyncio.sleep(0.05)
    raise AssertionError("the worker did not start the job within 180 s")
