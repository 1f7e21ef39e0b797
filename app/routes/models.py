"""GET /v1/models: every name a request may put in ``model``, each saying what it is.

The list has OpenAI's shape (``{"object": "list", "data": [model, ...]}``, each model with
``id``, ``object``, ``created``, ``owned_by``) and, like a completion, our one extra field,
``rag``, on each entry:

- ``auto``: ``{"kind": "router", "routes": [...]}``: the router chooses one of these routes.
- a route's name: ``{"kind": "route", "model": ...}``: pins the route; it answers with that model.
- a served model: ``{"kind": "model", "routes": [...]}``: the routes serving it (the router
  chooses when there are several).

A name that is both a route's and a model's is a route: a request naming it pins that route.
"""

from __future__ import annotations

import time
from typing import Any, Final

from fastapi import APIRouter

from app.http import answers
from app.http.auth import ChatPrincipal
from app.http.openapi import answers as declared
from app.services import ServicesDep
from pipeline.errors import NotFound
from pipeline.model.routes import AUTO, RouteTable

router = APIRouter(tags=["models"])
_STARTED = int(time.time())
OWNER: Final = "rag-pipeline"


def describe(routes: RouteTable, name: str) -> dict[str, Any]:
    """What ``name`` (one of ``routes.models``) means in a request's ``model``."""
    if name == AUTO:
        return {"kind": "router", "routes": sorted(routes.routes)}
    if name in routes.routes:
        return {"kind": "route", "model": routes.get(name).model}
    return {
        "kind": "model",
        "routes": sorted(r.name for r in routes.routes.values() if r.model == name),
    }


def _model(routes: RouteTable, name: str) -> dict[str, Any]:
    return {
        "id": name,
        "object": "model",
        "created": _STARTED,
        "owned_by": OWNER,
        "rag": describe(routes, name),
    }


@router.get(
    "/v1/models",
    response_model=None,
    operation_id="listModels",
    responses=declared(200, answers.ModelList, 403),
)
async def list_models(services: ServicesDep, principal: ChatPrincipal) -> dict[str, Any]:
    routes = services.routes
    return {"object": "list", "data": [_model(routes, m) for m in sorted(routes.models)]}


@router.get(
    "/v1/models/{model}",
    response_model=None,
    operation_id="retrieveModel",
    responses=declared(200, answers.Model, 403, 404),
)
async def retrieve_model(
    model: str, services: ServicesDep, principal: ChatPrincipal
) -> dict[str, Any]:
    if model not in services.routes.models:
        raise NotFound(
            f"The model '{model}' does not exist.", param="model", code="model_not_found"
        )
    return _model(services.routes, model)
