"""The floor for the cache-hit benchmark: a bare FastAPI route that does one Redis GET."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import redis.asyncio as redis
from fastapi import FastAPI
from starlette.responses import Response

REDIS_URL = os.environ.get("BENCH_REDIS_URL", "redis://127.0.0.1:6379/0")
# BENCH_REDIS_CLUSTER: the URL names a node of a Redis Cluster (bench.cache_hit --cluster).
client = (redis.RedisCluster if os.environ.get("BENCH_REDIS_CLUSTER") else redis.Redis).from_url(
    REDIS_URL
)


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    yield
    await client.aclose()


app = FastAPI(lifespan=lifespan)


@app.post("/floor")
async def floor() -> Response:
    value = await client.get("bench:floor")
    return Response(value or b"{}", media_type="application/json")
