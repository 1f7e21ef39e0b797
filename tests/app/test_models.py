"""GET /v1/models: OpenAI's list shape, every name a request may use, each saying what it is."""

from __future__ import annotations

from typing import Any

from tests.app.test_errors import assert_openai_error
from tests.conftest import AppHarness, make_settings
from tests.support.servers import free_port


async def models(h: AppHarness, path: str = "/v1/models") -> Any:
    key = await h.key()
    return await h.client.get(path, headers={"Authorization": f"Bearer {key}"})


def nowhere() -> str:
    return f"http://127.0.0.1:{free_port()}"


async def test_the_default_routes_are_listed_as_routes_beside_the_model_they_serve(
    make_app, redis_server
) -> None:
    async with make_app(make_settings(redis_server.url, nowhere())) as h:
        response = await models(h)
        one = await models(h, "/v1/models/large")
        accepted = h.services.routes
    assert response.status_code == 200
    body = response.json()
    assert set(body) == {"object", "data"} and body["object"] == "list"
    listed = {m["id"]: m for m in body["data"]}
    assert [m["id"] for m in body["data"]] == ["auto", "large", "small", "smollm2"]
    assert {name: m["rag"] for name, m in listed.items()} == {
        "auto": {"kind": "router", "routes": ["large", "small"]},
        "large": {"kind": "route", "model": "smollm2"},
        "small": {"kind": "route", "model": "smollm2"},
        "smollm2": {"kind": "model", "routes": ["large", "small"]},
    }
    for entry in body["data"]:
        assert set(entry) == {"id", "object", "created", "owned_by", "rag"}
        assert (entry["object"], entry["owned_by"]) == ("model", "rag-pipeline")
        assert isinstance(entry["created"], int)
        assert accepted.candidates(entry["id"]), "every listed name is accepted in `model`"
    assert one.json() == listed["large"], "one model reads as it is listed"


async def test_configured_routes_list_each_route_and_each_served_model(
    make_app, redis_server
) -> None:
    routes = {
        "fast": {"base_url": nowhere(), "model": "smollm2"},
        "deep": {"base_url": nowhere(), "model": "qwen2.5-7b"},
        "cheap": {"base_url": nowhere(), "model": "smollm2"},
    }
    settings = make_settings(
        redis_server.url,
        nowhere(),
        routing={
            "routes": routes,
            "default": "fast",
            "small_route": "cheap",
            "large_route": "deep",
        },
    )
    async with make_app(settings) as h:
        body = (await models(h)).json()
        missing = await models(h, "/v1/models/gpt-9")
    assert {m["id"]: m["rag"] for m in body["data"]} == {
        "auto": {"kind": "router", "routes": ["cheap", "deep", "fast"]},
        "cheap": {"kind": "route", "model": "smollm2"},
        "deep": {"kind": "route", "model": "qwen2.5-7b"},
        "fast": {"kind": "route", "model": "smollm2"},
        "qwen2.5-7b": {"kind": "model", "routes": ["deep"]},
        "smollm2": {"kind": "model", "routes": ["cheap", "fast"]},
    }
    assert assert_openai_error(missing, 404, "invalid_request_error")["code"] == "model_not_found"
