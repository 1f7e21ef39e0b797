"""The server's tools by name, and the checking of the arguments a call of one brings.

Arguments come from a model (or the planner) as raw JSON text. They are parsed and validated
against the tool's JSON schema here, once, for every way a tool is called; whatever is wrong
(not JSON, not an object, a wrong type, a missing or unknown property) becomes a
``ToolArgumentsError`` whose message says what was expected, because it goes back to the model
as the tool's result and the model may try again.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any, Final

import orjson
from jsonschema import Draft202012Validator
from jsonschema.exceptions import SchemaError, best_match

from pipeline.tools.base import Tool, ToolError

MAX_ARGUMENT_CHARS: Final = 16_000
_SHOWN_CHARS: Final = 120


class ToolRefused(ToolError):
    """A call that may not run as asked (the invoker reports it with status ``refused``)."""


class ToolArgumentsError(ToolRefused):
    """The arguments of a call are not what the tool's schema asks for."""


class UnknownTool(ToolRefused):
    """A call names a tool this server does not have."""


def _json_kind(value: Any) -> str:
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "null" if value is None else type(value).__name__


def _shorten(text: str) -> str:
    return text if len(text) <= _SHOWN_CHARS else text[:_SHOWN_CHARS] + "…"


def expected_shape(schema: Mapping[str, Any]) -> str:
    """The properties a schema asks for, in a line a model can follow."""
    properties = schema.get("properties") or {}
    required = set(schema.get("required") or ())
    if not properties:
        return "{}"
    parts = []
    for name, spec in properties.items():
        kind = spec.get("type", "any") if isinstance(spec, Mapping) else "any"
        parts.append(f'"{name}": {kind}{"" if name in required else " (optional)"}')
    return "{" + ", ".join(parts) + "}"


class ToolRegistry:
    """The server-side tools by name, each with its compiled argument validator."""

    def __init__(self, tools: Iterable[Tool] = ()) -> None:
        self._tools: dict[str, Tool] = {}
        self._validators: dict[str, Draft202012Validator] = {}
        for tool in tools:
            self.add(tool)

    def add(self, tool: Tool) -> None:
        """Register ``tool``; a second tool of the same name or an invalid schema is refused."""
        if tool.name in self._tools:
            raise ValueError(f"two tools are named {tool.name!r}")
        if tool.parameters.get("type") != "object":
            raise ValueError(f"tool {tool.name!r}: its parameters schema must be an object")
        try:
            Draft202012Validator.check_schema(tool.parameters)
        except SchemaError as exc:
            raise ValueError(
                f"tool {tool.name!r}: invalid parameters schema: {exc.message}"
            ) from exc
        self._tools[tool.name] = tool
        self._validators[tool.name] = Draft202012Validator(tool.parameters)

    def get(self, name: str) -> Tool | None:
        return self._tools.get(name)

    def __contains__(self, name: object) -> bool:
        return name in self._tools

    def __iter__(self) -> Iterator[Tool]:
        return iter(self._tools.values())

    def __len__(self) -> int:
        return len(self._tools)

    @property
    def tools(self) -> dict[str, Tool]:
        """Name -> tool (a copy: what validation and generation are given as server tools)."""
        return dict(self._tools)

    def definitions(self, names: Iterable[str] | None = None) -> list[dict[str, Any]]:
        """The OpenAI ``tools`` entries of the named tools (all of them by default)."""
        chosen = self._tools if names is None else {n: self._tools[n] for n in names}
        return [tool.definition() for tool in chosen.values()]

    def lookup(self, name: str) -> Tool:
        """The tool called ``name``, or ``UnknownTool``. The error lists no tools: the registry
        holds every tenant's, and which ones a caller may see is the request's to say (the
        tool loop answers a call of a tool it did not offer with the tools it did)."""
        tool = self._tools.get(name)
        if tool is None:
            raise UnknownTool(f"There is no tool named '{_shorten(name)}'.")
        return tool

    def arguments(self, tool: Tool, raw: str) -> dict[str, Any]:
        """The call's arguments, parsed and checked against ``tool``'s schema."""
        if len(raw) > MAX_ARGUMENT_CHARS:
            raise ToolArgumentsError(
                f"Arguments for {tool.name} are too long ({len(raw)} characters; "
                f"at most {MAX_ARGUMENT_CHARS})."
            )
        # Models send "" for a call without arguments.
        text = raw.strip() or "{}"
        try:
            value = orjson.loads(text)
        except orjson.JSONDecodeError as exc:
            raise ToolArgumentsError(
                f"Arguments for {tool.name} are not valid JSON ({exc}). "
                f"Send a JSON object: {expected_shape(tool.parameters)}."
            ) from None
        if not isinstance(value, dict):
            raise ToolArgumentsError(
                f"Arguments for {tool.name} must be a JSON object, not {_json_kind(value)} "
                f"({_shorten(text)}). Send: {expected_shape(tool.parameters)}."
            )
        self._validate(tool, value)
        return value

    def _validate(self, tool: Tool, value: dict[str, Any]) -> None:
        validator = self._validators.get(tool.name) or Draft202012Validator(tool.parameters)
        try:
            error = best_match(validator.iter_errors(value))
        except RecursionError:
            raise ToolArgumentsError(f"Arguments for {tool.name} are nested too deeply.") from None
        if error is None:
            return
        where = "/".join(str(p) for p in error.absolute_path)
        raise ToolArgumentsError(
            f"Invalid arguments for {tool.name}"
            f"{f' at {where}' if where else ''}: {_shorten(error.message)}. "
            f"Expected: {expected_shape(tool.parameters)}."
        )
