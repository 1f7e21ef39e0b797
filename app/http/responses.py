"""OpenAI-shaped response bodies: a chat completion as JSON, or as a stream of SSE chunks.

Our extra field ``rag`` (sources, citations, cache status, tools; with ``rag.explain`` the route,
the features and the stage records) rides on the completion object, and on the final chunk of a
stream. Both shapes are made from the same answer stream (``pipeline.answer.stream``).

A stream also carries each sentence's citation as soon as the sentence is complete: a chunk
with an empty delta and ``rag: {"citations": [one citation]}``, which OpenAI clients read as a
chunk with no content (``pipeline.answer.citations`` says how they are found).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Sequence
from contextlib import aclosing
from typing import Any

import orjson
from starlette.responses import Response

from pipeline.answer.completion import Completion
from pipeline.answer.events import AnswerEvent, Citation, ContentDelta, ToolCallDelta
from pipeline.answer.stream import AnswerStream
from pipeline.context import RequestContext
from pipeline.errors import PipelineError

# Every answer is served at one tier; OpenAI clients read the field.
SERVICE_TIER = "default"


class JSONResponse(Response):
    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return orjson.dumps(content)


def rag_field(ctx: RequestContext, completion: Completion | None) -> dict[str, Any]:
    """Our extension on the answer: sources, cache status, the server tools run; with
    ``rag.explain`` also the route and why, the features used, and every stage's record."""
    field: dict[str, Any] = {
        "sources": completion.sources if completion is not None else ctx.sources,
        "citations": [c.to_dict() for c in completion.citations] if completion is not None else [],
        "cache": ctx.cache_status,
        "tools": (
            completion.tools if completion is not None else [r.report() for r in ctx.tool_runs]
        ),
    }
    if ctx.params.rag.explain:
        route = completion.route if completion is not None else None
        field["route"] = route or (ctx.route.report() if ctx.route is not None else None)
        field["features"] = {
            "used": sorted(ctx.features.values),
            "defaulted": sorted(ctx.features.defaulted),
            "version": ctx.features.version,
        }
        field["explain"] = {
            "stages": [
                {
                    "name": r.name,
                    "start_ms": r.start_ms,
                    "duration_ms": r.duration_ms,
                    "status": r.status,
                    **({"info": r.info} if r.info else {}),
                }
                for r in ctx.records
            ],
            "total_ms": round(ctx.elapsed_ms(), 3),
        }
    return field


def usage(completion: Completion) -> dict[str, int]:
    return {
        "prompt_tokens": completion.prompt_tokens,
        "completion_tokens": completion.completion_tokens,
        "total_tokens": completion.prompt_tokens + completion.completion_tokens,
    }


def message(completion: Completion) -> dict[str, Any]:
    """The assistant message: content, and the calls for the client to run (content is null
    when there are calls and no text, as OpenAI returns it)."""
    body: dict[str, Any] = {"role": "assistant", "content": completion.content}
    if completion.tool_calls:
        body["tool_calls"] = [call.to_openai() for call in completion.tool_calls]
        body["content"] = completion.content or None
    return body


def logprobs(entries: Sequence[dict[str, Any]] | None) -> dict[str, Any] | None:
    """OpenAI's ``choices[].logprobs``: the content tokens' entries (None: not asked for)."""
    return None if entries is None else {"content": list(entries), "refusal": None}


def chat_completion(ctx: RequestContext, completion: Completion) -> dict[str, Any]:
    return {
        "id": ctx.request_id,
        "object": "chat.completion",
        "created": ctx.created,
        "model": completion.model,
        "choices": [
            {
                "index": 0,
                "message": message(completion),
                "logprobs": logprobs(completion.logprobs),
                "finish_reason": completion.finish_reason,
            }
        ],
        "usage": usage(completion),
        "service_tier": SERVICE_TIER,
        "system_fingerprint": None,
        "rag": rag_field(ctx, completion),
    }


class _Chunks:
    """Renders the SSE chunks of one response."""

    def __init__(self, ctx: RequestContext, model: str) -> None:
        self.ctx = ctx
        self.model = model

    def chunk(self, choices: list[dict[str, Any]], **extra: Any) -> bytes:
        if self.ctx.params.include_usage:
            extra.setdefault("usage", None)  # as OpenAI: null on every chunk but the last
        body = {
            "id": self.ctx.request_id,
            "object": "chat.completion.chunk",
            "created": self.ctx.created,
            "model": self.model,
            "choices": choices,
            "service_tier": SERVICE_TIER,
            "system_fingerprint": None,
            **extra,
        }
        return b"data: " + orjson.dumps(body) + b"\n\n"

    def delta(
        self,
        delta: dict[str, Any],
        finish: str | None = None,
        entries: Sequence[dict[str, Any]] | None = None,
        **extra: Any,
    ) -> bytes:
        choice = {"index": 0, "delta": delta, "logprobs": logprobs(entries)}
        return self.chunk([{**choice, "finish_reason": finish}], **extra)

    def event(self, event: AnswerEvent) -> bytes | None:
        if isinstance(event, Citation):
            return self.delta({}, rag={"citations": [event.to_dict()]})
        if isinstance(event, ContentDelta):
            entries = event.logprobs if self.ctx.params.sampling.get("logprobs") else None
            return self.delta({"content": event.text}, entries=entries)
        if isinstance(event, ToolCallDelta):
            return self.delta({"tool_calls": [event.to_openai()]})
        return None  # the finish and the usage go out when the stream has ended


async def sse_stream(ctx: RequestContext, answer: AnswerStream) -> AsyncGenerator[bytes]:
    """The SSE body: a role chunk, the answer's deltas as they come, a finish chunk (with
    ``rag``), the usage, ``[DONE]``. A live answer and a cached one (replayed) read the same.

    An error mid-stream becomes an ``error`` event, since the status line has already gone out.
    """
    if ctx.completion is not None:
        model = ctx.completion.model  # a cache hit
    else:
        model = ctx.route.model if ctx.route is not None else ctx.params.model
    chunks = _Chunks(ctx, model)
    yield chunks.delta({"role": "assistant", "content": ""})
    try:
        # Closed as soon as this is (not by the collector): that closes the model call.
        async with aclosing(answer.events()) as events:
            async for event in events:
                rendered = chunks.event(event)
                if rendered is not None:
                    yield rendered
    except PipelineError as exc:
        yield b"data: " + orjson.dumps(exc.to_dict()) + b"\n\n"
        return
    completion = answer.completion
    assert completion is not None  # set when events() ends
    chunks.model = completion.model
    yield chunks.delta({}, completion.finish_reason, rag=rag_field(ctx, completion))
    if ctx.params.include_usage:
        yield chunks.chunk([], usage=usage(completion))
    yield b"data: [DONE]\n\n"
