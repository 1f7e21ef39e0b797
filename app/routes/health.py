"""Liveness (the process answers) and readiness (Redis and the model server answer; whether
Milvus, when one is configured, is connected and answered its last call is said beside them,
not counted: the replica serves every other tenant).

Both need no key (probes and load balancers call them), so readiness is checked at most once a
second and the answer reused: a flood of `/readyz` costs Redis and the model server nothing
more than a probe every second does.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Final

from fastapi import APIRouter, Request

from app.http import answers
from app.http.responses import JSONResponse
from app.services import ServicesDep
from retrieval.backends.lazy import LazyBackend

router = APIRouter(tags=["health"])
READINESS_TTL_S: Final = 1.0


@router.get("/healthz", operation_id="healthz", response_model=answers.Health)
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get(
    "/readyz",
    response_model=None,
    operation_id="readyz",
    responses={
        200: {"model": answers.Readiness, "description": "Redis and the model server answer."},
        503: {"model": answers.Readiness, "description": "One of them does not."},
    },
)
async def readyz(request: Request, services: ServicesDep) -> JSONResponse:
    state = request.app.state
    cached: tuple[float, dict[str, Any], int] | None = getattr(state, "readiness", None)
    now = time.monotonic()
    if cached is None or now - cached[0] >= READINESS_TTL_S:
        redis_ok, llm_ok = await asyncio.gather(services.kv.ping(), services.llm.healthy())
        checks = {"redis": "ok" if redis_ok else "down", "llm": "ok" if llm_ok else "down"}
        milvus = services.retrieval.backends.backends.get("milvus") if services.retrieval else None
        if isinstance(milvus, LazyBackend):
            # Said, not counted: this replica still serves every tenant that is not on it.
            checks["milvus"] = "ok" if milvus.answering else "down"
            milvus.reconnect()  # a Milvus back after an outage is found without a request
        ready = redis_ok and llm_ok
        body = {"status": "ready" if ready else "unready", "checks": checks}
        cached = (time.monotonic(), body, 200 if ready else 503)
        state.readiness = cached
    return JSONResponse(cached[1], status_code=cached[2])
