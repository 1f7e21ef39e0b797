"""Shared fixtures: real Redis and vLLM servers for the session, apps with in-memory span export."""

from __future__ import annotations

import os
import tempfile
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from hypothesis import settings as hypothesis_settings
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from app.main import create_app
from app.path import Paths
from app.services import Services
from app.settings import Settings
from retrieval import Embedder
from tests.support.servers import RedisClusterServers, RedisServer, VLLMServer
from tests.support.tracing import memory_tracing

# A socket collected unclosed names the test and the code that opened it (the warning alone
# names neither, and fails whichever test the collector happens to run in).
pytest_plugins = ["tests.support.transports"]

# Property tests are deterministic in `make test`: each draws the same examples on every run and
# every machine (seeded from the test itself), with no example database carried between runs, so
# a fresh clone's suite passes or fails on the code alone. Failures found by `make fuzz` (random
# seeds, many more examples: the "fuzz" profile with RAG_FUZZ_FACTOR) are pinned with @example.
# Neither has a deadline: an example slowed past 200 ms by a busy machine (vLLM warming up beside
# the suite) is not a failure; speed is measured in bench/, not asserted in tests.
hypothesis_settings.register_profile(
    "ci", derandomize=True, database=None, print_blob=True, deadline=None
)
hypothesis_settings.register_profile("fuzz", derandomize=False, print_blob=True, deadline=None)
hypothesis_settings.load_profile(os.environ.get("RAG_HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    server = RedisServer()
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[RedisClusterServers]:
    """A Redis Cluster of three primaries, for the tests of ``RAG_REDIS__CLUSTER``."""
    cluster = RedisClusterServers()
    cluster.start()
    yield cluster
    cluster.stop()


# One vLLM for the session. It is launched as soon as the tests are collected, and the tests
# that need it run last: its warm-up (about two minutes the first time) passes while the others
# run, instead of stalling the first test that needs it.
VLLM = VLLMServer()


@pytest.hookimpl(trylast=True)  # after -k and -m have deselected what will not run
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    def needs_vllm(item: pytest.Item) -> bool:
        return "vllm" in getattr(item, "fixturenames", ())

    items.sort(key=needs_vllm)  # stable: each group keeps its order
    if items and needs_vllm(items[-1]) and not config.option.collectonly:
        VLLM.launch()


def pytest_sessionfinish(session: pytest.Session) -> None:
    VLLM.stop()


@pytest.fixture(scope="session")
def vllm() -> VLLMServer:
    VLLM.start()
    return VLLM


def make_settings(redis_url: str, llm_url: str, **groups: dict[str, Any]) -> Settings:
    """Settings of one test app: its own Redis key prefix and its own index directory.

    The features and route stages get 2 s budgets, not their 50 ms and 250 ms: on a loaded CI
    machine the event loop can reach a reply after such a budget is spent, the stage degrades,
    and an answer made after a degraded stage is not cached, so a miss-then-hit check fails by
    chance. The tests of those budgets set their own."""
    data: dict[str, Any] = {
        "environment": "test",
        "redis": {"url": redis_url, "key_prefix": f"t{uuid.uuid4().hex[:8]}:"},
        "llm": {"base_url": llm_url},
        "retrieval": {"index_dir": tempfile.mkdtemp(prefix="rag-test-index-")},
        "features": {"timeout_seconds": 2.0},
        "routing": {"timeout_seconds": 2.0},
    }
    for group, values in groups.items():
        data[group] = {**data.get(group, {}), **values}
    return Settings(**data)


class AppHarness:
    """An app with its lifespan running, an in-process client, and the spans it exported."""

    def __init__(self, app: FastAPI, exporter: InMemorySpanExporter) -> None:
        self.app = app
        self.exporter = exporter
        self.client = httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://service", timeout=120
        )

    @property
    def services(self) -> Services:
        services: Services = self.app.state.services
        return services

    @property
    def paths(self) -> Paths:
        paths: Paths = self.app.state.paths
        return paths

    async def key(self, tenant: str = "acme", user: str = "alice", scopes: str = "") -> str:
        chosen = frozenset(scopes.split(",")) if scopes else frozenset({"chat", "retrieve"})
        return await self.services.keys.create(tenant, user, chosen)

    async def chat(self, key: str | None, body: dict[str, Any], **headers: str) -> httpx.Response:
        if key is not None:
            headers["Authorization"] = f"Bearer {key}"
        return await self.client.post("/v1/chat/completions", json=body, headers=headers)


AppFactory = Callable[..., Any]


@pytest.fixture
def tracing() -> tuple[TracerProvider, InMemorySpanExporter]:
    """A fresh tracer provider and the in-memory exporter holding the spans it finished."""
    return memory_tracing()


@pytest.fixture(scope="session")
def shared_embedder() -> Embedder:
    """One loaded embedding model for every app of the session (loading it takes seconds)."""
    embedder = Embedder()
    embedder.warm_up()
    return embedder


@pytest.fixture
def make_app(shared_embedder: Embedder) -> Callable[[Settings], Any]:
    @asynccontextmanager
    async def factory(settings: Settings) -> AsyncIterator[AppHarness]:
        exporter = InMemorySpanExporter()
        app = create_app(
            settings, span_processors=[SimpleSpanProcessor(exporter)], embedder=shared_embedder
        )
        async with app.router.lifespan_context(app):
            harness = AppHarness(app, exporter)
            try:
                yield harness
            finally:
                await harness.client.aclose()

    return factory


def unique_question() -> str:
    """A question no earlier test asked, so its first request is a cache miss."""
    return f"In one short sentence, what is the capital of France? (ref {uuid.uuid4().hex[:6]})"


def chat_request(
    question: str, *, max_tokens: int = 8, model: str = "smollm2", **extra: Any
) -> dict[str, Any]:
    """A chat-completions body: one user message, greedy decoding, `max_tokens` short (the
    small model's answers are not what the tests read); `extra` fields go in as they are."""
    return {
        "model": model,
        "messages": [{"role": "user", "content": question}],
        "max_tokens": max_tokens,
        "temperature": 0,
        **extra,
    }
