"""Citations through the real service (real vLLM, Redis and embedding model): a plain answer's
``rag.citations``, the same from the cache, and a stream's citation chunks read by the official
``openai`` client; every span indexes the chunk's text as ``/v1/retrieve`` returns it."""

from __future__ import annotations

import secrets
from typing import Any

import httpx
import openai
import pytest

from pipeline.model.tokens import ModelTokenCounter
from tests.conftest import make_settings

KIWI = (
    "The kiwi is a flightless bird endemic to New Zealand. "
    "It lays a very large egg for the size of its body."
)
FJORD = "A fjord is a long, narrow inlet with steep sides. Glaciers carved most fjords in Norway."
DOCS = [
    {"id": "kiwi-1", "title": "Kiwi birds", "text": KIWI},
    {"id": "fjord-2", "title": "Fjords", "text": FJORD},
]
FIRST = "The kiwi is a flightless bird endemic to New Zealand."


@pytest.fixture
async def harness(make_app, redis_server, vllm):
    async with make_app(make_settings(redis_server.url, vllm.url)) as h:
        yield h


async def setup(harness) -> tuple[str, dict[str, str]]:
    """A key, the documents ingested, and each chunk's text as /v1/retrieve returns it."""
    key = await harness.key(scopes="chat,retrieve,ingest")
    headers = {"Authorization": f"Bearer {key}"}
    ingested = await harness.client.post("/v1/documents", json={"documents": DOCS}, headers=headers)
    assert ingested.status_code == 200, ingested.text
    found = await harness.client.post(
        "/v1/retrieve", json={"query": "kiwi bird fjord inlet", "top_k": 5}, headers=headers
    )
    assert found.status_code == 200, found.text
    return key, {hit["chunk_id"]: hit["text"] for hit in found.json()["data"]}


def body(question: str, **extra: Any) -> dict[str, Any]:
    return {
        "model": "smollm2",
        "messages": [{"role": "user", "content": question}],
        "max_tokens": 60,
        "temperature": 0,
        "rag": {"top_k": 2},
        **extra,
    }


def check(
    citations: list[dict[str, Any]],
    content: str,
    sources: list[dict[str, Any]],
    chunks: dict[str, str],
) -> list[tuple[str, str]]:
    """Every sentence of ``content`` is cited in order; each source is one of ``rag.sources`` and
    its span a whole sentence of the chunk's text. Returns (answer sentence, cited sentence)."""
    assert [c["sentence"] for c in citations] == list(range(len(citations)))
    spans = [content[c["text_span"][0] : c["text_span"][1]] for c in citations]
    assert " ".join(spans).split() == content.split(), "the sentences cover the whole answer"
    pairs = []
    for citation, sentence in zip(citations, spans, strict=True):
        assert citation["supported"] == bool(citation["sources"])
        for source in citation["sources"]:
            listed = sources[source["index"] - 1]
            assert (listed["document_id"], listed["chunk_id"]) == (
                source["document_id"],
                source["chunk_id"],
            )
            start, end = source["span"]
            cited = chunks[source["chunk_id"]][start:end]
            assert cited in (*KIWI.split(". "), *FJORD.split(". ")) or cited.rstrip(".") in (
                *KIWI.split(". "),
                *FJORD.split(". "),
            ), cited
            pairs.append((sentence, cited))
    return pairs


async def test_a_plain_answer_cites_its_sentences_and_a_cache_hit_keeps_them(harness) -> None:
    key, chunks = await setup(harness)
    request = body(f"Repeat exactly: {FIRST}")
    response = await harness.chat(key, request)
    assert response.status_code == 200, response.text
    answer = response.json()
    content = answer["choices"][0]["message"]["content"]
    citations = answer["rag"]["citations"]
    pairs = check(citations, content, answer["rag"]["sources"], chunks)
    # The model repeats the sentence: it is cited, with the very sentence of the source.
    assert (FIRST, FIRST) in pairs, (content, citations)
    assert citations[0]["sources"][0]["document_id"] == "kiwi-1"

    again = await harness.chat(key, request)
    assert again.headers["x-cache"] == "hit"
    assert again.json()["rag"]["citations"] == citations


