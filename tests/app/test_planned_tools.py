"""Planned tools on the chat path, against the real vLLM and a real Redis: the calculator's
result in the prompt and in ``rag.tools``, the clock's answers never cached, the profile from
the feature store, and the HTTP tool settings."""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest
from pydantic import ValidationError

from app.services import build_http_tools
from app.settings import Settings, SettingsError
from pipeline.features.store import FeatureRow
from tests.conftest import AppHarness, chat_request, make_settings


def body(question: str, **extra: Any) -> dict[str, Any]:
    return chat_request(question, **{"max_tokens": 8, **extra})


def ref() -> str:
    return uuid.uuid4().hex[:6]


def system_prompt(harness: AppHarness) -> str:
    chat = next(s for s in harness.exporter.get_finished_spans() if s.name.startswith("chat"))
    messages = json.loads(chat.attributes["gen_ai.input.messages"])
    assert messages[0]["role"] == "system", messages
    return str(messages[0]["content"])


@pytest.fixture
async def harness(make_app, redis_server, vllm):
    settings = make_settings(redis_server.url, vllm.url, telemetry={"capture_content": True})
    async with make_app(settings) as h:
        yield h


async def test_the_calculator_result_reaches_the_prompt_and_rag_tools(harness) -> None:
    key = await harness.key()
    response = await harness.chat(key, body(f"What is 1234 * 5678? (ref {ref()})"))
    assert response.status_code == 200, response.text
    (tool,) = response.json()["rag"]["tools"]
    assert (tool["name"], tool["status"]) == ("calculator", "ok")
    assert tool["duration_ms"] >= 0
    # The product reaches the caller in rag.tools whatever the small model makes of it.
    assert tool["output"] == "1234 * 5678 = 7006652"
    assert "Tool results:\n[tool calculator] 1234 * 5678 = 7006652" in system_prompt(harness)
    spans = {s.name: s for s in harness.exporter.get_finished_spans()}
    run = spans["execute_tool calculator"]
    assert run.attributes["gen_ai.operation.name"] == "execute_tool"
    assert run.attributes["gen_ai.tool.call.result"] == "1234 * 5678 = 7006652"
    assert run.parent is not None and run.parent.span_id == spans["stage tools"].context.span_id


async def test_an_answer_that_used_the_clock_is_not_cached(harness) -> None:
    key = await harness.key()
    question = body(f"What time is it in Tokyo? (ref {ref()})")
    first = await harness.chat(key, question)
    second = await harness.chat(key, question)
    assert first.status_code == second.status_code == 200, first.text
    assert [t["name"] for t in first.json()["rag"]["tools"]] == ["clock"]
    assert "(time zone Asia/Tokyo, UTC+09:00)" in system_prompt(harness)
    assert (first.json()["rag"]["cache"], second.json()["rag"]["cache"]) == ("miss", "miss")
    # The same pair of requests with the calculator: the second is a hit (the cache works here).
    arithmetic = body(f"What is 6 * 7? (ref {ref()})")
    await harness.chat(key, arithmetic)
    again = await harness.chat(key, arithmetic)
    assert again.json()["rag"]["cache"] == "hit"
    assert [t["name"] for t in again.json()["rag"]["tools"]] == ["calculator"]


async def test_the_profile_tool_reads_the_callers_features(harness) -> None:
    assert harness.services.features is not None
    await harness.services.features.write_many([FeatureRow("acme", "pat", {"tier": "pro"})])
    response = await harness.chat(
        await harness.key(user="pat"), body(f"What is on my plan? (ref {ref()})")
    )
    assert response.status_code == 200, response.text
    assert [t["name"] for t in response.json()["rag"]["tools"]] == ["profile"]
    assert "- tier: pro" in system_prompt(harness)


async def test_plan_tools_false_runs_no_tool(harness) -> None:
    response = await harness.chat(
        await harness.key(),
        body(f"What is 1234 * 5678? (ref {ref()})", rag={"plan_tools": False, "explain": True}),
    )
    assert response.status_code == 200, response.text
    assert response.json()["rag"]["tools"] == []
    assert not any(s.name.startswith("execute_tool") for s in harness.exporter.get_finished_spans())


async def test_configured_http_tools_are_server_tools(make_app, redis_server, vllm) -> None:
    http = {"name": "weather", "description": "Weather", "url": "https://w.example/v1?city={city}"}
    settings = make_settings(redis_server.url, vllm.url, tools={"http": [http]})
    async with make_app(settings) as harness:
        tools = harness.services.server_tools
        assert {"calculator", "clock", "profile", "search_documents", "weather"} <= set(tools)
        assert tools["weather"].parameters["required"] == ["city"]


def test_http_tools_come_from_the_environment_and_bad_ones_are_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    tool = {"name": "w", "description": "d", "url": "https://w.example/v1/{q}"}
    monkeypatch.setenv("RAG_TOOLS__HTTP", json.dumps([tool]))
    assert [t.name for t in Settings().tools.http] == ["w"]
    # Settings parse them; building them (first thing at start-up) checks the allow-list.
    with pytest.raises(SettingsError, match=r"RAG_TOOLS__HTTP: tool w: .*off its allow-list"):
        build_http_tools(Settings(tools={"http": [{**tool, "allow": ["https://o.example/"]}]}))
    with pytest.raises(SettingsError, match="only http and https"):
        build_http_tools(Settings(tools={"http": [{**tool, "url": "file:///etc/{q}"}]}))
    with pytest.raises(ValidationError, match="same name"):
        Settings(tools={"http": [tool, tool]})
