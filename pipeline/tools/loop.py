"""The function-calling flow: model, tools, model again, for a bounded number of rounds.

Each round streams one model call. Its text goes on to the client as it comes. Its tool calls
are sorted by name as soon as the name is known: a call of a function only the client knows is
passed on in OpenAI's shape (numbered among the client's calls), and ends the answer with
``finish_reason: "tool_calls"``; a call of a server tool (or of a name nobody knows) is held,
and when the round ends all of them run at once, their results (or errors) go back to the model
as ``tool`` messages, and the next round starts. The last allowed round is asked with
``tool_choice: "none"``, so the flow always ends with an answer. Usage is summed over rounds.
A round whose ``tool_choice`` names a function is made with structured output (see
``_forced_call``), so the forced call's arguments follow the function's schema.

The model can only run what the request offered: a call of a server tool this request did not
offer (``offered``: validated against the tenant's tool policy) is never run, and goes back to
the model as an error that lists only the tools offered. Before anything runs, the arguments of
every held call pass the output guardrails (``guard``: PII redacted inside the JSON, as in the
answer); a blocked term or PII kind there ends the answer with ``content_filter`` instead.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any, Protocol

from opentelemetry import context as otel_context
from opentelemetry.context import Context

from pipeline.answer.events import ContentDelta, Finish, StreamEvent, ToolCall, ToolCallDelta, Usage
from pipeline.context import ToolRun
from pipeline.tools.base import ToolContext
from pipeline.tools.offer import forced_name

ModelRound = Callable[[dict[str, Any]], AsyncGenerator[StreamEvent, None]]
_SHOWN_NAME = 64  # characters of a name the model made up that are shown back to it


class Invoker(Protocol):
    async def run(self, calls: Sequence[ToolCall], context: ToolContext) -> list[ToolRun]: ...


class Guarded(Protocol):
    """A call's arguments after the output guardrails: redacted, or blocked by a rule."""

    @property
    def text(self) -> str: ...

    @property
    def blocked(self) -> str | None: ...


GuardArguments = Callable[[str], Guarded]


@dataclass
class _Call:
    kind: str  # "client" or "server"
    id: str
    name: str
    arguments: list[str] = field(default_factory=list)
    client_index: int = -1


class _Round:
    """Sorts one round's tool-call fragments into client calls (passed on) and server calls."""

    def __init__(self, client_tools: frozenset[str]) -> None:
        self.client_tools = client_tools
        self.calls: dict[int, _Call] = {}
        self.waiting: dict[int, list[ToolCallDelta]] = {}
        self.text: list[str] = []
        self.finish = "stop"
        self.clients = 0

    def take(self, delta: ToolCallDelta) -> list[ToolCallDelta]:
        """The fragments to pass to the client now (none for server calls)."""
        call = self.calls.get(delta.index)
        if call is None:
            if delta.name is None:  # the name has not come yet: wait for it
                self.waiting.setdefault(delta.index, []).append(delta)
                return []
            call = self._open(delta)
        fragments = [*self.waiting.pop(delta.index, []), delta]
        call.arguments.extend(f.arguments for f in fragments)
        if call.kind != "client":
            return []
        first = len(call.arguments) == len(fragments)
        return [
            ToolCallDelta(
                call.client_index,
                call.id if first and i == 0 else None,
                call.name if first and i == 0 else None,
                f.arguments,
            )
            for i, f in enumerate(fragments)
        ]

    def _open(self, delta: ToolCallDelta) -> _Call:
        name = delta.name or ""
        call = _Call(
            kind="client" if name in self.client_tools else "server",
            id=delta.id or f"call_{uuid.uuid4().hex[:24]}",
            name=name,
        )
        if call.kind == "client":
            call.client_index = self.clients
            self.clients += 1
        self.calls[delta.index] = call
        return call

    def server_calls(self) -> list[ToolCall]:
        return [
            ToolCall(c.id, c.name, "".join(c.arguments))
            for _, c in sorted(self.calls.items())
            if c.kind == "server"
        ]


async def _forced_call(
    model_round: ModelRound, request: dict[str, Any], name: str
) -> AsyncGenerator[StreamEvent, None]:
    """A call of the named function, made with structured output: the model writes the
    function's arguments under a JSON-schema constraint, and its text becomes the call.

    vLLM's own named ``tool_choice`` (0.32, hermes parser) was seen here to ignore the schema
    (the string "number" for an object of {expression}), while ``response_format`` with the same
    schema is enforced; so the forced round asks for that instead."""
    schema: Any = {"type": "object"}
    for tool in request["tools"]:
        function = tool.get("function") or {}
        if function.get("name") == name:
            schema = function.get("parameters") or schema
    structured = {k: v for k, v in request.items() if k not in ("tools", "tool_choice")}
    structured["response_format"] = {
        "type": "json_schema",
        "json_schema": {"name": name, "schema": schema},
    }
    call_id = f"call_{uuid.uuid4().hex[:24]}"
    first = True
    # Closed here however this ends, not left to the collector: the call's slot, its upstream
    # request and what it spent (``pipeline.model.spend``) are settled before the caller goes on.
    async with aclosing(model_round(structured)) as events:
        async for event in events:
            if isinstance(event, ContentDelta):
                yield ToolCallDelta(
                    0, call_id if first else None, name if first else None, event.text
                )
                first = False
            elif isinstance(event, Finish):
                # Cut short (``length``): the arguments are not whole, and the caller must see it.
                yield Finish("tool_calls") if event.reason == "stop" else event
            else:
                yield event
    if first:  # no text at all: still a call, with empty arguments (the tool will say so)
        yield ToolCallDelta(0, call_id, name, "")


