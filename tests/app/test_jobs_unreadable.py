"""/v1/jobs when a stored job cannot be read (damaged, or written by another version during a
rolling upgrade): its owner gets a 503 in OpenAI's shape, anyone else a 404, and listings leave
it out; never a 500."""

from __future__ import annotations

import uuid

import pytest

from app.stores import job_queue
from tests.app.test_errors import assert_openai_error
from tests.app.test_jobs import auth, chat_body, submit, unreachable_llm
from tests.conftest import AppHarness, make_settings


@pytest.fixture
async def app_without_workers(make_app, redis_server):
    settings = make_settings(redis_server.url, unreachable_llm(), jobs={"workers": 0})
    async with make_app(settings) as h:
        yield h


async def damaged_job(h: AppHarness, key: str, field: str, value: bytes | None) -> tuple[str, str]:
    """A good job and one whose ``field`` is overwritten with ``value`` (deleted for None)."""
    good = (await submit(h, key, chat_body("good"))).json()["id"]
    bad = (await submit(h, key, chat_body("bad"))).json()["id"]
    record = job_queue(h.services.settings, h.services.kv).job_prefix + bad
    if value is None:
        await h.services.kv.client.hdel(record, field)
    else:
        await h.services.kv.client.hset(record, field, value)
    return good, bad


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("created", b"abc"),
        ("status", b"\xff"),
        ("metadata", b"{x"),
        ("request", b"[1]"),
    ],
)
async def test_an_unreadable_job_is_a_503_for_its_owner_and_left_out_of_the_list(
    app_without_workers: AppHarness, field: str, value: bytes
) -> None:
    h = app_without_workers
    tenant = f"t{uuid.uuid4().hex[:8]}"
    key = await h.key(tenant)
    good, bad = await damaged_job(h, key, field, value)
    for method in ("GET", "DELETE"):
        response = await h.client.request(method, f"/v1/jobs/{bad}", headers=auth(key))
        error = assert_openai_error(response, 503, "service_unavailable")
        assert error["code"] == "job_unreadable" and bad in error["message"]
    listing = await h.client.get("/v1/jobs", headers=auth(key))
    assert listing.status_code == 200, listing.text
    assert [j["id"] for j in listing.json()["data"]] == [good]
    other = await h.key(f"o{uuid.uuid4().hex[:8]}")
    response = await h.client.get(f"/v1/jobs/{bad}", headers=auth(other))
    assert_openai_error(response, 404, "invalid_request_error")


async def replaced_by_a_string(h: AppHarness, key: str) -> tuple[str, str]:
    """A good job and one whose key now holds a string (another program's key, or damage)."""
    good = (await submit(h, key, chat_body("good"))).json()["id"]
    bad = (await submit(h, key, chat_body("bad"))).json()["id"]
    record = job_queue(h.services.settings, h.services.kv).job_prefix + bad
    await h.services.kv.client.delete(record)
    await h.services.kv.client.set(record, "not a hash")
    return good, bad


@pytest.mark.parametrize("damage", ["tenant-missing", "key-not-a-hash"])
async def test_a_job_record_that_names_no_owner_is_not_found_and_the_list_still_answers(
    app_without_workers: AppHarness, damage: str
) -> None:
    h = app_without_workers
    key = await h.key(f"t{uuid.uuid4().hex[:8]}")
    if damage == "tenant-missing":
        good, bad = await damaged_job(h, key, "tenant", None)
    else:
        good, bad = await replaced_by_a_string(h, key)
    other = await h.key(f"o{uuid.uuid4().hex[:8]}")
    for who in (key, other):
        for method in ("GET", "DELETE"):
            response = await h.client.request(method, f"/v1/jobs/{bad}", headers=auth(who))
            error = assert_openai_error(response, 404, "invalid_request_error")
            assert error["code"] == "job_not_found"
    listing = await h.client.get("/v1/jobs", headers=auth(key))
    assert listing.status_code == 200, listing.text
    assert [j["id"] for j in listing.json()["data"]] == [good]


async def test_a_page_of_only_unreadable_jobs_gives_a_last_id_to_go_on_from(
    app_without_workers: AppHarness,
) -> None:
    h = app_without_workers
    key = await h.key(f"t{uuid.uuid4().hex[:8]}")
    good, bad = await damaged_job(h, key, "created", b"abc")
    page = await h.client.get("/v1/jobs?limit=1", headers=auth(key))
    assert page.status_code == 200, page.text
    assert page.json()["data"] == [] and page.json()["has_more"]
    assert page.json()["last_id"] == bad
    rest = await h.client.get(f"/v1/jobs?limit=1&after={bad}", headers=auth(key))
    assert [j["id"] for j in rest.json()["data"]] == [good]
