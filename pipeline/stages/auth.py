"""The auth stage: the bearer key becomes a principal, or the request ends with a 401."""

from __future__ import annotations

from pipeline import attributes as attr
from pipeline.context import Principal, RequestContext
from pipeline.errors import AuthenticationFailed, PermissionDenied, ServiceUnavailable
from pipeline.keys import ApiKeyStore
from pipeline.kv import StoreUnavailable


class Authenticate:
    name = "auth"

    def __init__(self, keys: ApiKeyStore, *, scope: str = "chat") -> None:
        self.keys = keys
        self.scope = scope

    async def __call__(self, ctx: RequestContext) -> RequestContext:
        credential, ctx.credential = ctx.credential, None  # the raw key goes no further
        ctx.principal = await self.authenticate(credential)
        ctx.annotate(**{attr.TENANT: ctx.principal.tenant})
        return ctx

    async def authenticate(self, credential: str | None) -> Principal:
        """The principal behind a bearer credential, or the error that ends the request."""
        if not credential:
            raise AuthenticationFailed("Missing API key: send 'Authorization: Bearer <key>'.")
        try:
            principal = await self.keys.resolve(credential)
        except StoreUnavailable as exc:
            raise ServiceUnavailable(
                "API keys cannot be checked right now (key store unreachable).",
                code="auth_unavailable",
            ) from exc
        if principal is None:
            raise AuthenticationFailed()
        if not principal.can(self.scope):
            raise PermissionDenied(f"This API key lacks the '{self.scope}' scope.")
        return principal
