"""Which tools a request offers the model: the client's functions plus the server tools it asks
for (``rag.tools``, or the one its ``tool_choice`` names), checked once against what exists and
what the caller's tenant may use (``access``), used by validation and generation alike.

A server tool the tenant may not use is a 403 naming it; an unknown one a 400 that lists only
the tools the tenant may use. A client function may share a name with a server tool the tenant
cannot use (it stays the client's); with one it can use, it is a 400 (the model could not tell
them apart)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pipeline.context import ChatParams
from pipeline.errors import InvalidRequest, PermissionDenied
from pipeline.tools.access import ToolAccess
from pipeline.tools.base import Tool

_EVERY_TOOL = ToolAccess()


def function_names(tools: list[dict[str, Any]]) -> list[str]:
    return [str((t.get("function") or {}).get("name", "")) for t in tools]


def forced_name(tool_choice: Any) -> str | None:
    """The function a ``tool_choice`` object names, if it names one."""
    if isinstance(tool_choice, dict):
        function = tool_choice.get("function")
        if isinstance(function, dict) and isinstance(function.get("name"), str):
            return str(function["name"])
    return None


@dataclass(frozen=True)
class Offer:
    """``options``: ``tools`` and ``tool_choice`` for the model (empty when nothing is offered);
    ``server``: the server tools among them, the only ones a call of the model may run."""

    options: dict[str, Any]
    server: frozenset[str]


def offer(
    params: ChatParams,
    server_tools: Mapping[str, Tool],
    *,
    tenant: str = "",
    access: ToolAccess | None = None,
) -> Offer:
    """What the request offers the model, or a 400/403 saying what it may not offer."""
    access = access or _EVERY_TOOL
    usable = access.usable(tenant, sorted(server_tools))
    client = function_names(params.tools)
    clashes = sorted(set(client) & set(usable))
    if clashes:
        raise InvalidRequest(
            f"Function name(s) {', '.join(clashes)} are server tools here; rename yours.",
            param="tools",
            code="tool_name_conflict",
        )
    offered = list(dict.fromkeys(params.rag.tools))
    forced = forced_name(params.tool_choice)
    forced_server = forced is not None and forced not in client and forced in server_tools
    if forced_server and forced not in offered:
        offered.append(str(forced))
    unknown = [name for name in offered if name not in server_tools]
    if unknown:
        raise InvalidRequest(
            f"Unknown server tool(s): {', '.join(unknown)}. "
            f"Available: {', '.join(usable) or 'none'}.",
            param="rag.tools",
            code="unknown_tool",
        )
    refused = [name for name in offered if name not in usable]
    if refused:
        raise PermissionDenied(
            f"Server tool(s) {', '.join(refused)} may not be used by this API key's tenant.",
            param="rag.tools" if set(refused) & set(params.rag.tools) else "tool_choice",
            code="tool_not_allowed",
        )
    if forced is not None and forced not in client and forced not in offered:
        raise InvalidRequest(
            f"tool_choice names '{forced}', which is not among the offered tools.",
            param="tool_choice",
            code="unknown_tool",
        )
    definitions = [*params.tools, *(server_tools[name].definition() for name in offered)]
    if not definitions:
        if params.tool_choice not in (None, "none"):
            raise InvalidRequest(
                "tool_choice needs tools: send `tools` or offer server tools in rag.tools.",
                param="tool_choice",
            )
        return Offer({}, frozenset())
    options: dict[str, Any] = {"tools": definitions}
    if params.tool_choice is not None:
        options["tool_choice"] = params.tool_choice
    return Offer(options, frozenset(offered))


def offered_tools(
    params: ChatParams,
    server_tools: Mapping[str, Tool],
    *,
    tenant: str = "",
    access: ToolAccess | None = None,
) -> dict[str, Any]:
    """``tools`` and ``tool_choice`` for the model (empty when nothing is offered), or a 4xx."""
    return offer(params, server_tools, tenant=tenant, access=access).options
