"""The registry: tools by name, and the arguments a model sends checked against their schemas."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.tools.base import Tool, ToolContext
from pipeline.tools.registry import ToolArgumentsError, ToolRegistry, UnknownTool
from tests.support.fuzzing import examples
from tests.support.strategies import json_values

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "expression": {"type": "string", "maxLength": 50},
        "digits": {"type": "integer", "minimum": 0, "maximum": 10},
    },
    "required": ["expression"],
    "additionalProperties": False,
}


async def echo(arguments: dict[str, Any], context: ToolContext) -> str:
    return repr(arguments)


TOOL = Tool("calc", "test tool", SCHEMA, echo)


@pytest.fixture
def registry() -> ToolRegistry:
    return ToolRegistry([TOOL])


def test_valid_arguments_are_parsed(registry: ToolRegistry) -> None:
    assert registry.arguments(TOOL, '{"expression": "1+1", "digits": 2}') == {
        "expression": "1+1",
        "digits": 2,
    }


def test_empty_arguments_are_an_empty_object_and_then_checked(registry: ToolRegistry) -> None:
    no_args = Tool("now", "no arguments", {"type": "object", "properties": {}}, echo)
    registry.add(no_args)
    assert registry.arguments(no_args, "") == {}
    with pytest.raises(ToolArgumentsError, match="'expression' is a required property"):
        registry.arguments(TOOL, "  ")


def test_malformed_json_is_refused_with_the_expected_shape(registry: ToolRegistry) -> None:
    with pytest.raises(ToolArgumentsError) as info:
        registry.arguments(TOOL, '{"expression": "1+1"')
    message = str(info.value)
    assert "not valid JSON" in message
    assert '"expression": string' in message and '"digits": integer (optional)' in message


@pytest.mark.parametrize(
    ("raw", "kind"),
    [("1234", "a number"), ('"1234"', "a string"), ("[1, 2]", "an array"), ("null", "null")],
)
def test_a_non_object_is_refused_naming_what_came(
    registry: ToolRegistry, raw: str, kind: str
) -> None:
    # SmolLM2 has been seen sending "1234" for an object schema.
    with pytest.raises(ToolArgumentsError, match=f"must be a JSON object, not {kind}"):
        registry.arguments(TOOL, raw)


@pytest.mark.parametrize(
    ("raw", "says"),
    [
        ('{"expression": 1234}', "1234 is not of type 'string'"),
        ('{"expression": "1", "digits": "two"}', "at digits: 'two' is not of type 'integer'"),
        ('{"expression": "1", "digits": 99}', "at digits: 99 is greater than the maximum of 10"),
        ('{"expression": "1", "tenant": "other"}', "Additional properties are not allowed"),
        ("{}", "'expression' is a required property"),
    ],
)
def test_schema_violations_are_refused_saying_where(
    registry: ToolRegistry, raw: str, says: str
) -> None:
    with pytest.raises(ToolArgumentsError) as info:
        registry.arguments(TOOL, raw)
    assert says in str(info.value)
    assert str(info.value).startswith("Invalid arguments for calc")


def test_overlong_arguments_are_refused_before_parsing(registry: ToolRegistry) -> None:
    with pytest.raises(ToolArgumentsError, match="too long"):
        registry.arguments(TOOL, '{"expression": "' + "1" * 20_000 + '"}')


def test_deeply_nested_arguments_are_refused(registry: ToolRegistry) -> None:
    with pytest.raises(ToolArgumentsError):
        registry.arguments(TOOL, "[" * 5000 + "]" * 5000)


def test_unknown_names_are_refused_without_listing_every_tenants_tools(
    registry: ToolRegistry,
) -> None:
    with pytest.raises(UnknownTool, match=r"^There is no tool named 'rm_rf'\.$"):
        registry.lookup("rm_rf")
    assert registry.get("rm_rf") is None and "calc" in registry


def test_duplicate_names_and_invalid_schemas_are_refused(registry: ToolRegistry) -> None:
    with pytest.raises(ValueError, match="two tools are named 'calc'"):
        registry.add(TOOL)
    with pytest.raises(ValueError, match="invalid parameters schema"):
        registry.add(Tool("bad", "x", {"type": "object", "properties": {"a": {"type": 5}}}, echo))
    with pytest.raises(ValueError, match="must be an object"):
        registry.add(Tool("bad", "x", {"type": "string"}, echo))


def test_definitions_are_openai_function_entries(registry: ToolRegistry) -> None:
    (entry,) = registry.definitions()
    assert entry == {
        "type": "function",
        "function": {"name": "calc", "description": "test tool", "parameters": SCHEMA},
    }
    assert registry.tools == {"calc": TOOL}


JSON = json_values(allow_nan=False, max_leaves=20)


SHARED = ToolRegistry([TOOL])


@settings(max_examples=examples(200), deadline=None)
@given(st.text(max_size=200))
def test_any_text_is_parsed_or_refused_with_a_tool_error(text: str) -> None:
    try:
        result = SHARED.arguments(TOOL, text)
    except ToolArgumentsError as exc:
        assert str(exc)
    else:
        assert isinstance(result, dict) and isinstance(result["expression"], str)


@settings(max_examples=examples(200), deadline=None)
@given(JSON)
def test_any_json_value_is_accepted_only_when_it_fits_the_schema(value: Any) -> None:
    raw = json.dumps(value)
    fits = (
        isinstance(value, dict)
        and isinstance(value.get("expression"), str)
        and len(value["expression"]) <= 50
        and set(value) <= {"expression", "digits"}
        and (
            "digits" not in value
            or (
                isinstance(value["digits"], int | float)
                and not isinstance(value["digits"], bool)
                and float(value["digits"]).is_integer()
                and 0 <= value["digits"] <= 10
            )
        )
    )
    try:
        SHARED.arguments(TOOL, raw)
    except ToolArgumentsError:
        assert not fits, raw
    else:
        assert fits, raw
