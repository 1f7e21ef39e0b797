"""The compress stage: the kept passages cut down to their sentences most relevant to the
question, in their original order, under a token budget counted with the served model's
tokenizer (``pipeline.sources.compress``). Each kept sentence keeps its passage's document
id, so the ``[doc-id]`` citations survive. Tokens before and after go on the span.

It degrades: should compression fail, the passages go to the model as they are.
"""

from __future__ import annotations

from collections.abc import Callable

from pipeline.context import Principal, RequestContext
from pipeline.model.messages import last_user_text
from pipeline.model.salt import MemoScope
from pipeline.model.tokens import TokenCounter
from pipeline.runner import StageSpec
from pipeline.sources.compress import compress
from pipeline.telemetry import attributes as attr

# (the caller, the query) -> the IDF of its terms in the index as that caller may see it.
IdfLookup = Callable[[Principal, str], dict[str, float]]


class CompressSources:
    spec = StageSpec.of(
        "compress", reads={"principal", "params", "passages"}, writes={"passages"}, policy="degrade"
    )

    def __init__(
        self,
        counter: TokenCounter,
        *,
        budget_tokens: int,
        enabled: bool = True,
        idf: IdfLookup | None = None,
        memo_scope: MemoScope,
    ) -> None:
        self.counter = counter
        self.budget_tokens = budget_tokens
        self.enabled = enabled
        self.idf = idf
        self.memo_scope = memo_scope  # the passages' analyses kept by it

    async def __call__(self, ctx: RequestContext) -> RequestContext:
        options = ctx.params.rag
        on = self.enabled if options.compress is None else options.compress
        if not ctx.passages or not on:
            ctx.annotate(**{attr.COMPRESS_SKIPPED: "off" if ctx.passages else "no sources"})
            return ctx
        query = last_user_text(ctx.params.messages)
        budget = options.budget_tokens or self.budget_tokens
        idf = self.idf(ctx.caller, query) if self.idf is not None else None
        # A few milliseconds of pure Python: run here rather than pay a thread hand-off for it.
        result = compress(
            query,
            ctx.passages,
            scope=self.memo_scope(ctx.caller),
            budget_tokens=budget,
            counter=self.counter,
            idf=idf,
        )
        ctx.passages = list(result.passages)
        ctx.annotate(
            **{
                attr.COMPRESS_TOKENS_BEFORE: result.tokens_before,
                attr.COMPRESS_TOKENS_AFTER: result.tokens_after,
                attr.COMPRESS_BUDGET: budget,
                attr.COMPRESS_SENTENCES: len(result.sentences),
            }
        )
        return ctx
