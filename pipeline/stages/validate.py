"""The validate stage: what the schema cannot know (served models, the context size)."""

from __future__ import annotations

from collections.abc import Iterable

from pipeline.context import RequestContext
from pipeline.errors import ContextTooLong, NotFound


class ValidateRequest:
    name = "validate"

    def __init__(self, *, models: Iterable[str], context_length: int) -> None:
        self.models = frozenset(models)
        self.context_length = context_length

    async def __call__(self, ctx: RequestContext) -> RequestContext:
        params = ctx.params
        if params.model not in self.models:
            raise NotFound(
                f"The model '{params.model}' does not exist. "
                f"Available: {', '.join(sorted(self.models))}.",
                param="model",
                code="model_not_found",
            )
        max_tokens = params.sampling.get("max_tokens")
        if isinstance(max_tokens, int) and max_tokens >= self.context_length:
            raise ContextTooLong(
                f"max_tokens={max_tokens} does not fit the model's context of "
                f"{self.context_length} tokens (prompt included)."
            )
        return ctx
