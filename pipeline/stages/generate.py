"""The generate stage: the prompt goes to vLLM, and the answer streams back as it is made.

The upstream is always asked for a stream (with usage), so time to first token is measured
for plain requests too. For a streamed request the stage returns once the first token is in,
leaving ``ctx.stream`` to carry the rest; the ``chat {model}`` span stays open until the
stream ends, and ``ctx.completion`` is filled in then.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import orjson
from opentelemetry import trace
from opentelemetry.semconv._incubating.attributes import gen_ai_attributes as gen_ai
from opentelemetry.semconv.attributes import error_attributes, server_attributes
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from pipeline import attributes as attr
from pipeline.context import Completion, RequestContext
from pipeline.errors import PipelineError
from pipeline.llm import LLMClient
from pipeline.prompt import build_messages


class Generate:
    name = "generate"

    def __init__(
        self,
        llm: LLMClient,
        tracer: trace.Tracer,
        *,
        capture_content: bool = False,
    ) -> None:
        self.llm = llm
        self.tracer = tracer
        self.capture_content = capture_content

    async def __call__(self, ctx: RequestContext) -> RequestContext:
        params = ctx.params
        model = params.model
        payload: dict[str, Any] = {
            "model": model,
            "messages": build_messages(params.messages, ctx.passages),
            **params.sampling,
        }
        span = self.tracer.start_span(
            f"chat {model}",
            kind=SpanKind.CLIENT,
            attributes={
                gen_ai.GEN_AI_OPERATION_NAME: "chat",
                gen_ai.GEN_AI_PROVIDER_NAME: "vllm",
                gen_ai.GEN_AI_REQUEST_MODEL: model,
                server_attributes.SERVER_ADDRESS: self.llm.base_url,
                **_request_attributes(params.sampling),
            },
        )
        if self.capture_content:
            span.set_attribute(
                gen_ai.GEN_AI_INPUT_MESSAGES, orjson.dumps(payload["messages"]).decode()
            )
        pieces = _Answer(ctx, span, model, capture_content=self.capture_content)
        chunks = self.llm.stream_chat(payload)
        try:
            first = await pieces.first_piece(chunks)
        except BaseException as exc:
            pieces.fail(exc)
            await _close(chunks)
            raise
        ctx.annotate(**{attr.TTFT_MS: round(pieces.ttft_ms, 3)})
        if params.stream:
            ctx.stream = pieces.rest(first, chunks)
        else:
            async for _ in pieces.rest(first, chunks):
                pass
        return ctx


async def _close(chunks: AsyncIterator[dict[str, Any]]) -> None:
    aclose = getattr(chunks, "aclose", None)
    if aclose is not None:
        await aclose()


def _request_attributes(sampling: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if isinstance(sampling.get("max_tokens"), int):
        out[gen_ai.GEN_AI_REQUEST_MAX_TOKENS] = sampling["max_tokens"]
    if isinstance(sampling.get("temperature"), int | float):
        out[gen_ai.GEN_AI_REQUEST_TEMPERATURE] = float(sampling["temperature"])
    if isinstance(sampling.get("top_p"), int | float):
        out[gen_ai.GEN_AI_REQUEST_TOP_P] = float(sampling["top_p"])
    return out


class _Answer:
    """Accumulates one streamed answer and closes its span when it ends, however it ends."""

    def __init__(
        self, ctx: RequestContext, span: Span, model: str, *, capture_content: bool = False
    ) -> None:
        self.ctx = ctx
        self.capture_content = capture_content
        self.span = span
        self.model = model
        self.started = time.perf_counter()
        self.ttft_ms = 0.0
        self.text: list[str] = []
        self.finish_reason = "stop"
        self.usage: dict[str, Any] = {}

    def _take(self, chunk: dict[str, Any]) -> str:
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        piece = ""
        for choice in chunk.get("choices") or []:
            piece += (choice.get("delta") or {}).get("content") or ""
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
        if chunk.get("model"):
            self.model = chunk["model"]
        return piece

    async def first_piece(self, chunks: AsyncIterator[dict[str, Any]]) -> str:
        """Wait for the first text (or the end of an empty answer) and time it."""
        async for chunk in chunks:
            piece = self._take(chunk)
            if piece:
                self._mark_first()
                return piece
        self._mark_first()
        return ""

    def _mark_first(self) -> None:
        self.ttft_ms = (time.perf_counter() - self.started) * 1000.0
        self.span.set_attribute(gen_ai.GEN_AI_RESPONSE_TIME_TO_FIRST_CHUNK, self.ttft_ms / 1000.0)

    async def rest(self, first: str, chunks: AsyncIterator[dict[str, Any]]) -> AsyncIterator[str]:
        try:
            if first:
                self.text.append(first)
                yield first
            async for chunk in chunks:
                piece = self._take(chunk)
                if piece:
                    self.text.append(piece)
                    yield piece
        except BaseException as exc:
            self.fail(exc)
            raise
        finally:
            await _close(chunks)
        self.finish()

    def finish(self) -> None:
        completion = Completion(
            content="".join(self.text),
            finish_reason=self.finish_reason,
            model=self.ctx.params.model,
            prompt_tokens=int(self.usage.get("prompt_tokens", 0)),
            completion_tokens=int(self.usage.get("completion_tokens", 0)),
            sources=self.ctx.sources,
        )
        self.ctx.completion = completion
        self.span.set_attributes(
            {
                gen_ai.GEN_AI_RESPONSE_MODEL: self.model,
                gen_ai.GEN_AI_RESPONSE_FINISH_REASONS: [self.finish_reason],
                gen_ai.GEN_AI_USAGE_INPUT_TOKENS: completion.prompt_tokens,
                gen_ai.GEN_AI_USAGE_OUTPUT_TOKENS: completion.completion_tokens,
            }
        )
        if self.capture_content:
            output = [{"role": "assistant", "content": completion.content}]
            self.span.set_attribute(gen_ai.GEN_AI_OUTPUT_MESSAGES, orjson.dumps(output).decode())
        self.span.end()

    def fail(self, exc: BaseException) -> None:
        if isinstance(exc, GeneratorExit | asyncio.CancelledError):
            # The caller went away; that is not the model's failure.
            self.span.set_attribute(attr.STREAM_ABANDONED, True)
        else:
            kind = exc.code if isinstance(exc, PipelineError) and exc.code else type(exc).__name__
            self.span.set_status(Status(StatusCode.ERROR, kind))
            self.span.set_attribute(error_attributes.ERROR_TYPE, type(exc).__name__)
        self.span.end()
