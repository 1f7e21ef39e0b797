"""Traces through the real OTLP exporters to real receivers: OTLP/gRPC (a trace service built on
``opentelemetry-proto``, in-process) and OTLP/HTTP (oteltap), chosen by the standard
``OTEL_*`` variables, with requests sent through the running app to the real vLLM."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator

import pytest
from opentelemetry.proto.trace.v1.trace_pb2 import Span as ProtoSpan
from oteltap import OtelTapHttpProtobufReceiver, OtelTapHttpProtobufReceiverSettings

from app.main import create_app
from pipeline.runner import Concurrent
from retrieval import Document
from tests.conftest import AppHarness, chat_request, make_settings
from tests.support.otlp import GrpcTraceReceiver, ReceivedSpan, of_trace
from tests.support.servers import free_port

QUESTION = "Using the sources: why does vitamin D matter for bones, and what is 1234 * 5678?"
DOCUMENTS = [
    Document(id="vitd", title="Vitamin D", text="Vitamin D helps the body absorb calcium."),
    Document(id="bones", title="Bones", text="Calcium keeps bones strong; vitamin D helps."),
    Document(id="fjord", title="Fjords", text="A fjord is a long, narrow inlet cut by a glacier."),
]


def question() -> str:
    return f"{QUESTION} (ref {uuid.uuid4().hex[:6]})"


def chat_body(text: str) -> dict[str, object]:
    return chat_request(text, max_tokens=8)


@pytest.fixture
def grpc_receiver(monkeypatch: pytest.MonkeyPatch) -> Iterator[GrpcTraceReceiver]:
    """A gRPC receiver, and the environment that points the app's exporter at it."""
    with GrpcTraceReceiver() as receiver:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint)
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
        monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
        yield receiver


def children(spans: list[ReceivedSpan], parent: ReceivedSpan) -> dict[str, ReceivedSpan]:
    return {s.name: s for s in spans if s.parent_id == parent.span_id}


def assert_path_structure(
    spans: list[ReceivedSpan], root: ReceivedSpan, harness: AppHarness, last_stage: str | None
) -> None:
    """Every step of the path up to ``last_stage`` (all: None) is a child of the root; the
    stages of a concurrent group are children of its ``group`` span."""
    under_root = children(spans, root)
    for step in harness.paths.chat.steps:
        if isinstance(step, Concurrent):
            group = under_root[f"group {step.name}"]
            assert set(children(spans, group)) == {f"stage {s.spec.name}" for s in step.stages}
        else:
            assert f"stage {step.spec.name}" in under_root, sorted(under_root)
            if step.spec.name == last_stage:
                return


async def send(harness: AppHarness, key: str, text: str, **headers: str) -> tuple[str, int, int]:
    """(trace id, start ns, end ns) of one chat request that must succeed."""
    started = time.time_ns()
    response = await harness.chat(key, chat_body(text), **headers)
    assert response.status_code == 200, response.text
    return response.headers["x-trace-id"], started, time.time_ns()


async def test_a_miss_and_a_hit_arrive_over_grpc_as_one_trace_each_through_every_stage(
    make_app, redis_server, vllm, grpc_receiver: GrpcTraceReceiver
) -> None:
    text = question()
    # The full path's hit, stage by stage (the fast path's trace: tests/app/test_fastpath.py).
    settings = make_settings(redis_server.url, vllm.url, cache={"fast_path": False})
    async with make_app(settings) as harness:
        assert harness.services.retrieval is not None
        await harness.services.retrieval.ingest("acme", DOCUMENTS)
        key = await harness.key()
        miss, miss_start, miss_end = await send(harness, key, text)
        hit, hit_start, hit_end = await send(harness, key, text)
        steps = harness.paths.chat.steps
        # Leaving the app shuts the provider down, which flushes the batch exporter.
    spans = grpc_receiver.spans()
    assert miss != hit
    during = [s for s in spans if miss_start <= s.start_ns <= hit_end]
    assert {s.trace_id for s in during} == {miss, hit}, "a span landed in a trace of its own"

    trace = of_trace(spans, miss)
    roots = [s for s in trace if not s.parent_id]
    assert [r.name for r in roots] == ["POST /v1/chat/completions"]
    root = roots[0]
    assert miss_start <= root.start_ns and root.end_ns <= miss_end
    assert_path_structure(trace, root, harness, last_stage=None)
    assert any(isinstance(step, Concurrent) for step in steps), "the path has a concurrent group"
    by_name = {s.name: s for s in trace}
    lookup = by_name["stage cache_lookup"]
    assert lookup.attributes["rag.cache.status"] == "miss"
    # (A coalescing leader looks in the cache once more, under the generate stage.)
    gets = [s for s in trace if s.name == "redis GET"]
    assert lookup.span_id in {s.parent_id for s in gets}
    assert by_name["retrieval acme"].parent_id == by_name["stage retrieve"].span_id
    assert by_name["retrieval acme"].attributes["rag.retrieval.results"] > 0
    assert by_name["execute_tool calculator"].parent_id == by_name["stage tools"].span_id
    chat = by_name["chat smollm2"]
    assert chat.parent_id == by_name["stage generate"].span_id
    assert chat.kind == ProtoSpan.SPAN_KIND_CLIENT
    assert chat.attributes["gen_ai.operation.name"] == "chat"
    assert chat.attributes["gen_ai.provider.name"] == "vllm"
    assert chat.attributes["gen_ai.request.model"] == "smollm2"
    assert chat.attributes["gen_ai.request.max_tokens"] == 8
    assert chat.attributes["gen_ai.usage.input_tokens"] > 0
    assert 0 < chat.attributes["gen_ai.usage.output_tokens"] <= 8
    assert chat.attributes["gen_ai.response.time_to_first_chunk"] > 0
    assert chat.attributes["gen_ai.response.finish_reasons"]

    hit_trace = of_trace(spans, hit)
    hit_root = next(s for s in hit_trace if not s.parent_id)
    assert_path_structure(hit_trace, hit_root, harness, last_stage="cache_lookup")
    hit_names = {s.name for s in hit_trace}
    assert "chat smollm2" not in hit_names and "stage generate" not in hit_names
    hit_lookup = next(s for s in hit_trace if s.name == "stage cache_lookup")
    assert hit_lookup.attributes["rag.cache.status"] == "hit"
    assert hit_start <= hit_root.start_ns

    resource = root.resource
    assert resource["service.name"] == "rag-pipeline"
    assert resource["service.version"] == "0.1.0"
    assert resource["deployment.environment.name"] == "test"
    assert len(resource["service.instance.id"]) == 36
    assert not any(text in value for s in trace + hit_trace for value in s.texts())
    assert not any("Bearer" in value or key in value for s in spans for value in s.texts())


