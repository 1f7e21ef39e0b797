"""POST /v1/chat/completions: build the context, run the pipeline, shape the answer."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request
from starlette.responses import Response, StreamingResponse

from app.auth import bearer_token
from app.responses import JSONResponse, chat_completion, sse_stream
from app.schemas import ChatCompletionRequest
from app.services import ServicesDep
from pipeline.context import CacheControl, RequestContext

router = APIRouter(tags=["chat"])


@router.post("/v1/chat/completions", response_model=None)
async def create_chat_completion(
    body: ChatCompletionRequest, request: Request, services: ServicesDep
) -> Response:
    settings = services.settings
    ctx = RequestContext(
        params=body.to_params(settings.retrieval.top_k, settings.llm.default_max_tokens),
        credential=bearer_token(request),
        deadline=asyncio.get_running_loop().time() + settings.server.request_timeout_seconds,
        cache_control=CacheControl.parse(request.headers.get("cache-control")),
    )
    await services.runner.run(ctx)
    headers = {"x-cache": "hit" if ctx.cache_status == "hit" else "miss"}
    if ctx.params.stream and ctx.answer is not None:
        return StreamingResponse(
            sse_stream(ctx, ctx.answer),
            media_type="text/event-stream",
            headers={**headers, "cache-control": "no-cache"},
        )
    if ctx.completion is None:
        raise RuntimeError("the path ended without an answer")
    return JSONResponse(chat_completion(ctx, ctx.completion), headers=headers)
