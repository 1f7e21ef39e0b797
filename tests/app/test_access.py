"""Documents only some users may see, through the API: two users of one tenant, one of them in
the group a document is restricted to; the other never gets it through /v1/retrieve, chat's
sources, a cache hit or a job; re-ingest changes who sees it at the next request; another
tenant with the same group names sees nothing of the first. Real Redis, the real embedding
model and the dev vLLM."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from app.stores import job_queue
from pipeline.context import ChatParams, Principal, RequestContext, StageRecord, _current_record
from pipeline.jobs.model import Job
from pipeline.model.salt import MemoScope
from pipeline.sources.search import viewer_of
from pipeline.stages.cache import cache_key, searched_the_keyed_version
from pipeline.stages.retrieve import Retrieve
from pipeline.stages.tools import features_when_ready
from pipeline.telemetry import attributes as attr
from pipeline.tools.base import ToolContext
from pipeline.tools.builtins import search_tool
from retrieval.access import AccessColumns, AccessList
from tests.app.test_errors import assert_openai_error
from tests.app.test_jobs import finished, submit
from tests.conftest import AppHarness, chat_request, make_settings
from tests.support.servers import free_port

SECRET_ID = "merger-memo"
SECRET = {
    "id": SECRET_ID,
    "title": "Project Nightingale",
    "text": "Project Nightingale merger terms: Acme Corporation buys Globex for 3 billion "
    "dollars in cash, closing in the second quarter.",
    "access": {"groups": ["finance"]},
}
PUBLIC = [
    {
        "id": "canteen",
        "title": "Canteen",
        "text": "The canteen serves lunch from noon to two; the merger of the two cafeterias "
        "into one canteen finished last year.",
    },
    {
        "id": "parking",
        "title": "Parking",
        "text": "Staff parking is on level two of the garage; visitors park on level one.",
    },
]
QUESTION = "What are the Project Nightingale merger terms for Acme and Globex?"


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def key(h: AppHarness, tenant: str, user: str, groups: tuple[str, ...] = ()) -> str:
    scopes = frozenset({"chat", "retrieve", "ingest"})
    return await h.services.keys.create(tenant, user, scopes, groups=frozenset(groups))


async def ingest(h: AppHarness, key_: str, documents: list[dict[str, Any]]) -> dict[str, Any]:
    response = await h.client.post(
        "/v1/documents", json={"documents": documents}, headers=auth(key_)
    )
    assert response.status_code == 200, response.text
    return response.json()


async def retrieved(h: AppHarness, key_: str, query: str = QUESTION) -> dict[str, Any]:
    response = await h.client.post(
        "/v1/retrieve", json={"query": query, "top_k": 10, "min_relevance": 0}, headers=auth(key_)
    )
    assert response.status_code == 200, response.text
    return response.json()


def ids(found: dict[str, Any]) -> set[str]:
    return {hit["document_id"] for hit in found["data"]}


def sources(answer: dict[str, Any]) -> set[str]:
    return {s["document_id"] for s in answer["rag"]["sources"]}


def ask(question: str = QUESTION) -> dict[str, Any]:
    # The gate off (min_relevance 0), so what reaches the prompt is what the search returned.
    return chat_request(question, max_tokens=6, rag={"top_k": 5, "min_relevance": 0})


@pytest.fixture
async def offline(make_app, redis_server):
    """No vLLM behind it: /v1/documents and /v1/retrieve only."""
    settings = make_settings(redis_server.url, f"http://127.0.0.1:{free_port()}")
    async with make_app(settings) as h:
        yield h


@pytest.fixture
async def live(make_app, redis_server, vllm):
    """Chat and one job worker against the dev vLLM. Features off, so users of a tenant share
    cache entries unless their access differs (the key then tells them apart)."""
    settings = make_settings(
        redis_server.url,
        vllm.url,
        features={"enabled": False},
        jobs={"workers": 1, "poll_seconds": 0.2},
    )
    async with make_app(settings) as h:
        yield h


async def test_retrieve_gives_a_restricted_document_only_to_its_group(offline) -> None:
    ann = await key(offline, "acme", "ann", ("finance",))
    bob = await key(offline, "acme", "bob", ("sales",))
    await ingest(offline, ann, [SECRET, *PUBLIC])
    offline.exporter.clear()
    for_bob = await retrieved(offline, bob)
    assert SECRET_ID not in ids(for_bob) and ids(for_bob), "bob still gets the public documents"
    # Nothing counts the hidden chunk: not the response, not the span.
    assert for_bob["allowed"] == len(PUBLIC)
    spans = [s for s in offline.exporter.get_finished_spans() if s.name.startswith("retrieval")]
    assert [s.attributes[attr.RETRIEVAL_ALLOWED] for s in spans] == [len(PUBLIC)]
    for_ann = await retrieved(offline, ann)
    assert SECRET_ID in ids(for_ann) and for_ann["allowed"] == len(PUBLIC) + 1


async def test_users_named_on_the_list_see_it_and_no_one_else(offline) -> None:
    ann = await key(offline, "acme", "ann")
    bob = await key(offline, "acme", "bob")
    await ingest(offline, ann, [{**SECRET, "access": {"users": ["bob"]}}, *PUBLIC])
    assert SECRET_ID in ids(await retrieved(offline, bob))
    assert SECRET_ID not in ids(await retrieved(offline, ann)), "the uploader is not on the list"


async def test_another_tenant_with_the_same_group_names_sees_nothing(offline) -> None:
    ann = await key(offline, "acme", "ann", ("finance",))
    await ingest(offline, ann, [SECRET, *PUBLIC])
    stranger = await key(offline, "globex", "ann", ("finance",))
    found = await retrieved(offline, stranger)
    assert found["data"] == [] and found["allowed"] == 0
    await ingest(offline, stranger, [{"id": "own", "text": "Globex own merger notes."}])
    assert ids(await retrieved(offline, stranger)) == {"own"}


async def test_re_ingest_changes_who_sees_it_at_the_next_request(offline) -> None:
    ann = await key(offline, "acme", "ann", ("finance",))
    bob = await key(offline, "acme", "bob")
    await ingest(offline, ann, [SECRET, *PUBLIC])
    assert SECRET_ID not in ids(await retrieved(offline, bob))
    opened = {k: v for k, v in SECRET.items() if k != "access"}
    await ingest(offline, ann, [opened])
    assert SECRET_ID in ids(await retrieved(offline, bob))
    await ingest(offline, ann, [{**SECRET, "access": {"users": ["ann"]}}])
    assert SECRET_ID not in ids(await retrieved(offline, bob))
    assert SECRET_ID in ids(await retrieved(offline, ann))


async def test_a_keys_new_groups_apply_at_its_next_request(offline) -> None:
    ann = await key(offline, "acme", "ann", ("finance",))
    await ingest(offline, ann, [SECRET, *PUBLIC])
    assert SECRET_ID in ids(await retrieved(offline, ann))  # the principal is cached now
    changed = await offline.services.keys.set_groups(ann, frozenset({"sales"}))
    assert changed is not None and changed.groups == {"sales"}
    assert SECRET_ID not in ids(await retrieved(offline, ann))
    await offline.services.keys.set_groups(ann, frozenset({"sales", "finance"}))
    assert SECRET_ID in ids(await retrieved(offline, ann))


@pytest.mark.parametrize(
    ("access", "param"),
    [
        ({"groups": ["fin ance"]}, "documents"),
        ({"groups": "finance"}, "documents"),
        ({"groups": ["a,b"]}, "documents"),
        ({"groups": [], "users": []}, "documents.0"),
        ({"roles": ["x"]}, "documents"),
        ({"users": ["x" * 65]}, "documents"),
        ({"groups": [f"g{i}" for i in range(33)]}, "documents"),
        ([], "documents"),
    ],
)
async def test_a_bad_access_list_is_a_400_naming_the_document(offline, access, param) -> None:
    ann = await key(offline, "acme", "ann")
    response = await offline.client.post(
        "/v1/documents", json={"documents": [{**SECRET, "access": access}]}, headers=auth(ann)
    )
    error = assert_openai_error(response, 400, "invalid_request_error")
    assert (error["param"] or "").startswith(param)
    assert (await retrieved(offline, ann))["data"] == [], "nothing of the request was stored"


JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 5) | st.text(max_size=70),
    lambda inner: (
        st.lists(inner, max_size=36)
        | st.dictionaries(st.sampled_from(["groups", "users", "roles"]), inner, max_size=3)
    ),
    max_leaves=50,
)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(access=JSON)
async def test_any_access_value_is_stored_or_a_4xx_in_openais_shape(offline, access) -> None:
    ann = await key(offline, "fuzz", "ann")
    document = {"id": "d", "text": "Some text about parking.", "access": access}
    response = await offline.client.post(
        "/v1/documents", json={"documents": [document]}, headers=auth(ann)
    )
    if response.status_code != 200:
        assert_openai_error(response, 400, "invalid_request_error")


async def test_chat_cache_and_jobs_never_give_bob_the_restricted_document(live) -> None:
    ann = await key(live, "acme", "ann", ("finance",))
    dora = await key(live, "acme", "dora", ("finance", "unrelated"))
    bob = await key(live, "acme", "bob")
    await ingest(live, ann, [SECRET, *PUBLIC])

    first = await live.chat(ann, ask())
    assert first.status_code == 200, first.text
    assert first.headers["x-cache"] == "miss" and SECRET_ID in sources(first.json())
    # Same scope (the group that some list names): the answer is shared.
    shared = await live.chat(dora, ask())
    assert shared.headers["x-cache"] == "hit" and SECRET_ID in sources(shared.json())
    # Bob asks the same question after them: no hit, and his sources lack the document.
    bobs = await live.chat(bob, ask())
    assert bobs.status_code == 200, bobs.text
    assert bobs.headers["x-cache"] == "miss"
    assert SECRET_ID not in sources(bobs.json()) and sources(bobs.json())
    again = await live.chat(bob, ask())
    assert again.headers["x-cache"] == "hit" and SECRET_ID not in sources(again.json())

    # Jobs run with the groups of the key that submitted them.
    question = QUESTION + " Answer briefly."
    for who, sees in ((ann, True), (bob, False)):
        submitted = await submit(live, who, ask(question))
        assert submitted.status_code == 202, submitted.text
        job = await finished(live, who, submitted.json()["id"])
        assert job["status"] == "succeeded", job
        assert (SECRET_ID in sources(job["result"])) is sees


async def test_a_job_keeps_the_groups_it_was_submitted_with(live) -> None:
    ann = await key(live, "acme", "ann", ("finance",))
    await ingest(live, ann, [SECRET, *PUBLIC])
    submitted = await submit(live, ann, ask(QUESTION + " In one word."))
    assert submitted.status_code == 202, submitted.text
    job_id = submitted.json()["id"]
    stored = await job_queue(live.services.settings, live.services.kv).get(job_id)
    assert stored is not None and stored.principal().groups == {"finance"}
    job = await finished(live, ann, job_id)
    assert job["status"] == "succeeded", job
    assert SECRET_ID in sources(job["result"])
    assert "result_withheld" not in job
    # Its answer is not for a reader who could not have seen what it was built from: ann's
    # other key without the group, or an admin of the tenant (another user).
    anns_other = await key(live, "acme", "ann")
    admin = await live.services.keys.create("acme", "root", frozenset({"admin"}))
    for reader in (anns_other, admin):
        read = await live.client.get(f"/v1/jobs/{job_id}", headers=auth(reader))
        assert read.status_code == 200, read.text
        assert read.json()["result"] is None and read.json()["result_withheld"] is True
        assert read.json()["status"] == "succeeded"
    listed = await live.client.get("/v1/jobs?all_users=true", headers=auth(admin))
    assert [j["result"] for j in listed.json()["data"] if j["id"] == job_id] == [None]
    # A job stored before groups existed runs with none: it sees only tenant-wide documents.
    fields = stored.to_hash()
    del fields["groups"]
    assert Job.from_hash({k.encode(): v.encode() for k, v in fields.items()}).groups == set()


async def test_a_third_tenant_with_the_same_groups_gets_no_cache_hit_and_no_sources(live) -> None:
    ann = await key(live, "acme", "ann", ("finance",))
    await ingest(live, ann, [SECRET, *PUBLIC])
    first = await live.chat(ann, ask(QUESTION + " Tenant check."))
    assert SECRET_ID in sources(first.json())
    stranger = await key(live, "globex", "ann", ("finance",))
    theirs = await live.chat(stranger, ask(QUESTION + " Tenant check."))
    assert theirs.status_code == 200, theirs.text
    assert theirs.headers["x-cache"] == "miss" and sources(theirs.json()) == set()


def test_the_cache_key_holds_the_access_scope_and_nothing_more() -> None:
    params = ChatParams(model="smollm2", messages=[{"role": "user", "content": QUESTION}])
    ann = Principal("acme", "ann", frozenset({"chat"}), "k1", groups=frozenset({"finance"}))
    dora = Principal("acme", "dora", frozenset({"chat"}), "k2", groups=frozenset({"finance", "x"}))
    bob = Principal("acme", "bob", frozenset({"chat"}), "k3")
    columns = AccessColumns([None, AccessList(groups=frozenset({"finance"}))])

    def key_of(principal: Principal, access: AccessColumns | None = columns) -> str:
        scope = access.scope(viewer_of(principal)) if access is not None else None
        return cache_key(params, principal, "v1", access=scope)

    assert key_of(ann) == key_of(dora), "same visible chunks: one entry"
    assert key_of(ann) != key_of(bob)
    unrestricted = AccessColumns([None, None])
    assert key_of(ann, unrestricted) == key_of(bob, unrestricted) == key_of(bob, None)
    personal = AccessColumns([None, AccessList(users=frozenset({"bob"}))])
    assert key_of(bob, personal) != key_of(ann, personal) == key_of(dora, personal)


def test_an_answer_retrieved_from_another_index_version_than_its_key_is_not_stored() -> None:
    def context(keyed: str, searched: str | None) -> RequestContext:
        params = ChatParams(model="smollm2", messages=[{"role": "user", "content": "hi"}])
        ctx = RequestContext(params=params, credential=None, deadline=0.0)
        ctx.records.append(StageRecord("cache_lookup", 0.0, info={"cache.index_version": keyed}))
        if searched is not None:
            info = {"retrieval.index_version": searched}
            ctx.records.append(StageRecord("retrieve", 1.0, info=info))
        return ctx

    # A re-ingest published between the key and the search: the answer may hold what the
    # key's other holders may not see (a list naming this user was added), so it is not kept.
    assert not searched_the_keyed_version(context("00000001-a", "00000002-b"))
    assert searched_the_keyed_version(context("00000002-b", "00000002-b"))
    assert searched_the_keyed_version(context("00000002-b", None)), "no retrieval ran"


async def test_recreating_a_custom_key_with_other_groups_is_refused(offline) -> None:
    raw = "team.Zq7-vP2mL9xK4tR8wB1nC6yH3jF5sD0gA-groups"
    keys = offline.services.keys
    scopes = frozenset({"retrieve"})
    assert await keys.create("acme", "ann", scopes, raw_key=raw, groups=frozenset({"a"})) == raw
    assert await keys.create("acme", "ann", scopes, raw_key=raw, groups=frozenset({"a"})) == raw
    with pytest.raises(ValueError, match="rag keys groups"):
        await keys.create("acme", "ann", scopes, raw_key=raw, groups=frozenset({"b"}))
    with pytest.raises(ValueError, match="group"):
        await keys.create("acme", "ann", scopes, groups=frozenset({"a b"}))
    principal = await keys.resolve(raw)
    assert principal is not None and principal.groups == {"a"}


async def test_compression_weighs_words_by_the_chunks_the_caller_may_see(offline) -> None:
    """A word's IDF over hidden chunks would tell how many of them hold it (compression's
    choices and token counts show in rag.explain)."""
    ann_key = await key(offline, "acme", "ann", ("finance",))
    bob_key = await key(offline, "acme", "bob")
    await ingest(offline, ann_key, [SECRET, *PUBLIC])
    search = offline.services.retrieval
    assert search is not None
    ann = await offline.services.keys.resolve(ann_key)
    bob = await offline.services.keys.resolve(bob_key)
    assert ann is not None and bob is not None
    for_ann, for_bob = search.idf(ann, "merger lunch"), search.idf(bob, "merger lunch")
    # "merger" is in the secret and in a public chunk: rarer among what bob sees.
    assert for_bob["merger"] != for_ann["merger"]
    # What bob's IDF is: that of an index of the public chunks alone.
    await ingest(offline, await key(offline, "solo", "bob"), PUBLIC)
    alone = await offline.services.keys.resolve(await key(offline, "solo", "bob"))
    assert alone is not None
    assert search.idf(alone, "merger lunch") == for_bob


def test_an_answer_a_tool_searched_from_another_index_version_is_not_stored() -> None:
    def context(keyed: str, retrieved: str | None, tools: set[str]) -> RequestContext:
        params = ChatParams(model="smollm2", messages=[{"role": "user", "content": "hi"}])
        ctx = RequestContext(params=params, credential=None, deadline=0.0)
        ctx.records.append(StageRecord("cache_lookup", 0.0, info={"cache.index_version": keyed}))
        if retrieved is not None:
            info = {"retrieval.index_version": retrieved}
            ctx.records.append(StageRecord("retrieve", 1.0, info=info))
        ctx.index_versions.update(tools)
        return ctx

    # The retrieve stage searched the keyed version, a tool call a newer one: not kept.
    assert not searched_the_keyed_version(context("00000001-a", "00000001-a", {"00000002-b"}))
    assert not searched_the_keyed_version(context("00000001-a", None, {"00000002-b"}))
    assert not searched_the_keyed_version(context("00000001-a", None, {"00000001-a", "00000002-b"}))
    assert searched_the_keyed_version(context("00000001-a", "00000001-a", {"00000001-a"}))
    assert searched_the_keyed_version(context("00000001-a", None, set())), "no search ran"


async def test_a_tool_search_after_an_ingest_keeps_the_answer_out_of_the_cache(offline) -> None:
    """The tools stage's search runs on whatever index is current: an ingest landing after the
    cache lookup (here: a document the key's other holders may not see) is recorded."""
    ann_key = await key(offline, "acme", "ann", ("finance",))
    await ingest(offline, ann_key, PUBLIC)
    search = offline.services.retrieval
    assert search is not None
    ann = await offline.services.keys.resolve(ann_key)
    assert ann is not None
    keyed, _ = search.access_scope(ann)
    params = ChatParams(model="smollm2", messages=[{"role": "user", "content": QUESTION}])
    ctx = RequestContext(params=params, credential=None, deadline=0.0, principal=ann)
    ctx.records.append(StageRecord("cache_lookup", 0.0, info={"cache.index_version": keyed}))
    tool = search_tool(search)
    await tool.function({"query": QUESTION}, features_when_ready(ctx))
    assert ctx.index_versions == {keyed}
    assert searched_the_keyed_version(ctx)
    await ingest(offline, ann_key, [SECRET])
    found = await tool.function({"query": QUESTION}, features_when_ready(ctx))
    assert SECRET_ID in found, "the tool searched the new index"
    assert len(ctx.index_versions) == 2 and keyed in ctx.index_versions
    assert not searched_the_keyed_version(ctx)


async def retrieve_as(h: AppHarness, principal: Principal) -> tuple[dict[str, Any], str]:
    """The retrieve stage's explain record and the search tool's output, for `principal`."""
    search = h.services.retrieval
    assert search is not None
    params = ChatParams(model="smollm2", messages=[{"role": "user", "content": QUESTION}])
    ctx = RequestContext(params=params, credential=None, deadline=0.0, principal=principal)
    record = StageRecord("retrieve", 0.0)
    token = _current_record.set(record)
    try:
        await Retrieve(search, memo_scope=MemoScope(search.access_scope))(ctx)
    finally:
        _current_record.reset(token)
    said = await search_tool(search).function({"query": QUESTION}, ToolContext(principal))
    return record.info, said


async def test_an_index_of_only_hidden_documents_answers_as_an_empty_one(offline) -> None:
    """Bob sees nothing of acme's index (one document, for finance only): the retrieve stage
    and the tool answer him as they answer a caller whose tenant's index holds no document,
    a search without hits, not a skip that an index of hidden documents would explain."""
    ann_key = await key(offline, "acme", "ann", ("finance",))
    bob_key = await key(offline, "acme", "bob", ("sales",))
    await ingest(offline, ann_key, [SECRET])
    carl_key = await key(offline, "empty", "carl")
    await ingest(offline, carl_key, PUBLIC)
    search = offline.services.retrieval
    assert search is not None
    await search.delete("empty", [doc["id"] for doc in PUBLIC])
    bob = await offline.services.keys.resolve(bob_key)
    carl = await offline.services.keys.resolve(carl_key)
    assert bob is not None and carl is not None
    (for_bob, bob_said), (for_carl, carl_said) = (
        await retrieve_as(offline, bob),
        await retrieve_as(offline, carl),
    )
    version = attr.info_key(attr.RETRIEVAL_INDEX_VERSION)
    assert for_bob.pop(version) != for_carl.pop(version)  # each tenant's own
    assert for_bob == for_carl
    assert attr.info_key(attr.RETRIEVAL_SKIPPED) not in for_bob
    assert for_bob[attr.info_key(attr.RETRIEVAL_ALLOWED)] == 0
    assert for_bob[attr.info_key(attr.RETRIEVAL_RESULTS)] == 0
    assert bob_said == carl_said
    assert bob_said.startswith("No passage of the caller's documents matches")
    ann = await offline.services.keys.resolve(ann_key)
    assert ann is not None
    assert SECRET_ID in (await retrieve_as(offline, ann))[1], "ann, in finance, finds it"


async def test_a_tenants_index_that_cannot_be_read_is_a_503_for_it_alone(
    make_app, redis_server
) -> None:
    """A damaged snapshot (a partial copy, another version's format) was a 500 for every
    search, ingest and delete of the tenant: now a 503 ``index_unreadable`` naming no path,
    and another tenant is served as before. Read by a second replica on the same volume."""
    settings = make_settings(redis_server.url, f"http://127.0.0.1:{free_port()}")
    async with make_app(settings) as h:
        damaged, other = await key(h, "damaged", "ann"), await key(h, "other", "bob")
        await ingest(h, damaged, PUBLIC)
        await ingest(h, other, PUBLIC)
    root = Path(settings.retrieval.index_dir)
    version = (root / "damaged" / "CURRENT").read_text().strip()
    (root / "damaged" / version / "chunks.json").write_text("{not json")
    async with make_app(settings) as h:
        calls = [
            ("/v1/retrieve", {"query": QUESTION, "top_k": 3, "min_relevance": 0}),
            ("/v1/documents", {"documents": PUBLIC[:1]}),
        ]
        for path, body in calls:
            response = await h.client.post(path, json=body, headers=auth(damaged))
            error = assert_openai_error(response, 503, "service_unavailable")
            assert error["code"] == "index_unreadable" and str(root) not in error["message"]
        # A chat request reads the caller's access scope first (the response cache's key, the
        # memos' scope): a 503 too, where it was a 500. A job's submission reads nothing of the
        # index (the memos then keep the caller's texts under its own user): queued.
        chat = {"model": "smollm2", "messages": [{"role": "user", "content": QUESTION}]}
        response = await h.client.post("/v1/chat/completions", json=chat, headers=auth(damaged))
        assert assert_openai_error(response, 503, "service_unavailable")["code"] == (
            "index_unreadable"
        )
        queued = await h.client.post("/v1/jobs", json=chat, headers=auth(damaged))
        assert queued.status_code == 202, queued.text
        assert ids(await retrieved(h, other)) >= {"canteen"}


async def test_the_search_tool_embeds_under_the_callers_memo_scope(offline, monkeypatch) -> None:
    """Callers waiting for the same query at once share one embedding, within their memo scope:
    ann (finance, whom a list names) and bob (sales) may see different documents, so the
    model's searches for them never share one (a review found the tool sharing by tenant)."""
    ann_key = await key(offline, "acme", "ann", ("finance",))
    bob_key = await key(offline, "acme", "bob", ("sales",))
    await ingest(offline, ann_key, [*PUBLIC, SECRET])
    search = offline.services.retrieval
    batcher = search.queries
    scopes: list[str] = []
    real_embed = batcher.embed

    async def recorded(text: str, *, scope: str) -> Any:
        scopes.append(scope)
        return await real_embed(text, scope=scope)

    monkeypatch.setattr(batcher, "embed", recorded)
    ann = await offline.services.keys.resolve(ann_key)
    bob = await offline.services.keys.resolve(bob_key)
    tool = search_tool(search)
    for principal in (ann, bob):
        await tool.function({"query": QUESTION}, ToolContext(principal))
    assert scopes == [search.memo_scope(ann), search.memo_scope(bob)]
    assert scopes[0] != scopes[1] and "acme" not in scopes


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/retrieve", {"query": QUESTION, "top_k": 3}),
        ("/v1/chat/completions", chat_request(QUESTION)),
        ("/v1/jobs", chat_request(QUESTION)),
    ],
)
async def test_a_cold_tenants_snapshot_is_loaded_off_the_event_loop(
    offline, monkeypatch, path: str, body: dict[str, Any]
) -> None:
    """A replica loads a tenant's snapshot when it first needs it (a fresh replica, one whose
    budget let it go, every replica after the tenant publishes a new version): 75 to 430 ms,
    during which a load on the event loop answered no one. The reads on the loop (the cache
    key, the memo scope, the prompt's salt) find it loaded by the search pool first: for a
    retrieve, a chat request (its auth stage; no vLLM here, so it ends at generation) and a
    job's submission (reviews found /v1/retrieve, then the chat path, loading on the loop)."""
    ann_key = await key(offline, "acme", "ann", ("finance",))
    await ingest(offline, ann_key, [*PUBLIC, SECRET])
    store = offline.services.retrieval.backend("acme").store
    store._entry("acme").index = None  # let go: the next read loads it again
    assert not offline.services.retrieval.loaded("acme")
    loads: list[str] = []
    real_load = type(store)._load

    def recorded(self: Any, tenant: str, pointer: str) -> Any:
        loads.append(threading.current_thread().name)
        return real_load(self, tenant, pointer)

    monkeypatch.setattr(type(store), "_load", recorded)
    await offline.client.post(path, json=body, headers=auth(ann_key))
    assert len(loads) == 1 and threading.current_thread().name not in loads, loads
    assert offline.services.retrieval.loaded("acme")
