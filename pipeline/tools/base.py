"""What a tool is, what a call of one is, and what it may use while it runs.

A tool is an async function with a name, a JSON schema for its arguments, a timeout, a
concurrency limit and a rate limit. It is called with its parsed, schema-checked arguments and
a ``ToolContext`` (the caller's principal and the collaborators a built-in needs); it returns
text for the model, or raises ``ToolError`` with a message the model is shown instead.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from pipeline.context import Features, Principal

ToolFunction = Callable[[dict[str, Any], "ToolContext"], Awaitable[str]]


class ToolError(Exception):
    """A tool could not do what was asked; the message goes back to the model as the result."""


@dataclass(frozen=True)
class Tool:
    """A server-side tool. ``cache_ttl``: None when its result does not change with time (the
    answer may be cached as usual), else the seconds an answer that used it may be cached
    (0: never)."""

    name: str
    description: str
    parameters: dict[str, Any]
    function: ToolFunction
    timeout_s: float = 2.0
    max_concurrency: int = 16
    rate_per_second: float | None = None
    cache_ttl: int | None = None

    def definition(self) -> dict[str, Any]:
        """The OpenAI ``tools`` entry offered to the model."""
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": self.parameters,
            },
        }


async def _no_features() -> Features:
    return Features()


@dataclass
class ToolContext:
    """What a tool may use: whose request it is, and the request's features when known.

    ``features`` waits for the feature stage when it runs beside the tools."""

    principal: Principal
    features: Callable[[], Awaitable[Features]] = _no_features
    extras: dict[str, Any] = field(default_factory=dict)
    # The tenant index versions the request's tool searches used (the request's own set,
    # ``RequestContext.index_versions``): the cache store keeps no answer built from another
    # version than its key's.
    index_versions: set[str] = field(default_factory=set)
