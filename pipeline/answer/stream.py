"""The answer stream: the one place where a request's answer events pass through.

Upstream events (from vLLM, from a tool-calling flow, or replayed from the cache) go through the
output filters in order, then to whoever reads the stream: the SSE writer for a streamed
request, ``drain()`` for a plain one. The ``Completion`` that is returned and cached is built
from what comes out of the filters, never from the raw upstream text, and the callbacks
registered with ``on_complete`` (the cache store) run only when the stream ends normally.

A filter is told about every event and, through ``end()``, when the stream ends, so it may hold
text back, rewrite it, or end the answer early by emitting ``Finish("content_filter")``; after
a ``Finish`` has gone out, the upstream is closed and nothing more is passed on.

Citations come after the filters (``cite``): each answer sentence's ``Citation`` is yielded as
soon as the filtered text has completed it, the last one just before the ``Finish``; the filters
never see them. A replayed answer (a cache hit) yields its stored citations instead.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from contextlib import aclosing
from dataclasses import replace
from typing import Any, Protocol

from pipeline.answer.completion import Completion
from pipeline.answer.events import (
    AnswerEvent,
    Citation,
    ContentDelta,
    Finish,
    StreamEvent,
    ToolCall,
    ToolCallDelta,
    Usage,
)

CompletionCallback = Callable[[Completion], Awaitable[None]]


class StreamTap(Protocol):
    """Sees what the reader of a stream gets (request coalescing publishes it to followers):
    each event as it is yielded, then how the stream ended: its completion (after the
    ``on_complete`` callbacks ran), or the error, or None for both when the reader let go."""

    def event(self, event: AnswerEvent) -> None: ...

    def ended(self, completion: Completion | None, error: BaseException | None) -> None: ...

    async def followed(self) -> bool:
        """Whether others read what it publishes now (the stream is then finished for them
        when its own reader leaves)."""
        ...


class StreamFilter(Protocol):
    """Transforms answer events in flight (output guardrails, for one)."""

    name: str

    def feed(self, event: StreamEvent) -> Sequence[StreamEvent]: ...

    def end(self) -> Sequence[StreamEvent]: ...


class SentenceCiter(Protocol):
    """Cites the answer's sentences as its text arrives (``pipeline.answer.citations``)."""

    def feed(self, text: str) -> Sequence[Citation]: ...

    def end(self) -> Sequence[Citation]: ...


class CompletionBuilder:
    """Assembles a ``Completion`` from events: text, tool calls by index, finish, usage."""

    def __init__(self) -> None:
        self.text: list[str] = []
        self.logprobs: list[dict[str, Any]] = []
        self.calls: dict[int, list[str]] = {}  # index -> [id, name, arguments]
        self.finish: Finish | None = None
        self.usage = Usage(0, 0)
        self.citations: list[Citation] = []

    def take(self, event: AnswerEvent) -> None:
        if isinstance(event, Citation):
            self.citations.append(event)
        elif isinstance(event, ContentDelta):
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
            citations=list(self.citations),
        )


async def _aclose(source: AsyncIterator[AnswerEvent]) -> None:
    aclose = getattr(source, "aclose", None)
    if aclose is not None:
        await aclose()


