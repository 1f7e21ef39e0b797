"""The tools stage: the calls a request plainly needs, run beside retrieval, for the prompt.

The planner reads the last user message and plans only tools the caller's tenant may use
(``tools.access``); the planned calls run at once through the invoker
(each in its ``execute_tool`` span, under its tool's limits) and their runs go into
``ctx.tool_runs``, which the prompt shows under "Tool results:" and the response reports in
``rag.tools``. The stage degrades: if it fails, the request goes on with what ran. A tool that
needs the user's features (the profile) waits for the features stage of the same group.
"""

from __future__ import annotations

from pipeline.context import Features, RequestContext
from pipeline.model.messages import last_user_text
from pipeline.runner import StageSpec, available
from pipeline.telemetry import attributes as attr
from pipeline.tools.access import ToolAccess
from pipeline.tools.base import ToolContext
from pipeline.tools.loop import Invoker
from pipeline.tools.planner import ToolPlanner


def features_when_ready(ctx: RequestContext) -> ToolContext:
    """The caller's tool context; its ``features`` waits for the features stage, if one runs."""

    async def features() -> Features:
        await available("features")
        return ctx.features

    return ToolContext(ctx.caller, features=features, index_versions=ctx.index_versions)


class PlannedTools:
    """Runs the planned tools (``rag.plan_tools`` false: none)."""

    spec = StageSpec.of(
        "tools",
        reads={"principal", "params"},
        writes={"tool_runs", "index_versions"},  # the versions its searches used
        policy="degrade",
    )

    def __init__(
        self, planner: ToolPlanner, invoker: Invoker, access: ToolAccess | None = None
    ) -> None:
        self.planner = planner
        self.invoker = invoker
        self.access = access or ToolAccess()

    async def __call__(self, ctx: RequestContext) -> RequestContext:
        if not ctx.params.rag.plan_tools:
            ctx.annotate(**{attr.TOOLS_PLANNED: []})
            return ctx
        allowed = self.access.usable(ctx.caller.tenant, self.planner.available)
        calls = self.planner.plan(last_user_text(ctx.params.messages), allowed)
        ctx.annotate(**{attr.TOOLS_PLANNED: [call.name for call in calls]})
        if calls:
            ctx.tool_runs.extend(await self.invoker.run(calls, features_when_ready(ctx)))
        return ctx

    def fallback(self, ctx: RequestContext, exc: Exception) -> None:
        """Leave the runs that finished (none are lost: a round's runs come back together)."""
