"""Authentication: every API path is refused without a valid key before its body is read.

``AuthenticateFirst`` is the ASGI middleware in front of the routes under ``/v1/``: it resolves
the bearer key from the headers alone and answers 401 (or 503 while keys cannot be checked)
without reading a byte of the body, so a caller without a key costs the server one hash and one
cached lookup however large or hostile the body it sends. The principal it resolved is left in
``request.state``; the route's dependency then checks the scope the route needs (403). Probes,
metrics and the API's own docs are outside ``/v1/`` and need no key.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Annotated

import orjson
from fastapi import Depends, Request
from starlette.types import ASGIApp, Receive, Scope, Send

from app.services import Services, ServicesDep
from pipeline.context import Principal
from pipeline.errors import (
    AuthenticationFailed,
    PermissionDenied,
    PipelineError,
)
from pipeline.stages.auth import Authenticate

PRINCIPAL = "principal"


def token_from_headers(headers: list[tuple[bytes, bytes]]) -> str | None:
    """The bearer token of raw ASGI headers, or None."""
    for name, value in headers:
        if name == b"authorization":
            return bearer(value.decode("latin-1"))
    return None


def bearer_token(request: Request) -> str | None:
    return bearer(request.headers.get("authorization", ""))


def bearer(header: str) -> str | None:
    """The token of an Authorization header's value (``Bearer <token>``), or None."""
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


class AuthenticateFirst:
    """Refuses requests under ``prefix`` that carry no valid key, before the route runs."""

    def __init__(self, app: ASGIApp, *, prefix: str = "/v1/") -> None:
        self.app = app
        self.prefix = prefix

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(self.prefix):
            await self.app(scope, receive, send)
            return
        services: Services = scope["app"].state.services
        try:
            principal = await Authenticate(services.keys).resolve(
                token_from_headers(scope["headers"])
            )
        except PipelineError as exc:
            await self._refuse(send, exc)
            return
        scope.setdefault("state", {})[PRINCIPAL] = principal
        await self.app(scope, receive, send)

    @staticmethod
    async def _refuse(send: Send, exc: PipelineError) -> None:
        await refuse(send, exc)


async def refuse(send: Send, exc: PipelineError) -> None:
    """Answer ``exc`` before the body was read (a 401, 403, 429 or 503 at the edge)."""
    body = orjson.dumps(exc.to_dict())
    # The body was never read: closing the connection spares reading (and discarding) it.
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"connection", b"close"),
    ]
    headers += [(name.lower().encode(), value.encode()) for name, value in exc.headers.items()]
    if isinstance(exc, AuthenticationFailed):
        headers.append((b"www-authenticate", b'Bearer realm="rag"'))
    await send({"type": "http.response.start", "status": exc.status_code, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def require(scope: str) -> Callable[[Request, ServicesDep], Awaitable[Principal]]:
    """A dependency: the caller's principal (resolved by ``AuthenticateFirst``, or here when the
    app runs without it), which must carry ``scope``."""

    async def dependency(request: Request, services: ServicesDep) -> Principal:
        principal = getattr(request.state, PRINCIPAL, None)
        if principal is None:
            principal = await Authenticate(services.keys).resolve(bearer_token(request))
        if not principal.can(scope):
            raise PermissionDenied(f"This API key lacks the '{scope}' scope.")
        return principal

    return dependency


ChatPrincipal = Annotated[Principal, Depends(require("chat"))]
RetrievePrincipal = Annotated[Principal, Depends(require("retrieve"))]
IngestPrincipal = Annotated[Principal, Depends(require("ingest"))]
