"""/v1/jobs fenced per tenant and per user, through the app against a real Redis: unknown fields
refused, per-tenant limits answered with 429 and Retry-After (shared by replicas), a full queue
503, jobs visible to their own user (and to admin keys), and `rag keys revoke` settling the
revoked key's queued jobs."""

from __future__ import annotations

import asyncio
import subprocess
from typing import Any

import pytest

from tests.app.test_errors import assert_openai_error
from tests.app.test_jobs import auth, backlog, chat_body, submit, unreachable_llm
from tests.conftest import AppHarness, make_settings
from tests.support import cli


def limited_settings(redis_url: str, **jobs: Any) -> Any:
    return make_settings(redis_url, unreachable_llm(), jobs={"workers": 0, **jobs})


async def stored_jobs(h: AppHarness) -> int:
    prefix = h.services.settings.redis.key_prefix
    return len(await h.services.kv.client.keys(f"{prefix}{{jobs}}:job:*"))


UNKNOWN = [
    ("a typo of metadata", "metadta"),
    ("a field of vLLM's that OpenAI does not have", "top_k"),
    ("something else", "callback"),
    ("a long name", "x" * 200),
]


@pytest.mark.parametrize(("what", "field"), UNKNOWN, ids=[u[0] for u in UNKNOWN])
async def test_an_unknown_top_level_field_is_refused_naming_it_and_never_stored(
    make_app, redis_server, what: str, field: str
) -> None:
    async with make_app(limited_settings(redis_server.url)) as h:
        key = await h.key()
        response = await submit(h, key, {**chat_body(), field: {"url": "https://x.example"}})
        error = assert_openai_error(response, 400, "invalid_request_error")
        assert error["code"] == "unknown_parameter"
        assert error["param"] == field[:63] + ("…" if len(field) > 64 else "")
        assert field[:40] in error["message"]
        assert await backlog(h) == 0 and await stored_jobs(h) == 0
        nested = await submit(h, key, chat_body(rag={"top_k": 2, "extra": 1}))
        assert assert_openai_error(nested, 400, "invalid_request_error")["param"] == "rag.extra"


async def test_a_tenant_over_its_queued_limit_gets_429_with_retry_after(
    make_app, redis_server
) -> None:
    async with make_app(limited_settings(redis_server.url, max_queued_per_tenant=2)) as h:
        alice, bob, other = await h.key(), await h.key(user="bob"), await h.key("globex", "gus")
        ids = [(await submit(h, alice, chat_body(f"q{i}"))).json()["id"] for i in range(2)]
        refused = await submit(h, bob, chat_body("one more"))  # the limit is the tenant's
        error = assert_openai_error(refused, 429, "rate_limit_error")
        assert error["code"] == "too_many_queued_jobs"
        assert int(refused.headers["retry-after"]) >= 1
        assert (await submit(h, other, chat_body("theirs"))).status_code == 202
        cancelled = await h.client.delete(f"/v1/jobs/{ids[0]}", headers=auth(alice))
        assert cancelled.status_code == 200
        assert (await submit(h, bob, chat_body("room again"))).status_code == 202
        assert await stored_jobs(h) == 4, "the refused submit stored nothing"


async def test_a_tenant_submitting_too_fast_gets_429_on_every_replica(
    make_app, redis_server
) -> None:
    settings = limited_settings(redis_server.url, submit_rate_per_minute=1, submit_burst=3)
    async with make_app(settings) as one, make_app(settings) as two:
        key = await one.key()
        answers = [await submit(replica, key, chat_body()) for replica in (one, two, one)]
        assert [a.status_code for a in answers] == [202, 202, 202]
        for replica in (two, one):
            refused = await submit(replica, key, chat_body())
            error = assert_openai_error(refused, 429, "rate_limit_error")
            assert error["code"] == "rate_limit_exceeded"
            assert 1 <= int(refused.headers["retry-after"]) <= 60  # a token a minute
        bad = await submit(one, key, {"model": "smollm2"})  # refused bodies count too
        assert bad.status_code == 429
        assert (await submit(one, await one.key("globex"), chat_body())).status_code == 202
        assert await backlog(one) == 4


async def test_a_full_queue_is_503_with_retry_after(make_app, redis_server) -> None:
    async with make_app(limited_settings(redis_server.url, max_stream_length=2)) as h:
        key, other = await h.key(), await h.key("globex", "gus")
        for body in (chat_body("a"), chat_body("b")):
            assert (await submit(h, key, body)).status_code == 202
        full = await submit(h, other, chat_body("c"))
        assert assert_openai_error(full, 503, "service_unavailable")["code"] == "queue_full"
        assert int(full.headers["retry-after"]) >= 1
        assert await backlog(h) == 2


