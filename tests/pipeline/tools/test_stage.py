"""The tools stage: planned calls run beside the features stage, their runs kept for the prompt."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from pipeline.answer.events import ToolCall
from pipeline.context import (
    ChatParams,
    Features,
    Principal,
    RagOptions,
    RequestContext,
    ToolRun,
)
from pipeline.model.prompt import build_messages
from pipeline.runner import Concurrent, Runner, StageSpec
from pipeline.stages.tools import PlannedTools
from pipeline.tools.base import ToolContext
from pipeline.tools.builtins import builtin_tools
from pipeline.tools.invoker import ToolInvoker
from pipeline.tools.planner import ToolPlanner
from pipeline.tools.registry import ToolRegistry
from tests.pipeline.tools.support import Tracing


class SignIn:
    spec = StageSpec.of("auth", writes={"principal"})

    async def __call__(self, ctx: RequestContext) -> RequestContext:
        ctx.principal = Principal("acme", "alice", frozenset({"chat"}), "k")
        return ctx


class SlowFeatures:
    """Writes the user's features after ``delay`` seconds."""

    spec = StageSpec.of("features", reads={"principal"}, writes={"features"}, policy="degrade")

    def __init__(self, delay: float) -> None:
        self.delay = delay

    async def __call__(self, ctx: RequestContext) -> RequestContext:
        await asyncio.sleep(self.delay)
        ctx.features = Features({"tier": "pro"}, version="v1")
        return ctx


class BrokenInvoker:
    async def run(self, calls: Sequence[ToolCall], context: ToolContext) -> list[ToolRun]:
        raise RuntimeError("invoker bug")


def request(text: str, **rag: bool) -> RequestContext:
    loop = asyncio.get_running_loop()
    return RequestContext(
        params=ChatParams(
            model="m", messages=[{"role": "user", "content": text}], rag=RagOptions(**rag)
        ),
        credential=None,
        deadline=loop.time() + 10,
    )


def stage(tracing: Tracing) -> PlannedTools:
    registry = ToolRegistry(builtin_tools())
    return PlannedTools(ToolPlanner(registry.tools), ToolInvoker(registry, tracing.tracer))


async def test_planned_tools_run_and_their_results_reach_the_prompt(tracing: Tracing) -> None:
    runner = Runner([SignIn(), stage(tracing)], tracing.tracer)
    ctx = await runner.run(request("What is 1234 * 5678?"))
    (run,) = ctx.tool_runs
    assert (run.name, run.status, run.content) == ("calculator", "ok", "1234 * 5678 = 7006652")
    spans = {s.name: s for s in tracing.exporter.get_finished_spans()}
    assert spans["stage tools"].attributes["rag.tools.planned"] == ("calculator",)
    tool_span = spans["execute_tool calculator"]
    assert tool_span.parent is not None
    assert tool_span.parent.span_id == spans["stage tools"].context.span_id
    assert ctx.records[-1].info == {"tools.planned": ["calculator"]}
    system = build_messages(ctx.params.messages, [], tool_runs=ctx.tool_runs)[0]["content"]
    assert "Tool results:\n[tool calculator] 1234 * 5678 = 7006652" in system


async def test_the_profile_waits_for_the_features_stage_beside_it(tracing: Tracing) -> None:
    # Features that take 0.8 s (the profile tool's timeout is 2 s): the calculator's own run
    # is far shorter than that on any machine.
    group = Concurrent(SlowFeatures(0.8), stage(tracing))
    runner = Runner([SignIn(), group], tracing.tracer)
    ctx = await runner.run(request("What is 6 * 7, and what is on my plan?"))
    calculator, profile = ctx.tool_runs
    assert calculator.content == "6 * 7 = 42"
    assert profile.content == "The user's profile (feature set v1):\n- tier: pro"
    # The calculator did not wait for the features; the profile did.
    assert calculator.duration_ms < 500 <= profile.duration_ms


async def test_plan_tools_false_plans_nothing(tracing: Tracing) -> None:
    runner = Runner([SignIn(), stage(tracing)], tracing.tracer)
    ctx = await runner.run(request("What is 1234 * 5678?", plan_tools=False))
    assert ctx.tool_runs == []
    assert not [s for s in tracing.exporter.get_finished_spans() if "execute_tool" in s.name]


async def test_a_request_that_needs_no_tool_runs_none(tracing: Tracing) -> None:
    runner = Runner([SignIn(), stage(tracing)], tracing.tracer)
    ctx = await runner.run(request("What is the capital of France?"))
    assert ctx.tool_runs == []
    assert ctx.records[-1].info == {"tools.planned": []}


async def test_a_failing_stage_degrades_and_the_request_goes_on(tracing: Tracing) -> None:
    broken = PlannedTools(ToolPlanner({"calculator"}), BrokenInvoker())
    runner = Runner([SignIn(), broken], tracing.tracer)
    ctx = await runner.run(request("What is 1234 * 5678?"))
    assert ctx.tool_runs == []
    record = ctx.records[-1]
    assert (record.status, record.info["error_type"]) == ("degraded", "RuntimeError")
