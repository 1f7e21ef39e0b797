"""The planner on its labelled set, and the calls it plans."""

from __future__ import annotations

import json

import pytest

from pipeline.tools.calculator import calculate
from pipeline.tools.planner import ToolPlanner
from tests.pipeline.tools.planner_cases import CASES, Case

PLANNER = ToolPlanner({"calculator", "clock", "profile", "search_documents"})


def test_the_labelled_set_is_big_enough_and_mostly_negative() -> None:
    assert len(CASES) >= 30
    nothing = [c for c in CASES if c[1:] == (None, None, False)]
    assert len(nothing) >= 12


@pytest.mark.parametrize("case", CASES, ids=[c[0][:40] for c in CASES])
def test_the_planner_plans_what_the_request_plainly_needs(case: Case) -> None:
    text, value, zone, profile = case
    calls = PLANNER.plan(text)
    names = [call.name for call in calls]
    arguments = [json.loads(call.arguments) for call in calls]
    expected = (
        (["calculator"] if value is not None else [])
        + (["clock"] if zone is not None else [])
        + (["profile"] if profile else [])
    )
    assert names == expected, calls
    if value is not None:
        assert calculate(arguments[0]["expression"]) == pytest.approx(value)
    if zone is not None:
        clock = arguments[names.index("clock")]
        assert clock == ({"timezone": zone} if zone else {})


def test_planned_calls_are_valid_tool_calls_with_distinct_ids() -> None:
    calls = PLANNER.plan("what is 2 * 3 and 4 * 5, and what time is it in Tokyo? my plan?")
    assert [c.name for c in calls] == ["calculator", "calculator", "clock", "profile"]
    assert len({c.id for c in calls}) == 4
    assert all(isinstance(json.loads(c.arguments), dict) for c in calls)


def test_only_available_tools_are_planned() -> None:
    assert ToolPlanner({"clock"}).plan("What is 1234 * 5678? my profile") == []
    assert [c.name for c in ToolPlanner(set()).plan("what time is it in Tokyo?")] == []


def test_an_unknown_place_is_passed_on_for_the_clock_to_refuse() -> None:
    (call,) = PLANNER.plan("What time is it in Narnia?")
    assert json.loads(call.arguments) == {"timezone": "narnia"}


def test_at_most_three_expressions_are_planned() -> None:
    calls = PLANNER.plan("1 * 2, 3 * 4, 5 * 6, 7 * 8, 9 * 10")
    assert [json.loads(c.arguments)["expression"] for c in calls] == ["1 * 2", "3 * 4", "5 * 6"]