async def test_users_of_one_tenant_see_only_their_own_jobs_unless_admin(
    make_app, redis_server
) -> None:
    async with make_app(limited_settings(redis_server.url)) as h:
        alice, alice_again = await h.key(user="alice"), await h.key(user="alice")
        bob = await h.key(user="bob")
        admin = await h.key(user="ops", scopes="admin")
        alices = (await submit(h, alice, chat_body("alice's"))).json()["id"]
        bobs = (await submit(h, bob, chat_body("bob's"))).json()["id"]
        for method in ("GET", "DELETE"):
            response = await h.client.request(method, f"/v1/jobs/{alices}", headers=auth(bob))
            error = assert_openai_error(response, 404, "invalid_request_error")
            assert error["code"] == "job_not_found", "as if it did not exist"
        still = await h.client.get(f"/v1/jobs/{alices}", headers=auth(alice_again))
        assert still.json()["status"] == "queued", "bob's DELETE did nothing; alice's keys see it"

        async def listed(key: str, query: str = "") -> list[str]:
            response = await h.client.get(f"/v1/jobs{query}", headers=auth(key))
            assert response.status_code == 200, response.text
            return [job["id"] for job in response.json()["data"]]

        assert await listed(alice) == [alices] and await listed(bob) == [bobs]
        assert await listed(admin) == [], "an admin's own list holds its own jobs"
        assert await listed(admin, "?all_users=true") == [bobs, alices]
        refused = await h.client.get("/v1/jobs?all_users=true", headers=auth(bob))
        assert assert_openai_error(refused, 403, "permission_error")["param"] == "all_users"
        seen = await h.client.get(f"/v1/jobs/{bobs}", headers=auth(admin))
        assert seen.status_code == 200 and seen.json()["id"] == bobs
        cancelled = await h.client.delete(f"/v1/jobs/{bobs}", headers=auth(admin))
        assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"
        submitted = await submit(h, admin, chat_body("admin only"))
        assert_openai_error(submitted, 403, "permission_error")  # admin alone cannot submit
        outsider = await h.key("globex", "gus", scopes="chat,admin")
        foreign = await h.client.get(f"/v1/jobs/{alices}", headers=auth(outsider))
        assert_openai_error(foreign, 404, "invalid_request_error")  # admin of its tenant only
        assert await listed(outsider, "?all_users=true") == []


def rag(*args: str, h: AppHarness, redis_url: str) -> subprocess.CompletedProcess[str]:
    env = {
        "RAG_REDIS__URL": redis_url,
        "RAG_REDIS__KEY_PREFIX": h.services.settings.redis.key_prefix,
    }
    return cli.rag(*args, env=env, timeout=120)


async def test_rag_keys_revoke_settles_the_keys_queued_jobs(make_app, redis_server) -> None:
    settings = limited_settings(redis_server.url)
    async with make_app(settings) as h:
        created = await asyncio.to_thread(
            rag, "keys", "create", "--tenant", "acme", "--user", "alice", "--scopes", "chat",
            h=h, redis_url=redis_server.url,
        )  # fmt: skip
        assert created.returncode == 0, created.stderr
        key = created.stdout.strip()
        kept_key, admin = await h.key(user="alice"), await h.key(user="ops", scopes="admin")
        doomed = [(await submit(h, key, chat_body(f"q{i}"))).json()["id"] for i in range(2)]
        kept = (await submit(h, kept_key, chat_body("kept"))).json()["id"]
        revoked = await asyncio.to_thread(
            rag, "keys", "revoke", key, h=h, redis_url=redis_server.url
        )
        assert revoked.returncode == 0, revoked.stderr
        assert "2 queued job(s)" in revoked.stderr
        for job_id in doomed:
            job = (await h.client.get(f"/v1/jobs/{job_id}", headers=auth(admin))).json()
            assert (job["status"], job["attempts"]) == ("failed", 0)
            assert job["error"]["code"] == "key_revoked"
        job = (await h.client.get(f"/v1/jobs/{kept}", headers=auth(admin))).json()
        assert job["status"] == "queued", "another key of the same user is untouched"
        gone = await submit(h, key, chat_body("after"))
        assert_openai_error(gone, 401, "authentication_error")
