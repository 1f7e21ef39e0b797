"""One traced call of a model: the ``chat {model}`` span, from the request until its stream ends.

The span carries the OpenTelemetry GenAI attributes (operation, provider, request and response
model, token usage, time to first chunk, finish reasons). It is started under the context the
caller gives (the ``generate`` stage's), so it nests there even when the stream is read later by
the response writer, and it ends however the stream ends: finished, failed, or abandoned by a
client that went away.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing
from typing import Any

import orjson
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.semconv._incubating.attributes import gen_ai_attributes as gen_ai
from opentelemetry.semconv.attributes import server_attributes
from opentelemetry.trace import Span, SpanKind

from pipeline.answer.events import (
    ContentDelta,
    Finish,
    StreamEvent,
    ToolCallDelta,
    Usage,
    events_from_chunk,
)
from pipeline.errors import ClientClosedRequest, DeadlineExceeded, PipelineError, UpstreamBusy
from pipeline.model.routes import Route
from pipeline.model.spend import prompt_tokens, spent
from pipeline.model.tokens import TokenCounter
from pipeline.telemetry import attributes as attr
from pipeline.telemetry import metrics
from pipeline.telemetry.spans import mark_failed
from pipeline.watchdog import Watchdog


def request_attributes(route: Route, payload: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {
        gen_ai.GEN_AI_OPERATION_NAME: "chat",
        gen_ai.GEN_AI_PROVIDER_NAME: "vllm",
        gen_ai.GEN_AI_REQUEST_MODEL: route.model,
        server_attributes.SERVER_ADDRESS: route.client.base_url,
        attr.ROUTE: route.name,
    }
    if isinstance(payload.get("max_tokens"), int):
        out[gen_ai.GEN_AI_REQUEST_MAX_TOKENS] = payload["max_tokens"]
    if isinstance(payload.get("temperature"), int | float):
        out[gen_ai.GEN_AI_REQUEST_TEMPERATURE] = float(payload["temperature"])
    if isinstance(payload.get("top_p"), int | float):
        out[gen_ai.GEN_AI_REQUEST_TOP_P] = float(payload["top_p"])
    return out


class _RoundRecord:
    """What one round produced, for the span's closing attributes."""

    def __init__(self, span: Span) -> None:
        self.span = span
        self.started = time.perf_counter()
        self.first_chunk_s: float | None = None
        self.text: list[str] = []
        self.finish: str | None = None
        self.usage = Usage(0, 0)
        self.usage_came = False
        self.model: str | None = None
        self.deltas = 0

    def take(self, event: StreamEvent) -> None:
        if isinstance(event, ContentDelta | ToolCallDelta):
            self.deltas += 1
            if self.first_chunk_s is None:
                self.first_chunk_s = time.perf_counter() - self.started
                self.span.set_attribute(
                    gen_ai.GEN_AI_RESPONSE_TIME_TO_FIRST_CHUNK, self.first_chunk_s
                )
        if isinstance(event, ContentDelta):
            self.text.append(event.text)
        elif isinstance(event, Finish):
            self.finish = event.reason
        elif isinstance(event, Usage):
            self.usage, self.usage_came = event, True

    def spent(self, payload: dict[str, Any], counter: TokenCounter | None) -> int:
        """The call's tokens (``pipeline.model.spend``): its usage, else an estimate."""
        if self.usage_came:
            return self.usage.prompt_tokens + self.usage.completion_tokens
        if not self.deltas:
            return 0
        return self.deltas + (prompt_tokens(payload, counter) if counter is not None else 0)

    def close(self, capture_content: bool, model: str) -> None:
        metrics.model_call_finished(
            model,
            first_token_s=self.first_chunk_s,
            total_s=time.perf_counter() - self.started,
            prompt_tokens=self.usage.prompt_tokens,
            completion_tokens=self.usage.completion_tokens,
        )
        if not self.span.is_recording():
            return  # not sampled: nothing to build for it
        self.span.set_attributes(
            {
                gen_ai.GEN_AI_RESPONSE_MODEL: self.model or "",
                gen_ai.GEN_AI_RESPONSE_FINISH_REASONS: [self.finish or "stop"],
                gen_ai.GEN_AI_USAGE_INPUT_TOKENS: self.usage.prompt_tokens,
                gen_ai.GEN_AI_USAGE_OUTPUT_TOKENS: self.usage.completion_tokens,
            }
        )
        if capture_content:
            output = [{"role": "assistant", "content": "".join(self.text)}]
            self.span.set_attribute(gen_ai.GEN_AI_OUTPUT_MESSAGES, orjson.dumps(output).decode())


