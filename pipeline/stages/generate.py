"""The generate stage: the prompt goes to the chosen route's vLLM, and the answer streams back.

The stage lays out the prompt, starts the function-calling flow (one round when no tools are
offered) and waits for the first event, so that a failure before any output is an HTTP error.
The flow may run only the server tools this request offered and its tenant may use
(``tools.offer``, ``tools.access``), with arguments that passed the tenant's output guardrails
(``guards.arguments``) first.
It leaves ``ctx.answer``, the answer stream, for the later stages (the cache store, output
guardrails) to hook into and for the response to read; the ``chat {model}`` spans stay open
until their streams end.
"""

from __future__ import annotations

import time
from typing import Any

from opentelemetry import context as otel_context

from pipeline.answer.completion import Completion
from pipeline.answer.stream import AnswerStream
from pipeline.context import RequestContext, RouteChoice, ToolRun
from pipeline.guards.arguments import ArgumentsGuard
from pipeline.guards.policy import PolicyBook
from pipeline.model.chat import TracedChat
from pipeline.model.prompt import build_messages, personalisation
from pipeline.model.routes import Route, RouteTable
from pipeline.runner import StageSpec
from pipeline.telemetry import attributes as attr
from pipeline.tools.access import ToolAccess
from pipeline.tools.base import Tool, ToolContext
from pipeline.tools.loop import Invoker, ToolLoop
from pipeline.tools.offer import function_names, offer


class Generate:
    spec = StageSpec.of(
        "generate",
        reads={"params", "principal"},
        optional={"passages", "features", "tool_runs", "route"},
        writes={"answer", "route"},
    )

    def __init__(
        self,
        routes: RouteTable,
        chat: TracedChat,
        *,
        server_tools: dict[str, Tool] | None = None,
        invoker: Invoker | None = None,
        max_rounds: int = 3,
        access: ToolAccess | None = None,
        policies: PolicyBook | None = None,
    ) -> None:
        self.routes = routes
        self.chat = chat
        self.server_tools = server_tools or {}
        self.invoker = invoker
        self.max_rounds = max_rounds
        self.access = access
        self.policies = policies

    async def __call__(self, ctx: RequestContext) -> RequestContext:
        params = ctx.params
        if ctx.route is None:
            route = self.routes.first_choice(params.model, params.rag.route)
            ctx.route = RouteChoice(route.name, route.model, "default")
        else:
            route = self.routes.get(ctx.route.name)
        tools = offer(params, self.server_tools, tenant=ctx.caller.tenant, access=self.access)
        payload: dict[str, Any] = {
            "model": route.model,
            "messages": build_messages(
                params.messages,
                ctx.passages,
                personal=personalisation(ctx.features),
                tool_runs=ctx.tool_runs,
            ),
            **params.sampling,
            **tools.options,
        }
        # The loop's runs are the planned ones and then its own: they go on the completion, and
        # the context keeps what the tools stage wrote (the loop runs on after this returns).
        runs = list(ctx.tool_runs)
        loop = self._loop(ctx, route, tools.server, runs)
        answer = AnswerStream(loop.events(payload), lambda: base_completion(ctx, route.model, runs))
        started = time.perf_counter()
        await answer.prime()
        ctx.annotate(**{attr.TTFT_MS: round((time.perf_counter() - started) * 1000.0, 3)})
        ctx.answer = answer
        return ctx

    def _loop(
        self, ctx: RequestContext, route: Route, offered: frozenset[str], runs: list[ToolRun]
    ) -> ToolLoop:
        parent = otel_context.get_current()

        def model_round(request: dict[str, Any]) -> Any:
            return self.chat.stream(route, request, parent)

        tenant = ctx.caller.tenant
        policy = self.policies.for_tenant(tenant) if self.policies is not None else None
        return ToolLoop(
            model_round,
            self.invoker,
            ToolContext(ctx.caller, features=lambda: _features(ctx)),
            client_tools=frozenset(function_names(ctx.params.tools)),
            max_rounds=self.max_rounds,
            parent=parent,
            runs=runs,
            # Validation checked the offer against the tenant's tools; asked again all the same.
            offered=frozenset(
                n for n in offered if self.access is None or self.access.allows(tenant, n)
            ),
            guard=ArgumentsGuard(policy) if policy is not None else None,
        )


async def _features(ctx: RequestContext) -> Any:
    return ctx.features


def base_completion(ctx: RequestContext, model: str, runs: list[ToolRun]) -> Completion:
    """The completion's fixed parts, read when the answer ends (tool runs are known by then)."""
    ttls = [run.cache_ttl for run in runs if run.cache_ttl is not None]
    return Completion(
        content="",
        finish_reason="stop",
        model=model,
        sources=ctx.sources,
        tools=[run.report() for run in runs],
        route=ctx.route.report() if ctx.route is not None else None,
        cache_ttl=min(ttls) if ttls else None,
        logprobs=[] if ctx.params.sampling.get("logprobs") else None,
    )
