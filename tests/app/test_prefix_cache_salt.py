"""The model server's prefix cache is kept per tenant (vLLM's ``cache_salt``): a prompt one
tenant sent is not a cached prefix for another tenant's, which would answer it several times
sooner and tell that tenant what the other sent (a hostile review, 2026-12-05: a guessed secret
in a known template answered in 0.15 s against 1.5 s). Read from vLLM's own counter of prompt
tokens found in its prefix cache, not from timings. And the grammars it compiles from JSON
schemas: each tenant's schema reaches it salted, checked with the real grammar compiler."""

from __future__ import annotations

import itertools
import json
import os
import re
import subprocess
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from pipeline.model.salt import salted_schema
from tests.conftest import AppHarness, make_settings
from tests.support.servers import RedisServer, VLLMServer

RAG_HOME = Path(os.environ.get("RAG_HOME", Path.home() / ".cache" / "rag"))
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


# The model server's other cache keyed by what callers send: the grammar compiled from each
# JSON schema (xgrammar's cache, keyed by the schema's text). A schema another tenant sent
# compiled in 0.02 ms against 6 ms (BENCHMARKS.md): it is salted as the prompt is.
BIRD = {
    "type": "object",
    "properties": {"species": {"type": "string", "maxLength": 30}, "alpine": {"type": "boolean"}},
    "required": ["species", "alpine"],
    "additionalProperties": False,
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "bird", "schema": BIRD}}
XGRAMMAR_CHECK = """
import glob, json, sys
import xgrammar as xgr
from transformers import AutoTokenizer
model = sorted(glob.glob(sys.argv[1] + "/models/smollm2-135m-instruct-*"))[-1]
info = xgr.TokenizerInfo.from_huggingface(AutoTokenizer.from_pretrained(model))
compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=True)
sizes, grammars = [compiler.get_cache_size_bytes()], []
for schema in json.loads(sys.argv[2]):
    grammars.append(str(compiler.compile_json_schema(json.dumps(schema)).grammar))
    sizes.append(compiler.get_cache_size_bytes())
print(json.dumps({"sizes": sizes, "same_grammar": [g == grammars[0] for g in grammars]}))
"""


async def test_a_tenants_json_schema_reaches_the_model_server_salted_and_still_holds(
    make_app: Callable[..., Any],
    redis_server: RedisServer,
    vllm: VLLMServer,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    settings = make_settings(redis_server.url, vllm.url)
    async with make_app(settings) as harness:
        sent: list[dict[str, Any]] = []
        stream = harness.services.chat.stream

        def recorded(route: Any, request: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
            sent.append(request)
            return stream(route, request, *args, **kwargs)

        monkeypatch.setattr(harness.services.chat, "stream", recorded)
        body = {
            "model": "smollm2",
            "messages": [{"role": "user", "content": "Which parrot lives in the Alps of NZ?"}],
            "max_tokens": 40,
            "temperature": 0,
            "rag": {"enabled": False},
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "b", "schema": BIRD},
            },
        }
        for tenant in ("acme", "beta", "acme"):
            key = await harness.key(tenant=tenant)
            answer = await harness.chat(key, body, **{"Cache-Control": "no-cache"})
            assert answer.status_code == 200, answer.text
            parsed = json.loads(answer.json()["choices"][0]["message"]["content"])
            assert set(parsed) == {"species", "alpine"} and isinstance(parsed["alpine"], bool)
    schemas = [r["response_format"]["json_schema"]["schema"] for r in sent]
    assert [{k: v for k, v in s.items() if k != "$comment"} for s in schemas] == [BIRD] * 3
    comments = [s["$comment"] for s in schemas]
    assert comments[0] == comments[2] != comments[1], "one key for a tenant, another for the next"
    assert all(sent[i]["cache_salt"] in comments[i] for i in range(3)), "the prompt's salt"


def test_a_salted_schema_compiles_to_the_same_grammar_under_a_key_of_its_own() -> None:
    """With the real grammar compiler vLLM runs (xgrammar, in vLLM's venv): the cache grows for
    each salt, not for a salt seen before, and every salted schema's grammar is the caller's."""
    salted = [
        salted_schema({"cache_salt": salt, "response_format": FORMAT})["response_format"]
        for salt in ("a" * 64, "b" * 64, "a" * 64)
    ]
    schemas = [BIRD, *(f["json_schema"]["schema"] for f in salted)]
    vllm_python = RAG_HOME / "venv-vllm" / "bin" / "python"
    assert vllm_python.exists(), f"no vLLM venv at {vllm_python}: run `make vllm`"
    done = subprocess.run(
        [str(vllm_python), "-c", XGRAMMAR_CHECK, str(RAG_HOME), json.dumps(schemas)],
        capture_output=True,
        timeout=300,
        check=True,
    )
    found = json.loads(done.stdout.splitlines()[-1])
    assert found["same_grammar"] == [True] * 4, "the salt constrains nothing"
    sizes = found["sizes"]
    grew = [b > a for a, b in itertools.pairwise(sizes)]
    assert grew == [True, True, True, False], f"a key of each salt's own, kept: {sizes}"
