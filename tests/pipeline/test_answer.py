"""The answer stream: events from chunks, filters told when the stream ends, the completion built
from what came out, callbacks only on a normal end."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence

import pytest

from pipeline.answer.completion import Completion
from pipeline.answer.events import (
    ContentDelta,
    Finish,
    StreamEvent,
    ToolCall,
    ToolCallDelta,
    Usage,
    events_from_chunk,
)
from pipeline.answer.stream import AnswerStream
from pipeline.errors import UpstreamError


def base() -> Completion:
    return Completion(content="", finish_reason="stop", model="m", sources=[{"document_id": "d"}])


async def source(events: Sequence[StreamEvent], closed: list[bool]) -> AsyncIterator[StreamEvent]:
    try:
        for event in events:
            yield event
    finally:
        closed.append(True)


ANSWER = [
    ContentDelta("The capital "),
    ContentDelta("is Paris."),
    Finish("stop"),
    Usage(12, 4),
]


class Upper:
    name = "upper"

    def feed(self, event: StreamEvent) -> list[StreamEvent]:
        if isinstance(event, ContentDelta):
            return [ContentDelta(event.text.upper())]
        return [event]

    def end(self) -> list[StreamEvent]:
        return []


class HoldUntilEnd:
    """Holds every piece of text back, and lets it out when told the stream ended."""

    name = "hold"

    def __init__(self) -> None:
        self.held: list[str] = []

    def feed(self, event: StreamEvent) -> list[StreamEvent]:
        if isinstance(event, ContentDelta):
            self.held.append(event.text)
            return []
        if isinstance(event, Finish):
            return [ContentDelta("".join(self.held)), event]
        return [event]

    def end(self) -> list[StreamEvent]:
        return [ContentDelta("[late]")]


class BlockWord:
    name = "block"

    def feed(self, event: StreamEvent) -> list[StreamEvent]:
        if isinstance(event, ContentDelta) and "Paris" in event.text:
            return [Finish("content_filter", "blocked_term")]
        return [event]

    def end(self) -> list[StreamEvent]:
        return []


def test_events_from_a_vllm_chunk() -> None:
    chunk = {
        "choices": [
            {
                "index": 0,
                "delta": {
                    "content": "Hi",
                    "tool_calls": [
                        {"index": 0, "id": "c1", "function": {"name": "calc", "arguments": "{"}}
                    ],
                },
                "finish_reason": "tool_calls",
            }
        ],
        "usage": {"prompt_tokens": 3, "completion_tokens": 1},
    }
    assert events_from_chunk(chunk) == [
        ContentDelta("Hi"),
        ToolCallDelta(0, "c1", "calc", "{"),
        Finish("tool_calls"),
        Usage(3, 1),
    ]
    assert events_from_chunk({"choices": [{"delta": {"content": ""}}]}) == []


@pytest.mark.parametrize(
    "chunk",
    [
        {"choices": "Blue"},
        {"choices": [1]},
        {"choices": [{"delta": "Blue"}]},
        {"choices": [{"delta": {"content": ["Blue"]}}]},
        {"choices": [{"delta": {}, "finish_reason": 1}]},
        {"choices": [{"delta": {"tool_calls": [{"function": "calc"}]}}]},
        {"choices": [{"delta": {"tool_calls": [{"function": {"arguments": {"x": 1}}}]}}]},
        {"choices": [{"delta": {"tool_calls": [{"id": 7, "function": {}}]}}]},
        {"choices": [], "usage": {"prompt_tokens": "x"}},
        {"choices": [], "usage": {"completion_tokens": -1}},
        {"choices": [], "usage": {"completion_tokens": True}},
    ],
)
def test_a_chunk_of_another_shape_is_the_model_server_failing(chunk: dict) -> None:
    # Read as chunks, these crashed further on (a 500, or an internal error ending a stream)
    # or passed nonsense on as the answer (a list as its text, a negative token count).
    with pytest.raises(UpstreamError) as failed:
        events_from_chunk(chunk)
    assert (failed.value.status_code, failed.value.code) == (502, "upstream_malformed")


async def test_drain_builds_the_completion_and_runs_callbacks() -> None:
    closed: list[bool] = []
    stored: list[Completion] = []
    answer = AnswerStream(source(ANSWER, closed), base)

    async def store(completion: Completion) -> None:
        stored.append(completion)

    answer.on_complete(store)
    completion = await answer.drain()
    assert completion.content == "The capital is Paris."
    assert (completion.prompt_tokens, completion.completion_tokens) == (12, 4)
    assert completion.sources == [{"document_id": "d"}]
    assert stored == [completion] and closed == [True]


async def test_the_completion_is_built_from_the_filtered_text() -> None:
    answer = AnswerStream(source(ANSWER, []), base)
    answer.add_filter(Upper())
    out = [e async for e in answer.events()]
    assert [e.text for e in out if isinstance(e, ContentDelta)] == ["THE CAPITAL ", "IS PARIS."]
    assert answer.completion is not None
    assert answer.completion.content == "THE CAPITAL IS PARIS."


async def test_a_filter_may_hold_back_and_is_told_when_the_stream_ends() -> None:
    answer = AnswerStream(source(ANSWER, []), base)
    answer.add_filter(HoldUntilEnd())
    answer.add_filter(Upper())  # what the first lets out passes the second
    out = [e async for e in answer.events()]
    assert out[0] == ContentDelta("THE CAPITAL IS PARIS.")
    assert out[1] == Finish("stop")
    # Text after the finish is not passed on: the answer has ended.
    assert ContentDelta("[LATE]") not in out
    assert answer.completion is not None and answer.completion.content == "THE CAPITAL IS PARIS."


async def test_a_content_filter_finish_ends_the_stream_and_closes_the_upstream() -> None:
    closed: list[bool] = []
    stored: list[Completion] = []
    answer = AnswerStream(source([*ANSWER[:2], ContentDelta("never"), *ANSWER[2:]], closed), base)
    answer.add_filter(BlockWord())

    async def store(completion: Completion) -> None:
        stored.append(completion)

    answer.on_complete(store)
    out = [e async for e in answer.events()]
    assert out == [ContentDelta("The capital "), Finish("content_filter", "blocked_term")]
    assert closed == [True]
    assert stored[0].finish_reason == "content_filter"
    assert stored[0].finish_detail == "blocked_term"
    assert stored[0].content == "The capital "


async def test_a_reader_that_stops_early_runs_no_callback() -> None:
    closed: list[bool] = []
    stored: list[Completion] = []
    answer = AnswerStream(source(ANSWER, closed), base)

    async def store(completion: Completion) -> None:
        stored.append(completion)

    answer.on_complete(store)
    events = answer.events()
    assert await anext(events) == ContentDelta("The capital ")
    await events.aclose()  # the client went away
    assert stored == [] and closed == [True]


class Ends:
    """A tap that notes how the answer ended, and what its source had done by then."""

    def __init__(self, closing: asyncio.Event) -> None:
        self.closing = closing
        self.endings: list[tuple[Completion | None, BaseException | None, bool]] = []

    def event(self, event: StreamEvent) -> None:
        pass

    def ended(self, completion: Completion | None, error: BaseException | None) -> None:
        self.endings.append((completion, error, self.closing.is_set()))

    async def followed(self) -> bool:
        return False


async def test_a_tap_is_told_the_reader_let_go_before_the_upstream_is_closed() -> None:
    # Closing the model call awaits the network: a coalesced flight's leader learnt that its
    # reader had gone only after it, and a request joining meanwhile followed an answer
    # about to stop (``pipeline.store.singleflight``).
    closing, closed = asyncio.Event(), asyncio.Event()

    async def slow_to_close() -> AsyncIterator[StreamEvent]:
        try:
            for event in ANSWER:
                yield event
        finally:
            closing.set()
            await closed.wait()

    answer = AnswerStream(slow_to_close(), base)
    tap = Ends(closing)
    answer.tap(tap)
    events = answer.events()
    assert await anext(events) == ANSWER[0]
    letting_go = asyncio.create_task(events.aclose())  # the client went away
    await asyncio.wait_for(closing.wait(), 5)
    assert tap.endings == [(None, None, False)], "told before the upstream began to close"
    closed.set()
    await letting_go
    assert tap.endings == [(None, None, False)], "told once"


async def test_prime_surfaces_an_error_before_any_output() -> None:
    async def failing() -> AsyncIterator[StreamEvent]:
        raise RuntimeError("upstream refused")
        yield ContentDelta("unreachable")

    answer = AnswerStream(failing(), base)
    with pytest.raises(RuntimeError, match="refused"):
        await answer.prime()


async def test_prime_keeps_the_first_event_for_the_reader() -> None:
    answer = AnswerStream(source(ANSWER, []), base)
    await answer.prime()
    assert (await answer.drain()).content == "The capital is Paris."


async def test_tool_call_fragments_are_assembled_by_index() -> None:
    events = [
        ToolCallDelta(0, "a", "calc", '{"expr'),
        ToolCallDelta(1, "b", "clock", "{}"),
        ToolCallDelta(0, None, None, 'ession": "1+1"}'),
        Finish("tool_calls"),
        Usage(5, 9),
    ]
    completion = await AnswerStream(source(events, []), base).drain()
    assert completion.finish_reason == "tool_calls"
    assert completion.tool_calls == [
        ToolCall("a", "calc", '{"expression": "1+1"}'),
        ToolCall("b", "clock", "{}"),
    ]
    assert completion.to_dict()["tool_calls"] == [
        {
            "id": "a",
            "type": "function",
            "function": {"name": "calc", "arguments": '{"expression": "1+1"}'},
        },
        {"id": "b", "type": "function", "function": {"name": "clock", "arguments": "{}"}},
    ]


async def test_replay_gives_back_the_same_completion() -> None:
    original = Completion(
        content="Paris [d1]",
        finish_reason="stop",
        model="m",
        prompt_tokens=7,
        completion_tokens=3,
        tool_calls=[ToolCall("x", "f", "{}")],
        route={"name": "small", "model": "m", "reason": "rule"},
    )
    again = await AnswerStream.replay(original).drain()
    assert again.to_dict() == original.to_dict()
    assert Completion.from_dict(original.to_dict()) == original  # as the cache stores it


async def test_a_stream_is_read_once_and_filters_come_first() -> None:
    answer = AnswerStream(source(ANSWER, []), base)
    await answer.drain()
    with pytest.raises(RuntimeError):
        answer.add_filter(Upper())
    with pytest.raises(RuntimeError):
        await answer.drain()


async def test_text_held_back_reaches_the_reader_before_an_upstream_error() -> None:
    async def breaks() -> AsyncIterator[StreamEvent]:
        yield ContentDelta("Half")
        raise RuntimeError("connection broke")

    answer = AnswerStream(breaks(), base)
    answer.add_filter(HoldUntilEnd())
    seen: list[StreamEvent] = []
    with pytest.raises(RuntimeError, match="broke"):
        async for event in answer.events():
            seen.append(event)
    assert seen == [ContentDelta("[late]")]  # HoldUntilEnd lets out only what end() gives
    assert answer.completion is None  # and nothing is built or stored from a broken answer
