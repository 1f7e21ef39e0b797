"""The app under uvicorn with a fault proxy in front of its Redis and one in front of its vLLM,
and the counts a fault test compares before and after (tasks on the app's loop, connections
open through each proxy)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import httpx
from fastapi import FastAPI

from app.main import create_app
from app.services import Services
from pipeline.telemetry.metrics import REDIS_ERRORS
from retrieval import Embedder
from tests.conftest import make_settings
from tests.support.faultproxy import FaultProxy
from tests.support.servers import LiveService


@dataclass(frozen=True)
class Counts:
    """``tasks``: on the app's loop. ``redis_busy``: the Redis pool's connections in use;
    ``redis_pooled``: all it holds; ``redis_open``, ``llm_open``: open through each proxy."""

    tasks: int
    redis_busy: int
    redis_pooled: int
    redis_open: int
    llm_open: int


class ProxiedService:
    """A ``LiveService`` whose Redis and vLLM are reached through ``redis`` and ``llm``."""

    def __init__(self, app: FastAPI, live: LiveService, redis: FaultProxy, llm: FaultProxy) -> None:
        self.app = app
        self.live = live
        self.redis = redis
        self.llm = llm
        self.client = httpx.Client(base_url=live.url, timeout=60)

    @property
    def services(self) -> Services:
        services: Services = self.app.state.services
        return services

    def key(self, tenant: str = "faults", user: str = "fay") -> str:
        return self.live.run(self.services.keys.create(tenant, user))

    def chat(self, key: str, body: dict[str, Any], **headers: str) -> httpx.Response:
        headers["Authorization"] = f"Bearer {key}"
        return self.client.post("/v1/chat/completions", json=body, headers=headers)

    def breaker_closed(self) -> bool:
        return self.services.kv.available

    def counts(self) -> Counts:
        # redis-py's pool keeps no public count of what it holds; its two collections are it.
        pool = self.services.kv.client.connection_pool

        async def inside() -> tuple[int, int, int]:
            busy = len(pool._in_use_connections)
            return len(asyncio.all_tasks()) - 1, busy, busy + len(pool._available_connections)

        tasks, busy, pooled = self.live.run(inside())
        return Counts(tasks, busy, pooled, self.redis.open_connections, self.llm.open_connections)

    def assert_settled(self, before: Counts, within: float = 10.0) -> Counts:
        """Wait until no more tasks run on the app's loop, no more Redis connections are in
        use, and no more vLLM connections are open than ``before``, and every connection open
        to Redis is one its pool holds (a pool may keep more idle ones than before: it grows
        to the concurrency it saw, up to its bound); fail with the counts otherwise."""
        deadline = time.monotonic() + within
        while True:
            now = self.counts()
            settled = (
                now.tasks <= before.tasks
                and now.redis_busy <= before.redis_busy
                and now.redis_open <= now.redis_pooled
                and now.llm_open <= before.llm_open
            )
            if settled or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert settled, f"leaked: before {before}, after {now}"
        return now


@contextmanager
def proxied_service(
    embedder: Embedder, redis_url: str, llm_url: str, **groups: dict[str, Any]
) -> Iterator[ProxiedService]:
    with FaultProxy(redis_url) as redis, FaultProxy(llm_url) as llm:
        settings = make_settings(redis.url, llm.url, **groups)
        app = create_app(settings, embedder=embedder)
        with LiveService(app) as live:
            service = ProxiedService(app, live, redis, llm)
            try:
                yield service
            finally:
                service.client.close()
                # Whatever a test left switched, the app shuts down against working parts.
                redis.passing()
                llm.passing()


def redis_errors(kind: str) -> float:
    """Redis calls that failed so far in this process with ``kind`` (all commands)."""
    return sum(
        sample.value
        for metric in REDIS_ERRORS.collect()
        for sample in metric.samples
        if sample.name.endswith("_total") and sample.labels["kind"] == kind
    )


def sse_events(text: str) -> list[Any]:
    """The data of each SSE event: parsed JSON, or the string ``[DONE]``."""
    return [
        data if data == "[DONE]" else json.loads(data)
        for line in text.splitlines()
        if line.startswith("data: ") and (data := line[6:])
    ]


def streamed_text(events: list[Any]) -> str:
    return "".join(
        e["choices"][0]["delta"].get("content") or ""
        for e in events
        if isinstance(e, dict) and e.get("choices")
    )


def finish_reasons(events: list[Any]) -> list[str]:
    return [
        e["choices"][0]["finish_reason"]
        for e in events
        if isinstance(e, dict) and e.get("choices") and e["choices"][0].get("finish_reason")
    ]


def assert_openai_error(response: httpx.Response, status: int, error_type: str) -> dict[str, Any]:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}, body
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["type"] == error_type, body
    assert body["error"]["message"], body
    error: dict[str, Any] = body["error"]
    return error
