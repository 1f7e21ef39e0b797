"""The runner: one span per stage in order, early exit, deadline, concurrent groups."""

from __future__ import annotations

import asyncio

import pytest
from opentelemetry.sdk.trace import TracerProvider

from pipeline.context import ChatParams, Completion, Features, RequestContext, StageRecord
from pipeline.errors import DeadlineExceeded, InvalidRequest, ServiceUnavailable
from pipeline.runner import Concurrent, PathError, Runner, StageSpec, available


class Sleep:
    def __init__(self, name: str, seconds: float = 0.0, log: list[str] | None = None) -> None:
        self.name = name
        self.spec = StageSpec.of(name)
        self.seconds = seconds
        self.log = log if log is not None else []

    async def __call__(self, ctx: RequestContext) -> RequestContext:
        self.log.append(f"start {self.name}")
        await asyncio.sleep(self.seconds)
        ctx.annotate(slept=self.seconds)
        self.log.append(f"end {self.name}")
        return ctx


class Answer:
    spec = StageSpec.of("answer", writes={"completion", "answer", "finished"})

    async def __call__(self, ctx: RequestContext) -> RequestContext:
        ctx.respond(Completion(content="cached", finish_reason="stop", model="m"))
        return ctx


class Fail:
    spec = StageSpec.of("fail")

    async def __call__(self, ctx: RequestContext) -> RequestContext:
        raise InvalidRequest("nope")


def new_ctx(seconds: float = 5.0) -> RequestContext:
    loop = asyncio.get_running_loop()
    return RequestContext(
        params=ChatParams(model="m", messages=[]), credential=None, deadline=loop.time() + seconds
    )


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
    # All three started before any finished: they overlapped (their sum would be 0.9 s; a bound
    # on the wall time would only add the luck of a busy machine to what the order proves).
    assert log[:3] == ["start x", "start y", "start z"]
    assert elapsed >= 0.3, elapsed
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


async def test_a_fault_in_the_code_of_a_group_is_on_its_span_with_its_stack(tracing) -> None:
    # Not a ``Described`` failure: the group's span (and the stage's) keep the stack.
    provider, exporter = tracing
    runner = Runner([Concurrent(Sleep("slow", 2.0), Bug())], provider.get_tracer("t"))
    with pytest.raises(ExceptionGroup):
        await runner.run(new_ctx())
    spans = {s.name: s for s in exporter.get_finished_spans()}
    for name in ("group slow+bug", "stage bug"):
        assert spans[name].status.status_code.name == "ERROR", name
        stacks = [e.attributes.get("exception.stacktrace", "") for e in spans[name].events]
        assert any("a bug in a stage" in stack and "Traceback" in stack for stack in stacks)


class Bug:
    spec = StageSpec.of("bug")

    async def __call__(self, ctx: RequestContext) -> RequestContext:
        raise RuntimeError("a bug in a stage")


class Broken:
    """A degrading stage that fails; its fallback puts defaults in place."""

    def __init__(
        self, error: Exception | None = None, delay: float = 0.0, timeout_s: float | None = None
    ) -> None:
        self.error = error or RuntimeError("feature store down")
        self.delay = delay
        self.spec = StageSpec.of(
            "features", reads={"params"}, writes={"features"}, policy="degrade", timeout_s=timeout_s
        )

    async def __call__(self, ctx: RequestContext) -> RequestContext:
        await asyncio.sleep(self.delay)
        raise self.error

    def fallback(self, ctx: RequestContext, exc: BaseException) -> None:
        ctx.features = Features({"tier": "free"}, frozenset({"tier"}))


class Writes:
    def __init__(self, name: str, reads: set[str], writes: set[str]) -> None:
        self.spec = StageSpec.of(name, reads=reads, writes=writes)

    async def __call__(self, ctx: RequestContext) -> RequestContext:
        return ctx


async def test_a_degrading_stage_fails_without_failing_the_request(tracing) -> None:
    provider, exporter = tracing
    log: list[str] = []
    runner = Runner(
        [Concurrent(Broken(delay=0.05), Sleep("retrieve", 0.2, log)), Sleep("after", log=log)],
        provider.get_tracer("t"),
    )
    ctx = await runner.run(new_ctx())
    # The sibling was not cancelled and the path went on.
    assert log == ["start retrieve", "end retrieve", "start after", "end after"]
    record = next(r for r in ctx.records if r.name == "features")
    assert record.status == "degraded"
    assert record.info["error"] == "feature store down"
    assert ctx.features.defaulted == frozenset({"tier"})
    span = next(s for s in exporter.get_finished_spans() if s.name == "stage features")
    assert span.status.status_code.name == "ERROR"
    assert span.attributes["error.type"] == "RuntimeError"
    # A fault in the code (not a ``Described`` failure): recorded with its stack.
    (event,) = span.events
    assert event.name == "exception" and event.attributes["exception.type"] == "RuntimeError"
    assert "feature store down" in event.attributes["exception.stacktrace"]
    assert "in __call__" in event.attributes["exception.stacktrace"]


