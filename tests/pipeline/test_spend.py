"""What a model call spent (``pipeline.model.spend``): the running usage when the upstream sends
it, passed on once at the end; an estimate when it sends none; nothing for a call that streamed
nothing."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Any

from opentelemetry.trace import NoOpTracer

from pipeline.answer.completion import Completion
from pipeline.answer.events import ContentDelta, Usage
from pipeline.context import Principal
from pipeline.model.chat import TracedChat
from pipeline.model.routes import Route
from pipeline.model.slots import SlotPool
from pipeline.model.spend import MESSAGE_OVERHEAD_TOKENS, Spend, prompt_tokens, spent
from pipeline.model.tokens import ApproximateTokenCounter
from pipeline.tools.base import ToolContext
from pipeline.tools.loop import ToolLoop

PAYLOAD = {"model": "m", "messages": [{"role": "user", "content": "Tell me about dragons."}]}


class Upstream:
    """Streams the given chunks, as ``LLMClient.stream_chat`` would."""

    base_url = "http://upstream.invalid"

    def __init__(self, chunks: list[dict[str, Any]]) -> None:
        self.chunks = chunks

    async def stream_chat(
        self, payload: dict[str, Any], *, deadline: float | None = None
    ) -> AsyncGenerator[dict[str, Any], None]:
        for chunk in self.chunks:
            yield chunk


def delta(text: str, usage: tuple[int, int] | None = None) -> dict[str, Any]:
    chunk: dict[str, Any] = {"choices": [{"index": 0, "delta": {"content": text}}]}
    if usage is not None:
        chunk["usage"] = {"prompt_tokens": usage[0], "completion_tokens": usage[1]}
    return chunk


def route(chunks: list[dict[str, Any]]) -> Route:
    return Route(name="small", model="m", client=Upstream(chunks), slots=SlotPool(4))  # type: ignore[arg-type]


async def read(chat: TracedChat, chunks: list[dict[str, Any]], upto: int | None = None) -> Any:
    """The events read (all, or ``upto`` of them before the reader lets go) and the spend."""
    spend = Spend()
    token = spent.set(spend)
    try:
        events = []
        stream = chat.stream(route(chunks), PAYLOAD)
        async for event in stream:
            events.append(event)
            if upto is not None and len(events) == upto:
                break
        await stream.aclose()
    finally:
        spent.reset(token)
    return events, spend.tokens


async def test_running_usage_is_spent_as_read_and_passed_on_once_at_the_end() -> None:
    chunks = [delta("Dra", (20, 1)), delta("gons", (20, 2)), delta(" fly", (20, 3))]
    chunks.append({"choices": [], "usage": {"prompt_tokens": 20, "completion_tokens": 3}})
    events, tokens = await read(TracedChat(NoOpTracer()), chunks)
    assert [e for e in events if isinstance(e, Usage)] == [Usage(20, 3)]  # one, the last
    assert [e.text for e in events if isinstance(e, ContentDelta)] == ["Dra", "gons", " fly"]
    assert tokens == 23

    # Cut after two deltas: what the last chunk read said.
    events, tokens = await read(TracedChat(NoOpTracer()), chunks, upto=2)
    assert tokens == 22 and not any(isinstance(e, Usage) for e in events)


async def test_without_usage_the_prompt_is_counted_and_each_delta_is_a_token() -> None:
    counter = ApproximateTokenCounter()
    chunks = [delta("Dra"), delta("gons"), delta(" fly")]
    _, tokens = await read(TracedChat(NoOpTracer(), counter=counter), chunks, upto=2)
    prompt = prompt_tokens(PAYLOAD, counter)
    assert prompt == MESSAGE_OVERHEAD_TOKENS + counter.count("Tell me about dragons.") > 4
    assert tokens == prompt + 2


async def test_a_call_that_streamed_nothing_spent_nothing() -> None:
    _, tokens = await read(TracedChat(NoOpTracer(), counter=ApproximateTokenCounter()), [])
    assert tokens == 0


def test_the_prompt_counts_text_parts_tool_calls_and_tools() -> None:
    counter = ApproximateTokenCounter()
    plain = prompt_tokens(PAYLOAD, counter)
    parts = {
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "Tell me about dragons."}]}
        ]
    }
    assert prompt_tokens(parts, counter) == plain
    call = [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    tool = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    more = {
        "messages": [*PAYLOAD["messages"], {"role": "assistant", "tool_calls": call}],
        "tools": tool,
    }
    assert prompt_tokens(more, counter) > plain + MESSAGE_OVERHEAD_TOKENS


async def test_a_round_closed_mid_stream_through_the_tool_loop_is_spent_at_once() -> None:
    """The reader lets go (a stalled write closes the body: no cancellation reaches the model
    read): the round is closed before the loop is, so its spend is there for the charge."""
    chunks = [delta(w, (30, n)) for n, w in enumerate(["Once", " upon", " a", " time"], 1)]
    chat = TracedChat(NoOpTracer())
    loop = ToolLoop(
        lambda request: chat.stream(route(chunks), request),
        None,
        ToolContext(Principal("acme", "alice", frozenset({"chat"}), "k1")),
        client_tools=frozenset(),
        max_rounds=1,
        parent=None,
        runs=[],
    )
    spend = Spend()
    token = spent.set(spend)
    try:
        events = loop.events(PAYLOAD)
        assert isinstance(await anext(events), ContentDelta)
        assert isinstance(await anext(events), ContentDelta)
        await events.aclose()  # no loop turn between this and the charge
        assert spend.tokens == 32
    finally:
        spent.reset(token)


def test_the_charge_is_the_answers_usage_or_the_spend_where_that_is_more() -> None:
    spend = Spend()
    spend.add(50)
    spend.add(-3)  # never takes any back
    filtered = Completion(content="", finish_reason="content_filter", model="m")  # no usage read
    answered = Completion(
        content="x", finish_reason="stop", model="m", prompt_tokens=40, completion_tokens=40
    )
    assert spend.charge(None) == 50  # cut short
    assert spend.charge(filtered) == 50  # ended by a filter before its usage came
    assert spend.charge(answered) == 80  # a follower pays the shared answer's usage


async def test_a_follower_cut_short_is_charged_the_events_it_was_relayed(monkeypatch) -> None:
    # A follower of a shared generation spends nothing itself and, cut short, has no usage:
    # it read most of an answer for free (a hostile review, 2026-12-05: 330 of 351 chunks).
    import app.routes.chat as chat_route

    charged: list[int] = []
    monkeypatch.setattr(
        chat_route, "charge", lambda services, who, tokens, held: charged.append(tokens)
    )

    async def relayed() -> AsyncGenerator[bytes, None]:
        for i in range(10):
            yield b'data: {"choices": [{"delta": {"content": "w%d "}}]}\n\n' % i

    class Unfinished:  # the shared answer, not ended when its client leaves
        completion = None

    who = Principal(tenant="acme", user="alice", scopes=frozenset({"chat"}), key_id="k")
    stream = chat_route.Charged(relayed(), Unfinished(), None, who, Spend(), None)  # type: ignore[arg-type]
    read = [await anext(stream) for _ in range(7)]
    await stream.aclose()  # the client hangs up
    assert len(read) == 7 and charged == [7]


async def test_a_stream_closed_before_it_started_is_charged_once(monkeypatch) -> None:
    # A generator closed before its first step runs no finally: the request's reservation
    # was held until its window ended (a review, 2026-12-05).
    import app.routes.chat as chat_route

    charged: list[tuple[int, object]] = []
    monkeypatch.setattr(
        chat_route, "charge", lambda services, who, tokens, held: charged.append((tokens, held))
    )

    async def relayed() -> AsyncGenerator[bytes, None]:
        yield b'data: {"choices": [{"delta": {"content": "w"}}]}\n\n'

    class Unfinished:
        completion = None

    who = Principal(tenant="acme", user="alice", scopes=frozenset({"chat"}), key_id="k")
    spend = Spend()
    spend.add(12)  # what its model call spent before the client left
    held = object()
    stream = chat_route.Charged(relayed(), Unfinished(), None, who, spend, held)  # type: ignore[arg-type]
    await stream.aclose()
    await stream.aclose()
    assert charged == [(12, held)]
    whole = chat_route.Charged(relayed(), Unfinished(), None, who, Spend(), held)  # type: ignore[arg-type]
    assert [chunk async for chunk in whole] and charged[-1] == (1, held)
    await whole.aclose()
    assert len(charged) == 2
