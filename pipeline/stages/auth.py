"""The auth stage: the bearer key becomes a principal, or the request ends with a 401."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from pipeline.context import Principal, RequestContext
from pipeline.errors import AuthenticationFailed, PermissionDenied
from pipeline.runner import StageSpec
from pipeline.store.keys import ApiKeyStore
from pipeline.telemetry import attributes as attr

MAX_CREDENTIAL_CHARS = 512  # generated keys are ~60 characters, custom ones at most 256


class Authenticate:
    """Resolves the bearer key; a request that arrives with its principal already resolved (a
    queued job) is checked again: its key must still be active."""

    # A queued job arrives with its principal and no credential; the raw key is cleared.
    spec = StageSpec.of(
        "auth", reads={"credential"}, optional={"principal"}, writes={"principal", "credential"}
    )

    def __init__(
        self,
        keys: ApiKeyStore,
        *,
        scope: str = "chat",
        ready: Callable[[str], Awaitable[None]] | None = None,
    ) -> None:
        self.keys = keys
        self.scope = scope
        # The caller's tenant's index made ready off the event loop (``PassageSearch.ready``):
        # the stages after this one read its version and the caller's access scope on it.
        self.ready = ready

    async def __call__(self, ctx: RequestContext) -> RequestContext:
        credential, ctx.credential = ctx.credential, None  # the raw key goes no further
        if ctx.principal is not None and credential is None:
            await self.recheck(ctx.principal)
        else:
            ctx.principal = await self.authenticate(credential)
        ctx.annotate(**{attr.TENANT: ctx.principal.tenant})
        if self.ready is not None:
            await self.ready(ctx.principal.tenant)
        return ctx

    async def recheck(self, principal: Principal) -> None:
        """A principal resolved earlier: its key must still exist and carry the scope."""
        active = await self.keys.is_active(principal.key_id)  # StoreUnavailable: a 503
        if not active:
            raise AuthenticationFailed("The API key of this request has been revoked.")
        if not principal.can(self.scope):
            raise PermissionDenied(f"This API key lacks the '{self.scope}' scope.")

    async def authenticate(self, credential: str | None) -> Principal:
        """The principal behind a bearer credential, or the error that ends the request."""
        principal = await self.resolve(credential)
        if not principal.can(self.scope):
            raise PermissionDenied(f"This API key lacks the '{self.scope}' scope.")
        return principal

    async def resolve(self, credential: str | None) -> Principal:
        """The principal behind a bearer credential, whatever its scopes (401 or 503 if none).
        A credential longer than any key is refused without a lookup."""
        if not credential:
            raise AuthenticationFailed("Missing API key: send 'Authorization: Bearer <key>'.")
        if len(credential) > MAX_CREDENTIAL_CHARS:
            raise AuthenticationFailed()
        principal = await self.keys.resolve(credential)  # StoreUnavailable: a 503
        if principal is None:
            raise AuthenticationFailed()
        return principal
