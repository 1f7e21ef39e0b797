"""Cache-hit latency through the service, beside a floor measured in the same run.

    python -m bench.cache_hit [--requests 2000] [--concurrency 1 32]

Both servers run as their own uvicorn processes on loopback, against a private redis-server:
the service (auth, validate, cache lookup; the answer is a cache hit) and the floor (a bare
FastAPI route doing one Redis GET). The same client measures both, interleaved by round, and
prints p50/p99 latency and requests/s for each, and the ratio service/floor.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import orjson
import redis.asyncio as aioredis
from opentelemetry import trace

from app.schemas import ChatCompletionRequest
from app.settings import Settings
from pipeline.context import Completion
from pipeline.keys import ApiKeyStore
from pipeline.kv import KeyValueStore
from pipeline.stages.cache import ResponseCache, cache_key
from tests.support.servers import RedisServer, free_port, wait_for

ROOT = Path(__file__).resolve().parents[1]
BODY = {
    "model": "smollm2",
    "messages": [{"role": "user", "content": "What is the capital of France?"}],
    "max_tokens": 16,
    "temperature": 0,
    "rag": {"enabled": False},
}


def serve(target: str, port: int, env: dict[str, str]) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "uvicorn",
            target,
            "--port",
            str(port),
            "--log-level",
            "warning",
            "--no-access-log",
            *(["--factory"] if target.endswith("create_app") else []),
        ],
        cwd=ROOT,
        env={**os.environ, **env},
    )


def up(url: str) -> bool:
    try:
        return httpx.get(url, timeout=0.5).status_code < 500
    except httpx.HTTPError:
        return False


async def prefill(redis_url: str, prefix: str) -> str:
    """Create a key and store the answer the benchmark request will hit."""
    kv = KeyValueStore.from_url(redis_url, trace.NoOpTracer())
    keys = ApiKeyStore(kv, prefix=f"{prefix}apikey:")
    raw = await keys.create("bench", "bench")
    principal = await keys.resolve(raw)
    assert principal is not None
    defaults = Settings()
    params = ChatCompletionRequest.model_validate(BODY).to_params(
        defaults.retrieval.top_k, defaults.llm.default_max_tokens
    )
    completion = Completion(
        content="The capital of France is Paris.",
        finish_reason="stop",
        model="smollm2",
        prompt_tokens=20,
        completion_tokens=8,
    )
    cache = ResponseCache(kv, prefix=f"{prefix}cache:")
    await cache.put(cache_key(params, principal, "none"), completion)
    await kv.aclose()
    floor = aioredis.Redis.from_url(redis_url)
    await floor.set("bench:floor", orjson.dumps(completion.to_dict()))
    await floor.aclose()
    return raw


async def measure(
    url: str, headers: dict[str, str], requests: int, concurrency: int
) -> dict[str, float]:
    latencies: list[float] = []
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(limits=limits, timeout=30) as client:
        for _ in range(min(50, requests)):  # warm connections and code paths
            await client.post(url, json=BODY, headers=headers)
        queue = iter(range(requests))

        async def worker() -> None:
            for _ in queue:
                started = time.perf_counter()
                response = await client.post(url, json=BODY, headers=headers)
                latencies.append(time.perf_counter() - started)
                if response.status_code != 200:
                    raise RuntimeError(f"{url}: {response.status_code} {response.text[:200]}")

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - started
    latencies.sort()
    return {
        "p50_ms": statistics.median(latencies) * 1000,
        "p99_ms": latencies[int(len(latencies) * 0.99) - 1] * 1000,
        "rps": len(latencies) / wall,
    }


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    args = parser.parse_args()

    redis_server = RedisServer()
    redis_server.start()
    prefix = "bench:"
    key = await prefill(redis_server.url, prefix)
    service_port, floor_port = free_port(), free_port()
    procs = [
        serve(
            "app.main:create_app",
            service_port,
            {
                "RAG_REDIS__URL": redis_server.url,
                "RAG_REDIS__KEY_PREFIX": prefix,
                "RAG_LLM__BASE_URL": "http://127.0.0.1:9",
                "RAG_RETRIEVAL__ENABLED": "false",
            },
        ),
        serve("bench.floor_app:app", floor_port, {"BENCH_REDIS_URL": redis_server.url}),
    ]
    try:
        wait_for(lambda: up(f"http://127.0.0.1:{service_port}/healthz"), 60, "service")
        wait_for(lambda: up(f"http://127.0.0.1:{floor_port}/docs"), 60, "floor")
        service = (
            f"http://127.0.0.1:{service_port}/v1/chat/completions",
            {"Authorization": f"Bearer {key}"},
        )
        async with httpx.AsyncClient() as client:
            check = await client.post(service[0], json=BODY, headers=service[1])
        assert check.headers["x-cache"] == "hit", check.text
        floor = (f"http://127.0.0.1:{floor_port}/floor", {})
        print(
            f"# cache-hit benchmark, {args.requests} requests x {args.rounds} rounds, "
            f"{os.cpu_count()} cores, {time.strftime('%Y-%m-%d')}"
        )
        print("| concurrency | target | p50 ms | p99 ms | req/s |")
        print("|---|---|---|---|---|")
        for concurrency in args.concurrency:
            runs: dict[str, list[dict[str, float]]] = {"service": [], "floor": []}
            for _ in range(args.rounds):
                for name, (url, headers) in (("floor", floor), ("service", service)):
                    runs[name].append(await measure(url, headers, args.requests, concurrency))
            summary = {
                name: {k: statistics.median(r[k] for r in results) for k in results[0]}
                for name, results in runs.items()
            }
            for name in ("floor", "service"):
                s = summary[name]
                cells = [f"{s['p50_ms']:.2f}", f"{s['p99_ms']:.2f}", f"{s['rps']:.0f}"]
                print(f"| {concurrency} | {name} | " + " | ".join(cells) + " |")
            ratio = summary["service"]["p50_ms"] / summary["floor"]["p50_ms"]
            print(
                f"| {concurrency} | service/floor p50 | {ratio:.2f}x | | "
                f"{summary['service']['rps'] / summary['floor']['rps']:.2f}x |"
            )
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(10)
        redis_server.stop()


if __name__ == "__main__":
    asyncio.run(main())
