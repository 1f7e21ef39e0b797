"""The invoker: a round's calls at once, each bounded and traced, results in call order."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from opentelemetry.trace import StatusCode

from pipeline.answer.events import ToolCall
from pipeline.tools.base import Tool, ToolContext, ToolError
from pipeline.tools.invoker import ToolInvoker
from pipeline.tools.registry import ToolRegistry
from tests.pipeline.tools.support import OBJECT, Sleeper, Tracing, caller


def invoker_for(tracing: Tracing, *tools: Tool, **options: Any) -> ToolInvoker:
    return ToolInvoker(ToolRegistry(tools), tracing.tracer, **options)


def calls(*names: str, arguments: str = "{}") -> list[ToolCall]:
    return [ToolCall(f"call-{i}", name, arguments) for i, name in enumerate(names)]


async def raises(arguments: dict[str, Any], context: ToolContext) -> str:
    raise RuntimeError("database password is hunter2")


async def refuses(arguments: dict[str, Any], context: ToolContext) -> str:
    raise ToolError("no such city")


async def hangs(arguments: dict[str, Any], context: ToolContext) -> str:
    await asyncio.sleep(3600)
    return "never"


async def own_timeout(arguments: dict[str, Any], context: ToolContext) -> str:
    raise TimeoutError("the upstream timed out")


async def test_three_tools_of_100_ms_take_about_100_ms_together(tracing: Tracing) -> None:
    sleepers = [Sleeper(name, 0.1) for name in ("a", "b", "c")]
    invoker = invoker_for(tracing, *(s.tool for s in sleepers))
    started = time.perf_counter()
    runs = await invoker.run(calls("a", "b", "c"), caller())
    elapsed = time.perf_counter() - started
    assert [r.status for r in runs] == ["ok", "ok", "ok"]
    # At once: every call started before any ended (what a wall-clock bound would say, without
    # the luck of a busy machine); and none was cut short.
    assert max(s.starts[0] for s in sleepers) < min(s.ends[0] for s in sleepers)
    assert elapsed >= 0.1


async def test_results_come_back_in_call_order_not_finishing_order(tracing: Tracing) -> None:
    slow, fast = Sleeper("slow", 0.08), Sleeper("fast", 0.0)
    invoker = invoker_for(tracing, slow.tool, fast.tool)
    runs = await invoker.run(calls("slow", "fast", "slow"), caller())
    assert [(r.name, r.call_id) for r in runs] == [
        ("slow", "call-0"),
        ("fast", "call-1"),
        ("slow", "call-2"),
    ]
    assert fast.ends[0] < slow.ends[0]


async def test_failing_and_hanging_tools_do_not_fail_the_others(tracing: Tracing) -> None:
    ok = Sleeper("ok", 0.01)
    invoker = invoker_for(
        tracing,
        ok.tool,
        Tool("boom", "raises", OBJECT, raises),
        Tool("refuse", "tool error", OBJECT, refuses),
        Tool("hang", "hangs", OBJECT, hangs, timeout_s=0.1),
        Tool("upstream", "own timeout", OBJECT, own_timeout),
    )
    started = time.perf_counter()
    runs = await invoker.run(calls("boom", "ok", "hang", "refuse", "upstream"), caller())
    # About the hanging tool's 0.1 s timeout; without it, the hang's hour.
    assert time.perf_counter() - started < 10.0
    by_name = {r.name: r for r in runs}
    assert by_name["ok"].status == "ok" and by_name["ok"].content == "slept 0.01"
    assert by_name["boom"].status == "error"
    assert by_name["boom"].content == "boom failed with an internal error (RuntimeError)."
    assert "hunter2" not in by_name["boom"].content  # internals stay in the logs
    assert by_name["hang"].status == "timeout"
    assert "did not answer within 0.1 s" in by_name["hang"].content
    assert (by_name["refuse"].status, by_name["refuse"].content) == ("error", "no such city")
    # A tool's own TimeoutError is its failure, not our timeout.
    assert by_name["upstream"].status == "error"


async def test_unknown_tools_and_bad_arguments_are_refused_runs(tracing: Tracing) -> None:
    ok = Sleeper("ok", 0.0)
    invoker = invoker_for(tracing, ok.tool)
    runs = await invoker.run(
        [
            ToolCall("1", "drop_tables", "{}"),
            ToolCall("2", "ok", "1234"),
            ToolCall("3", "ok", "{not json"),
            ToolCall("4", "ok", '{"extra": 1}'),
            ToolCall("5", "ok", ""),
        ],
        caller(),
    )
    assert [r.status for r in runs] == ["refused", "refused", "refused", "refused", "ok"]
    assert runs[0].content == "There is no tool named 'drop_tables'."  # lists no tool
    assert "must be a JSON object, not a number" in runs[1].content
    assert "not valid JSON" in runs[2].content
    assert "Additional properties are not allowed" in runs[3].content
    assert len(ok.starts) == 1  # refused calls never reached the tool


async def test_more_calls_than_a_round_allows_are_refused(tracing: Tracing) -> None:
    ok = Sleeper("ok", 0.0)
    invoker = invoker_for(tracing, ok.tool, max_calls=2)
    runs = await invoker.run(calls("ok", "ok", "ok", "ok"), caller())
    assert [r.status for r in runs] == ["ok", "ok", "refused", "refused"]
    assert "at most 2 tool calls" in runs[3].content


async def test_the_concurrency_limit_holds_across_requests(tracing: Tracing) -> None:
    limited = Sleeper("limited", 0.05, max_concurrency=2)
    invoker = invoker_for(tracing, limited.tool)
    # Two "requests" of three calls each, at the same time: the slots are the tool's.
    first, second = await asyncio.gather(
        invoker.run(calls("limited", "limited", "limited"), caller("acme")),
        invoker.run(calls("limited", "limited", "limited"), caller("other")),
    )
    assert all(r.status == "ok" for r in [*first, *second])
    assert limited.most_at_once() == 2
    assert len(limited.starts) == 6


async def test_the_rate_limit_spaces_out_the_starts(tracing: Tracing) -> None:
    rated = Sleeper("rated", 0.0, rate_per_second=5, timeout_s=5.0)
    invoker = invoker_for(tracing, rated.tool)
    runs = await invoker.run(calls(*["rated"] * 7), caller())
    assert all(r.status == "ok" for r in runs)
    starts = sorted(rated.starts)
    # Five in the first second, the sixth and seventh only once the window has moved on.
    assert starts[4] - starts[0] < 0.5
    assert starts[5] - starts[0] >= 0.95
    for i in range(len(starts) - 5):
        assert starts[i + 5] - starts[i] >= 0.95


async def test_a_fractional_rate_is_one_call_per_period(tracing: Tracing) -> None:
    rated = Sleeper("rated", 0.0, rate_per_second=4.5, timeout_s=5.0)
    invoker = invoker_for(tracing, rated.tool)
    await invoker.run(calls(*["rated"] * 5), caller())
    starts = sorted(rated.starts)
    # 4.5 a second: four in a window of 4 / 4.5 s, the fifth after it.
    assert starts[4] - starts[0] >= 4 / 4.5 - 0.01


async def test_waiting_for_a_busy_tool_counts_against_its_timeout(tracing: Tracing) -> None:
    busy = Sleeper("busy", 0.3, max_concurrency=1, timeout_s=0.2)
    invoker = invoker_for(tracing, busy.tool)
    runs = await invoker.run(calls("busy", "busy"), caller())
    assert [r.status for r in runs] == ["timeout", "timeout"]


async def test_each_call_has_an_execute_tool_span_with_genai_attributes(tracing: Tracing) -> None:
    ok = Sleeper("ok", 0.0)
    invoker = invoker_for(
        tracing,
        ok.tool,
        Tool("boom", "raises", OBJECT, raises),
        Tool("hang", "hangs", OBJECT, hangs, timeout_s=0.05),
    )
    with tracing.tracer.start_as_current_span("stage tools") as parent:
        await invoker.run(calls("ok", "boom", "hang", "nope"), caller())
    spans = tracing.spans()
    assert set(spans) == {
        "execute_tool ok",
        "execute_tool boom",
        "execute_tool hang",
        "execute_tool nope",
    }
    good = spans["execute_tool ok"]
    assert good.parent is not None and good.parent.span_id == parent.get_span_context().span_id
    assert good.attributes["gen_ai.operation.name"] == "execute_tool"
    assert good.attributes["gen_ai.tool.name"] == "ok"
    assert good.attributes["gen_ai.tool.call.id"] == "call-0"
    assert good.attributes["gen_ai.tool.type"] == "function"
    assert good.attributes["rag.tool.status"] == "ok"
    assert good.status.status_code == StatusCode.UNSET
    assert "gen_ai.tool.call.arguments" not in good.attributes  # content capture is off
    for name, status, error in (
        ("boom", "error", "RuntimeError"),
        ("hang", "timeout", "ToolTimeout"),
        ("nope", "refused", "UnknownTool"),
    ):
        span = spans[f"execute_tool {name}"]
        assert span.status.status_code == StatusCode.ERROR
        assert span.attributes["error.type"] == error
        assert span.attributes["rag.tool.status"] == status


async def test_content_capture_puts_arguments_and_results_on_the_span(tracing: Tracing) -> None:
    ok = Sleeper("ok", 0.0)
    invoker = invoker_for(tracing, ok.tool, capture_content=True)
    await invoker.run(calls("ok"), caller())
    span = tracing.spans()["execute_tool ok"]
    assert span.attributes["gen_ai.tool.call.arguments"] == "{}"
    assert span.attributes["gen_ai.tool.call.result"] == "slept 0.0"


async def test_runs_carry_their_tool_cache_ttl_and_duration(tracing: Tracing) -> None:
    clock = Sleeper("clock", 0.02, cache_ttl=0)
    invoker = invoker_for(tracing, clock.tool)
    (run,) = await invoker.run(calls("clock"), caller())
    assert run.cache_ttl == 0
    assert 20 <= run.duration_ms < 1000
    assert run.report() == {
        "name": "clock",
        "status": "ok",
        "duration_ms": round(run.duration_ms, 3),
        "output": run.content,
    }
