"""OTLP export to a real receiver (oteltap, OTLP/HTTP protobuf), switched on by the env var."""

from __future__ import annotations

import asyncio

import pytest
from oteltap import OtelTapHttpProtobufReceiver, OtelTapHttpProtobufReceiverSettings

from tests.conftest import make_settings
from tests.support.servers import free_port


async def test_spans_reach_an_otlp_receiver_when_the_endpoint_is_set(
    make_app, redis_server, monkeypatch: pytest.MonkeyPatch
) -> None:
    port = free_port()
    receiver_settings = OtelTapHttpProtobufReceiverSettings(
        http_port=port,
        listen_on_all_interfaces=False,
        print_traces_as_ndjson=False,
        print_logs_as_ndjson=False,
        print_metrics_as_ndjson=False,
    )
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{port}")
    async with OtelTapHttpProtobufReceiver(receiver_settings) as receiver:
        seen = asyncio.ensure_future(
            receiver.await_trace(lambda s: s.name == "POST /v1/chat/completions", timeout=20)
        )
        auth = asyncio.ensure_future(
            receiver.await_trace(lambda s: s.name == "stage auth", timeout=20)
        )
        settings = make_settings(redis_server.url, "http://127.0.0.1:9")
        async with make_app(settings) as harness:
            key = await harness.key()
            response = await harness.chat(
                key, {"model": "no-such-model", "messages": [{"role": "user", "content": "x"}]}
            )
            assert response.status_code == 404
        # Leaving the app shuts the provider down, which flushes the batch exporter.
        root, stage = await seen, await auth
        assert root.trace_id.hex() == response.headers["x-trace-id"]
        assert stage.trace_id == root.trace_id
        assert stage.parent_span_id == root.span_id
