"""The function-calling flow, round by round, with scripted model rounds.

The real vLLM proves the loop end to end (tests/app/test_function_calling.py); here each round's
events are scripted so every branch (server calls, client calls, both, bounded rounds) is seen.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Sequence
from typing import Any

from pipeline.answer.events import ContentDelta, Finish, StreamEvent, ToolCall, ToolCallDelta, Usage
from pipeline.context import Principal, ToolRun
from pipeline.tools.base import ToolContext
from pipeline.tools.loop import ToolLoop

ALICE = Principal("acme", "alice", frozenset({"chat"}), "k1")
TOOLS = {"tools": [{"type": "function", "function": {"name": "calculator"}}]}


class Script:
    """Plays one list of events per model round and keeps the requests it was sent."""

    def __init__(self, *rounds: Sequence[StreamEvent]) -> None:
        self.rounds = list(rounds)
        self.requests: list[dict[str, Any]] = []

    def __call__(self, request: dict[str, Any]) -> AsyncIterator[StreamEvent]:
        self.requests.append(request)
        events = self.rounds.pop(0)

        async def play() -> AsyncIterator[StreamEvent]:
            for event in events:
                yield event

        return play()


class Invoker:
    def __init__(self) -> None:
        self.calls: list[ToolCall] = []

    async def run(self, calls: Sequence[ToolCall], context: ToolContext) -> list[ToolRun]:
        self.calls.extend(calls)
        return [ToolRun(c.name, c.id, "ok", f"result of {c.arguments}", 1.0) for c in calls]


def loop(script: Script, invoker: Invoker | None, runs: list[ToolRun], **options: Any) -> ToolLoop:
    return ToolLoop(
        script,
        invoker,
        ToolContext(ALICE),
        client_tools=frozenset(options.get("client", ())),
        max_rounds=options.get("max_rounds", 3),
        parent=None,
        runs=runs,
        offered=frozenset(options.get("offered", {"calculator"})),
        guard=options.get("guard"),
    )


def calc_call(index: int = 0, call_id: str = "call-1") -> list[StreamEvent]:
    return [
        ToolCallDelta(index, call_id, "calculator", '{"expression": '),
        ToolCallDelta(index, None, None, '"1234 * 5678"}'),
    ]


async def collect(events: AsyncIterator[StreamEvent]) -> list[StreamEvent]:
    return [event async for event in events]


async def test_without_tools_one_round_passes_through() -> None:
    script = Script([ContentDelta("Hi"), Finish("stop"), Usage(5, 1)])
    out = await collect(loop(script, Invoker(), []).events({"messages": []}))
    assert out == [ContentDelta("Hi"), Finish("stop"), Usage(5, 1)]
    assert len(script.requests) == 1


async def test_server_calls_run_and_the_model_is_called_again_with_their_results() -> None:
    script = Script(
        [*calc_call(), Finish("tool_calls"), Usage(50, 10)],
        [ContentDelta("It is 7006652."), Finish("stop"), Usage(70, 6)],
    )
    invoker = Invoker()
    runs: list[ToolRun] = []
    out = await collect(loop(script, invoker, runs).events({"messages": [], **TOOLS}))
    # The server's call is not shown to the client; the usage is summed over both rounds.
    assert out == [ContentDelta("It is 7006652."), Finish("stop"), Usage(120, 16)]
    assert invoker.calls == [ToolCall("call-1", "calculator", '{"expression": "1234 * 5678"}')]
    assert [r.name for r in runs] == ["calculator"]
    second = script.requests[1]
    assistant, result = second["messages"][-2:]
    assert assistant["tool_calls"][0]["function"]["arguments"] == '{"expression": "1234 * 5678"}'
    assert result == {
        "role": "tool",
        "tool_call_id": "call-1",
        "content": 'result of {"expression": "1234 * 5678"}',
    }
    assert second["tool_choice"] == "auto"


async def test_rounds_are_bounded_and_the_last_asks_for_no_tools() -> None:
    script = Script(
        [*calc_call(call_id="a"), Finish("tool_calls"), Usage(1, 1)],
        [*calc_call(call_id="b"), Finish("tool_calls"), Usage(1, 1)],
        [ContentDelta("done"), Finish("stop"), Usage(1, 1)],
    )
    out = await collect(loop(script, Invoker(), [], max_rounds=2).events({"messages": [], **TOOLS}))
    assert out[-2:] == [Finish("stop"), Usage(3, 3)]
    assert [r.get("tool_choice") for r in script.requests] == [None, "auto", "none"]


async def test_client_calls_go_back_to_the_client_in_openai_shape() -> None:
    script = Script(
        [
            ToolCallDelta(0, "c-1", "get_weather", '{"city": '),
            ToolCallDelta(0, None, None, '"Lisbon"}'),
            Finish("tool_calls"),
            Usage(9, 9),
        ]
    )
    runs: list[ToolRun] = []
    out = await collect(
        loop(script, Invoker(), runs, client={"get_weather"}).events({"messages": [], **TOOLS})
    )
    assert out == [
        ToolCallDelta(0, "c-1", "get_weather", '{"city": '),
        ToolCallDelta(0, None, None, '"Lisbon"}'),
        Finish("tool_calls"),
        Usage(9, 9),
    ]
    assert runs == [] and len(script.requests) == 1


async def test_with_client_and_server_calls_in_one_round_the_client_ones_win() -> None:
    script = Script(
        [
            *calc_call(index=0, call_id="s-1"),
            ToolCallDelta(1, "c-1", "get_weather", "{}"),
            Finish("tool_calls"),
            Usage(9, 9),
        ]
    )
    invoker = Invoker()
    runs: list[ToolRun] = []
    out = await collect(
        loop(script, invoker, runs, client={"get_weather"}).events({"messages": [], **TOOLS})
    )
    # The client's call is renumbered among the client's calls (index 0), the server's is
    # not run and is reported as skipped.
    assert out[0] == ToolCallDelta(0, "c-1", "get_weather", "{}")
    assert out[-2] == Finish("tool_calls")
    assert invoker.calls == []
    assert [(r.name, r.status) for r in runs] == [("calculator", "skipped")]


async def test_a_fragment_before_its_name_waits_for_it() -> None:
    script = Script(
        [
            ToolCallDelta(0, "c-9", None, '{"a": 1'),
            ToolCallDelta(0, None, "lookup", "}"),
            Finish("tool_calls"),
            Usage(1, 1),
        ]
    )
    out = await collect(loop(script, None, [], client={"lookup"}).events({"messages": [], **TOOLS}))
    calls = [e for e in out if isinstance(e, ToolCallDelta)]
    assert calls[0].name == "lookup" and "".join(c.arguments for c in calls) == '{"a": 1}'
    assert json.loads("".join(c.arguments for c in calls)) == {"a": 1}


async def test_a_call_of_an_unknown_name_is_refused_listing_only_the_offered_tools() -> None:
    script = Script(
        [ToolCallDelta(0, "u-1", "no_such_tool", "{}"), Finish("tool_calls"), Usage(1, 1)],
        [ContentDelta("ok"), Finish("stop"), Usage(1, 1)],
    )
    invoker = Invoker()
    runs: list[ToolRun] = []
    await collect(loop(script, invoker, runs, client={"lookup"}).events({"messages": [], **TOOLS}))
    # Not the client's, not run: the model is told which tools this request offers.
    assert invoker.calls == []
    assert [(r.name, r.status) for r in runs] == [("no_such_tool", "refused")]
    result = script.requests[1]["messages"][-1]
    assert result["role"] == "tool" and result["tool_call_id"] == "u-1"
    assert result["content"] == (
        "There is no tool named 'no_such_tool' here. Tools offered: calculator, lookup."
    )


async def test_a_forced_call_is_asked_for_with_the_functions_schema() -> None:
    schema = {"type": "object", "properties": {"expression": {"type": "string"}}}
    tools = {
        "tools": [{"type": "function", "function": {"name": "calculator", "parameters": schema}}]
    }
    forced = {"type": "function", "function": {"name": "calculator"}}
    script = Script(
        [ContentDelta('{"expression": '), ContentDelta('"2 * 21"}'), Finish("stop"), Usage(9, 8)],
        [ContentDelta("42"), Finish("stop"), Usage(20, 1)],
    )
    invoker = Invoker()
    out = await collect(
        loop(script, invoker, []).events({"messages": [], **tools, "tool_choice": forced})
    )
    assert out == [ContentDelta("42"), Finish("stop"), Usage(29, 9)]
    first = script.requests[0]
    assert "tools" not in first and "tool_choice" not in first
    assert first["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "calculator", "schema": schema},
    }
    assert [(c.name, c.arguments) for c in invoker.calls] == [
        ("calculator", '{"expression": "2 * 21"}')
    ]
    # The next round is a normal one, free to answer.
    assert script.requests[1]["tool_choice"] == "auto" and "tools" in script.requests[1]


async def test_a_forced_client_function_goes_back_to_the_client() -> None:
    forced = {"type": "function", "function": {"name": "get_weather"}}
    script = Script([ContentDelta('{"city": "Porto"}'), Finish("stop"), Usage(3, 3)])
    out = await collect(
        loop(script, Invoker(), [], client={"get_weather"}).events(
            {"messages": [], **TOOLS, "tool_choice": forced}
        )
    )
    assert out[0].name == "get_weather" and out[0].arguments == '{"city": "Porto"}'
    assert out[1:] == [Finish("tool_calls"), Usage(3, 3)]


async def test_a_call_cut_short_by_max_tokens_ends_with_length_and_is_not_run() -> None:
    # It ended with `tool_calls`, so a client took arguments cut mid-way for a whole call
    # (`{"ci`), and the server ran its own tools with them.
    cut = [ToolCallDelta(0, "c-1", "get_weather", '{"ci'), Finish("length"), Usage(3, 4)]
    out = await collect(
        loop(Script(cut), Invoker(), [], client={"get_weather"}).events({"messages": [], **TOOLS})
    )
    assert out[0] == ToolCallDelta(0, "c-1", "get_weather", '{"ci')
    assert out[1:] == [Finish("length"), Usage(3, 4)]
    invoker = Invoker()
    script = Script([calc_call()[0], Finish("length"), Usage(3, 4)])
    runs: list[ToolRun] = []
    out = await collect(loop(script, invoker, runs).events({"messages": [], **TOOLS}))
    assert out == [Finish("length"), Usage(3, 4)]
    assert invoker.calls == [] and len(script.requests) == 1
    assert [(r.name, r.status) for r in runs] == [("calculator", "skipped")]
    forced = {"type": "function", "function": {"name": "get_weather"}}
    script = Script([ContentDelta('{"ci'), Finish("length"), Usage(3, 4)])
    out = await collect(
        loop(script, Invoker(), [], client={"get_weather"}).events(
            {"messages": [], **TOOLS, "tool_choice": forced}
        )
    )
    assert out[1:] == [Finish("length"), Usage(3, 4)]
