"""Graceful under load: a request asks for less of a loaded route before anything is refused.

Load is what the route's slots say (``SlotPool.pressure``: calls holding or awaiting a slot
over the slots, or the same for the caller's tenant's share, whichever is larger). As it
grows, a request takes more steps, each on top of the ones before:

- ``top_k`` (from ``top_k_at``, 0.75 by default: most slots taken): fewer sources, so a shorter
  prompt, the prefill that dominates time to first token on vLLM;
- ``compress`` (from ``compress_at``, 1.0: every slot taken, the next call waits): the sources
  compressed to a tighter budget, even where the request turned compression off;
- ``small_route`` (from ``small_route_at``, 1.5: a queue half the slots long): the small route,
  when the route chosen is another and the small one is less loaded (``ChooseRoute``).

A request that pinned its route keeps it. Each step is said in ``rag.explain`` (the ``adapt``
stage's record, or the route stage's), on the span and in ``rag_adapted_total{step}``; an
adapted answer is not stored in the response cache (its key describes the request as asked).
Before routing, the pressure is the largest among the routes the request may take: it may be
sent to any of them.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Final

from pipeline.model.routes import Route

TOP_K: Final = "top_k"
COMPRESS: Final = "compress"
SMALL_ROUTE: Final = "small_route"


@dataclass(frozen=True)
class LoadPolicy:
    """Where each step starts (pressure) and what the request is given there."""

    top_k_at: float = 0.75
    compress_at: float = 1.0
    small_route_at: float = 1.5
    top_k: int = 2
    budget_tokens: int = 192

    def __post_init__(self) -> None:
        if not 0 < self.top_k_at <= self.compress_at <= self.small_route_at:
            raise ValueError("the steps must start in order: top_k, compress, small_route")
        if self.top_k < 1 or self.budget_tokens < 1:
            raise ValueError("a reduced request keeps at least one source and one token")

    def steps(self, pressure: float) -> tuple[str, ...]:
        """The steps a request takes at ``pressure`` (none below ``top_k_at``)."""
        starts = ((TOP_K, self.top_k_at), (COMPRESS, self.compress_at))
        taken = tuple(step for step, at in starts if pressure >= at)
        return (*taken, SMALL_ROUTE) if pressure >= self.small_route_at else taken


def pressure(routes: Iterable[Route], tenant: str) -> float:
    """The largest pressure among ``routes`` for a call of ``tenant`` (0 for none)."""
    return max((route.slots.pressure(tenant) for route in routes), default=0.0)
