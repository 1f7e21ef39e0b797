"""Authentication for the routes other than chat (chat authenticates in its pipeline stage)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Annotated

from fastapi import Depends, Request

from app.services import ServicesDep
from pipeline.context import Principal
from pipeline.stages.auth import Authenticate


def bearer_token(request: Request) -> str | None:
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


def require(scope: str) -> Callable[[Request, ServicesDep], Awaitable[Principal]]:
    """A dependency that resolves the caller's key and checks that it carries ``scope``."""

    async def dependency(request: Request, services: ServicesDep) -> Principal:
        return await Authenticate(services.keys, scope=scope).authenticate(bearer_token(request))

    return dependency


ChatPrincipal = Annotated[Principal, Depends(require("chat"))]
RetrievePrincipal = Annotated[Principal, Depends(require("retrieve"))]
IngestPrincipal = Annotated[Principal, Depends(require("ingest"))]
