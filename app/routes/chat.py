"""POST /v1/chat/completions: read the body (after auth), build the context, run the pipeline,
shape the answer.

The key is checked before the body is read (``app.http.auth.AuthenticateFirst``), so the route takes
the raw request and validates the body itself (``app.http.bodies``): inline when small, in a worker
thread when large. The OpenAPI document still describes the body (``openapi_extra``).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator

from fastapi import APIRouter, Request
from starlette.responses import Response

from app.http.answers import ChatCompletion
from app.http.auth import ChatPrincipal, bearer_token
from app.http.bodies import BodyLimits, read_body, request_body
from app.http.disconnect import queued_calls_leave_with
from app.http.limits import charge, reserve
from app.http.openapi import answers
from app.http.responses import JSONResponse, chat_completion, sse_stream
from app.http.schemas import ChatCompletionRequest
from app.http.streaming import EventStreamResponse
from app.logs import hand_to_log
from app.path import PathsDep
from app.services import Services, ServicesDep
from pipeline.answer.stream import AnswerStream
from pipeline.context import CacheControl, Principal, RequestContext
from pipeline.model.spend import Spend, estimated_tokens, spent
from pipeline.store.limits import Reservation

router = APIRouter(tags=["chat"])

LIMITS = BodyLimits()


ANSWERS = answers(200, ChatCompletion, 400, 403, 404, 413, 502, 504)
# With "stream": true the answer is server-sent events (the schema is each event's, as
# OpenAPI 3.1 reads it): chunks as JSON in ``data``, then ``data: [DONE]``.
SSE_EVENT = {"type": "object", "properties": {"data": {"type": "string"}}, "required": ["data"]}
ANSWERS[200]["content"] = {"text/event-stream": {"schema": SSE_EVENT}}


@router.post(
    "/v1/chat/completions",
    response_model=None,
    openapi_extra=request_body(ChatCompletionRequest),
    operation_id="createChatCompletion",
    responses=ANSWERS,
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
    # Its estimate held in its token limits until it is charged: the requests in flight count.
    held = await reserve(
        services, principal, estimated_tokens(ctx.params, settings.llm.context_length)
    )
    # The model calls of this request, the streamed answer's included, add what they spend
    # (the task's context, copied into every task started for it).
    spend = Spend()
    spent.set(spend)
    try:
        with queued_calls_leave_with(request.receive):
            await paths.chat.run(ctx)
    except BaseException:
        charge(services, principal, spend.tokens, held)  # a call that ended without an answer
        raise
    hit = ctx.cache_status == "hit"
    headers = {"x-request-id": ctx.request_id, "x-cache": "hit" if hit else "miss"}
    if hit:
        charge(services, principal, 0, held)  # a cache hit costs no tokens
    if ctx.params.stream and ctx.answer is not None:
        events = sse_stream(ctx, ctx.answer)
        return EventStreamResponse(
            events if hit else Charged(events, ctx.answer, services, principal, spend, held),
            deadline=ctx.deadline,
            write_stall_s=settings.server.stream_write_stall_seconds,
            headers={**headers, "cache-control": "no-cache"},
            shared=None if hit else ctx.answer,
        )
    if ctx.completion is None:
        raise RuntimeError("the path ended without an answer")
    if not hit:
        charge(services, principal, spend.charge(ctx.completion), held)
    return JSONResponse(chat_completion(ctx, ctx.completion), headers=headers)


class Charged:
    """The stream, and its tokens charged to the caller's limits however it ends: its usage
    when it has ended, else what its model calls spent until it was cut (``spend``, complete
    once ``body`` is closed: ``pipeline.model.spend``). ``body`` is closed at once however this
    one ends, and the charge is made once: at the end, or when it is closed, started or not (a
    generator closed before its first step runs no ``finally``: the request's reservation was
    held until the window ended, found by a review of the change).

    A follower of a shared generation spent nothing itself: cut short, it has no usage either,
    and would be charged nothing for what it read (a hostile review, 2026-12-05: 330 of 351
    chunks read for free). So at least one token is charged per event relayed (each a delta of
    one token or more)."""

    def __init__(
        self,
        body: AsyncGenerator[bytes],
        answer: AnswerStream,
        services: Services,
        principal: Principal,
        spend: Spend,
        held: Reservation | None,
    ) -> None:
        self._body = body
        self._answer = answer
        self._services = services
        self._principal = principal
        self._spend = spend
        self._held = held
        self._relayed = 0
        self._charged = False

    def __aiter__(self) -> Charged:
        return self

    async def __anext__(self) -> bytes:
        try:
            chunk = await anext(self._body)
        except StopAsyncIteration:
            self._charge()
            raise
        self._relayed += chunk.count(b"data: ")
        return chunk

    async def aclose(self) -> None:
        try:
            await self._body.aclose()
        finally:
            self._charge()

    def _charge(self) -> None:
        if self._charged:
            return
        self._charged = True
        tokens = max(self._spend.charge(self._answer.completion), self._relayed)
        charge(self._services, self._principal, tokens, self._held)