class TracedChat:
    """Streams one model call as typed events inside its ``chat {model}`` span."""

    def __init__(
        self,
        tracer: trace.Tracer,
        *,
        capture_content: bool = False,
        counter: TokenCounter | None = None,
    ) -> None:
        """``counter``: the model's, for what a call that ended without usage spent."""
        self.tracer = tracer
        self.capture_content = capture_content
        self.counter = counter

    async def stream(
        self,
        route: Route,
        payload: dict[str, Any],
        parent: Context | None = None,
        *,
        tenant: str = "",
        deadline: float | None = None,
        memo_scope: str | None = None,
    ) -> AsyncGenerator[StreamEvent, None]:
        """The call's events. It holds one of the route's slots for ``tenant`` from the request
        until the stream ends or is closed, and no read of the model server goes past
        ``deadline`` (event-loop time): a stream too ends there, with ``DeadlineExceeded``.
        ``memo_scope``: under which the counter keeps what it counts of a call that ended
        without usage (``pipeline.model.salt.MemoScope``; the tenant when None)."""
        span = self.tracer.start_span(
            f"chat {route.model}",
            context=parent,
            kind=SpanKind.CLIENT,
            attributes=request_attributes(route, payload),
        )
        if self.capture_content and span.is_recording():
            messages = orjson.dumps(payload.get("messages", [])).decode()
            span.set_attribute(gen_ai.GEN_AI_INPUT_MESSAGES, messages)
        record = _RoundRecord(span)
        spend = spent.get()  # the request's, read now: the stream may end in another context
        waiting = time.perf_counter()
        # One timer bounds all the reads (``pipeline.watchdog``), not one per chunk.
        watchdog = Watchdog()
        try:
            async with route.slot(tenant, deadline) as waited:
                # Time queued for the route's concurrency bound, apart from the model's own.
                span.set_attribute(attr.ROUTE_WAIT_MS, waited * 1000.0)
                # Closed here, not left to the collector, so the upstream request ends (and
                # the model server stops generating) before the slot is given back.
                async with aclosing(
                    route.client.stream_chat(payload, deadline=deadline)
                ) as upstream:
                    while (chunk := await _read(upstream, deadline, watchdog)) is not None:
                        model = chunk.get("model")
                        record.model = model if isinstance(model, str) and model else record.model
                        events = events_from_chunk(chunk)
                        for event in events:  # the whole chunk's, before any is passed on
                            record.take(event)
                        for event in events:
                            # The usage may come on every chunk, running (what a call cut
                            # short spent): the last one is the answer's, passed on at the end.
                            if not isinstance(event, Usage):
                                yield event
                    if record.usage_came:
                        yield record.usage
        except (GeneratorExit, asyncio.CancelledError, ClientClosedRequest) as exc:
            # The caller went away (or left the slot's queue); that is not the model's failure.
            span.set_attribute(attr.STREAM_ABANDONED, True)
            metrics.model_call_abandoned(route.model, queued=isinstance(exc, ClientClosedRequest))
            raise
        except BaseException as exc:
            if isinstance(exc, UpstreamBusy):  # queued until the deadline: the wait is the story
                span.set_attribute(attr.ROUTE_WAIT_MS, (time.perf_counter() - waiting) * 1000.0)
            code = exc.code if isinstance(exc, PipelineError) and exc.code else None
            mark_failed(span, exc, kind=code)
            metrics.model_call_failed(route.model, code or type(exc).__name__)
            raise
        else:
            record.close(self.capture_content, route.model)
        finally:
            watchdog.close()
            span.end()
            if spend is not None:
                scope = memo_scope if memo_scope is not None else tenant
                counter = self.counter.for_scope(scope) if self.counter is not None else None
                spend.add(record.spent(payload, counter))


async def _read(
    chunks: AsyncIterator[dict[str, Any]], deadline: float | None, watchdog: Watchdog
) -> dict[str, Any] | None:
    """The next chunk (None: the stream ended), read before ``deadline`` or
    ``DeadlineExceeded``. One read at a time: a timeout must not span a generator's ``yield``."""
    try:
        with watchdog.until(deadline):
            return await anext(chunks)
    except StopAsyncIteration:
        return None
    except TimeoutError as exc:
        raise DeadlineExceeded(
            "The answer did not complete before the request's deadline."
        ) from exc
