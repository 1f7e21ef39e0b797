"""The output guard on the answer stream: PII redacted across chunk boundaries, the same result
streamed or drained, grounding judged when the answer ends, a violation ending the stream."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from pipeline.answer import AnswerStream
from pipeline.completion import Completion
from pipeline.context import ChatParams, Passage, Principal, RequestContext
from pipeline.events import ContentDelta, Finish, StreamEvent, Usage
from pipeline.guards.policy import PolicyBook
from pipeline.stages.guard_out import GuardOutput

ANSWER = "Write to jane.doe@example.com or call +44 20 7946 0958 about [kea] and [moa]."
PASSAGES = [Passage("kea", "kea#0", "Kea", "The kea is a parrot of the Southern Alps.", 1.0)]


def chunks(text: str, size: int) -> list[StreamEvent]:
    pieces: list[StreamEvent] = [
        ContentDelta(text[i : i + size]) for i in range(0, len(text), size)
    ]
    return [*pieces, Finish("stop"), Usage(10, 20)]


async def play(events: Sequence[StreamEvent]) -> AsyncIterator[StreamEvent]:
    for event in events:
        yield event


def base() -> Completion:
    return Completion(content="", finish_reason="stop", model="m")


async def guarded(
    events: Sequence[StreamEvent], policy: str | None = None
) -> tuple[list[StreamEvent], Completion, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    ctx = RequestContext(
        params=ChatParams(model="m", messages=[]),
        credential=None,
        deadline=asyncio.get_running_loop().time() + 10,
        principal=Principal("acme", "alice", frozenset({"chat"}), "k"),
        passages=PASSAGES,
    )
    ctx.answer = AnswerStream(play(events), base)
    await GuardOutput(PolicyBook.from_json(policy), provider.get_tracer("t"))(ctx)
    out = [event async for event in ctx.answer.events()]
    assert ctx.answer.completion is not None
    return out, ctx.answer.completion, exporter


@pytest.mark.parametrize("size", [1, 3, 4, 7, 200])
async def test_pii_is_redacted_whatever_the_chunking(size: int) -> None:
    out, completion, _ = await guarded(chunks(ANSWER, size))
    text = "".join(e.text for e in out if isinstance(e, ContentDelta))
    assert text == completion.content
    assert "jane.doe" not in text and "7946" not in text
    assert "[EMAIL]" in text and "[PHONE]" in text
    assert completion.finish_reason == "stop"


async def test_grounding_is_judged_when_the_answer_ends() -> None:
    answer = "The kea is a parrot of the Southern Alps [kea]. Moas were tall birds [moa]."
    _, _, exporter = await guarded(chunks(answer, 5))
    (span,) = [s for s in exporter.get_finished_spans() if s.name == "guard_out grounding"]
    assert span.attributes["rag.grounding.cited"] == ("kea", "moa")
    assert span.attributes["rag.grounding.unknown_citations"] == ("moa",)
    assert span.attributes["rag.grounding.sentences"] == 2
    assert span.attributes["rag.grounding.support"] == 0.5


async def test_a_blocked_kind_ends_the_answer_with_content_filter() -> None:
    policy = '{"*": {"pii": {"email": "block"}}}'
    out, completion, exporter = await guarded(chunks(ANSWER, 4), policy)
    assert out[-1] == Finish("content_filter", "pii.email")
    assert completion.finish_reason == "content_filter"
    assert completion.finish_detail == "pii.email"
    assert "jane.doe" not in completion.content
    (span,) = [s for s in exporter.get_finished_spans() if s.name == "guard_out grounding"]
    assert span.attributes["rag.guard.output.violation"] == "pii.email"


@settings(max_examples=40, deadline=None)
@given(text=st.text(max_size=120), size=st.integers(min_value=1, max_value=9))
async def test_streamed_and_whole_answers_come_out_the_same(text: str, size: int) -> None:
    streamed, completion, _ = await guarded(chunks(text + " mail me at ab@cd.io", size))
    _, again, _ = await guarded(chunks(text + " mail me at ab@cd.io", 10_000))
    assert completion.content == again.content
    assert "".join(e.text for e in streamed if isinstance(e, ContentDelta)) == again.content
    assert "ab@cd.io" not in completion.content
