"""The runner: one span per stage in order, early exit, deadline, concurrent groups."""

from __future__ import annotations

import asyncio

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from pipeline.context import ChatParams, Completion, RequestContext
from pipeline.errors import DeadlineExceeded, InvalidRequest
from pipeline.runner import Concurrent, Runner


class Sleep:
    def __init__(self, name: str, seconds: float = 0.0, log: list[str] | None = None) -> None:
        self.name = name
        self.seconds = seconds
        self.log = log if log is not None else []

    async def __call__(self, ctx: RequestContext) -> RequestContext:
        self.log.append(f"start {self.name}")
        await asyncio.sleep(self.seconds)
        ctx.annotate(slept=self.seconds)
        self.log.append(f"end {self.name}")
        return ctx


class Answer:
    name = "answer"

    async def __call__(self, ctx: RequestContext) -> RequestContext:
        ctx.respond(Completion(content="cached", finish_reason="stop", model="m"))
        return ctx


class Fail:
    name = "fail"

    async def __call__(self, ctx: RequestContext) -> RequestContext:
        raise InvalidRequest("nope")


def new_ctx(seconds: float = 5.0) -> RequestContext:
    loop = asyncio.get_running_loop()
    return RequestContext(
        params=ChatParams(model="m", messages=[]), credential=None, deadline=loop.time() + seconds
    )


@pytest.fixture
def tracing() -> tuple[TracerProvider, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider, exporter


async def test_each_stage_gets_its_own_span_in_order(tracing) -> None:
    provider, exporter = tracing
    runner = Runner([Sleep("a"), Sleep("b"), Sleep("c")], provider.get_tracer("t"))
    ctx = await runner.run(new_ctx())
    spans = sorted(exporter.get_finished_spans(), key=lambda s: s.start_time)
    assert [s.name for s in spans] == ["stage a", "stage b", "stage c"]
    assert [r.name for r in ctx.records] == ["a", "b", "c"]
    assert spans[0].attributes["rag.slept"] == 0.0
    assert ctx.records[0].info == {"slept": 0.0}


async def test_a_stage_that_answers_ends_the_run(tracing) -> None:
    provider, exporter = tracing
    log: list[str] = []
    runner = Runner(
        [Sleep("a", log=log), Answer(), Sleep("late", log=log)], provider.get_tracer("t")
    )
    ctx = await runner.run(new_ctx())
    assert ctx.finished and ctx.completion is not None
    assert "start late" not in log
    assert [s.name for s in exporter.get_finished_spans()] == ["stage a", "stage answer"]


async def test_deadline_stops_a_slow_stage_with_504(tracing) -> None:
    provider, _exporter = tracing
    runner = Runner([Sleep("slow", 5.0)], provider.get_tracer("t"))
    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(DeadlineExceeded) as info:
        await runner.run(new_ctx(0.2))
    assert info.value.status_code == 504
    assert loop.time() - started < 2.0
    assert new_ctx().records == []


async def test_concurrent_group_costs_the_slowest_not_the_sum(tracing) -> None:
    provider, exporter = tracing
    log: list[str] = []
    group = Concurrent(Sleep("x", 0.3, log), Sleep("y", 0.3, log), Sleep("z", 0.3, log))
    runner = Runner([group, Sleep("after", log=log)], provider.get_tracer("t"))
    loop = asyncio.get_running_loop()
    started = loop.time()
    await runner.run(new_ctx())
    elapsed = loop.time() - started
    # All three started before any finished: they overlapped.
    assert log[:3] == ["start x", "start y", "start z"]
    assert elapsed < 0.85, elapsed
    names = {s.name: s for s in exporter.get_finished_spans()}
    group_span = names["group x+y+z"]
    for child in ("stage x", "stage y", "stage z"):
        assert names[child].parent is not None
        assert names[child].parent.span_id == group_span.context.span_id


async def test_a_failing_stage_in_a_group_fails_the_run_with_its_error(tracing) -> None:
    provider, exporter = tracing
    runner = Runner([Concurrent(Sleep("slow", 2.0), Fail())], provider.get_tracer("t"))
    with pytest.raises(InvalidRequest):
        await runner.run(new_ctx())
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert spans["stage fail"].attributes["error.type"] == "InvalidRequest"
