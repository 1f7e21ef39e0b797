"""The generate stage: the prompt goes to the chosen route's vLLM, and the answer streams back.

The stage lays out the prompt, starts the function-calling flow (one round when no tools are
offered) and waits for the first event, so that a failure before any output is an HTTP error.
It leaves ``ctx.answer``, the answer stream, for the later stages (the cache store, output
guardrails) to hook into and for the response to read; the ``chat {model}`` spans stay open
until their streams end.
"""

from __future__ import annotations

import time
from typing import Any

from opentelemetry import context as otel_context

from pipeline import attributes as attr
from pipeline.answer import AnswerStream
from pipeline.completion import Completion
from pipeline.context import RequestContext, RouteChoice
from pipeline.generation import TracedChat
from pipeline.prompt import build_messages, personalisation
from pipeline.routing import Route, RouteTable
from pipeline.runner import FailurePolicy
from pipeline.tools.base import Tool, ToolContext
from pipeline.tools.loop import Invoker, ToolLoop
from pipeline.tools.offer import function_names, offered_tools


class Generate:
    name = "generate"
    reads = frozenset({"params", "principal"})
    writes = frozenset({"answer", "route"})
    policy: FailurePolicy = "fatal"

    def __init__(
        self,
        routes: RouteTable,
        chat: TracedChat,
        *,
        server_tools: dict[str, Tool] | None = None,
        invoker: Invoker | None = None,
        max_rounds: int = 3,
    ) -> None:
        self.routes = routes
        self.chat = chat
        self.server_tools = server_tools or {}
        self.invoker = invoker
        self.max_rounds = max_rounds

    async def __call__(self, ctx: RequestContext) -> RequestContext:
        params = ctx.params
        if ctx.route is None:
            route = self.routes.first_choice(params.model, params.rag.route)
            ctx.route = RouteChoice(route.name, route.model, "default")
        else:
            route = self.routes.get(ctx.route.name)
        payload: dict[str, Any] = {
            "model": route.model,
            "messages": build_messages(
                params.messages,
                ctx.passages,
                personal=personalisation(ctx.features),
                tool_runs=ctx.tool_runs,
            ),
            **params.sampling,
            **offered_tools(params, self.server_tools),
        }
        loop = self._loop(ctx, route)
        answer = AnswerStream(loop.events(payload), lambda: base_completion(ctx, route.model))
        started = time.perf_counter()
        await answer.prime()
        ctx.annotate(**{attr.TTFT_MS: round((time.perf_counter() - started) * 1000.0, 3)})
        ctx.answer = answer
        return ctx

    def _loop(self, ctx: RequestContext, route: Route) -> ToolLoop:
        parent = otel_context.get_current()

        def model_round(request: dict[str, Any]) -> Any:
            return self.chat.stream(route, request, parent)

        return ToolLoop(
            model_round,
            self.invoker,
            ToolContext(ctx.caller, features=lambda: _features(ctx)),
            client_tools=frozenset(function_names(ctx.params.tools)),
            max_rounds=self.max_rounds,
            parent=parent,
            runs=ctx.tool_runs,
        )


async def _features(ctx: RequestContext) -> Any:
    return ctx.features


def base_completion(ctx: RequestContext, model: str) -> Completion:
    """The completion's fixed parts, read when the answer ends (tool runs are known by then)."""
    ttls = [run.cache_ttl for run in ctx.tool_runs if run.cache_ttl is not None]
    return Completion(
        content="",
        finish_reason="stop",
        model=model,
        sources=ctx.sources,
        tools=ctx.tools_report(),
        route=ctx.route.report() if ctx.route is not None else None,
        cache_ttl=min(ttls) if ttls else None,
    )
