"""Function calling against the real vLLM: calls of the client's functions come back in OpenAI's
shape, streamed and not; calls of server tools run and the model answers with their results."""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest

from app.main import create_app
from tests.app.test_chat import sse_events
from tests.conftest import chat_request, make_settings, unique_question
from tests.support.servers import LiveService

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 40}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
FORCE_WEATHER = {"type": "function", "function": {"name": "get_weather"}}


def body(question: str, **extra: Any) -> dict[str, Any]:
    return chat_request(question, **{"max_tokens": 48, "rag": {"enabled": False}, **extra})


@pytest.fixture
async def harness(make_app, redis_server, vllm):
    async with make_app(make_settings(redis_server.url, vllm.url)) as h:
        yield h


async def test_a_forced_client_function_comes_back_as_tool_calls(harness) -> None:
    key = await harness.key()
    question = f"What is the weather in Lisbon today? ({unique_question()[-10:]})"
    response = await harness.chat(key, body(question, tools=[WEATHER], tool_choice=FORCE_WEATHER))
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    message = choice["message"]
    assert message["content"] is None
    (call,) = message["tool_calls"]
    assert call["type"] == "function" and call["id"]
    assert call["function"]["name"] == "get_weather"
    # Structured output made the arguments follow the function's schema.
    arguments = json.loads(call["function"]["arguments"])
    assert set(arguments) == {"city"} and isinstance(arguments["city"], str)
    assert response.json()["rag"]["tools"] == [], "no server tool ran"


async def test_a_forced_client_function_streams_as_tool_call_deltas(harness) -> None:
    key = await harness.key()
    response = await harness.chat(
        key,
        body(unique_question(), tools=[WEATHER], tool_choice=FORCE_WEATHER, stream=True),
    )
    assert response.status_code == 200
    events = sse_events(response.text)
    assert events[-1] == "[DONE]"
    chunks = [e for e in events if isinstance(e, dict)]
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    calls = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    assert calls[0]["id"] and calls[0]["type"] == "function"
    assert calls[0]["function"]["name"] == "get_weather"
    assert all(c["index"] == 0 for c in calls)
    json.loads("".join(c["function"]["arguments"] for c in calls))
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert [f for f in finishes if f] == ["tool_calls"]


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
async def test_a_call_cut_short_by_max_tokens_ends_with_length(harness, stream: bool) -> None:
    # It ended with `tool_calls` (vLLM itself says `length`), so an agent loop took `{"ci` for
    # a whole call's arguments.
    key = await harness.key()
    request = body(
        unique_question(), tools=[WEATHER], tool_choice=FORCE_WEATHER, max_tokens=3, stream=stream
    )
    response = await harness.chat(key, request)
    assert response.status_code == 200, response.text
    if stream:
        chunks = [e for e in sse_events(response.text) if isinstance(e, dict)]
        finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
        assert [f for f in finishes if f] == ["length"]
    else:
        choice = response.json()["choices"][0]
        assert choice["finish_reason"] == "length"
        (call,) = choice["message"]["tool_calls"]
        with pytest.raises(json.JSONDecodeError):
            json.loads(call["function"]["arguments"])


def test_the_openai_sdk_reads_tool_calls_and_sends_the_result_back(redis_server, vllm) -> None:
    app = create_app(make_settings(redis_server.url, vllm.url))
    with LiveService(app) as live:
        key = live.run(app.state.services.keys.create("sdk-tools", "carol"))
        client = openai.OpenAI(base_url=f"{live.url}/v1", api_key=key, max_retries=0)
        messages: list[Any] = [{"role": "user", "content": "What is the weather in Porto?"}]
        first = client.chat.completions.create(
            model="smollm2",
            messages=messages,
            tools=[WEATHER],
            tool_choice=FORCE_WEATHER,
            max_tokens=48,
            temperature=0,
            extra_body={"rag": {"enabled": False}},
        )
        call = first.choices[0].message.tool_calls[0]
        assert first.choices[0].finish_reason == "tool_calls"
        messages += [
            first.choices[0].message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 23 degrees Celsius."},
        ]
        second = client.chat.completions.create(
            model="smollm2",
            messages=messages,
            tools=[WEATHER],
            max_tokens=48,
            temperature=0,
            extra_body={"rag": {"enabled": False}},
        )
        assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")
        assert second.usage.prompt_tokens > first.usage.prompt_tokens


async def test_a_forced_server_tool_runs_and_its_result_goes_back_to_the_model(
    make_app, redis_server, vllm
) -> None:
    """The mechanics, whatever the small model writes: it is made to call the calculator, the
    call runs on the server (under generate), and the second round reads the tool's result.
    (SmolLM2 writes "1234.5678" or "1234 * 5678 = 729056, ..." as the expression depending on
    the CPU's float path, so the test does not ask it for 7006652; the planned-tools tests
    check a calculator result reaching the prompt.)"""
    settings = make_settings(redis_server.url, vllm.url, telemetry={"capture_content": True})
    async with make_app(settings) as harness:
        key = await harness.key()
        harness.exporter.clear()
        request = body(
            "What is 1234 * 5678?",
            tool_choice={"type": "function", "function": {"name": "calculator"}},
            rag={"enabled": False, "plan_tools": False},
            max_tokens=64,
        )
        response = await harness.chat(key, request)
        assert response.status_code == 200, response.text
        answer = response.json()
        assert answer["choices"][0]["finish_reason"] in ("stop", "length")
        (run,) = answer["rag"]["tools"]
        assert run["name"] == "calculator" and run["status"] in ("ok", "refused", "error")
        spans = harness.exporter.get_finished_spans()
        rounds = sorted((s for s in spans if s.name == "chat smollm2"), key=lambda s: s.start_time)
        assert len(rounds) == 2, "one round for the call, one for the answer"
        tool_span = next(s for s in spans if s.name == "execute_tool calculator")
        generate = next(s for s in spans if s.name == "stage generate")
        assert tool_span.parent.span_id == generate.context.span_id
        assert tool_span.attributes["gen_ai.tool.name"] == "calculator"
        # The second round saw the tool's result.
        second_input = json.loads(rounds[1].attributes["gen_ai.input.messages"])
        assert second_input[-1]["role"] == "tool"
        assert second_input[-1]["content"][:100] == run["output"][:100]


async def test_a_server_tool_offered_and_streamed_shows_only_the_answer(harness) -> None:
    key = await harness.key()
    request = body(
        "What is 1234 * 5678?",
        tool_choice={"type": "function", "function": {"name": "calculator"}},
        rag={"enabled": False, "plan_tools": False},
        max_tokens=64,
        stream=True,
    )
    response = await harness.chat(key, request)
    events = [e for e in sse_events(response.text) if isinstance(e, dict)]
    deltas = [e["choices"][0]["delta"] for e in events if e.get("choices")]
    assert not any("tool_calls" in d for d in deltas), "server tool calls stay on the server"
    final = events[-1]
    assert final["choices"][0]["finish_reason"] in ("stop", "length")
    assert [t["name"] for t in final["rag"]["tools"]] == ["calculator"]
    assert "".join(d.get("content") or "" for d in deltas).strip(), "the model answered"
