"""The output guard on the answer stream: PII redacted across chunk boundaries, in the text and
in tool-call arguments (kept valid JSON, a forced tool_choice included), the same result
streamed or drained, grounding judged when the answer ends, a violation ending the stream."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Sequence
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from pipeline.answer.completion import Completion
from pipeline.answer.events import ContentDelta, Finish, StreamEvent, ToolCallDelta, Usage
from pipeline.answer.stream import AnswerStream
from pipeline.context import ChatParams, Passage, Principal, RequestContext
from pipeline.guards.pii import PII_KINDS
from pipeline.guards.policy import PolicyBook
from pipeline.stages.guard_out import GuardOutput
from pipeline.tools.base import ToolContext
from pipeline.tools.loop import ToolLoop
from tests.pipeline.test_tool_loop import Script, collect
from tests.support.fuzzing import examples
from tests.support.tracing import memory_tracing

ANSWER = "Write to jane.doe@example.com or call +44 20 7946 0958 about [kea] and [moa]."
PASSAGES = [Passage("kea", "kea#0", "Kea", "The kea is a parrot of the Southern Alps.", 1.0)]


def chunks(text: str, size: int) -> list[StreamEvent]:
    pieces: list[StreamEvent] = [
        ContentDelta(text[i : i + size]) for i in range(0, len(text), size)
    ]
    return [*pieces, Finish("stop"), Usage(10, 20)]


async def play(events: Sequence[StreamEvent], gap: float = 0.0) -> AsyncIterator[StreamEvent]:
    for event in events:
        if gap:
            await asyncio.sleep(gap)
        yield event


def base() -> Completion:
    return Completion(content="", finish_reason="stop", model="m")


async def guarded(
    events: Sequence[StreamEvent], policy: str | None = None, gap: float = 0.0
) -> tuple[list[StreamEvent], Completion, InMemorySpanExporter]:
    provider, exporter = memory_tracing()
    ctx = RequestContext(
        params=ChatParams(model="m", messages=[]),
        credential=None,
        deadline=asyncio.get_running_loop().time() + 10,
        principal=Principal("acme", "alice", frozenset({"chat"}), "k"),
        passages=PASSAGES,
    )
    ctx.answer = AnswerStream(play(events, gap), base)
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


def words(*pieces: str) -> list[StreamEvent]:
    return [*(ContentDelta(p) for p in pieces), Finish("stop"), Usage(10, 20)]


async def holdback(events: Sequence[StreamEvent], policy: str | None = None) -> dict[str, Any]:
    """The grounding span's attributes for ``events`` played 20 ms apart."""
    _, _, exporter = await guarded(events, policy, gap=0.02)
    (span,) = [s for s in exporter.get_finished_spans() if s.name == "guard_out grounding"]
    return dict(span.attributes or {})


async def test_the_wait_of_the_first_text_in_the_redaction_is_on_the_span() -> None:
    first_ms, pieces = "rag.guard.output.first_held_ms", "rag.guard.output.first_held_pieces"
    # A first word of four pieces is let out when the fifth shows where it ends.
    # A piece without text (a delta of log probabilities only) is not one.
    facts = await holdback(
        [ContentDelta(""), *words("R", "ip", "amy", "cin", " decreases", " it.")]
    )
    assert facts[pieces] == 5 and facts["rag.guard.output.held_max"] >= len("Ripamycin")
    assert facts[first_ms] >= 4 * 20 - 5  # four gaps of 20 ms (the sleeps' clock is coarser)
    # Most answers: the second piece ends the first word.
    facts = await holdback(words("The", " answer", " is", " yes."))
    assert facts[pieces] == 2 and facts[first_ms] >= 20 - 5
    # A one-word answer is let out when it ends (the end counts as a piece).
    facts = await holdback(words("Y", "es"))
    assert facts[pieces] == 3 and facts[first_ms] >= 2 * 20 - 5
    # Nothing to redact: each piece is let out as it comes.
    off = json.dumps({"*": {"pii": dict.fromkeys(PII_KINDS, "allow")}})
    facts = await holdback(words("R", "ip", "amy", "cin"), off)
    assert facts[pieces] == 1 and facts[first_ms] >= 0  # let out in the call that took it
    # An answer without text says nothing of a first text.
    facts = await holdback(words())
    assert first_ms not in facts and pieces not in facts
    assert facts["rag.guard.output.held_max"] == 0