async def test_a_degrading_stage_past_its_budget_times_out_alone(tracing) -> None:
    provider, exporter = tracing
    slow = Broken(delay=5.0, timeout_s=0.05)
    runner = Runner([slow, Sleep("after")], provider.get_tracer("t"))
    loop = asyncio.get_running_loop()
    started = loop.time()
    ctx = await runner.run(new_ctx())
    assert loop.time() - started < 2.0
    record = ctx.records[0]
    assert record.status == "degraded" and record.info["error_type"] == "StageTimeout"
    assert ctx.records[1].status == "ok"
    # A spent budget is described by its type and message; no stack is formatted for it.
    span = next(s for s in exporter.get_finished_spans() if s.name == "stage features")
    (event,) = span.events
    assert dict(event.attributes) == {
        "exception.type": "pipeline.runner.StageTimeout",
        "exception.message": "features ran past its budget of 50 ms",
    }


async def test_a_fatal_error_in_a_degrading_stage_is_still_a_deadline(tracing) -> None:
    provider, _ = tracing
    runner = Runner([Broken(delay=5.0)], provider.get_tracer("t"))
    with pytest.raises(DeadlineExceeded):
        await runner.run(new_ctx(0.1))


async def test_a_refusal_from_a_degrading_stage_ends_the_request_and_a_fault_does_not(
    tracing,
) -> None:
    """Degrading absorbs faults (a 503 from a model that is down), never a stage's decision to
    refuse the request (a 4xx, such as a guardrail's block), which cancels the group."""
    provider, exporter = tracing
    log: list[str] = []
    refusing = Runner(
        [Concurrent(Broken(InvalidRequest("blocked")), Sleep("retrieve", 1.0, log))],
        provider.get_tracer("t"),
    )
    with pytest.raises(InvalidRequest, match="blocked"):
        await refusing.run(new_ctx())
    assert log == ["start retrieve"]  # the sibling was cancelled
    faulty = Runner([Broken(ServiceUnavailable("model down"))], provider.get_tracer("t"))
    ctx = await faulty.run(new_ctx())
    assert ctx.records[0].status == "degraded"
    assert ctx.records[0].info["error_type"] == "ServiceUnavailable"
    events = [e for s in exporter.get_finished_spans() for e in s.events]
    assert {e.attributes["exception.message"] for e in events} == {"blocked", "model down"}
    # The stage's span and the group's: each says what ended it, neither formats a stack.
    assert len(events) == 3
    assert not any("exception.stacktrace" in e.attributes for e in events)


async def test_a_stage_waits_for_a_sibling_that_writes_what_it_reads(tracing) -> None:
    provider, _ = tracing
    seen: list[str] = []

    class Loader:
        spec = StageSpec.of("features", reads={"params"}, writes={"features"}, policy="degrade")

        async def __call__(self, ctx: RequestContext) -> RequestContext:
            await asyncio.sleep(0.1)
            ctx.features = Features({"department": "legal"})
            return ctx

    class Reader:
        spec = StageSpec.of("retrieve", reads={"features"}, writes={"passages"})

        async def __call__(self, ctx: RequestContext) -> RequestContext:
            seen.append("embedding while the features load")
            await available("features")
            seen.append(ctx.features.get("department"))
            return ctx

    runner = Runner([Concurrent(Loader(), Reader())], provider.get_tracer("t"))
    await runner.run(new_ctx())
    assert seen == ["embedding while the features load", "legal"]


async def test_a_stage_waiting_on_a_failed_sibling_gets_its_fallback(tracing) -> None:
    provider, _ = tracing
    seen: list[object] = []

    class Reader:
        spec = StageSpec.of("retrieve", reads={"features"}, writes={"passages"})

        async def __call__(self, ctx: RequestContext) -> RequestContext:
            await available("features")
            seen.append(ctx.features.defaulted)
            return ctx

    runner = Runner([Concurrent(Broken(delay=0.05), Reader())], provider.get_tracer("t"))
    await runner.run(new_ctx())
    assert seen == [frozenset({"tier"})]


def test_a_path_whose_stage_reads_what_nothing_wrote_is_refused() -> None:
    tracer = TracerProvider().get_tracer("t")
    with pytest.raises(PathError, match="cache_store reads \\['cache_key'\\]"):
        Runner(
            [Writes("auth", set(), {"principal"}), Writes("cache_store", {"cache_key"}, set())],
            tracer,
        )
    # Written earlier, or by a sibling of the same group: accepted.
    Runner(
        [
            Writes("auth", set(), {"principal"}),
            Concurrent(
                Writes("features", {"principal"}, {"features"}),
                Writes("retrieve", {"principal", "features"}, {"passages"}),
            ),
            Writes("generate", {"passages", "features"}, {"answer"}),
        ],
        tracer,
    )
    with pytest.raises(PathError, match="features reads"):
        Runner([Writes("features", {"principal"}, {"features"})], tracer)


async def test_observers_hear_of_every_stage(tracing) -> None:
    provider, _ = tracing
    heard: list[tuple[str, str]] = []

    class Observer:
        def stage_finished(self, record: StageRecord, ctx: RequestContext) -> None:
            heard.append((record.name, record.status))

    runner = Runner(
        [Sleep("a"), Broken(), Sleep("b")], provider.get_tracer("t"), observers=[Observer()]
    )
    await runner.run(new_ctx())
    assert heard == [("a", "ok"), ("features", "degraded"), ("b", "ok")]
