"""The validate stage: what the schema cannot know (served models and routes, the context size,
the tools a request offers)."""

from __future__ import annotations

from collections.abc import Mapping

from pipeline.context import RequestContext
from pipeline.errors import ContextTooLong
from pipeline.routing import RouteTable
from pipeline.runner import FailurePolicy
from pipeline.tools.base import Tool
from pipeline.tools.offer import offered_tools


class ValidateRequest:
    name = "validate"
    reads = frozenset({"params", "principal"})
    writes: frozenset[str] = frozenset()
    policy: FailurePolicy = "fatal"

    def __init__(
        self,
        *,
        routes: RouteTable,
        context_length: int,
        server_tools: Mapping[str, Tool] | None = None,
    ) -> None:
        self.routes = routes
        self.context_length = context_length
        self.server_tools = dict(server_tools or {})

    async def __call__(self, ctx: RequestContext) -> RequestContext:
        params = ctx.params
        self.routes.candidates(params.model, params.rag.route)  # 404/400 for unknown names
        max_tokens = params.sampling.get("max_tokens")
        if isinstance(max_tokens, int) and max_tokens >= self.context_length:
            raise ContextTooLong(
                f"max_tokens={max_tokens} does not fit the model's context of "
                f"{self.context_length} tokens (prompt included)."
            )
        offered_tools(params, self.server_tools)
        return ctx
