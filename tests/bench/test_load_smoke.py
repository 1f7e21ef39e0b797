"""The load benchmark in small: a few seconds of cache hits, misses (the real vLLM), streamed and
plain answers at 32 connections against the service as its own process (`rag serve`).

Every request is answered whole with no unexpected error, every connection is answered, and
once the load has stopped the app holds no client connection and no file descriptor it did not
hold before, beyond its connection pools (Redis: at most two per concurrent request; vLLM: at
most one per miss in flight). `make bench-load` runs the long version (bench/load_bench.py).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.load_bench import HIT_QUESTIONS, App, warm_hits
from bench.loadclient import LoadSpec, Mix, chat_workload, run_load
from tests.support.process import ServiceProcess
from tests.support.servers import RedisServer, VLLMServer

CONNECTIONS = 32
MISS_SLOTS = 2


@pytest.fixture
def service(redis_server: RedisServer, vllm: VLLMServer, tmp_path: Path) -> Iterator[App]:
    # Retrieval off: the process starts in seconds (no embedding model), and the load's tenant
    # has no documents anyway.
    with ServiceProcess(redis_server.url, vllm.url, tmp_path, RAG_RETRIEVAL__ENABLED="false") as s:
        yield App(s, redis_server, vllm.url)


def test_a_mixed_load_is_answered_whole_and_leaves_no_descriptor_behind(service: App) -> None:
    key = service.service.key("load", "smoke", "chat")
    hits = HIT_QUESTIONS[:2]
    asyncio.run(warm_hits(service.service.url, key, hits))
    baseline = service.census()
    mix = Mix(miss_share=0.05, stream_share=0.5, miss_slots=MISS_SLOTS, miss_max_tokens=8)
    spec = LoadSpec(
        service.service.url,
        chat_workload(key, hits, mix),
        connections=CONNECTIONS,
        start_at=time.monotonic(),
        duration_s=3.0,
        drain_s=60.0,
    )
    result = run_load(spec)
    in_load = service.census()
    settled = asyncio.run(service.settle(baseline, within_s=20.0))

    examples = [e for t in result.kinds.values() for e in t.examples]
    assert result.unexpected == 0, examples
    assert result.connections_answered == CONNECTIONS
    assert result.sent == result.answered  # nothing left unanswered
    for kind in ("hit/plain", "hit/stream", "miss/plain", "miss/stream"):
        tally = result.kinds.get(kind)
        assert tally is not None and tally.answered > 0, f"no {kind} was answered"
    assert sum(len(result.kinds[k].latencies) for k in ("miss/plain", "miss/stream")) > 0
    assert result.kinds["hit/stream"].cache == {"hit": len(result.kinds["hit/stream"].latencies)}
    assert len(result.kinds["hit/stream"].ttfts) == len(result.kinds["hit/stream"].latencies)

    assert in_load.fds >= baseline.fds  # the census sees the load's sockets come and go
    assert settled.clients == 0, settled
    assert settled.other <= baseline.other, (baseline, settled)
    # Pooled, not leaked: a request's parallel stages (features, the cache, its log record) may
    # each hold a connection at once, so the pool may keep up to two per concurrent request.
    assert settled.redis <= baseline.redis + 2 * CONNECTIONS, (baseline, settled)
    assert settled.upstream <= baseline.upstream + MISS_SLOTS, (baseline, settled)
