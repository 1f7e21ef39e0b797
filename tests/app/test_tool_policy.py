"""Tools fenced per tenant: the settings say which server tools each tenant may use (checked at
start-up), a request offering another is a 403 naming it, HTTP tools that reach private
networks are opt-in, and the unknown-tool error lists only the tenant's tools."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from app.settings import Settings, ToolSettings
from pipeline.context import ChatParams, RagOptions
from pipeline.tools.access import TenantTools, ToolAccess
from pipeline.tools.offer import offer
from pipeline.tools.planner import ToolPlanner
from tests.app.test_errors import BODY, assert_openai_error
from tests.conftest import make_settings

NO_LLM = "http://127.0.0.1:9"  # every request here is refused before generation
INTERNAL = {
    "name": "inventory",
    "description": "Stock levels from the warehouse service inside the network.",
    "url": "http://10.1.2.3:8080/stock/{sku}",
    "allow_private": True,
}
TENANTS = {
    "*": {"allow": ["calculator", "clock", "inventory"]},
    "ops": {"allow": ["*"], "private_network": True},
}


@pytest.fixture
async def harness(make_app, redis_server):
    settings = make_settings(
        redis_server.url, NO_LLM, tools={"http": [INTERNAL], "tenants": TENANTS}
    )
    async with make_app(settings) as h:
        yield h


def offering(*names: str, forced: str | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {**BODY, "rag": {"enabled": False, "tools": list(names)}}
    if forced is not None:
        body["tool_choice"] = {"type": "function", "function": {"name": forced}}
    return body


async def test_a_tool_the_tenant_may_not_use_is_a_403_naming_it(harness) -> None:
    key = await harness.key(tenant="acme")
    error = assert_openai_error(
        await harness.chat(key, offering("calculator", "profile")), 403, "permission_error"
    )
    assert (error["code"], error["param"]) == ("tool_not_allowed", "rag.tools")
    assert "profile" in error["message"] and "calculator" not in error["message"]
    forced = await harness.chat(key, offering(forced="profile"))
    assert assert_openai_error(forced, 403, "permission_error")["param"] == "tool_choice"


async def test_a_private_network_tool_needs_the_tenants_opt_in(harness) -> None:
    # "inventory" is allowed by name for every tenant, but reaches a private address.
    key = await harness.key(tenant="acme")
    error = assert_openai_error(
        await harness.chat(key, offering("inventory")), 403, "permission_error"
    )
    assert "inventory" in error["message"]
    assert not harness.services.tool_access.allows("acme", "inventory")
    assert harness.services.tool_access.allows("ops", "inventory")


async def test_the_unknown_tool_error_lists_only_the_tenants_tools(harness) -> None:
    key = await harness.key(tenant="acme")
    error = assert_openai_error(
        await harness.chat(key, offering("no_such_tool")), 400, "invalid_request_error"
    )
    assert error["code"] == "unknown_tool"
    assert error["message"].endswith("Available: calculator, clock.")
    for hidden in ("profile", "search_documents", "inventory"):
        assert hidden not in error["message"]


async def test_a_client_function_may_share_a_name_only_with_tools_the_tenant_cannot_use(
    harness,
) -> None:
    key = await harness.key(tenant="acme")
    own = {"type": "function", "function": {"name": "profile", "parameters": {"type": "object"}}}
    clash = {"type": "function", "function": {"name": "clock", "parameters": {"type": "object"}}}
    refused = await harness.chat(key, {**BODY, "tools": [clash]})
    assert assert_openai_error(refused, 400, "invalid_request_error")["code"] == (
        "tool_name_conflict"
    )
    # "profile" is not acme's: the name stays the client's (the call would go back to it).
    services = harness.services
    params = ChatParams(model="smollm2", messages=[], tools=[own], rag=RagOptions(enabled=False))
    result = offer(params, services.server_tools, tenant="acme", access=services.tool_access)
    assert result.server == frozenset() and result.options["tools"] == [own]


def test_the_planner_plans_only_tools_the_tenant_may_use() -> None:
    planner = ToolPlanner(["calculator", "clock", "profile"])
    access = ToolAccess({"*": TenantTools(frozenset({"clock"}))})
    text = "What is 1234 * 5678, what time is it, and what is my plan?"
    assert [c.name for c in planner.plan(text)] == ["calculator", "clock", "profile"]
    allowed = access.usable("acme", planner.available)
    assert [c.name for c in planner.plan(text, allowed)] == ["clock"]


@pytest.mark.parametrize(
    "tenants, problem",
    [
        ({"*": {"allow": ["calculater"]}}, "allows tools that do not exist: calculater"),
        ({"acme": {"allow": ["*"], "private": True}}, "Extra inputs are not permitted"),
        ({"acme": {"allow": ["no way"]}}, "String should match pattern"),
    ],
)
def test_a_tool_policy_naming_unknown_tools_or_keys_is_refused_at_start_up(
    tenants: dict[str, Any], problem: str
) -> None:
    with pytest.raises(ValidationError, match=problem):
        ToolSettings(tenants=tenants)


def test_the_tool_policy_is_read_from_the_environment(monkeypatch) -> None:
    monkeypatch.setenv("RAG_TOOLS__TENANTS", '{"*": {"allow": ["clock"]}}')
    settings = Settings(environment="test")
    assert settings.tools.tenants["*"].allow == ["clock"]
    assert settings.tools.tenants["*"].private_network is False
