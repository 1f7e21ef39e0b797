"""Bad input and failing dependencies: always a 4xx/5xx in OpenAI's error shape, never a hang."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator

import httpx
import pytest

from pipeline.model.client import LLMClient
from tests.conftest import make_settings
from tests.support.servers import free_port

BODY = {"model": "smollm2", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def assert_openai_error(response: httpx.Response, status: int, error_type: str) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["type"] == error_type
    assert body["error"]["message"]
    return body["error"]


@pytest.fixture
async def harness(make_app, redis_server):
    # No vLLM behind this one: the tests here never get as far as generating.
    settings = make_settings(redis_server.url, f"http://127.0.0.1:{free_port()}")
    async with make_app(settings) as h:
        yield h


async def test_missing_key_is_401(harness) -> None:
    response = await harness.chat(None, BODY)
    assert_openai_error(response, 401, "authentication_error")


async def test_wrong_key_is_401(harness) -> None:
    response = await harness.chat("rag-nope.not-a-key", BODY)
    error = assert_openai_error(response, 401, "authentication_error")
    assert error["code"] == "invalid_api_key"


async def test_key_without_chat_scope_is_403(harness) -> None:
    key = await harness.key(scopes="retrieve")
    response = await harness.chat(key, BODY)
    assert_openai_error(response, 403, "permission_error")


async def test_models_lists_the_served_model_and_needs_a_key(harness) -> None:
    assert (await harness.client.get("/v1/models")).status_code == 401
    key = await harness.key()
    response = await harness.client.get("/v1/models", headers={"Authorization": f"Bearer {key}"})
    assert response.status_code == 200
    # The served model, its routes, and "auto" (the router chooses).
    assert [m["id"] for m in response.json()["data"]] == ["auto", "large", "small", "smollm2"]
    missing = await harness.client.get(
        "/v1/models/gpt-9", headers={"Authorization": f"Bearer {key}"}
    )
    assert assert_openai_error(missing, 404, "invalid_request_error")["code"] == "model_not_found"


async def test_unknown_model_is_404_model_not_found(harness) -> None:
    key = await harness.key()
    response = await harness.chat(key, {**BODY, "model": "gpt-9"})
    error = assert_openai_error(response, 404, "invalid_request_error")
    assert error["code"] == "model_not_found"
    assert error["param"] == "model"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": "smollm2"}, "messages"),
        ({"model": "smollm2", "messages": []}, "messages"),
        ({"model": "smollm2", "messages": "hello"}, "messages"),
        ({"model": "smollm2", "messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
        ({"model": 7, "messages": [{"role": "user", "content": "x"}]}, "model"),
        ({**BODY, "temperature": "hot"}, "temperature"),
        ({**BODY, "max_tokens": -1}, "max_tokens"),
        ({**BODY, "n": 3}, "n"),
        ({**BODY, "stream": "yes please"}, "stream"),
        ({**BODY, "rag": {"top_k": 0}}, "rag.top_k"),
        ({**BODY, "rag": {"explian": True}}, "rag.explian"),
        (
            {**BODY, "tools": [{"type": "function", "function": {"name": "bad name"}}]},
            "tools.0.function.name",
        ),
    ],
)
async def test_invalid_bodies_are_400_naming_the_field(harness, body, param) -> None:
    key = await harness.key()
    response = await harness.chat(key, body)
    error = assert_openai_error(response, 400, "invalid_request_error")
    assert error["param"] == param


async def test_malformed_json_is_400(harness) -> None:
    key = await harness.key()
    response = await harness.client.post(
        "/v1/chat/completions",
        content=b'{"model": "smollm2", "messages": [',
        headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
    )
    assert assert_openai_error(response, 400, "invalid_request_error")["code"] == "invalid_json"


async def test_max_tokens_beyond_the_context_is_400(harness) -> None:
    key = await harness.key()
    response = await harness.chat(key, {**BODY, "max_tokens": 100_000})
    error = assert_openai_error(response, 400, "invalid_request_error")
    assert error["code"] == "context_length_exceeded"


async def test_body_over_the_limit_is_413(make_app, redis_server) -> None:
    settings = make_settings(
        redis_server.url, "http://127.0.0.1:9", server={"max_body_bytes": 2000}
    )
    async with make_app(settings) as harness:
        key = await harness.key()
        big = {**BODY, "messages": [{"role": "user", "content": "x" * 5000}]}
        response = await harness.chat(key, big)
        assert_openai_error(response, 413, "invalid_request_error")

        async def chunks() -> AsyncIterator[bytes]:
            # No content-length: the limit must hold on the bytes actually received.
            yield b'{"model": "smollm2", "messages": [{"role": "user", "content": "'
            for _ in range(10):
                yield b"y" * 500
            yield b'"}]}'

        streamed = await harness.client.post(
            "/v1/chat/completions",
            content=chunks(),
            headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
        )
        assert_openai_error(streamed, 413, "invalid_request_error")
        # Both branches (a declared length, bytes counted as they come) give the same error.
        assert streamed.json() == response.json()
        assert response.json()["error"]["code"] == "request_too_large"


async def test_unknown_path_is_404_in_openai_shape_for_a_caller_with_a_key(harness) -> None:
    key = await harness.key()
    response = await harness.client.get(
        "/v1/nothing-here", headers={"Authorization": f"Bearer {key}"}
    )
    assert_openai_error(response, 404, "invalid_request_error")
    assert_openai_error(await harness.client.get("/nothing-here"), 404, "invalid_request_error")
    # Without a key, every API path is a 401: what exists is not told to strangers.
    assert_openai_error(await harness.client.get("/v1/nothing-here"), 401, "authentication_error")


async def test_llm_unreachable_is_503_quickly(harness) -> None:
    key = await harness.key()
    started = time.monotonic()
    response = await harness.chat(key, BODY)
    # Refused connections answer in milliseconds; a service that waited for the model server
    # would give a 504 at the 60 s deadline. 15 s tells them apart on a loaded machine.
    assert time.monotonic() - started < 15.0
    assert assert_openai_error(response, 503, "service_unavailable")["code"] == (
        "upstream_unavailable"
    )


@pytest.fixture
async def silent_upstream() -> AsyncIterator[str]:
    """A real TCP server that accepts the request and never answers: a hung model server."""

    async def hold(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(65536)
        await asyncio.sleep(30)
        writer.close()

    server = await asyncio.start_server(hold, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    yield f"http://127.0.0.1:{port}"
    server.close()


async def test_llm_slower_than_the_deadline_is_504(make_app, redis_server, silent_upstream) -> None:
    settings = make_settings(
        redis_server.url, silent_upstream, server={"request_timeout_seconds": 1.0}
    )
    async with make_app(settings) as harness:
        key = await harness.key()
        started = time.monotonic()
        response = await harness.chat(key, BODY)
        # About the 1 s deadline; without it, the silent upstream's 30 s (or the 60 s default).
        assert time.monotonic() - started < 10.0
        assert_openai_error(response, 504, "timeout")


async def test_llm_read_timeout_is_504(make_app, redis_server, silent_upstream) -> None:
    settings = make_settings(redis_server.url, silent_upstream, llm={"read_timeout_seconds": 0.5})
    async with make_app(settings) as harness:
        key = await harness.key()
        response = await harness.chat(key, BODY)
        assert_openai_error(response, 504, "timeout")


async def test_llm_failing_with_500_is_502() -> None:
    transport = httpx.MockTransport(
        lambda request: httpx.Response(500, json={"error": {"message": "engine died"}})
    )
    client = LLMClient("http://llm", transport=transport)
    from pipeline.errors import UpstreamError

    with pytest.raises(UpstreamError, match="engine died"):
        async for _ in client.stream_chat({"model": "m", "messages": []}):
            pass
    await client.aclose()


@pytest.fixture
async def breaking_upstream() -> AsyncIterator[str]:
    """A real TCP server that starts a streamed answer, then drops the connection."""

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(65536)
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
            b"transfer-encoding: chunked\r\n\r\n"
        )
        for word in (b"Half", b" an"):
            event = b'data: {"choices": [{"index": 0, "delta": {"content": "' + word + b'"}}]}\n\n'
            writer.write(f"{len(event):x}\r\n".encode() + event + b"\r\n")
            await writer.drain()
        writer.close()  # no terminating chunk: the peer vanished mid-answer

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    server.close()


async def test_upstream_dropping_mid_stream_ends_the_stream_with_an_error_and_caches_nothing(
    make_app, redis_server, breaking_upstream
) -> None:
    async with make_app(make_settings(redis_server.url, breaking_upstream)) as harness:
        key = await harness.key()
        streamed = await harness.chat(key, {**BODY, "stream": True})
        assert streamed.status_code == 200
        events = [line[6:] for line in streamed.text.splitlines() if line.startswith("data: ")]
        assert "[DONE]" not in events
        text = "".join(
            json.loads(e)["choices"][0]["delta"].get("content") or ""
            for e in events
            if e.startswith('{"id"') and json.loads(e)["choices"]
        )
        # What came before the break reaches the client (the output guard lets out what it
        # held back), then the error.
        assert text == "Half an", streamed.text
        assert events[-1].startswith('{"error"')
        assert '"code":"upstream_failed"' in events[-1]
        plain = await harness.chat(key, BODY)
        # A cached half answer would come back as a 200 hit; it must fail upstream again.
        assert_openai_error(plain, 502, "api_error")


async def test_openai_fields_are_taken_and_unknown_ones_are_refused_by_name(harness) -> None:
    key = await harness.key()
    openai_fields = {
        **BODY,
        "logprobs": False,
        "response_format": {"type": "text"},
        "parallel_tool_calls": False,
        "metadata": {"trace": "abc"},
        "service_tier": "auto",
    }
    response = await harness.chat(key, openai_fields)
    # Past validation, auth and the cache: it fails only because no model server runs here.
    assert_openai_error(response, 503, "service_unavailable")
    # A field OpenAI does not have is refused as OpenAI refuses it (see test_openai_compat).
    unknown = await harness.chat(key, {**openai_fields, "a_field_from_the_future": {"x": 1}})
    error = assert_openai_error(unknown, 400, "invalid_request_error")
    assert (error["param"], error["code"]) == ("a_field_from_the_future", "unknown_parameter")
