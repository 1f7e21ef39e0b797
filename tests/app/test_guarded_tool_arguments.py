"""Against the real vLLM: PII the model writes into a tool call's arguments is redacted before
it leaves the service, to the client (streamed or not) or to a server tool (an HTTP tool whose
local server records what it was sent), and the arguments stay valid JSON. The model's own
output, on the ``chat`` span (content capture on), shows it did write the address."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, ClassVar
from urllib.parse import parse_qs, urlsplit

import pytest

from tests.app.test_chat import sse_events
from tests.conftest import AppHarness, chat_request, make_settings

ADDRESS = "jane.doe@example.com"
PROMPT = f"Subscribe the address {ADDRESS} to the newsletter."


def function(name: str, email: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": "Subscribe an e-mail address to the newsletter.",
            "parameters": {
                "type": "object",
                "properties": {"email": email},
                "required": ["email"],
                "additionalProperties": False,
            },
        },
    }


# The pattern makes structured output write the address whatever the small model would prefer.
# The address itself in the schema (an enum, say) would be redacted by guard_in, as in the
# prompt: the model would never see it. Spelled as groups it is not found, so the model writes it.
SUBSCRIBE = function(
    "subscribe", {"type": "string", "pattern": "^(jane)[.](doe)(@)(example)[.](com)$"}
)
FORCE = {"type": "function", "function": {"name": "subscribe"}}


def model_output(harness: AppHarness) -> str:
    rounds = [s for s in harness.exporter.get_finished_spans() if s.name.startswith("chat ")]
    return " ".join(str(s.attributes.get("gen_ai.output.messages", "")) for s in rounds)


@pytest.fixture
async def harness(make_app, redis_server, vllm):
    settings = make_settings(redis_server.url, vllm.url, telemetry={"capture_content": True})
    async with make_app(settings) as h:
        yield h


def body(**extra: Any) -> dict[str, Any]:
    return chat_request(PROMPT, **{"max_tokens": 48, "rag": {"enabled": False}, **extra})


async def test_pii_in_a_forced_client_call_is_redacted_and_the_json_stays_valid(harness) -> None:
    key = await harness.key()
    response = await harness.chat(key, body(tools=[SUBSCRIBE], tool_choice=FORCE))
    assert response.status_code == 200, response.text
    assert ADDRESS in model_output(harness), "the model wrote the address"
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    (call,) = choice["message"]["tool_calls"]
    assert json.loads(call["function"]["arguments"]) == {"email": "[EMAIL]"}
    assert "jane.doe" not in response.text


async def test_pii_in_streamed_call_arguments_is_redacted_and_the_json_stays_valid(
    harness,
) -> None:
    key = await harness.key()
    response = await harness.chat(key, body(tools=[SUBSCRIBE], tool_choice=FORCE, stream=True))
    assert response.status_code == 200
    assert ADDRESS in model_output(harness)
    chunks = [e for e in sse_events(response.text) if isinstance(e, dict) and e.get("choices")]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    arguments = "".join(
        d["tool_calls"][0]["function"].get("arguments", "") for d in deltas if "tool_calls" in d
    )
    assert json.loads(arguments) == {"email": "[EMAIL]"}
    assert "jane.doe" not in response.text
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "tool_calls"


async def test_a_blocked_term_in_call_arguments_ends_the_answer_with_content_filter(
    make_app, redis_server, vllm
) -> None:
    # An output term (a blocked PII kind would refuse the prompt itself, at guard_in).
    settings = make_settings(
        redis_server.url,
        vllm.url,
        guard={"policy": json.dumps({"*": {"blocked_output_terms": ["example.com"]}})},
    )
    async with make_app(settings) as harness:
        key = await harness.key()
        response = await harness.chat(key, body(tools=[SUBSCRIBE], tool_choice=FORCE))
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        assert choice["finish_reason"] == "content_filter"
        assert "jane.doe" not in response.text and "example.com" not in response.text


class Directory(BaseHTTPRequestHandler):
    """The third party an HTTP tool would send the arguments to: records each query."""

    seen: ClassVar[list[str]] = []

    def do_GET(self) -> None:
        self.seen += parse_qs(urlsplit(self.path).query).get("email", [])
        payload = b"subscribed"
        self.send_response(200)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def directory() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), Directory)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


async def test_a_server_tool_gets_redacted_arguments(
    make_app, redis_server, vllm, directory
) -> None:
    # The prompt names no address (guard_in would redact it before the model saw it); the
    # schema leaves the model the address or the token, which the tool's check must accept.
    email = {"type": "string", "enum": [ADDRESS, "[EMAIL]"]}
    tool = {
        "name": "newsletter",
        "description": "Subscribe an e-mail address to the newsletter.",
        "url": directory + "/subscribe?email={email}",
        "allow_private": True,  # the local server; its tenant opts in below
        "parameters": function("x", email)["function"]["parameters"],
    }
    settings = make_settings(
        redis_server.url,
        vllm.url,
        telemetry={"capture_content": True},
        tools={"http": [tool], "tenants": {"acme": {"allow": ["*"], "private_network": True}}},
    )
    async with make_app(settings) as harness:
        key = await harness.key()
        before = len(Directory.seen)
        forced = {"type": "function", "function": {"name": "newsletter"}}
        request = chat_request(
            "Subscribe Jane Doe (jane dot doe, example) to the newsletter.",
            max_tokens=48,
            tool_choice=forced,
            rag={"enabled": False, "plan_tools": False},
        )
        response = await harness.chat(key, request)
        assert response.status_code == 200, response.text
        assert ADDRESS in model_output(harness), "the model wrote the address"
        assert Directory.seen[before:] == ["[EMAIL]"], "the tool got the redacted address"
        assert [(t["name"], t["status"]) for t in response.json()["rag"]["tools"]] == [
            ("newsletter", "ok")
        ]
        span = next(
            s for s in harness.exporter.get_finished_spans() if s.name == "execute_tool newsletter"
        )
        assert json.loads(span.attributes["gen_ai.tool.call.arguments"]) == {"email": "[EMAIL]"}
