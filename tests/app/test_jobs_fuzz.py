"""/v1/jobs with generated input: never a 5xx, errors in OpenAI's shape, a job queued exactly
when the answer is a 202, an unknown top-level field always refused by name (never stored), and
any listing query answered in shape."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from app.main import create_app
from app.routes.jobs import JobRequest
from app.stores import job_queue
from tests.conftest import AppHarness, make_settings
from tests.support.fuzzing import examples
from tests.support.servers import free_port
from tests.support.strategies import json_values

JSON = json_values(
    text_size=20,
    key_size=10,
    list_size=4,
    dict_size=4,
    allow_nan=False,
    allow_infinity=False,
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
KNOWN = frozenset(JobRequest.model_fields)
UNKNOWN_OR_UNUSABLE = frozenset(
    {
        "unknown_parameter",
        "integer_out_of_range",
        "number_out_of_range",
        "too_deep",
        "invalid_string",
    }
)
EXTRA = st.dictionaries(
    st.sampled_from(["metadta", "response_format", "", "Model", "webhook"]) | st.text(max_size=12),
    JSON,
    max_size=2,
)
BODIES = (
    st.builds(
        lambda known, extra: {**extra, **known}, st.fixed_dictionaries({}, optional=FIELDS), EXTRA
    )
    | JSON
)


@pytest.fixture(scope="module")
async def fuzzed(redis_server, shared_embedder) -> AsyncIterator[tuple[AppHarness, str, str]]:
    """The app, a key of alice's, and an admin key of the same tenant."""
    config = make_settings(
        redis_server.url,
        f"http://127.0.0.1:{free_port()}",
        jobs={"workers": 0, "submit_rate_per_minute": 1e6, "submit_burst": 10**6},
    )
    app = create_app(config, embedder=shared_embedder)
    async with app.router.lifespan_context(app):
        harness = AppHarness(app, exporter=None)  # type: ignore[arg-type]
        key = await harness.key()
        admin = await harness.key(user="ops", scopes="chat,admin")
        try:
            yield harness, key, admin
        finally:
            await harness.client.aclose()


@settings(
    max_examples=examples(200),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(body=BODIES)
# Found by reading: a job record is written with orjson, which refuses integers past 64 bits.
@example(body={"model": "smollm2", "messages": [{"role": "user", "content": "hi"}], "seed": 2**70})
@example(body={"model": "smollm2", "messages": [], "metadta": {"a": 1}})
async def test_generated_job_bodies_never_get_a_5xx(
    fuzzed: tuple[AppHarness, str, str], body: Any
) -> None:
    harness, key, _ = fuzzed
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
    unknown = sorted(set(body) - KNOWN) if isinstance(body, dict) else []
    if unknown:  # refused by name, unless a value nothing can use is refused first
        assert response.status_code == 400 and error["code"] in UNKNOWN_OR_UNUSABLE, response.text
        if error["code"] == "unknown_parameter":
            shown = {name[:63] + ("…" if len(name) > 64 else "") for name in unknown}
            assert error["param"] in shown


QUERY = st.dictionaries(
    st.sampled_from(["limit", "after", "all_users", "x"]),
    st.sampled_from(["1", "0", "101", "true", "false", "yes", "job_" + "0" * 24, ""])
    | st.text(max_size=70),
    max_size=3,
)


@settings(
    max_examples=examples(100),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(query=QUERY, admin=st.booleans())
async def test_generated_listing_queries_never_get_a_5xx(
    fuzzed: tuple[AppHarness, str, str], query: dict[str, str], admin: bool
) -> None:
    harness, alice, ops = fuzzed
    key = ops if admin else alice
    response = await harness.client.get(
        "/v1/jobs", params=query, headers={"Authorization": f"Bearer {key}"}
    )
    assert response.status_code in (200, 400, 403), (query, response.text)
    body = response.json()
    if response.status_code == 200:
        assert body["object"] == "list" and isinstance(body["data"], list)
    else:
        assert set(body["error"]) == {"message", "type", "param", "code"}
