"""Which tools a request offers the model: the client's functions plus the server tools it asks
for (``rag.tools``, or the one its ``tool_choice`` names), checked once, used by validation and
generation alike."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pipeline.context import ChatParams
from pipeline.errors import InvalidRequest
from pipeline.tools.base import Tool


def function_names(tools: list[dict[str, Any]]) -> list[str]:
    return [str((t.get("function") or {}).get("name", "")) for t in tools]


def forced_name(tool_choice: Any) -> str | None:
    """The function a ``tool_choice`` object names, if it names one."""
    if isinstance(tool_choice, dict):
        function = tool_choice.get("function")
        if isinstance(function, dict) and isinstance(function.get("name"), str):
            return str(function["name"])
    return None


def offered_tools(params: ChatParams, server_tools: Mapping[str, Tool]) -> dict[str, Any]:
    """``tools`` and ``tool_choice`` for the model (empty when nothing is offered), or a 400."""
    client = function_names(params.tools)
    clashes = sorted(set(client) & set(server_tools))
    if clashes:
        raise InvalidRequest(
            f"Function name(s) {', '.join(clashes)} are server tools here; rename yours.",
            param="tools",
            code="tool_name_conflict",
        )
    offered = list(dict.fromkeys(params.rag.tools))
    forced = forced_name(params.tool_choice)
    if forced is not None and forced in server_tools and forced not in offered:
        offered.append(forced)
    unknown = [name for name in offered if name not in server_tools]
    if unknown:
        raise InvalidRequest(
            f"Unknown server tool(s): {', '.join(unknown)}. "
            f"Available: {', '.join(sorted(server_tools)) or 'none'}.",
            param="rag.tools",
            code="unknown_tool",
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
        return {}
    options: dict[str, Any] = {"tools": definitions}
    if params.tool_choice is not None:
        options["tool_choice"] = params.tool_choice
    return options
