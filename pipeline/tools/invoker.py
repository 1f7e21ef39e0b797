"""Runs one round of tool calls: all at once, each in its span, each bounded, in call order.

Every call gets an ``execute_tool {name}`` span (OpenTelemetry GenAI conventions) and runs
under its tool's limits: a timeout (waiting for a slot included, so a busy tool cannot hold a
request), a concurrency limit and a rate limit, both shared by all requests of this process.
Nothing a tool does fails the request: an unknown name, bad arguments, an exception or a
timeout each become a ``ToolRun`` whose content tells the model what happened. Results come
back in the order of the calls, whatever order they finish in (as Haystack's ToolInvoker).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Sequence
from typing import Final

from asyncio_throttle.throttler import Throttler
from opentelemetry import trace
from opentelemetry.semconv._incubating.attributes import gen_ai_attributes as gen_ai
from opentelemetry.trace import Span, SpanKind

from pipeline.answer.events import ToolCall
from pipeline.context import ToolRun
from pipeline.telemetry import attributes as attr
from pipeline.telemetry.spans import mark_failed
from pipeline.tools.base import Tool, ToolContext, ToolError
from pipeline.tools.registry import ToolRefused, ToolRegistry

logger = logging.getLogger(__name__)

MAX_CONTENT_CHARS: Final = 16_000
MAX_CALLS_PER_ROUND: Final = 16


class ToolTimeout(ToolError):
    """A tool did not answer within its timeout (waiting for a slot included)."""


class TooManyCalls(ToolRefused):
    """More calls in one round than a round may run."""


class RateLimit:
    """At most ``rate_per_second`` starts a second, fractions too (0.5: one every 2 s), over
    asyncio-throttle's sliding window."""

    def __init__(self, rate_per_second: float) -> None:
        burst = max(1, math.floor(rate_per_second))
        self._throttler = Throttler(
            rate_limit=burst, period=burst / rate_per_second, retry_interval=0.005
        )

    async def acquire(self) -> None:
        await self._throttler.acquire()  # type: ignore[no-untyped-call]


class ToolInvoker:
    """Runs calls of the registry's tools; one per process, so its limits hold across requests.

    ``capture_content`` puts arguments and results on the spans (off: never)."""

    def __init__(
        self,
        registry: ToolRegistry,
        tracer: trace.Tracer,
        *,
        capture_content: bool = False,
        max_calls: int = MAX_CALLS_PER_ROUND,
    ) -> None:
        self.registry = registry
        self.tracer = tracer
        self.capture_content = capture_content
        self.max_calls = max_calls
        self._slots = {t.name: asyncio.Semaphore(t.max_concurrency) for t in registry}
        self._throttles = {
            t.name: RateLimit(t.rate_per_second) for t in registry if t.rate_per_second
        }

    async def run(self, calls: Sequence[ToolCall], context: ToolContext) -> list[ToolRun]:
        """Run every call at once; one ``ToolRun`` per call, in call order."""
        if len(calls) <= 1:  # nothing to run beside it: no task needed
            return [await self.run_one(call, context) for call in calls]
        async with asyncio.TaskGroup() as group:
            tasks = [
                group.create_task(self.run_one(call, context, refuse=index >= self.max_calls))
                for index, call in enumerate(calls)
            ]
        return [task.result() for task in tasks]

    async def run_one(
        self, call: ToolCall, context: ToolContext, *, refuse: bool = False
    ) -> ToolRun:
        """One call in its ``execute_tool`` span; never raises (but for cancellation)."""
        tool = self.registry.get(call.name)
        started = time.perf_counter()
        with self.tracer.start_as_current_span(
            f"execute_tool {call.name}",
            kind=SpanKind.INTERNAL,
            attributes={
                gen_ai.GEN_AI_OPERATION_NAME: gen_ai.GenAiOperationNameValues.EXECUTE_TOOL.value,
                gen_ai.GEN_AI_TOOL_NAME: call.name,
                gen_ai.GEN_AI_TOOL_CALL_ID: call.id,
                gen_ai.GEN_AI_TOOL_TYPE: "function",
            },
            record_exception=False,
            set_status_on_exception=False,
        ) as span:
            if tool is not None:
                span.set_attribute(gen_ai.GEN_AI_TOOL_DESCRIPTION, tool.description)
            if self.capture_content:
                span.set_attribute(gen_ai.GEN_AI_TOOL_CALL_ARGUMENTS, call.arguments)
            status, content = await self._outcome(call, tool, context, span, refuse=refuse)
            span.set_attribute(attr.TOOL_STATUS, status)
            if self.capture_content:
                span.set_attribute(gen_ai.GEN_AI_TOOL_CALL_RESULT, content)
        return ToolRun(
            name=call.name,
            call_id=call.id,
            status=status,
            content=content,
            duration_ms=(time.perf_counter() - started) * 1000.0,
            cache_ttl=tool.cache_ttl if tool is not None else None,
        )

    async def _outcome(
        self, call: ToolCall, tool: Tool | None, context: ToolContext, span: Span, *, refuse: bool
    ) -> tuple[str, str]:
        """(status, content) of one call; every failure is described, none is raised."""
        try:
            if refuse:
                raise TooManyCalls(
                    f"Not run: at most {self.max_calls} tool calls are run in one round."
                )
            if tool is None:
                tool = self.registry.lookup(call.name)  # raises UnknownTool, listing the tools
            arguments = self.registry.arguments(tool, call.arguments)
        except ToolRefused as exc:
            mark_failed(span, exc)
            return "refused", str(exc)
        try:
            content = await self._call(tool, arguments, context)
        except ToolTimeout as exc:
            mark_failed(span, exc, kind="timeout")
            return "timeout", str(exc)
        except ToolRefused as exc:  # e.g. an HTTP tool aimed off its allow-list
            mark_failed(span, exc)
            return "refused", str(exc)
        except ToolError as exc:
            mark_failed(span, exc)
            return "error", str(exc) or f"{tool.name} failed."
        except Exception as exc:
            # A bug or an outage in the tool: the model is told it failed, not the internals.
            logger.warning("tool %s failed", tool.name, exc_info=True)
            mark_failed(span, exc)
            return "error", f"{tool.name} failed with an internal error ({type(exc).__name__})."
        if len(content) > MAX_CONTENT_CHARS:
            content = content[:MAX_CONTENT_CHARS] + " … (truncated)"
        return "ok", content

    async def _call(self, tool: Tool, arguments: dict[str, object], context: ToolContext) -> str:
        timeout = asyncio.timeout(tool.timeout_s)
        try:
            async with timeout, self._slot(tool):
                throttle = self._throttles.get(tool.name)
                if throttle is not None:
                    await throttle.acquire()
                result = await tool.function(arguments, context)
        except TimeoutError:
            if not timeout.expired():
                raise  # the tool's own TimeoutError: an error of the tool, not our timeout
            raise ToolTimeout(
                f"{tool.name} did not answer within {tool.timeout_s:g} s; try again later."
            ) from None
        return result if isinstance(result, str) else str(result)

    def _slot(self, tool: Tool) -> asyncio.Semaphore:
        slot = self._slots.get(tool.name)
        if slot is None:  # a tool added to the registry after the invoker was built
            slot = self._slots[tool.name] = asyncio.Semaphore(tool.max_concurrency)
            if tool.rate_per_second:
                self._throttles[tool.name] = RateLimit(tool.rate_per_second)
        return slot
