"""The validate stage: what the schema cannot know (served models and routes, the context size,
the tools a request offers, and whether the JSON Schemas of the caller's functions and of its
``response_format`` are valid: checked here, after auth, within limits and off the event loop).

Structured output and function calling are not offered together: vLLM's structured output
constrains the whole answer to the schema, so the model could never write a call; a request
that asks for both is refused rather than given an answer that silently drops one."""

from __future__ import annotations

from collections.abc import Mapping

from pipeline.context import RequestContext
from pipeline.errors import ContextTooLong, InvalidRequest
from pipeline.model.routes import RouteTable
from pipeline.model.salt import MemoScope
from pipeline.runner import StageSpec
from pipeline.tools.access import ToolAccess
from pipeline.tools.base import Tool
from pipeline.tools.offer import offered_tools
from pipeline.tools.schema_check import SchemaLimits, check_schemas, check_tool_schemas


class ValidateRequest:
    spec = StageSpec.of("validate", reads={"params", "principal"})

    def __init__(
        self,
        *,
        routes: RouteTable,
        context_length: int,
        server_tools: Mapping[str, Tool] | None = None,
        schema_limits: SchemaLimits | None = None,
        tool_access: ToolAccess | None = None,
        memo_scope: MemoScope,
    ) -> None:
        self.routes = routes
        self.context_length = context_length
        self.server_tools = dict(server_tools or {})
        self.schema_limits = schema_limits or SchemaLimits()
        self.tool_access = tool_access
        self.memo_scope = memo_scope  # whose memo the patterns' verdicts go in

    async def __call__(self, ctx: RequestContext) -> RequestContext:
        params = ctx.params
        self.routes.candidates(params.model, params.rag.route)  # 404/400 for unknown names
        max_tokens = params.sampling.get("max_tokens")
        if isinstance(max_tokens, int) and max_tokens >= self.context_length:
            raise ContextTooLong(
                f"max_tokens={max_tokens} does not fit the model's context of "
                f"{self.context_length} tokens (prompt included)."
            )
        # 400 for unknown tools, 403 for a tool the caller's tenant may not use.
        offered_tools(params, self.server_tools, tenant=ctx.caller.tenant, access=self.tool_access)
        if params.tools:
            scope = self.memo_scope(ctx.caller)
            await check_tool_schemas(params.tools, self.schema_limits, scope=scope)
        response_format = params.sampling.get("response_format")
        if response_format is not None:
            self._not_with_tools(ctx)
            schema = response_format.get("json_schema", {}).get("schema")
            if schema is not None:
                param = "response_format.json_schema.schema"
                await check_schemas(
                    [(param, schema)],
                    self.schema_limits,
                    kind="response",
                    param=param,
                    scope=self.memo_scope(ctx.caller),
                )
        return ctx

    @staticmethod
    def _not_with_tools(ctx: RequestContext) -> None:
        params = ctx.params
        if (params.tools or params.rag.tools) and params.tool_choice != "none":
            raise InvalidRequest(
                "response_format (json_object or json_schema) cannot be combined with tools "
                "the model may call: structured output constrains the whole answer, so no call "
                'could be written. Drop one, or send tool_choice: "none".',
                param="response_format",
                code="unsupported_combination",
            )
