"""The OpenAPI document says what the service does: every status a route answers (errors in
OpenAI's shape, ``ErrorResponse``), the bodies it answers with, the bearer key of every ``/v1/``
path, and links from what a call creates to the calls that read, list and delete it.

Routes read their bodies themselves (``app.http.bodies``, after the key check), so their
request schemas are added here (``document_models``); bounds that come from the running
server's configuration (the model names, routes and server tools a request may name, the
context size, a batch's size) are written into the document from its services when it is
first served.

What JSON Schema cannot say is left to the validation: the 64-bit range of every integer and
the nesting depth of any body (``app.http.bodies``); a filter's 1,024 values in all; a
document's metadata of at most 8 KB as JSON; a tool's or ``response_format``'s JSON Schema
being a valid one (``pipeline.tools.schema_check``); ``tool_choice`` naming an offered
function; a prompt that fits the context with ``max_tokens``; a webhook host that resolves
to an address a webhook may reach; the guardrails' refusals; a server tool the tenant may
not use (403); ``after`` naming an existing job.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Final

from fastapi import FastAPI
from pydantic import BaseModel


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """OpenAI's error shape (``pipeline.errors.error_body``), which every refusal has."""

    error: ErrorDetail


_DESCRIPTIONS: Final = {
    400: "The body or a query parameter is not valid (``param`` names the field).",
    401: "No valid API key.",
    403: "The key lacks the scope this route needs.",
    404: "No such object (or another tenant's, or another user's).",
    409: "The object is not in a state that allows this.",
    413: "The body is larger than the limit.",
    415: "A file of a type this service does not read, or whose content is not its extension's.",
    429: "A rate limit of the key or the tenant is spent; wait ``Retry-After`` seconds.",
    502: "The model server answered with an error.",
    503: "A part the request needs (Redis, the model server) is busy or down; retry later.",
    504: "The request did not complete before its deadline.",
    507: "The index volume has no room for the write; nothing was written.",
}
RETRY_AFTER: Final = {
    "Retry-After": {
        "description": "Seconds to wait before retrying.",
        "schema": {"type": "string", "pattern": "^[0-9]+$"},
    }
}
# Every /v1 route: the key (401), the rate limits (429), a busy or missing dependency (503).
V1: Final = (401, 429, 503)


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """``responses=`` entries for the error statuses a route can answer with."""
    declared: dict[int | str, dict[str, Any]] = {}
    for status in sorted(set(statuses)):
        entry: dict[str, Any] = {"model": ErrorResponse, "description": _DESCRIPTIONS[status]}
        if status in (429, 503):
            entry["headers"] = RETRY_AFTER
        declared[status] = entry
    return declared


def answers(
    status: int,
    model: type[BaseModel],
    *errors: int,
    links: Mapping[str, Any] | None = None,
    description: str = "Success.",
) -> dict[int | str, dict[str, Any]]:
    """``responses=`` for a /v1 route: its success body, its own error statuses and ``V1``'s."""
    success: dict[str, Any] = {"model": model, "description": description}
    if links:
        success["links"] = dict(links)
    return {status: success, **error_responses(*errors, *V1)}


def link(operation_id: str, description: str, **parameters: str) -> dict[str, Any]:
    """An OpenAPI link: the values of the next call's parameters, taken from this call."""
    return {"operationId": operation_id, "parameters": parameters, "description": description}


def document_models(app: FastAPI, models: Sequence[type[BaseModel]]) -> None:
    """Add the schemas of bodies that routes read themselves, the bearer key, and the bounds of
    the running configuration to the app's OpenAPI document."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = FastAPI.openapi(app)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for model in models:
                full = model.model_json_schema(ref_template="#/components/schemas/{model}")
                components.update(full.pop("$defs", {}))
                components[model.__name__] = full
            _declare_key(schema)
            _drop_unused_422(schema)
            services = getattr(app.state, "services", None)
            if services is not None:
                _configured_bounds(schema, services)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def _declare_key(schema: dict[str, Any]) -> None:
    schema["components"]["securitySchemes"] = {
        "apiKey": {"type": "http", "scheme": "bearer", "description": "An API key (`rag keys`)."}
    }
    for path, operations in schema["paths"].items():
        if path.startswith("/v1/"):
            for operation in operations.values():
                operation["security"] = [{"apiKey": []}]


def _drop_unused_422(schema: dict[str, Any]) -> None:
    """FastAPI declares a 422 for routes with parameters; this service answers a 400 there
    (``app.http.errors``), which each route declares."""
    for operations in schema["paths"].values():
        for operation in operations.values():
            operation.get("responses", {}).pop("422", None)
    for name in ("HTTPValidationError", "ValidationError"):
        schema["components"]["schemas"].pop(name, None)


def _configured_bounds(schema: dict[str, Any], services: Any) -> None:
    """What the validation checks against the configuration, as enums and bounds."""
    components = schema["components"]["schemas"]
    names = sorted(services.routes.models)
    routes = sorted(services.routes.routes)
    tools = sorted(services.server_tools)
    settings = services.settings
    for name in ("ChatCompletionRequest", "JobRequest"):
        properties = components.get(name, {}).get("properties", {})
        if "model" in properties:
            properties["model"] = {**properties["model"], "enum": names}
        for field in ("max_tokens", "max_completion_tokens"):
            if field in properties:
                _bound_any_of(properties[field], maximum=settings.llm.context_length - 1)
    options = components.get("RagRequestOptions", {}).get("properties", {})
    if "route" in options:
        _bound_any_of(options["route"], enum=routes)
    if "tools" in options:
        options["tools"]["items"] = {"type": "string", "enum": tools}
        if not tools:
            options["tools"]["maxItems"] = 0
    ingest = components.get("IngestRequest", {}).get("properties", {})
    if "documents" in ingest:
        ingest["documents"]["maxItems"] = settings.retrieval.max_batch_documents
    deletes = components.get("DeleteRequest", {}).get("properties", {})
    if "ids" in deletes:
        deletes["ids"]["maxItems"] = settings.retrieval.max_batch_documents
    document = components.get("DocumentIn", {}).get("properties", {})
    if "text" in document:
        document["text"]["maxLength"] = settings.retrieval.max_document_chars
    model_path = schema["paths"].get("/v1/models/{model}", {}).get("get", {})
    for parameter in model_path.get("parameters", []):
        if parameter["name"] == "model":
            parameter["schema"] = {**parameter["schema"], "enum": names}


def _bound_any_of(field: dict[str, Any], **bounds: Any) -> None:
    """Add ``bounds`` to the non-null branch of an optional field's schema."""
    for branch in field.get("anyOf", [field]):
        if branch.get("type") != "null":
            branch.update(bounds)
