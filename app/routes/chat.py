"""POST /v1/chat/completions: read the body (after auth), build the context, run the pipeline,
shape the answer.

The key is checked before the body is read (``app.http.auth.AuthenticateFirst``), so the route takes
the raw request and validates the body itself (``app.http.bodies``): inline when small, in a worker
thread when large. The OpenAPI document still describes the body (``openapi_extra``).
"""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request
from starlette.responses import Response, StreamingResponse

from app.http.auth import ChatPrincipal, bearer_token
from app.http.bodies import BodyLimits, read_body, request_body
from app.http.responses import JSONResponse, chat_completion, sse_stream
from app.http.schemas import ChatCompletionRequest
from app.logs import hand_to_log
from app.path import PathsDep
from app.services import ServicesDep
from pipeline.context import CacheControl, RequestContext

router = APIRouter(tags=["chat"])

LIMITS = BodyLimits()


@router.post(
    "/v1/chat/completions",
    response_model=None,
    openapi_extra=request_body(ChatCompletionRequest),
)
async def create_chat_completion(
    request: Request, services: ServicesDep, paths: PathsDep, principal: ChatPrincipal
) -> Response:
    body = await read_body(await request.body(), ChatCompletionRequest, LIMITS)
    settings = services.settings
    ctx = RequestContext(
        params=body.to_params(settings.retrieval.top_k, settings.llm.default_max_tokens),
        credential=bearer_token(request),
        deadline=asyncio.get_running_loop().time() + settings.server.request_timeout_seconds,
        cache_control=CacheControl.parse(request.headers.get("cache-control")),
    )
    hand_to_log(request.scope, ctx)
    await paths.chat.run(ctx)
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
