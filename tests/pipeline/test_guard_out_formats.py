"""The output guard on answers that carry log probabilities or must be JSON: a redacted token's
logprobs entry is removed and every other kept, whatever the chunking; a JSON answer is redacted
inside its strings and stays valid JSON, and PII outside a string ends it with content_filter."""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import AsyncIterator, Sequence
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.answer.completion import Completion
from pipeline.answer.events import ContentDelta, Finish, StreamEvent, Usage
from pipeline.answer.stream import AnswerStream
from pipeline.context import ChatParams, Principal, RequestContext
from pipeline.guards.output import StreamingRedactor
from pipeline.guards.policy import PolicyBook
from pipeline.stages.guard_out import GuardOutput, kept_stretches
from tests.support.fuzzing import examples
from tests.support.tracing import memory_tracing

TOKENS = ["Mail", " jane", ".doe", "@", "example", ".com", " or", " ask", " Bob", "."]


def entry(token: str) -> dict[str, Any]:
    return {"token": token, "logprob": -0.5, "bytes": list(token.encode()), "top_logprobs": []}


def deltas(tokens: Sequence[str], per_chunk: int) -> list[StreamEvent]:
    """`per_chunk` tokens per delta, each with its logprobs entry, as vLLM streams them."""
    events: list[StreamEvent] = []
    for i in range(0, len(tokens), per_chunk):
        group = tokens[i : i + per_chunk]
        events.append(ContentDelta("".join(group), tuple(entry(t) for t in group)))
    return [*events, Finish("stop"), Usage(5, len(tokens))]


async def play(events: Sequence[StreamEvent]) -> AsyncIterator[StreamEvent]:
    for event in events:
        yield event


async def guarded(
    events: Sequence[StreamEvent], sampling: dict[str, Any], policy: str | None = None
) -> tuple[list[StreamEvent], Completion]:
    provider, _ = memory_tracing()
    ctx = RequestContext(
        params=ChatParams(model="m", messages=[], sampling=sampling),
        credential=None,
        deadline=asyncio.get_running_loop().time() + 10,
        principal=Principal("acme", "alice", frozenset({"chat"}), "k"),
    )
    logprobs = [] if sampling.get("logprobs") else None
    base = Completion(content="", finish_reason="stop", model="m", logprobs=logprobs)
    ctx.answer = AnswerStream(play(events), lambda: base)
    await GuardOutput(PolicyBook.from_json(policy), provider.get_tracer("t"))(ctx)
    out = [event async for event in ctx.answer.events()]
    assert ctx.answer.completion is not None
    return out, ctx.answer.completion


def text_of(events: Sequence[StreamEvent]) -> str:
    return "".join(e.text for e in events if isinstance(e, ContentDelta))


def tokens_of(events: Sequence[StreamEvent]) -> list[str]:
    return [x["token"] for e in events if isinstance(e, ContentDelta) for x in e.logprobs]


@pytest.mark.parametrize("per_chunk", [1, 2, 3, 10])
async def test_a_redacted_tokens_logprobs_are_removed_and_the_others_kept(per_chunk: int) -> None:
    out, completion = await guarded(deltas(TOKENS, per_chunk), {"logprobs": True})
    assert text_of(out) == "Mail [EMAIL] or ask Bob."
    kept = tokens_of(out)
    # The email's tokens (and " jane", whose space stays but whose name went) are gone.
    assert kept == ["Mail", " or", " ask", " Bob", "."]
    assert [x["token"] for x in completion.logprobs or []] == kept


async def test_without_redaction_every_entry_comes_through_with_its_text() -> None:
    tokens = ["The", " kea", " is", " a", " parrot", "."]
    out, completion = await guarded(deltas(tokens, 2), {"logprobs": True})
    assert tokens_of(out) == tokens
    assert "".join(tokens_of(out)) == text_of(out) == completion.content


async def test_no_logprobs_when_not_asked_for() -> None:
    out, completion = await guarded(deltas(TOKENS, 2), {})
    assert completion.logprobs is None and tokens_of(out) == []


