"""The answer stream: the one place where a request's answer events pass through.

Upstream events (from vLLM, from a tool-calling flow, or replayed from the cache) go through the
output filters in order, then to whoever reads the stream: the SSE writer for a streamed
request, ``drain()`` for a plain one. The ``Completion`` that is returned and cached is built
from what comes out of the filters, never from the raw upstream text, and the callbacks
registered with ``on_complete`` (the cache store) run only when the stream ends normally.

A filter is told about every event and, through ``end()``, when the stream ends, so it may hold
text back, rewrite it, or end the answer early by emitting ``Finish("content_filter")``; after
a ``Finish`` has gone out, the upstream is closed and nothing more is passed on.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import replace
from typing import Any, Protocol

from pipeline.answer.completion import Completion
from pipeline.answer.events import (
    ContentDelta,
    Finish,
    StreamEvent,
    ToolCall,
    ToolCallDelta,
    Usage,
)

CompletionCallback = Callable[[Completion], Awaitable[None]]


class StreamFilter(Protocol):
    """Transforms answer events in flight (output guardrails, for one)."""

    name: str

    def feed(self, event: StreamEvent) -> Sequence[StreamEvent]: ...

    def end(self) -> Sequence[StreamEvent]: ...


class CompletionBuilder:
    """Assembles a ``Completion`` from events: text, tool calls by index, finish, usage."""

    def __init__(self) -> None:
        self.text: list[str] = []
        self.logprobs: list[dict[str, Any]] = []
        self.calls: dict[int, list[str]] = {}  # index -> [id, name, arguments]
        self.finish: Finish | None = None
        self.usage = Usage(0, 0)

    def take(self, event: StreamEvent) -> None:
        if isinstance(event, ContentDelta):
            self.text.append(event.text)
            self.logprobs.extend(event.logprobs)
        elif isinstance(event, ToolCallDelta):
            call = self.calls.setdefault(event.index, ["", "", ""])
            call[0] = event.id or call[0]
            call[1] = event.name or call[1]
            call[2] += event.arguments
        elif isinstance(event, Finish):
            self.finish = self.finish or event
        else:
            self.usage = event

    def build(self, base: Completion) -> Completion:
        finish = self.finish or Finish("stop")
        return replace(
            base,
            content="".join(self.text),
            tool_calls=[ToolCall(*self.calls[i]) for i in sorted(self.calls)],
            finish_reason=finish.reason,
            finish_detail=finish.detail,
            prompt_tokens=self.usage.prompt_tokens,
            completion_tokens=self.usage.completion_tokens,
            # Asked for (the base says so with a list): what came out of the filters.
            logprobs=list(self.logprobs) if base.logprobs is not None else None,
        )


async def _aclose(source: AsyncIterator[StreamEvent]) -> None:
    aclose = getattr(source, "aclose", None)
    if aclose is not None:
        await aclose()


class AnswerStream:
    """One answer's events, through the filters, to one reader.

    ``base`` makes the completion's fixed parts (model, sources, route, tools) when the stream
    ends, so that facts learned while streaming (tools run between rounds) are included.
    """

    def __init__(self, source: AsyncIterator[StreamEvent], base: Callable[[], Completion]) -> None:
        self._source = source
        self._base = base
        self._primed: list[StreamEvent] = []
        self._callbacks: list[CompletionCallback] = []
        self._read = False
        self.filters: list[StreamFilter] = []
        self.completion: Completion | None = None

    @classmethod
    def replay(cls, completion: Completion) -> AnswerStream:
        """The events of a complete answer again (a cache hit), as one delta each."""

        async def events() -> AsyncIterator[StreamEvent]:
            if completion.content or completion.logprobs:
                yield ContentDelta(completion.content, tuple(completion.logprobs or ()))
            for index, call in enumerate(completion.tool_calls):
                yield ToolCallDelta(index, call.id, call.name, call.arguments)
            yield Finish(completion.finish_reason, completion.finish_detail)
            yield Usage(completion.prompt_tokens, completion.completion_tokens)

        return cls(events(), lambda: completion)

    def add_filter(self, stream_filter: StreamFilter) -> None:
        if self._read:
            raise RuntimeError("filters must be added before the stream is read")
        self.filters.append(stream_filter)

    def on_complete(self, callback: CompletionCallback) -> None:
        self._callbacks.append(callback)

    async def prime(self) -> None:
        """Wait for the first upstream event, so that a failure before any output is raised
        here (and becomes an HTTP error) rather than in the middle of a 200 stream."""
        try:
            self._primed.append(await anext(self._source))
        except StopAsyncIteration:
            pass
        except BaseException:
            await _aclose(self._source)
            raise

    async def _upstream(self) -> AsyncGenerator[StreamEvent, None]:
        for event in self._primed:
            yield event
        self._primed.clear()
        async for event in self._source:
            yield event

    def _through(self, event: StreamEvent, start: int = 0) -> list[StreamEvent]:
        out = [event]
        for stream_filter in self.filters[start:]:
            out = [result for item in out for result in stream_filter.feed(item)]
        return out

    def _flush(self) -> list[StreamEvent]:
        out: list[StreamEvent] = []
        for position, stream_filter in enumerate(self.filters):
            for event in stream_filter.end():
                out.extend(self._through(event, position + 1))
        return out

    async def events(self) -> AsyncIterator[StreamEvent]:
        """The filtered events; read once. The completion is built when they end."""
        if self._read:
            raise RuntimeError("an answer stream can be read only once")
        self._read = True
        builder = CompletionBuilder()
        upstream = self._upstream()
        try:
            async for raw in upstream:
                for event in self._through(raw):
                    if _accepts(builder, event):
                        builder.take(event)
                        yield event
                if builder.finish is not None and builder.finish.reason == "content_filter":
                    break
            else:
                for event in self._flush():
                    if _accepts(builder, event):
                        builder.take(event)
                        yield event
        except Exception:
            # The upstream failed mid-answer: what the filters held back has passed their
            # checks in full at end(), so the reader gets it before the error.
            for event in self._flush():
                if isinstance(event, ContentDelta | ToolCallDelta) and _accepts(builder, event):
                    yield event
            raise
        finally:
            await upstream.aclose()
            await _aclose(self._source)
        self.completion = builder.build(self._base())
        for callback in self._callbacks:
            await callback(self.completion)

    async def drain(self) -> Completion:
        """Read the whole stream (a plain, non-streamed request) and return its completion."""
        async for _ in self.events():
            pass
        assert self.completion is not None
        return self.completion


def _accepts(builder: CompletionBuilder, event: StreamEvent) -> bool:
    # After the answer has finished only its usage may follow.
    return builder.finish is None or isinstance(event, Usage)
