"""POST /v1/jobs with generated bodies: never a 5xx, errors in OpenAI's shape, and a job queued
exactly when the answer is a 202."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from app.jobs import job_queue
from app.main import create_app
from tests.conftest import AppHarness, make_settings
from tests.support.servers import free_port

JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4)
    ),
    max_leaves=12,
)
MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "tool", "robot"]) | JSON},
    optional={"content": st.text(max_size=40) | JSON, "name": JSON},
)
URL = (
    st.sampled_from(
        [
            "https://hooks.example.com/x",
            "https://10.0.0.1/",
            "http://127.0.0.1:1/",
            "https://[::1]/",
            "https://localhost/",
            "https://169.254.169.254/",
            "https://exa mple.com",
            "https://user:pw@example.com/",
            "https://[zz::1]/",
            "https://example.com:0/",
        ]
    )
    | st.text(max_size=30)
    | JSON
)
FIELDS = {
    "model": st.sampled_from(["smollm2", "", "gpt-9"]) | JSON,
    "messages": st.lists(MESSAGE, max_size=3) | JSON,
    "max_tokens": st.integers(-5, 5000) | JSON,
    "temperature": st.floats(-1, 3) | JSON,
    "stream": st.booleans() | JSON,
    "n": st.integers(-1, 3),
    "stop": JSON,
    "tools": JSON,
    "tool_choice": JSON,
    "rag": st.fixed_dictionaries({}, optional={"top_k": JSON, "filters": JSON, "route": JSON})
    | JSON,
    "webhook_url": URL,
    "metadata": st.dictionaries(st.text(max_size=70), st.text(max_size=30), max_size=18) | JSON,
}
BODIES = st.fixed_dictionaries({}, optional=FIELDS) | JSON


@pytest.fixture(scope="module")
async def fuzzed(redis_server, shared_embedder) -> AsyncIterator[tuple[AppHarness, str]]:
    config = make_settings(redis_server.url, f"http://127.0.0.1:{free_port()}", jobs={"workers": 0})
    app = create_app(config, embedder=shared_embedder)
    async with app.router.lifespan_context(app):
        harness = AppHarness(app, exporter=None)  # type: ignore[arg-type]
        key = await harness.key()
        try:
            yield harness, key
        finally:
            await harness.client.aclose()


@settings(
    max_examples=200,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(body=BODIES)
async def test_generated_job_bodies_never_get_a_5xx(
    fuzzed: tuple[AppHarness, str], body: Any
) -> None:
    harness, key = fuzzed
    queue = job_queue(harness.services.settings, harness.services.kv)
    before = await queue.backlog()
    response: httpx.Response = await harness.client.post(
        "/v1/jobs", json=body, headers={"Authorization": f"Bearer {key}"}
    )
    assert response.status_code < 500, (body, response.text)
    queued = await queue.backlog() - before
    if response.status_code == 202:
        assert queued == 1
    else:
        assert 400 <= response.status_code < 500
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"]
        assert queued == 0, "a refused job is never queued"