async def test_a_blocked_kind_ends_the_answer_with_content_filter() -> None:
    policy = '{"*": {"pii": {"email": "block"}}}'
    out, completion, exporter = await guarded(chunks(ANSWER, 4), policy)
    assert out[-1] == Finish("content_filter", "pii.email")
    assert completion.finish_reason == "content_filter"
    assert completion.finish_detail == "pii.email"
    assert "jane.doe" not in completion.content
    (span,) = [s for s in exporter.get_finished_spans() if s.name == "guard_out grounding"]
    assert span.attributes["rag.guard.output.violation"] == "pii.email"


@settings(max_examples=examples(40), deadline=None)
@given(text=st.text(max_size=120), size=st.integers(min_value=1, max_value=9))
async def test_streamed_and_whole_answers_come_out_the_same(text: str, size: int) -> None:
    streamed, completion, _ = await guarded(chunks(text + " mail me at ab@cd.io", size))
    _, again, _ = await guarded(chunks(text + " mail me at ab@cd.io", 10_000))
    assert completion.content == again.content
    assert "".join(e.text for e in streamed if isinstance(e, ContentDelta)) == again.content
    assert "ab@cd.io" not in completion.content


CALL_ARGUMENTS = json.dumps(
    {"to": "jane.doe@example.com", "body": "Call me on +44 20 7946 0958", "n": 4111111111111111}
)


def call_events(arguments: str, size: int) -> list[StreamEvent]:
    pieces = [arguments[i : i + size] for i in range(0, len(arguments), size)]
    deltas: list[StreamEvent] = [
        ToolCallDelta(0, "call-1" if i == 0 else None, "send_email" if i == 0 else None, piece)
        for i, piece in enumerate(pieces)
    ]
    return [*deltas, Finish("tool_calls"), Usage(10, 20)]


@pytest.mark.parametrize("size", [1, 3, 7, 500])
async def test_tool_call_arguments_are_redacted_as_json_whatever_the_fragments(size: int) -> None:
    out, completion, _ = await guarded(call_events(CALL_ARGUMENTS, size))
    deltas = [e for e in out if isinstance(e, ToolCallDelta)]
    assert (deltas[0].id, deltas[0].name) == ("call-1", "send_email")
    streamed = "".join(d.arguments for d in deltas)
    assert json.loads(streamed) == {"to": "[EMAIL]", "body": "Call me on [PHONE]", "n": "[CARD]"}
    (call,) = completion.tool_calls
    assert call.arguments == streamed
    assert completion.finish_reason == "tool_calls"


@pytest.mark.parametrize(
    "policy, rule",
    [
        ('{"*": {"pii": {"email": "block"}}}', "pii.email"),
        ('{"*": {"blocked_output_terms": ["call me"]}}', "blocked_term"),
    ],
)
async def test_a_blocked_kind_or_term_in_arguments_ends_the_answer(policy: str, rule: str) -> None:
    out, completion, exporter = await guarded(call_events(CALL_ARGUMENTS, 4), policy)
    assert out[-1] == Finish("content_filter", rule)
    assert completion.finish_reason == "content_filter" and completion.finish_detail == rule
    sent = "".join(e.arguments for e in out if isinstance(e, ToolCallDelta))
    assert "jane.doe" not in sent and "7946" not in sent
    (span,) = [s for s in exporter.get_finished_spans() if s.name == "guard_out grounding"]
    assert span.attributes["rag.guard.output.violation"] == rule


async def test_a_forced_tool_choice_makes_the_whole_answer_guarded_arguments() -> None:
    # The model answers a forced call in plain text (structured output); the loop turns that
    # text into the call's arguments, and those pass the output guard on their way out.
    schema = {"type": "object", "properties": {"email": {"type": "string"}}}
    function = {"type": "function", "function": {"name": "subscribe", "parameters": schema}}
    script = Script(
        [ContentDelta('{"email": "ana.sil'), ContentDelta('va@example.org"}'), Finish("stop")]
    )
    loop = ToolLoop(
        script,
        None,
        ToolContext(Principal("acme", "alice", frozenset({"chat"}), "k")),
        client_tools=frozenset({"subscribe"}),
        max_rounds=3,
        parent=None,
        runs=[],
    )
    request = {"messages": [], "tools": [function], "tool_choice": function}
    out, completion, _ = await guarded(await collect(loop.events(request)))
    (call,) = completion.tool_calls
    assert call.name == "subscribe"
    assert json.loads(call.arguments) == {"email": "[EMAIL]"}
    assert completion.finish_reason == "tool_calls"
    assert "ana.silva" not in "".join(e.arguments for e in out if isinstance(e, ToolCallDelta))
