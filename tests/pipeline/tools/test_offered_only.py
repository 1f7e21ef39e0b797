"""The tool loop runs only what the request offered, and only with guarded arguments: a call
of a tool that exists but was not offered is never run (no ``execute_tool`` span), and the
arguments of a server tool's call are redacted (or the answer blocked) before it runs."""

from __future__ import annotations

import json
from typing import Any

from pipeline.answer.events import ContentDelta, Finish, StreamEvent, ToolCallDelta, Usage
from pipeline.context import ToolRun
from pipeline.guards.arguments import ArgumentsGuard
from pipeline.guards.policy import GuardPolicy, PolicyBook
from pipeline.tools.base import Tool, ToolContext
from pipeline.tools.invoker import ToolInvoker
from pipeline.tools.loop import ToolLoop
from pipeline.tools.registry import ToolRegistry
from tests.pipeline.test_tool_loop import Script, collect
from tests.pipeline.tools.support import Tracing, caller

QUERY = {
    "type": "object",
    "properties": {"q": {"type": "string"}},
    "required": ["q"],
    "additionalProperties": False,
}


class Recorder:
    """A tool that records the arguments of each call it gets."""

    def __init__(self, name: str) -> None:
        self.arguments: list[dict[str, Any]] = []
        self.tool = Tool(name, f"records its calls ({name})", QUERY, self.run)

    async def run(self, arguments: dict[str, Any], context: ToolContext) -> str:
        self.arguments.append(arguments)
        return "done"


def tool_loop(
    script: Script,
    tracing: Tracing,
    tools: list[Recorder],
    offered: set[str],
    runs: list[ToolRun],
    policy: GuardPolicy | None = None,
) -> ToolLoop:
    invoker = ToolInvoker(ToolRegistry(t.tool for t in tools), tracing.tracer, capture_content=True)
    return ToolLoop(
        script,
        invoker,
        caller(),
        client_tools=frozenset(),
        max_rounds=3,
        parent=None,
        runs=runs,
        offered=frozenset(offered),
        guard=ArgumentsGuard(policy or GuardPolicy()),
    )


def call(name: str, arguments: str, call_id: str = "c-1") -> list[StreamEvent]:
    return [ToolCallDelta(0, call_id, name, arguments), Finish("tool_calls"), Usage(5, 5)]


ANSWER: list[StreamEvent] = [ContentDelta("ok"), Finish("stop"), Usage(5, 1)]
TOOLS = {"tools": [{"type": "function", "function": {"name": "lookup"}}]}


async def test_a_tool_that_exists_but_was_not_offered_is_never_run(tracing: Tracing) -> None:
    lookup, internal = Recorder("lookup"), Recorder("internal_admin")
    script = Script(call("internal_admin", '{"q": "drop everything"}'), ANSWER)
    runs: list[ToolRun] = []
    loop = tool_loop(script, tracing, [lookup, internal], {"lookup"}, runs)
    out = await collect(loop.events({"messages": [], **TOOLS}))
    assert out[-2:] == [Finish("stop"), Usage(10, 6)]
    assert internal.arguments == [] and lookup.arguments == []
    assert tracing.spans() == {}, "no execute_tool span: nothing ran"
    assert [(r.name, r.status) for r in runs] == [("internal_admin", "refused")]
    refusal = script.requests[1]["messages"][-1]["content"]
    assert refusal == "There is no tool named 'internal_admin' here. Tools offered: lookup."


async def test_an_offered_tool_runs_beside_a_refused_one(tracing: Tracing) -> None:
    lookup, internal = Recorder("lookup"), Recorder("internal_admin")
    script = Script(
        [
            ToolCallDelta(0, "a", "internal_admin", '{"q": "x"}'),
            ToolCallDelta(1, "b", "lookup", '{"q": "kea"}'),
            Finish("tool_calls"),
            Usage(5, 5),
        ],
        ANSWER,
    )
    runs: list[ToolRun] = []
    loop = tool_loop(script, tracing, [lookup, internal], {"lookup"}, runs)
    await collect(loop.events({"messages": [], **TOOLS}))
    assert lookup.arguments == [{"q": "kea"}] and internal.arguments == []
    assert set(tracing.spans()) == {"execute_tool lookup"}
    assert [(r.call_id, r.status) for r in runs] == [("a", "refused"), ("b", "ok")]
    results = [m for m in script.requests[1]["messages"] if m["role"] == "tool"]
    assert [m["tool_call_id"] for m in results] == ["a", "b"]


async def test_server_call_arguments_are_redacted_before_the_tool_runs(tracing: Tracing) -> None:
    lookup = Recorder("lookup")
    arguments = '{"q": "mail ana@example.com or call +44 20 7946 0958"}'
    script = Script(call("lookup", arguments), ANSWER)
    loop = tool_loop(script, tracing, [lookup], {"lookup"}, [])
    await collect(loop.events({"messages": [], **TOOLS}))
    assert lookup.arguments == [{"q": "mail [EMAIL] or call [PHONE]"}]
    span = tracing.spans()["execute_tool lookup"]
    assert "ana@" not in span.attributes["gen_ai.tool.call.arguments"]
    sent_back = script.requests[1]["messages"][-2]["tool_calls"][0]["function"]["arguments"]
    assert json.loads(sent_back) == {"q": "mail [EMAIL] or call [PHONE]"}


async def test_a_forced_server_call_is_redacted_too(tracing: Tracing) -> None:
    lookup = Recorder("lookup")
    forced = {"type": "function", "function": {"name": "lookup", "parameters": QUERY}}
    script = Script(
        [ContentDelta('{"q": "ana@exa'), ContentDelta('mple.com"}'), Finish("stop"), Usage(3, 3)],
        ANSWER,
    )
    request = {"messages": [], "tools": [forced], "tool_choice": forced}
    await collect(tool_loop(script, tracing, [lookup], {"lookup"}, []).events(request))
    assert lookup.arguments == [{"q": "[EMAIL]"}]


async def test_blocked_arguments_end_the_answer_and_nothing_runs(tracing: Tracing) -> None:
    lookup = Recorder("lookup")
    policy = PolicyBook.from_json('{"*": {"blocked_output_terms": ["project x"]}}').default
    script = Script(call("lookup", '{"q": "all about Project X"}'), ANSWER)
    runs: list[ToolRun] = []
    loop = tool_loop(script, tracing, [lookup], {"lookup"}, runs, policy)
    out = await collect(loop.events({"messages": [], **TOOLS}))
    assert out == [Finish("content_filter", "blocked_term"), Usage(5, 5)]
    assert lookup.arguments == [] and tracing.spans() == {}
    assert [(r.name, r.status) for r in runs] == [("lookup", "refused")]
    assert len(script.requests) == 1, "no second round"