class AnswerStream:
    """One answer's events, through the filters, to one reader.

    ``base`` makes the completion's fixed parts (model, sources, route, tools) when the stream
    ends, so that facts learned while streaming (tools run between rounds) are included.
    """

    def __init__(self, source: AsyncIterator[AnswerEvent], base: Callable[[], Completion]) -> None:
        self._source = source
        self._base = base
        self._primed: list[AnswerEvent] = []
        self._citer: SentenceCiter | None = None
        self._callbacks: list[CompletionCallback] = []
        self._taps: list[StreamTap] = []
        self._told = False  # the taps know how it ended
        self._read = False
        self.filters: list[StreamFilter] = []
        self.completion: Completion | None = None

    @classmethod
    def replay(cls, completion: Completion) -> AnswerStream:
        """The events of a complete answer again (a cache hit), as one delta each."""

        async def events() -> AsyncIterator[AnswerEvent]:
            if completion.content or completion.logprobs:
                yield ContentDelta(completion.content, tuple(completion.logprobs or ()))
            for citation in completion.citations:
                yield citation
            for index, call in enumerate(completion.tool_calls):
                yield ToolCallDelta(index, call.id, call.name, call.arguments)
            yield Finish(completion.finish_reason, completion.finish_detail)
            yield Usage(completion.prompt_tokens, completion.completion_tokens)

        return cls(events(), lambda: completion)

    def add_filter(self, stream_filter: StreamFilter) -> None:
        if self._read:
            raise RuntimeError("filters must be added before the stream is read")
        self.filters.append(stream_filter)

    def cite(self, citer: SentenceCiter) -> None:
        """Cite the filtered text's sentences as they complete (see the module's docstring)."""
        if self._read:
            raise RuntimeError("a citer must be set before the stream is read")
        self._citer = citer

    def on_complete(self, callback: CompletionCallback) -> None:
        self._callbacks.append(callback)

    def tap(self, tap: StreamTap) -> None:
        """Show ``tap`` every event the reader gets, and the end (see ``StreamTap``)."""
        self._taps.append(tap)

    def _ended(self, completion: Completion | None, error: BaseException | None) -> None:
        if self._told:
            return
        self._told = True
        for tap in self._taps:
            tap.ended(completion, error)

    def let_go(self) -> None:
        """Its reader lets it go (its client left, nobody follows): the taps are told now,
        before the stream is cancelled or closed (``app.http.streaming``)."""
        self._ended(None, None)

    async def followed(self) -> bool:
        """Whether a tap's readers read this answer now: its reader's leaving should then not
        end it (``app.http.streaming``)."""
        for tap in self._taps:
            if await tap.followed():
                return True
        return False

    async def prime(self) -> None:
        """Wait for the first upstream event, so that a failure before any output is raised
        here (and becomes an HTTP error) rather than in the middle of a 200 stream."""
        try:
            self._primed.append(await anext(self._source))
        except StopAsyncIteration:
            pass
        except BaseException as exc:
            self._ended(None, exc)
            await _aclose(self._source)
            raise

    async def _upstream(self) -> AsyncGenerator[AnswerEvent, None]:
        for event in self._primed:
            yield event
        self._primed.clear()
        async for event in self._source:
            yield event

    def _through(self, event: AnswerEvent, start: int = 0) -> list[AnswerEvent]:
        if isinstance(event, Citation):
            return [event]  # replayed: made of text that has passed the filters
        out: list[AnswerEvent] = [event]
        for stream_filter in self.filters[start:]:
            out = [
                result
                for item in out
                if not isinstance(item, Citation)
                for result in stream_filter.feed(item)
            ]
        return out

    def _cited(self, event: AnswerEvent) -> list[AnswerEvent]:
        """The event, with the citations it completes: after a delta, before a finish."""
        if self._citer is None:
            return [event]
        if isinstance(event, ContentDelta):
            return [event, *self._citer.feed(event.text)]
        if isinstance(event, Finish):
            return [*self._citer.end(), event]
        return [event]

    def _flush(self) -> list[AnswerEvent]:
        out: list[AnswerEvent] = []
        for position, stream_filter in enumerate(self.filters):
            for event in stream_filter.end():
                out.extend(self._through(event, position + 1))
        return out

    async def events(self) -> AsyncGenerator[AnswerEvent, None]:
        """The filtered events; read once. The completion is built when they end."""
        if self._read:
            raise RuntimeError("an answer stream can be read only once")
        self._read = True
        async with aclosing(self._events()) as events:
            try:
                async for event in events:
                    for tap in self._taps:
                        tap.event(event)
                    yield event
            except BaseException as exc:  # the reader let go (GeneratorExit) or the answer failed
                # Said before the upstream is closed (that awaits the network): a leader's
                # flight is closed to new followers at once (``pipeline.store.singleflight``).
                self._ended(None, None if isinstance(exc, GeneratorExit) else exc)
                raise
        self._ended(self.completion, None)

    async def _events(self) -> AsyncGenerator[AnswerEvent, None]:
        builder = CompletionBuilder()
        upstream = self._upstream()
        try:
            async for raw in upstream:
                for event in self._through(raw):
                    for cited in self._cited(event) if _accepts(builder, event) else ():
                        builder.take(cited)
                        yield cited
                if builder.finish is not None and builder.finish.reason == "content_filter":
                    break
            else:
                for event in self._flush():
                    for cited in self._cited(event) if _accepts(builder, event) else ():
                        builder.take(cited)
                        yield cited
            if self._citer is not None:
                for citation in self._citer.end():  # an upstream that ended without a finish
                    builder.take(citation)
                    yield citation
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


def _accepts(builder: CompletionBuilder, event: AnswerEvent) -> bool:
    # After the answer has finished only its usage may follow.
    return builder.finish is None or isinstance(event, Usage)
