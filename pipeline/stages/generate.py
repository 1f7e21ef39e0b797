"""The generate stage: the prompt goes to the chosen route's vLLM, and the answer streams back.

The stage lays out the prompt, starts the function-calling flow (one round when no tools are
offered) and waits for the first event, so that a failure before any output is an HTTP error.
The flow may run only the server tools this request offered and its tenant may use
(``tools.offer``, ``tools.access``), with arguments that passed the tenant's output guardrails
(``guards.arguments``) first.
It leaves ``ctx.answer``, the answer stream, for the later stages (the cache store, output
guardrails) to hook into and for the response to read, citing the answer's sentences against
the prompt's passages as they complete (``pipeline.answer.citations``); the ``chat {model}``
spans stay open until their streams end.
"""

from __future__ import annotations

import time
from typing import Any

from opentelemetry import context as otel_context

from pipeline.answer.citations import Attributor, CitationTracker
from pipeline.answer.completion import Completion
from pipeline.answer.stream import AnswerStream
from pipeline.context import RequestContext, RouteChoice, ToolRun
from pipeline.guards.arguments import ArgumentsGuard
from pipeline.guards.policy import PolicyBook
from pipeline.model.budget import fit_sources
from pipeline.model.chat import TracedChat
from pipeline.model.prompt import build_messages, personalisation
from pipeline.model.routes import Route, RouteTable
from pipeline.model.salt import MemoScope, PrefixCacheSalt, salted_schema
from pipeline.model.tokens import TokenCounter
from pipeline.runner import StageSpec
from pipeline.stages.cache import degraded, searched_the_keyed_version, storable, unshareable
from pipeline.store.singleflight import Leader, Shared, SingleFlight
from pipeline.telemetry import attributes as attr
from pipeline.tools.access import ToolAccess
from pipeline.tools.base import Tool, ToolContext
from pipeline.tools.loop import Invoker, ToolLoop
from pipeline.tools.offer import function_names, offer


