"""The model server's prefix cache is kept per tenant (vLLM's ``cache_salt``): a prompt one
tenant sent is not a cached prefix for another tenant's, which would answer it several times
sooner and tell that tenant what the other sent (a hostile review, 2026-12-05: a guessed secret
in a known template answered in 0.15 s against 1.5 s). Read from vLLM's own counter of prompt
tokens found in its prefix cache, not from timings."""

from __future__ import annotations

import re
import uuid
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from tests.conftest import AppHarness, make_settings
from tests.support.servers import RedisServer, VLLMServer

HITS = re.compile(rb"^vllm:prefix_cache_hits_total\{[^}]*\} ([0-9.e+]+)$", re.MULTILINE)
# vLLM caches whole blocks of 128 tokens: a prompt of several blocks.
BLOCK_TOKENS = 128


def prefix_hits(vllm: VLLMServer) -> float:
    found = HITS.search(httpx.get(f"{vllm.url}/metrics", timeout=10.0).content)
    assert found, "vLLM's /metrics has no vllm:prefix_cache_hits_total (is prefix caching on?)"
    return float(found.group(1))


def long_prompt() -> dict[str, Any]:
    """A prompt of about 600 tokens that no earlier request sent, retrieval off, answered in
    one token, past the response cache."""
    secret = uuid.uuid4().hex
    lines = [f"Line {n}: the merger codename is BLUE-HERON-{secret}." for n in range(40)]
    return {
        "model": "smollm2",
        "messages": [{"role": "user", "content": "\n".join(lines) + "\nRepeat the codename."}],
        "max_tokens": 1,
        "temperature": 0,
        "rag": {"enabled": False},
    }


async def cached_tokens(harness: AppHarness, vllm: VLLMServer, key: str, body: dict) -> float:
    """The prompt tokens vLLM found in its prefix cache for this request."""
    before = prefix_hits(vllm)
    answer = await harness.chat(key, body, **{"Cache-Control": "no-cache"})
    assert answer.status_code == 200, answer.text
    return prefix_hits(vllm) - before


@pytest.mark.parametrize("salt", ["tenant", "off"])
async def test_a_tenants_prompt_is_no_cached_prefix_for_another_tenant(
    make_app: Callable[..., Any], redis_server: RedisServer, vllm: VLLMServer, salt: str
) -> None:
    settings = make_settings(redis_server.url, vllm.url, llm={"prefix_cache_salt": salt})
    async with make_app(settings) as harness:
        victim = await harness.key(tenant="beta", user="carol")
        prober = await harness.key(tenant="acme", user="alice")
        colleague = await harness.key(tenant="beta", user="dave")
        body = long_prompt()
        await cached_tokens(harness, vllm, victim, body)
        across = await cached_tokens(harness, vllm, prober, body)
        within = await cached_tokens(harness, vllm, colleague, body)
    # The same tenant (with the same key groups) still shares it: sources reused across users.
    assert within >= 2 * BLOCK_TOKENS, f"{within} prompt tokens from the cache within a tenant"
    if salt == "tenant":
        assert across == 0, f"{across} prompt tokens of another tenant's prompt from the cache"
    else:  # one cache for all: the test can see a prefix cross tenants
        assert across >= 2 * BLOCK_TOKENS, f"{across} tokens from the cache with the salt off"


async def test_a_user_named_by_an_access_list_has_a_prefix_cache_of_its_own(
    make_app: Callable[..., Any], redis_server: RedisServer, vllm: VLLMServer
) -> None:
    """Within a tenant, callers whose access scopes differ (here a document listed for carol
    alone) share no cached prompt: carol's prompts may hold text dave may not read (a review,
    2026-12-05: salted by the key's groups only, dave timed carol's document). Callers of one
    scope (dave and erin, named by no list) still share."""
    settings = make_settings(redis_server.url, vllm.url)
    async with make_app(settings) as harness:
        carol = await harness.key(tenant="beta", user="carol", scopes="chat,ingest")
        dave = await harness.key(tenant="beta", user="dave")
        erin = await harness.key(tenant="beta", user="erin")
        listed = {
            "id": "merger",
            "text": "The merger's price is 4.2 billion.",
            "access": {"users": ["carol"]},
        }
        stored = await harness.client.post(
            "/v1/documents",
            json={"documents": [listed]},
            headers={"Authorization": f"Bearer {carol}"},
        )
        assert stored.status_code == 200, stored.text
        body = long_prompt()
        await cached_tokens(harness, vllm, carol, body)
        across = await cached_tokens(harness, vllm, dave, body)
        within = await cached_tokens(harness, vllm, erin, body)
    assert across == 0, f"{across} prompt tokens of another access scope's prompt from the cache"
    assert within >= 2 * BLOCK_TOKENS, f"{within} prompt tokens from the cache within a scope"
