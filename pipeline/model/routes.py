"""Model routes: each a name, an OpenAI-compatible server, the model it serves, its own
connection pool and its own bound on concurrent requests, in all and per tenant
(``pipeline.model.slots``).

A request names ``auto``, a route, or a model. ``candidates`` gives the routes it may take (one
when it pins a route, or names a model only one route serves); the router chooses among them.
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass

from pipeline.errors import InvalidRequest, NotFound
from pipeline.model.client import LLMClient
from pipeline.model.slots import SlotPool

AUTO = "auto"


@dataclass
class Route:
    name: str
    model: str
    client: LLMClient
    slots: SlotPool

    def slot(
        self, tenant: str, deadline: float | None = None
    ) -> AbstractAsyncContextManager[float]:
        """Hold one of the route's concurrent-request slots for ``tenant``, waiting in turn
        with other tenants until shortly before ``deadline``; yields the seconds waited."""
        return self.slots.slot(tenant, deadline)


class RouteTable:
    def __init__(self, routes: Mapping[str, Route], default: str | None = None) -> None:
        if not routes:
            raise ValueError("at least one route is needed")
        self.routes = dict(routes)
        self.default = default if default in self.routes else next(iter(self.routes))

    @property
    def models(self) -> frozenset[str]:
        """Every name a request may put in ``model``."""
        return frozenset({AUTO, *self.routes, *(r.model for r in self.routes.values())})

    def get(self, name: str) -> Route:
        return self.routes[name]

    def candidates(self, model: str, pinned: str | None = None) -> list[Route]:
        """The routes a request for ``model`` (optionally pinned to a route) may take."""
        if pinned is not None:
            route = self.routes.get(pinned)
            if route is None:
                raise InvalidRequest(
                    f"Unknown route '{pinned}'. Routes: {', '.join(sorted(self.routes))}.",
                    param="rag.route",
                    code="unknown_route",
                )
            if model not in (AUTO, route.name, route.model):
                raise InvalidRequest(
                    f"Route '{pinned}' serves '{route.model}', not '{model}'.", param="rag.route"
                )
            return [route]
        if model in self.routes:
            return [self.routes[model]]
        if model == AUTO:
            return list(self.routes.values())
        serving = [r for r in self.routes.values() if r.model == model]
        if not serving:
            raise NotFound(
                f"The model '{model}' does not exist. Available: {', '.join(sorted(self.models))}.",
                param="model",
                code="model_not_found",
            )
        return serving

    def first_choice(self, model: str, pinned: str | None = None) -> Route:
        """The route taken when no router decides: the default route if it may, else the first."""
        candidates = self.candidates(model, pinned)
        for route in candidates:
            if route.name == self.default:
                return route
        return candidates[0]

    async def aclose(self) -> None:
        for client in {id(r.client): r.client for r in self.routes.values()}.values():
            await client.aclose()