@settings(max_examples=examples(60), deadline=None)
@given(
    words=st.lists(
        st.sampled_from(["a", " b", " jane@example.com", " +44 20 7946 0958", ".", " ok", "\n"]),
        min_size=1,
        max_size=12,
    ),
    per_chunk=st.integers(1, 5),
)
def test_kept_entries_are_exactly_the_tokens_outside_the_redactions(
    words: list[str], per_chunk: int
) -> None:
    tokens = [piece for word in words for piece in _split(word)]
    out, completion = asyncio.run(guarded(deltas(tokens, per_chunk), {"logprobs": True}))
    kept = tokens_of(out)
    assert [x["token"] for x in completion.logprobs or []] == kept
    # The spans the redactor replaces in the whole text (streaming replaces the same ones).
    whole = StreamingRedactor()
    redacted = whole.feed("".join(tokens)) + whole.end()
    assert text_of(out) == redacted
    expected, position = [], 0
    for token in tokens:
        end = position + len(token)
        if not any(a < end and position < b for a, b in whole.redacted):
            expected.append(token)
        position = end
    assert kept == expected


def _split(word: str) -> list[str]:
    # Tokens of a few characters, as a tokenizer cuts an email or a phone number.
    return [word[i : i + 3] for i in range(0, len(word), 3)]


JSON_FORMAT = {"response_format": {"type": "json_object"}}


@pytest.mark.parametrize("size", [1, 4, 9, 500])
async def test_a_json_answer_is_redacted_inside_its_strings_and_stays_valid(size: int) -> None:
    answer = '{"name": "Jane", "contact": "mail jane.doe@example.com now", "age": 41}'
    events = [ContentDelta(answer[i : i + size]) for i in range(0, len(answer), size)]
    out, completion = await guarded([*events, Finish("stop")], JSON_FORMAT)
    assert completion.finish_reason == "stop"
    value = json.loads(completion.content)
    assert value == {"name": "Jane", "contact": "mail [EMAIL] now", "age": 41}
    assert text_of(out) == completion.content


async def test_pii_outside_a_string_ends_a_json_answer_with_content_filter() -> None:
    answer = '{"card": 4111111111111111, "name": "Jane"}'
    _, completion = await guarded([ContentDelta(answer), Finish("stop")], JSON_FORMAT)
    assert (completion.finish_reason, completion.finish_detail) == (
        "content_filter",
        "pii_outside_string",
    )
    assert "4111111111111111" not in completion.content


async def test_the_same_number_in_text_is_redacted_as_text() -> None:
    answer = '{"card": 4111111111111111}'
    _, completion = await guarded([ContentDelta(answer), Finish("stop")], {})
    assert completion.finish_reason == "stop" and "4111111111111111" not in completion.content


async def test_a_json_answers_logprobs_keep_the_tokens_the_answer_kept() -> None:
    tokens = ['{"', "mail", '":', ' "', "jane", ".doe", "@example", ".com", '"}']
    out, completion = await guarded(deltas(tokens, 2), {**JSON_FORMAT, "logprobs": True})
    assert json.loads(completion.content) == {"mail": "[EMAIL]"}
    kept = tokens_of(out)
    assert kept == ['{"', "mail", '":', ' "', '"}']
    assert [x["token"] for x in completion.logprobs or []] == kept


@settings(max_examples=examples(200), deadline=None)
@given(
    pieces=st.lists(
        st.tuples(
            st.text(alphabet='abc de,:{}"0123456789', max_size=60),
            st.text(alphabet="XYZ@.", min_size=1, max_size=20),  # rewritten: PII-like text
        ),
        max_size=4,
    ),
    last=st.text(alphabet='abc de,:{}"0123456789', max_size=60),
)
def test_kept_stretches_never_include_rewritten_text(
    pieces: list[tuple[str, str]], last: str
) -> None:
    original, output, spans = "", "", []
    for kept_text, rewritten in pieces:
        original += kept_text
        output += kept_text + "[EMAIL]"
        spans.append((len(original), len(original) + len(rewritten)))
        original += rewritten
    original, output = original + last, output + last
    kept = kept_stretches(original, output)
    assert all(a < b for a, b in kept)
    assert all(b1 <= a2 for (_, b1), (a2, _) in itertools.pairwise(kept))
    for a, b in kept:
        assert not any(s < b and a < e for s, e in spans), (a, b, spans)
    if not spans:
        assert kept == ([(0, len(original))] if original else [])
    # Kept text is the output's, in order.
    position = 0
    for a, b in kept:
        found = output.find(original[a:b], position)
        assert found >= 0
        position = found + b - a