async def test_over_http_a_trusted_callers_traceparent_is_continued_and_content_shows(
    make_app, redis_server, vllm, monkeypatch: pytest.MonkeyPatch
) -> None:
    port = free_port()
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
    caller_trace, caller_span = uuid.uuid4().hex, uuid.uuid4().hex[:16]
    text = question()
    settings = make_settings(
        redis_server.url,
        vllm.url,
        telemetry={"capture_content": True, "caller_trace": "follow"},
    )
    async with http_receiver(port) as receiver:
        received: list[ReceivedSpan] = []
        root_seen = asyncio.Event()

        async def collect() -> None:
            async for span in receiver.stream_traces():
                received.append(ReceivedSpan.of(span))
                if span.name == "POST /v1/chat/completions":
                    root_seen.set()

        collecting = asyncio.ensure_future(collect())
        async with make_app(settings) as harness:
            key = await harness.key()
            trace_id, started, ended = await send(
                harness,
                key,
                text,
                traceparent=f"00-{caller_trace}-{caller_span}-01",
                tracestate="vendor=caller",
            )
        async with asyncio.timeout(20):
            await root_seen.wait()
        collecting.cancel()
    assert trace_id == caller_trace
    trace = of_trace(received, caller_trace)
    root = next(s for s in trace if s.name == "POST /v1/chat/completions")
    assert root.parent_id == caller_span, "our root's parent is the caller's span"
    assert root.trace_state == "vendor=caller"
    during = {s.trace_id for s in received if started <= s.start_ns <= ended}
    assert during == {caller_trace}, [s.name for s in received if s.trace_id != caller_trace]
    chat = next(s for s in trace if s.name == "chat smollm2")
    assert text in chat.attributes["gen_ai.input.messages"]


async def test_the_sampler_and_headers_come_from_the_environment(
    make_app, redis_server, grpc_receiver: GrpcTraceReceiver, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``parentbased_traceidratio`` at 0: a new trace is not exported (its id still comes
    back), a followed caller's sampled trace is; the exporter sends
    ``OTEL_EXPORTER_OTLP_HEADERS``."""
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "parentbased_traceidratio")
    monkeypatch.setenv("OTEL_TRACES_SAMPLER_ARG", "0")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_HEADERS", "x-tenant-of-collector=ours")
    body = {"model": "no-such-model", "messages": [{"role": "user", "content": "x"}]}
    caller_trace = uuid.uuid4().hex
    settings = make_settings(
        redis_server.url, "http://127.0.0.1:9", telemetry={"caller_trace": "follow"}
    )
    async with make_app(settings) as harness:
        key = await harness.key()
        alone = await harness.chat(key, body)
        continued = await harness.chat(
            key, body, traceparent=f"00-{caller_trace}-{uuid.uuid4().hex[:16]}-01"
        )
    assert alone.status_code == continued.status_code == 404
    trace_ids = {s.trace_id for s in grpc_receiver.spans()}
    assert len(alone.headers["x-trace-id"]) == 32
    assert alone.headers["x-trace-id"] not in trace_ids
    assert trace_ids == {caller_trace}
    assert all(m.get("x-tenant-of-collector") == "ours" for m in grpc_receiver.metadata)


def test_an_unknown_otlp_protocol_is_refused_at_start_up(
    redis_server, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json")
    with pytest.raises(ValueError, match="http/json"):
        create_app(make_settings(redis_server.url, "http://127.0.0.1:9"))


def http_receiver(port: int) -> OtelTapHttpProtobufReceiver:
    return OtelTapHttpProtobufReceiver(
        OtelTapHttpProtobufReceiverSettings(
            http_port=port,
            listen_on_all_interfaces=False,
            print_traces_as_ndjson=False,
            print_logs_as_ndjson=False,
            print_metrics_as_ndjson=False,
        )
    )
