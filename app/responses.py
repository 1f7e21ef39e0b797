"""OpenAI-shaped response bodies: a chat completion as JSON, or as a stream of SSE chunks.

Our extra field ``rag`` (sources; with ``rag.explain``, the stage records) rides on the
completion object, and on the final chunk of a stream.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import orjson
from starlette.responses import Response

from pipeline.context import Completion, RequestContext
from pipeline.errors import PipelineError


class JSONResponse(Response):
    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return orjson.dumps(content)


def rag_field(ctx: RequestContext, completion: Completion | None) -> dict[str, Any]:
    field: dict[str, Any] = {
        "sources": completion.sources if completion is not None else ctx.sources,
        "cache": ctx.cache_status,
    }
    if ctx.params.rag.explain:
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


def chat_completion(ctx: RequestContext, completion: Completion) -> dict[str, Any]:
    return {
        "id": ctx.request_id,
        "object": "chat.completion",
        "created": ctx.created,
        "model": ctx.params.model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": completion.content},
                "logprobs": None,
                "finish_reason": completion.finish_reason,
            }
        ],
        "usage": usage(completion),
        "rag": rag_field(ctx, completion),
    }


def _chunk(ctx: RequestContext, choices: list[dict[str, Any]], **extra: Any) -> bytes:
    if ctx.params.include_usage:
        extra.setdefault("usage", None)  # as OpenAI: null on every chunk but the last
    body = {
        "id": ctx.request_id,
        "object": "chat.completion.chunk",
        "created": ctx.created,
        "model": ctx.params.model,
        "choices": choices,
        **extra,
    }
    return b"data: " + orjson.dumps(body) + b"\n\n"


def _delta(ctx: RequestContext, delta: dict[str, Any], finish: str | None = None) -> bytes:
    return _chunk(ctx, [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}])


async def sse_stream(
    ctx: RequestContext, pieces: AsyncIterator[str] | None
) -> AsyncIterator[bytes]:
    """The SSE body: a role chunk, content chunks, a finish chunk (with ``rag``), usage, [DONE].

    ``pieces`` is the live stream; when it is None the answer is replayed from
    ``ctx.completion`` (a cache hit). An error mid-stream becomes an ``error`` event, since the
    status line has already gone out.
    """
    yield _delta(ctx, {"role": "assistant", "content": ""})
    try:
        if pieces is None:
            assert ctx.completion is not None
            if ctx.completion.content:
                yield _delta(ctx, {"content": ctx.completion.content})
        else:
            async for piece in pieces:
                yield _delta(ctx, {"content": piece})
    except PipelineError as exc:
        yield b"data: " + orjson.dumps(exc.to_dict()) + b"\n\n"
        return
    completion = ctx.completion
    assert completion is not None
    yield _chunk(
        ctx,
        [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": completion.finish_reason}],
        rag=rag_field(ctx, completion),
    )
    if ctx.params.include_usage:
        yield _chunk(ctx, [], usage=usage(completion))
    yield b"data: [DONE]\n\n"
