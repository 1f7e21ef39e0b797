"""Fixtures of the job tests: a queue on the session's real redis-server, under its own prefix."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from opentelemetry import trace

from pipeline.context import Principal
from pipeline.jobs.model import Job
from pipeline.jobs.queue import JobQueue
from pipeline.store.kv import KeyValueStore

ALICE = Principal(tenant="acme", user="alice", scopes=frozenset({"chat"}), key_id="rag-alice")
BOB = Principal(tenant="globex", user="bob", scopes=frozenset({"chat"}), key_id="rag-bob")


def make_job(question: str = "hi", principal: Principal = ALICE, **fields: Any) -> Job:
    body = {"model": "smollm2", "messages": [{"role": "user", "content": question}]}
    return Job.create(principal, body, max_attempts=fields.pop("max_attempts", 3), **fields)


@pytest.fixture
async def kv(redis_server) -> AsyncIterator[KeyValueStore]:
    # 10 s, not the 0.5 s default: a worker's blocking read (200 ms) whose reply a loaded
    # machine reads late would fail, and the entries it was handed would wait out the 30 s
    # visibility timeout. The tests of a short timeout make their own store.
    store = KeyValueStore.from_url(redis_server.url, trace.NoOpTracer(), timeout=10.0)
    yield store
    await store.aclose()


@pytest.fixture
def prefix() -> str:
    return f"jt{uuid.uuid4().hex[:8]}:"


@pytest.fixture
def queue(kv: KeyValueStore, prefix: str) -> JobQueue:
    return JobQueue(kv, prefix=prefix, max_attempts=3, result_ttl=600)


async def wait_until(
    check: Callable[[], Awaitable[bool]], within: float = 30.0, what: str = "condition"
) -> None:
    deadline = asyncio.get_running_loop().time() + within
    while asyncio.get_running_loop().time() < deadline:
        if await check():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"{what} not reached within {within} s")
