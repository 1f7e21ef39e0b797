"""The features stage: the caller's features from the online store, within a small budget.

It runs beside retrieval (which waits for it only to merge a feature-derived filter) and
degrades: a miss, a timeout or Redis being down leaves every feature at its declared default,
and the span and ``rag.explain`` say which features were used, which fell back and why.
Spans carry feature names only, never values: a user's features are personal data (the tenant
and user ids are on the request's spans already).
"""

from __future__ import annotations

from pipeline.context import Features, RequestContext
from pipeline.features.requestlog import request_record
from pipeline.features.store import FeatureStore
from pipeline.runner import StageSpec, StageTimeout
from pipeline.telemetry import attributes as attr


class LoadFeatures:
    """Loads the user's batch features and real-time counters in one Redis round trip, and
    appends the request to the request log (``log_requests``)."""

    def __init__(
        self, store: FeatureStore, *, timeout_s: float = 0.05, log_requests: bool = True
    ) -> None:
        self.store = store
        self.log_requests = log_requests
        self.spec = StageSpec.of(
            "features",
            reads={"principal", "params"},
            writes={"features"},
            policy="degrade",
            timeout_s=timeout_s,
        )

    async def __call__(self, ctx: RequestContext) -> RequestContext:
        caller = ctx.caller
        log = request_record(ctx.params) if self.log_requests else None
        lookup = await self.store.load(caller.tenant, caller.user, log=log)
        ctx.features = lookup.features
        _annotate(ctx, lookup.features, lookup.status)
        ctx.annotate(
            **{
                attr.FEATURES_AGE_S: lookup.age_s,
                attr.FEATURES_INVALID: sorted(lookup.invalid) or None,
            }
        )
        return ctx

    def fallback(self, ctx: RequestContext, exc: Exception) -> None:
        """Every declared feature at its default: the lookup failed or ran past its budget."""
        ctx.features = self.store.defaults()
        _annotate(ctx, ctx.features, "timeout" if isinstance(exc, StageTimeout) else "error")


def _annotate(ctx: RequestContext, features: Features, lookup: str) -> None:
    ctx.annotate(
        **{
            attr.FEATURES_LOOKUP: lookup,
            attr.FEATURES_USED: sorted(features.values),
            attr.FEATURES_DEFAULTED: sorted(features.defaulted),
            attr.FEATURES_VERSION: features.version,
        }
    )