async def test_a_stream_sends_each_citation_as_its_sentence_completes(harness) -> None:
    key, chunks = await setup(harness)
    client = openai.AsyncOpenAI(
        base_url="http://service/v1",
        api_key=key,
        max_retries=0,
        http_client=httpx.AsyncClient(transport=httpx.ASGITransport(app=harness.app)),
    )
    request = body("Copy the two sentences of the Kiwi birds source.")

    async def read() -> tuple[list[Any], str, list[tuple[int, Any]], Any]:
        stream = await client.chat.completions.create(
            model=request["model"],
            messages=request["messages"],
            max_tokens=request["max_tokens"],
            temperature=0,
            stream=True,
            extra_body={"rag": request["rag"]},
        )
        parsed = [chunk async for chunk in stream]  # the SDK parses every chunk
        content = "".join(c.choices[0].delta.content or "" for c in parsed if c.choices)
        events = [
            (position, chunk.model_extra["rag"]["citations"])
            for position, chunk in enumerate(parsed)
            if chunk.choices and chunk.choices[0].finish_reason is None
            and "rag" in (chunk.model_extra or {})
        ]  # fmt: skip
        final = parsed[-1].model_extra["rag"]
        assert parsed[-1].choices[0].finish_reason in ("stop", "length")
        return parsed, content, events, final

    try:
        parsed, content, events, final = await read()
        # One citation a chunk, each on a chunk with no content, as a client that ignores
        # the extra field sees it.
        assert all(len(cited) == 1 for _, cited in events)
        assert all(not parsed[p].choices[0].delta.content for p, _ in events)
        streamed = [cited[0] for _, cited in events]
        assert streamed == final["citations"], "the final chunk repeats them all"
        pairs = check(streamed, content, final["sources"], chunks)
        assert (FIRST, FIRST) in pairs, (content, streamed)
        assert len(streamed) >= 2, content
        last_text = max(p for p, c in enumerate(parsed) if c.choices and c.choices[0].delta.content)
        assert events[0][0] < last_text, "the first sentence is cited while the answer streams on"

        _, replayed_content, replayed, replayed_final = await read()  # a cache hit, replayed
        assert replayed_content == content
        assert [cited[0] for _, cited in replayed] == streamed == replayed_final["citations"]
    finally:
        await client.close()


async def test_the_openapi_document_declares_the_citations(harness) -> None:
    document = (await harness.client.get("/openapi.json")).json()
    schemas = document["components"]["schemas"]
    rag = schemas["ChatCompletion"]["properties"]["rag"]
    assert rag == {"$ref": "#/components/schemas/RagInfo"}
    citations = schemas["RagInfo"]["properties"]["citations"]
    assert citations["items"] == {"$ref": "#/components/schemas/Citation"}
    assert set(schemas["Citation"]["required"]) == {"sentence", "text_span", "supported", "sources"}
    assert set(schemas["CitedSource"]["required"]) == {
        "index",
        "document_id",
        "chunk_id",
        "span",
        "score",
    }


@pytest.fixture
def analysed(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str]]:
    """Each analysis of a passage's text from here on, compression's and citations', the memos
    emptied first."""
    from pipeline.answer import citations
    from pipeline.sources import compress

    compress.clear_passage_cache()
    citations._analyse.cache_clear()
    found: list[tuple[str, str]] = []
    spans, segments = compress.sentence_spans, citations.segments

    def counted_spans(text: str) -> Any:
        found.append(("compress", text))
        return spans(text)

    def counted_segments(text: str, start: int = 0) -> Any:
        found.append(("cite", text))
        return segments(text, start)

    monkeypatch.setattr(compress, "sentence_spans", counted_spans)
    monkeypatch.setattr(citations, "segments", counted_segments)
    return found


async def kiwi_analysed(
    harness, analysed: list[tuple[str, str]], key: str, question: str
) -> set[str]:
    """Which memos analysed the kiwi passage for this request (a miss, its one source)."""
    analysed.clear()
    response = await harness.chat(key, body(question, max_tokens=16, rag={
        "top_k": 1, "compress": True
    }))  # fmt: skip
    assert response.status_code == 200, response.text
    assert response.headers["x-cache"] != "hit"
    (source,) = response.json()["rag"]["sources"]
    assert source["document_id"] == "kiwi-1", source
    return {kind for kind, text in analysed if text == KIWI}


async def ingest(harness, key: str, documents: list[dict[str, Any]]) -> None:
    stored = await harness.client.post(
        "/v1/documents", json={"documents": documents}, headers={"Authorization": f"Bearer {key}"}
    )
    assert stored.status_code == 200, stored.text


async def test_a_tenants_passages_are_analysed_for_it_alone(harness, analysed) -> None:
    # Compression and citations keep each passage's analysis for texts seen again. Kept for all
    # tenants at once, a tenant's request would be answered faster for a passage another tenant
    # holds: the service would tell whether another tenant has the same text.
    from pipeline.sources import compress

    keys = {}
    for tenant in ("acme", "globex"):
        keys[tenant] = await harness.key(tenant=tenant, scopes="chat,retrieve,ingest")
        await ingest(harness, keys[tenant], DOCS)
    seen = [
        await kiwi_analysed(harness, analysed, keys[tenant], question)
        for tenant, question in (
            ("acme", "Where do kiwi birds live?"),
            ("acme", "How large is the egg of a kiwi bird?"),  # not a cache hit: another question
            ("globex", "Where do kiwi birds live?"),
        )
    ]
    assert seen == [{"compress", "cite"}, set(), {"compress", "cite"}], (
        "each tenant analyses the passage the first time it is retrieved for it; later requests "
        "find the analyses its own requests left, and only those"
    )
    # The words' token pieces and stems too: each request counts and stems for its tenant.
    counter = harness.services.tokens
    assert isinstance(counter, ModelTokenCounter), "make model: the model's tokenizer"
    assert counter.kept_pieces(None) == {}, "no text of a request is counted for no tenant"
    assert " flightless" in counter.kept_pieces("acme").keys() & counter.kept_pieces("globex")
    assert all("flightless" in compress.STEMS.kept(t) for t in ("acme", "globex"))


