"""How a failure goes on a span: a ``Described`` one by type and message, without formatting
its stack; a fault in the code with its stack; a cancellation not at all."""

from __future__ import annotations

import asyncio

import pytest

from pipeline.errors import InvalidRequest
from pipeline.telemetry.spans import current_span


def test_a_described_failure_is_recorded_without_its_stack(tracing) -> None:
    provider, exporter = tracing
    with (
        pytest.raises(InvalidRequest),
        current_span(provider.get_tracer("t"), "retrieval acme"),
    ):
        raise InvalidRequest("Invalid filters: year must be a number", param="filters")
    (span,) = exporter.get_finished_spans()
    assert span.status.status_code.name == "ERROR"
    assert span.attributes["error.type"] == "InvalidRequest"
    (event,) = span.events
    assert dict(event.attributes) == {
        "exception.type": "pipeline.errors.InvalidRequest",
        "exception.message": "Invalid filters: year must be a number",
    }


def test_a_fault_in_the_code_is_recorded_with_its_stack(tracing) -> None:
    provider, exporter = tracing
    with pytest.raises(KeyError), current_span(provider.get_tracer("t"), "ingest acme"):
        {}["missing"]
    (span,) = exporter.get_finished_spans()
    assert span.status.status_code.name == "ERROR"
    (event,) = span.events
    assert event.attributes["exception.type"] == "KeyError"
    assert "Traceback" in event.attributes["exception.stacktrace"]
    assert (
        "test_a_fault_in_the_code_is_recorded_with_its_stack"
        in (event.attributes["exception.stacktrace"])
    )


def test_a_cancellation_is_not_a_failure(tracing) -> None:
    provider, exporter = tracing

    async def main() -> None:
        async def work() -> None:
            with current_span(provider.get_tracer("t"), "group a+b"):
                await asyncio.sleep(10)

        task = asyncio.create_task(work())
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    (span,) = exporter.get_finished_spans()
    assert span.status.status_code.name == "UNSET" and not span.events
