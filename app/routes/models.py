"""GET /v1/models: the model names this service accepts: ``auto`` (the router chooses), each
route's name (pinned), and each model a route serves."""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter

from app.http.auth import ChatPrincipal
from app.services import ServicesDep
from pipeline.errors import NotFound

router = APIRouter(tags=["models"])
_STARTED = int(time.time())


def _model(name: str) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": _STARTED, "owned_by": "rag-pipeline"}


@router.get("/v1/models")
async def list_models(services: ServicesDep, principal: ChatPrincipal) -> dict[str, Any]:
    return {"object": "list", "data": [_model(m) for m in sorted(services.routes.models)]}


@router.get("/v1/models/{model}")
async def retrieve_model(
    model: str, services: ServicesDep, principal: ChatPrincipal
) -> dict[str, Any]:
    if model not in services.routes.models:
        raise NotFound(
            f"The model '{model}' does not exist.", param="model", code="model_not_found"
        )
    return _model(model)