def _add(total: Usage, more: Usage) -> Usage:
    return Usage(
        total.prompt_tokens + more.prompt_tokens, total.completion_tokens + more.completion_tokens
    )


class ToolLoop:
    """Runs the rounds of one answer; ``runs`` collects the server tool runs, in call order."""

    def __init__(
        self,
        model_round: ModelRound,
        invoker: Invoker | None,
        context: ToolContext,
        *,
        client_tools: frozenset[str],
        max_rounds: int,
        parent: Context | None,
        runs: list[ToolRun],
        offered: frozenset[str] = frozenset(),
        guard: GuardArguments | None = None,
    ) -> None:
        self.model_round = model_round
        self.invoker = invoker
        self.context = context
        self.client_tools = client_tools
        self.max_rounds = max_rounds
        self.parent = parent
        self.runs = runs
        self.offered = offered
        self.guard = guard

    async def events(self, payload: dict[str, Any]) -> AsyncIterator[StreamEvent]:
        usage = Usage(0, 0)
        messages = list(payload["messages"])
        for number in range(self.max_rounds + 1):
            request = self._request(payload, messages, number)
            current = _Round(self.client_tools)
            # Closed at once however the reader lets go (as in ``_forced_call``).
            async with aclosing(self._round(request)) as events:
                async for event in events:
                    if isinstance(event, Usage):
                        usage = _add(usage, event)
                    elif isinstance(event, Finish):
                        current.finish = event.reason
                    elif isinstance(event, ToolCallDelta):
                        for passed in current.take(event):
                            yield passed
                    else:
                        current.text.append(event.text)
                        yield event
            calls = current.server_calls()
            if current.clients and calls:
                # The answer goes back to the client, which will send the conversation again.
                self.runs.extend(
                    ToolRun(c.name, c.id, "skipped", "not run: the client's calls came first")
                    for c in calls
                )
            cut = current.finish == "length"  # a call's arguments may be cut: none is run
            if cut and calls and not current.clients:
                self.runs.extend(
                    ToolRun(c.name[:_SHOWN_NAME], c.id, "skipped", "not run: cut by max_tokens")
                    for c in calls
                )
            done = cut or current.clients or not calls or self.invoker is None
            if done or "tools" not in request:
                yield Finish("tool_calls" if current.clients and not cut else current.finish)
                yield usage
                return
            calls, blocked = self._guarded(calls)
            if blocked is not None:
                yield Finish("content_filter", blocked)
                yield usage
                return
            messages.extend(await self._run_tools(current, calls))
        yield Finish("length")  # not reached: the last round is asked for no tool calls
        yield usage

    def _round(self, request: dict[str, Any]) -> AsyncGenerator[StreamEvent, None]:
        forced = forced_name(request.get("tool_choice"))
        if forced is None or "tools" not in request:
            return self.model_round(request)
        return _forced_call(self.model_round, request, forced)

    def _request(
        self, payload: dict[str, Any], messages: list[dict[str, Any]], number: int
    ) -> dict[str, Any]:
        request = {**payload, "messages": messages}
        if "tools" in request and number > 0:
            request["tool_choice"] = "none" if number >= self.max_rounds else "auto"
        return request

    def _guarded(self, calls: list[ToolCall]) -> tuple[list[ToolCall], str | None]:
        """The calls with their arguments redacted, or the rule that blocks one of them."""
        if self.guard is None:
            return calls, None
        out = []
        for call in calls:
            guarded = self.guard(call.arguments)
            if guarded.blocked is not None:
                self.runs.append(
                    ToolRun(
                        call.name[:_SHOWN_NAME],
                        call.id,
                        "refused",
                        f"Not run: its arguments hold what the policy blocks ({guarded.blocked}).",
                    )
                )
                return [], guarded.blocked
            out.append(ToolCall(call.id, call.name, guarded.text))
        return out, None

    def _not_offered(self, call: ToolCall) -> ToolRun:
        """The refusal of a call of a tool this request did not offer (it is never run)."""
        offered = ", ".join(sorted(self.offered | self.client_tools)) or "none"
        return ToolRun(
            call.name[:_SHOWN_NAME],
            call.id,
            "refused",
            f"There is no tool named '{call.name[:_SHOWN_NAME]}' here. Tools offered: {offered}.",
        )

    async def _run_tools(self, current: _Round, calls: list[ToolCall]) -> list[dict[str, Any]]:
        assert self.invoker is not None
        runnable = [call for call in calls if call.name in self.offered]
        # The tool spans belong under the generate stage even when a response writer is reading.
        token = otel_context.attach(self.parent) if self.parent is not None else None
        try:
            ran = iter(await self.invoker.run(runnable, self.context) if runnable else [])
        finally:
            if token is not None:
                otel_context.detach(token)
        runs = [
            next(ran) if call.name in self.offered else self._not_offered(call) for call in calls
        ]
        self.runs.extend(runs)
        assistant = {
            "role": "assistant",
            "content": "".join(current.text) or None,
            "tool_calls": [call.to_openai() for call in calls],
        }
        results = [
            {"role": "tool", "tool_call_id": run.call_id, "content": run.content} for run in runs
        ]
        return [assistant, *results]
