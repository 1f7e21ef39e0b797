"""Liveness (the process answers) and readiness (Redis and the model server answer)."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter

from app.responses import JSONResponse
from app.services import ServicesDep

router = APIRouter(tags=["health"])


@router.get("/healthz")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/readyz", response_model=None)
async def readyz(services: ServicesDep) -> JSONResponse:
    redis_ok, llm_ok = await asyncio.gather(services.kv.ping(), services.llm.healthy())
    checks = {"redis": "ok" if redis_ok else "down", "llm": "ok" if llm_ok else "down"}
    ready = redis_ok and llm_ok
    return JSONResponse(
        {"status": "ready" if ready else "unready", "checks": checks},
        status_code=200 if ready else 503,
    )
