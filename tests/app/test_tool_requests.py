"""Bad ``tools`` and ``tool_choice`` input: a clear 400 in OpenAI's shape, never a 5xx."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings

from tests.app.test_errors import BODY, assert_openai_error
from tests.conftest import make_settings
from tests.support.fuzzing import examples
from tests.support.strategies import json_values

# No model server is needed: every request here is refused before generation.
NO_LLM = "http://127.0.0.1:9"


def function(name: str = "get_weather", **extra: Any) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, **extra}}


@pytest.fixture
async def harness(make_app, redis_server):
    async with make_app(make_settings(redis_server.url, NO_LLM)) as h:
        yield h


@pytest.mark.parametrize(
    ("extra", "param", "code"),
    [
        (
            {"tools": [function(parameters={"type": "objekt"})]},
            "tools.0.function.parameters",
            None,
        ),
        ({"tools": [function(parameters={"properties": "nope"})]}, "tools.0.function", None),
        ({"tools": [function(), function()]}, "tools", None),
        ({"tools": [{"type": "retrieval"}]}, "tools.0.type", None),
        ({"tools": [function("x" * 65)]}, "tools.0.function.name", None),
        ({"tool_choice": "sometimes", "tools": [function()]}, "tool_choice", None),
        (
            {
                "tools": [function()],
                "tool_choice": {"type": "function", "function": {"name": "nope"}},
            },
            "tool_choice",
            "unknown_tool",
        ),
        ({"tool_choice": "required"}, "tool_choice", None),
        ({"rag": {"tools": ["no_such_server_tool"]}}, "rag.tools", "unknown_tool"),
        ({"rag": {"route": "huge"}}, "rag.route", "unknown_route"),
    ],
)
async def test_bad_tool_input_is_a_400_naming_the_field(harness, extra, param, code) -> None:
    key = await harness.key()
    response = await harness.chat(key, {**BODY, **extra})
    error = assert_openai_error(response, 400, "invalid_request_error")
    assert error["param"] is not None and error["param"].startswith(param), error
    if code is not None:
        assert error["code"] == code


JSON = json_values(
    text_size=8,
    key_size=6,
    list_size=3,
    dict_size=3,
    allow_nan=False,
    allow_infinity=False,
    max_leaves=12,
)


@settings(max_examples=examples(60), deadline=None, suppress_health_check=list(HealthCheck))
@given(tools=JSON, tool_choice=JSON, parameters=JSON)
# Found at random on a fresh clone: orjson could not encode the integer (a 500 then).
@example(tools=None, tool_choice=None, parameters={"type": "object", "maximum": 2**64})
@example(
    tools=[{"type": "function", "function": {"name": "f", "x": -(2**70)}}],
    tool_choice=0,
    parameters=0,
)
async def test_any_tools_value_gets_a_decision_not_a_5xx(
    harness, tools: Any, tool_choice: Any, parameters: Any
) -> None:
    key = await harness.key()
    for body in (
        {**BODY, "tools": tools, "tool_choice": tool_choice},
        {**BODY, "tools": [function(parameters=parameters)], "tool_choice": tool_choice},
    ):
        response = await harness.chat(key, body)
        # A body that passes every check reaches the (absent) model server: 503, not a 500.
        assert response.status_code in (400, 503), (body, response.text)
        assert "error" in response.json()