class Generate:
    spec = StageSpec.of(
        "generate",
        reads={"params", "principal", "deadline"},
        # cache_*, records, index_versions: whether its answer may be shared (coalescing)
        optional={
            "passages",
            "features",
            "tool_runs",
            "route",
            "cache_key",
            "cache_status",
            "cache_control",
            "index_versions",
        },
        # index_versions: those its tool searches used; passages: the sources that fit the window
        # completion: a follower's, the leader's answer
        writes={"answer", "route", "index_versions", "passages", "completion"},
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
        counter: TokenCounter | None = None,
        context_length: int | None = None,
        flights: SingleFlight | None = None,
        salt: PrefixCacheSalt | None = None,
        memo_scope: MemoScope,
    ) -> None:
        self.routes = routes
        self.chat = chat
        self.server_tools = server_tools or {}
        self.invoker = invoker
        self.max_rounds = max_rounds
        self.access = access
        self.policies = policies
        # With both, the sources are cut to the window (pipeline.model.budget).
        self.counter = counter
        self.context_length = context_length
        self.flights = flights  # request coalescing, when on
        self.salt = salt  # the model server's prefix cache kept per tenant, when on
        self.memo_scope = memo_scope  # what the replica's memos keep, by whom

    async def __call__(self, ctx: RequestContext) -> RequestContext:
        params = ctx.params
        if ctx.route is None:
            route = self.routes.first_choice(params.model, params.rag.route)
            ctx.route = RouteChoice(route.name, route.model, "default")
        else:
            route = self.routes.get(ctx.route.name)
        leader = await self._share(ctx) if self.flights is not None else None
        if ctx.finished:  # followed: the leader's answer is this request's
            return ctx
        tools = offer(params, self.server_tools, tenant=ctx.caller.tenant, access=self.access)
        personal = personalisation(ctx.features)
        memo_scope = self.memo_scope(ctx.caller)
        if ctx.passages:
            self._fit_sources(ctx, personal, tools.options.get("tools"), memo_scope)
        payload: dict[str, Any] = {
            "model": route.model,
            "messages": build_messages(
                params.messages, ctx.passages, personal=personal, tool_runs=ctx.tool_runs
            ),
            **params.sampling,
            **tools.options,
        }
        if self.salt is not None:
            payload["cache_salt"] = self.salt(ctx.caller)
        # The loop's runs are the planned ones and then its own: they go on the completion, and
        # the context keeps what the tools stage wrote (the loop runs on after this returns).
        runs = list(ctx.tool_runs)
        loop = self._loop(ctx, route, tools.server, runs, memo_scope)
        answer = AnswerStream(loop.events(payload), lambda: base_completion(ctx, route.model, runs))
        # Against the passages of this prompt only: what the caller was allowed to see. An
        # answer with no sources in its prompt has nothing to be cited against: no citations
        # (not one "unsupported" per sentence, and no extra chunk per sentence on its stream).
        if ctx.passages:
            answer.cite(CitationTracker(Attributor(ctx.passages, scope=memo_scope)))
        if leader is not None:
            answer.tap(leader)  # what this request's reader gets, its followers get
        started = time.perf_counter()
        await answer.prime()
        ctx.annotate(**{attr.TTFT_MS: round((time.perf_counter() - started) * 1000.0, 3)})
        ctx.answer = answer
        return ctx

    async def _share(self, ctx: RequestContext) -> Leader | None:
        """Request coalescing (``pipeline.store.singleflight``): lead the flight of the
        request's cache key (the leader is returned), follow it (the context is finished with
        the leader's answer, or fails with its error), or generate alone (None)."""
        assert self.flights is not None
        why = unshareable(ctx)
        variant = ",".join(degraded(ctx))  # shared only with requests degraded alike
        if why is not None or ctx.cache_key is None:
            shared = Shared("off", detail=why or "no cache key")
        else:
            shared = await self.flights.share(
                ctx.cache_key, stream=ctx.params.stream, deadline=ctx.deadline, variant=variant
            )
            if variant and not shared.detail:
                shared.detail = f"degraded: {variant}"
        ctx.annotate(**{attr.COALESCED: shared.role, attr.COALESCE_DETAIL: shared.detail or None})
        if shared.error is not None:
            raise shared.error
        if shared.completion is not None:
            ctx.respond(shared.completion)
        elif shared.events is not None and shared.final is not None:
            ctx.answer = AnswerStream(shared.events, shared.final)  # filtered and cited
            ctx.finished = True
        if shared.leader is not None:
            shared.leader.lead(
                still_shared=lambda: searched_the_keyed_version(ctx), storable=storable
            )
        return shared.leader

    def _fit_sources(self, ctx: RequestContext, personal: str, tools: Any, memo_scope: str) -> None:
        """Keep the sources that fit the window with the rest of the prompt and the answer;
        the passages kept are the request's from here on (its sources, what is cited)."""
        if self.counter is None or self.context_length is None:
            return
        fit = fit_sources(
            ctx.params.messages,
            ctx.passages,
            counter=self.counter.for_scope(memo_scope),
            context_length=self.context_length,
            max_tokens=ctx.params.sampling.get("max_tokens"),
            personal=personal,
            tool_runs=ctx.tool_runs,
            tools=tools,
        )
        ctx.annotate(**{attr.PROMPT_SOURCE_BUDGET: fit.budget_tokens})
        if not fit.changed:
            return
        ctx.passages = fit.passages
        ctx.annotate(
            **{
                attr.PROMPT_SOURCE_TOKENS: fit.source_tokens,
                attr.PROMPT_SOURCES_DROPPED: list(fit.dropped) or None,
                attr.PROMPT_SOURCE_CUT: fit.cut,
                attr.PROMPT_SOURCE_CUT_CHARS: list(fit.cut_chars) if fit.cut_chars else None,
            }
        )

    def _loop(
        self,
        ctx: RequestContext,
        route: Route,
        offered: frozenset[str],
        runs: list[ToolRun],
        memo_scope: str,
    ) -> ToolLoop:
        parent = otel_context.get_current()
        tenant, deadline = ctx.caller.tenant, ctx.deadline

        def model_round(request: dict[str, Any]) -> Any:
            # Each round takes a slot of the route as the tenant, queued fairly among tenants
            # until the request's deadline, which also bounds the stream's reads. A schema the
            # round is held to (the caller's, or a forced tool call's) is salted as its prompt.
            request = salted_schema(request)
            return self.chat.stream(
                route, request, parent, tenant=tenant, deadline=deadline, memo_scope=memo_scope
            )

        policy = self.policies.for_tenant(tenant) if self.policies is not None else None
        return ToolLoop(
            model_round,
            self.invoker,
            ToolContext(
                ctx.caller, features=lambda: _features(ctx), index_versions=ctx.index_versions
            ),
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