async def test_callers_of_a_tenant_who_may_see_different_documents_keep_apart(
    harness, analysed
) -> None:
    """Within a tenant whose index has access lists, as the prompt's salt: carol, whom a list
    names, finds nothing dave's requests left (her requests hold text he may not read, and
    his timings would tell him of it); dave and erin, named by no list, see the same documents
    and share (a review of the per-tenant memos, 2026-12-07)."""
    carol = await harness.key(tenant="beta", user="carol", scopes="chat,ingest")
    dave = await harness.key(tenant="beta", user="dave")
    erin = await harness.key(tenant="beta", user="erin")
    listed = {"id": "memo", "text": "The merger closes in May.", "access": {"users": ["carol"]}}
    await ingest(harness, carol, [*DOCS, listed])
    seen = [
        await kiwi_analysed(harness, analysed, key, question)
        for key, question in (
            (carol, "Where do kiwi birds live?"),
            (dave, "Where do kiwi birds live?"),
            (erin, "How large is the egg of a kiwi bird?"),
        )
    ]
    assert seen == [{"compress", "cite"}, {"compress", "cite"}, set()], (
        "carol's analyses are not dave's; dave's are erin's"
    )
    counter = harness.services.tokens
    assert isinstance(counter, ModelTokenCounter), "make model: the model's tokenizer"
    assert counter.kept_pieces("beta") == {}, "no request of the tenant counts for all its callers"


async def test_a_tenants_callers_who_may_see_different_documents_share_no_embedding_or_verdict(
    harness, monkeypatch
) -> None:
    """The query's embedding, shared by callers waiting for the same text at once, and the
    validate stage's verdicts on a schema's patterns are kept per memo scope as the other memos
    are: carol, whom a list names, shares neither with dave, who may not read what she may;
    dave and erin (the same scope) share both. Through chat and /v1/retrieve."""
    from pipeline.tools import schema_check

    carol = await harness.key(tenant="beta", user="carol", scopes="chat,retrieve,ingest")
    dave = await harness.key(tenant="beta", user="dave", scopes="chat,retrieve")
    erin = await harness.key(tenant="beta", user="erin", scopes="chat,retrieve")
    listed = {"id": "memo", "text": "The merger closes in May.", "access": {"users": ["carol"]}}
    await ingest(harness, carol, [*DOCS, listed])

    batcher = harness.services.retrieval.queries
    embedded: list[tuple[str, str]] = []
    real_embed = batcher.embed

    async def recorded(text: str, *, scope: str) -> Any:
        embedded.append((scope, text))
        return await real_embed(text, scope=scope)

    monkeypatch.setattr(batcher, "embed", recorded)
    compiled: list[str] = []
    real_compiled = schema_check._compiled

    def counted(pattern: str, max_mem: int) -> int | str:
        compiled.append(pattern)
        return real_compiled(pattern, max_mem)

    monkeypatch.setattr(schema_check, "_compiled", counted)
    pattern = f"^[A-Z]{{2}}-{secrets.token_hex(4)}$"  # new to this replica's verdicts
    tool = {"type": "function", "function": {"name": "lookup", "parameters": {
        "type": "object", "properties": {"code": {"type": "string", "pattern": pattern}},
    }}}  # fmt: skip
    scopes = []
    for key, question in (
        (carol, "Where do kiwi birds live?"),
        (dave, "How large is the egg of a kiwi bird?"),
        (erin, "Can a kiwi bird fly?"),  # each a miss: erin's would be a hit of dave's
    ):
        embedded.clear()
        response = await harness.chat(
            key, body(question, max_tokens=4, tools=[tool], tool_choice="none")
        )
        assert response.status_code == 200, response.text
        found = await harness.client.post(
            "/v1/retrieve", json={"query": "kiwi", "top_k": 1},
            headers={"Authorization": f"Bearer {key}"},
        )  # fmt: skip
        assert found.status_code == 200, found.text
        (chat_scope, chat_text), (retrieve_scope, retrieve_text) = embedded
        assert (chat_text, retrieve_text) == (question, "kiwi")
        assert chat_scope == retrieve_scope != "beta", "the caller's memo scope, not the tenant"
        scopes.append(chat_scope)
    assert scopes[0] != scopes[1] == scopes[2], "carol's scope is not dave's; dave's is erin's"
    assert compiled == [pattern, pattern], "compiled for carol and for dave; erin finds dave's"
