"""An OpenAI-compatible gateway in front of the real vLLM that checks request bodies as
OpenAI's own API does: a ``stream_options`` field it does not know is refused with OpenAI's
400 (``unknown_parameter``, the field named); any other request goes on to vLLM and its answer
comes back as vLLM streams it. vLLM itself accepts every field this service sends, so this is
how a test meets a stricter server."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

KNOWN_STREAM_OPTIONS = frozenset({"include_usage"})


def unknown_parameter(body: dict[str, Any]) -> str | None:
    """The first ``stream_options`` field of ``body`` that OpenAI's API does not know, by its
    dotted name (None: all known)."""
    unknown = sorted(set(body.get("stream_options") or {}) - KNOWN_STREAM_OPTIONS)
    return f"stream_options.{unknown[0]}" if unknown else None


def refusal(param: str) -> dict[str, Any]:
    """OpenAI's 400 body for a request parameter it does not know."""
    error = {
        "message": f"Unknown parameter: '{param}'.",
        "type": "invalid_request_error",
        "param": param,
        "code": "unknown_parameter",
    }
    return {"error": error}


def strict_gateway(upstream: str) -> FastAPI:
    """The gateway's app; ``app.state.refused`` counts its refusals, ``app.state.forwarded``
    holds the bodies it passed on."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with httpx.AsyncClient(base_url=upstream, timeout=120) as client:
            app.state.client = client
            yield

    app = FastAPI(lifespan=lifespan)
    app.state.refused = 0
    app.state.forwarded = []

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        body: dict[str, Any] = await request.json()
        if (param := unknown_parameter(body)) is not None:
            app.state.refused += 1
            return JSONResponse(refusal(param), status_code=400)
        app.state.forwarded.append(body)
        client: httpx.AsyncClient = app.state.client
        answer = await client.send(
            client.build_request("POST", "/v1/chat/completions", json=body), stream=True
        )
        return StreamingResponse(
            answer.aiter_raw(),
            status_code=answer.status_code,
            media_type=answer.headers.get("content-type"),
            background=BackgroundTask(answer.aclose),
        )

    return app
