"""A caller's W3C trace context (``traceparent``): by default a link on a trace of the
request's own, so no caller joins another tenant's trace or turns tracing off for its requests;
followed only when the operator says its callers are trusted (``telemetry.caller_trace``)."""

from __future__ import annotations

import uuid

import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.trace import SpanKind

from tests.conftest import AppHarness, make_settings

# Refused with a 404 after the key check, before any model is called: traced all the same.
BODY = {"model": "no-such-model", "messages": [{"role": "user", "content": "x"}]}


def traceparent(trace_id: str, span_id: str, *, sampled: bool = True) -> str:
    return f"00-{trace_id}-{span_id}-{'01' if sampled else '00'}"


def of_trace(h: AppHarness, trace_id: str) -> list[ReadableSpan]:
    return [
        s
        for s in h.exporter.get_finished_spans()
        if s.context is not None and format(s.context.trace_id, "032x") == trace_id
    ]


def server_span(h: AppHarness, trace_id: str) -> ReadableSpan:
    return next(s for s in of_trace(h, trace_id) if s.kind == SpanKind.SERVER)


@pytest.fixture
async def h(make_app, redis_server):
    async with make_app(make_settings(redis_server.url, "http://127.0.0.1:9")) as harness:
        yield harness


async def test_a_callers_trace_is_a_link_on_a_trace_of_the_requests_own(h: AppHarness) -> None:
    key = await h.key()
    caller_trace, caller_span = uuid.uuid4().hex, uuid.uuid4().hex[:16]
    response = await h.chat(
        key,
        BODY,
        traceparent=traceparent(caller_trace, caller_span),
        tracestate="v=caller",
        baggage="tenant=someone-else",
    )
    assert response.status_code == 404, response.text
    ours = response.headers["x-trace-id"]
    assert len(ours) == 32 and ours != caller_trace
    assert of_trace(h, caller_trace) == []
    root = server_span(h, ours)
    assert root.parent is None, "a root of its own"
    assert [
        (format(link.context.trace_id, "032x"), format(link.context.span_id, "016x"))
        for link in root.links
    ] == [(caller_trace, caller_span)]
    assert root.context is not None and root.context.trace_state.get("v") is None
    assert not root.links[0].context.trace_state, "the caller's tracestate is not kept"


async def test_a_caller_can_neither_join_another_tenants_trace_nor_go_untraced(
    h: AppHarness,
) -> None:
    victim = await h.chat(await h.key("victim"), BODY)
    victims_trace = victim.headers["x-trace-id"]
    before = len(of_trace(h, victims_trace))
    # Another tenant that learned the victim's trace id, asking not to be sampled.
    joined = await h.chat(
        await h.key("intruder"),
        BODY,
        traceparent=traceparent(victims_trace, uuid.uuid4().hex[:16], sampled=False),
    )
    assert joined.status_code == 404
    assert joined.headers["x-trace-id"] != victims_trace
    assert len(of_trace(h, victims_trace)) == before, "nothing added to the victim's trace"
    intruders = server_span(h, joined.headers["x-trace-id"])
    assert intruders.context is not None and intruders.context.trace_flags.sampled


async def test_a_trusted_callers_trace_and_sampling_decision_are_followed(
    make_app, redis_server
) -> None:
    settings = make_settings(
        redis_server.url, "http://127.0.0.1:9", telemetry={"caller_trace": "follow"}
    )
    async with make_app(settings) as h:
        key = await h.key()
        caller_trace, caller_span = uuid.uuid4().hex, uuid.uuid4().hex[:16]
        followed = await h.chat(key, BODY, traceparent=traceparent(caller_trace, caller_span))
        assert followed.headers["x-trace-id"] == caller_trace
        root = server_span(h, caller_trace)
        assert root.parent is not None and format(root.parent.span_id, "016x") == caller_span
        assert not root.links
        unsampled = uuid.uuid4().hex
        dropped = await h.chat(
            key, BODY, traceparent=traceparent(unsampled, caller_span, sampled=False)
        )
        assert dropped.headers["x-trace-id"] == unsampled
        assert of_trace(h, unsampled) == [], "the caller's decision not to sample, followed"
