"""The app's error handlers: every error leaves in OpenAI's shape, written by
``pipeline.errors.error_body``, with the headers the error carries (``Retry-After``)."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from app.http.responses import JSONResponse
from app.http.server import REFUSED_STATUS
from pipeline.errors import ClientClosedRequest, PipelineError, error_body

log = logging.getLogger("rag.errors")

_HTTP_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
}
_HTTP_CODES = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}


SHOWN_PARAM_CHARS = 64  # of a field name a client wrote: echoed back, so bounded


def shown_name(name: str) -> str:
    """A field name as an error shows it: cut to ``SHOWN_PARAM_CHARS`` (a hostile body may
    carry a megabyte-long key)."""
    return name if len(name) <= SHOWN_PARAM_CHARS else name[: SHOWN_PARAM_CHARS - 1] + "…"


def _param(loc: tuple[Any, ...]) -> str | None:
    parts = [str(p) for p in loc if p != "body"]
    return shown_name(".".join(parts)) if parts else None


def validation_error_body(exc: RequestValidationError) -> dict[str, Any]:
    errors = exc.errors()
    first: dict[str, Any] = (
        dict(errors[0]) if errors else {"loc": (), "msg": "Invalid request.", "type": "invalid"}
    )
    if first.get("type") == "json_invalid":
        detail = dict(first.get("ctx") or {}).get("error", first["msg"])
        return error_body(
            f"We could not parse the JSON body of your request: {detail}.",
            "invalid_request_error",
            code="invalid_json",
        )
    param = _param(tuple(first.get("loc", ())))
    kind = str(first.get("type"))
    if kind == "extra_forbidden":  # as OpenAI words it
        kind, first["msg"] = "unknown_parameter", "Unrecognized request argument supplied"
    message = f"{param}: {first['msg']}" if param else str(first["msg"])
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})"
    return error_body(message, "invalid_request_error", param=param, code=kind)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(PipelineError)
    async def _pipeline_error(request: Request, exc: PipelineError) -> JSONResponse:
        return JSONResponse(exc.to_dict(), status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(ClientDisconnect)
    async def _client_left(request: Request, exc: ClientDisconnect) -> JSONResponse:
        # The client went away before its body was read whole (``request.body()``,
        # ``request.form()``): a 499 for the log and metrics, as for one that leaves while its
        # request waits (``app.http.disconnect``), not a 500 with a traceback; the answer goes
        # nowhere. Unless the protocol refused the body (a chunk it could not read, trailers
        # too large) and answered the client itself: then that answer's status.
        refused = request.scope.get(REFUSED_STATUS)
        if isinstance(refused, int):
            message = "The request body could not be read."
            return JSONResponse(error_body(message, "invalid_request_error"), status_code=refused)
        return await _pipeline_error(request, ClientClosedRequest())

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse(validation_error_body(exc), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        error_type = _HTTP_TYPES.get(exc.status_code, "invalid_request_error")
        message = str(exc.detail) if exc.detail else "Request failed."
        if exc.status_code == 404 and exc.detail == "Not Found":
            message = f"Unknown path: {request.method} {request.url.path}"
        return JSONResponse(
            error_body(message, error_type, code=_HTTP_CODES.get(exc.status_code)),
            status_code=exc.status_code,
            headers=getattr(exc, "headers", None),
        )

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return JSONResponse(
            error_body("The server had an error while processing your request.", "api_error"),
            status_code=500,
        )
