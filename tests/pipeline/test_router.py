"""The router and the route stage: the labelled queries, pinning, the features policy, the
fallback when embedding fails, and what the span says. The real MiniLM embedder throughout."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from pipeline.context import (
    ChatParams,
    Features,
    Principal,
    RagOptions,
    RequestContext,
    RouteChoice,
)
from pipeline.errors import InvalidRequest
from pipeline.model.client import LLMClient
from pipeline.model.routes import Route, RouteTable
from pipeline.model.salt import MemoScope
from pipeline.model.slots import SlotPool
from pipeline.routing.router import ROUTER_VERSION, Centroids, Router, RouterPolicy, load_examples
from pipeline.routing.rules import Thresholds
from pipeline.runner import INPUTS, PathError, Runner, StageSpec
from pipeline.stages.route import ChooseRoute
from pipeline.telemetry import attributes as attr
from retrieval import Embedder

LABELLED = Path(__file__).parent / "data" / "route_queries.jsonl"
MIN_ACCURACY = 0.9


def labelled() -> list[dict[str, str]]:
    return [json.loads(line) for line in LABELLED.read_text("utf-8").splitlines() if line]


@pytest.fixture
async def routes() -> AsyncIterator[RouteTable]:
    # Nothing is sent to these clients: the router only chooses among the routes.
    def route(name: str, model: str) -> Route:
        return Route(name, model, LLMClient("http://127.0.0.1:9"), SlotPool(1))

    table = RouteTable(
        {
            "small": route("small", "smollm2"),
            "large": route("large", "smollm2"),
            "other": route("other", "other-model"),
        },
        default="small",
    )
    yield table
    await table.aclose()


@pytest.fixture(scope="module")
def centroids(shared_embedder: Embedder) -> Centroids:
    built = Centroids(load_examples(), shared_embedder.embed)
    built.warm_up()
    return built


@pytest.fixture
def router(routes: RouteTable, centroids: Centroids) -> Router:
    return Router(routes, RouterPolicy(), centroids)


def params(text: str, model: str = "auto", route: str | None = None) -> ChatParams:
    return ChatParams(
        model=model,
        messages=[{"role": "user", "content": text}],
        rag=RagOptions(route=route),
    )


def test_router_picks_the_expected_route_for_the_labelled_queries(
    router: Router, shared_embedder: Embedder
) -> None:
    rows = labelled()
    assert len(rows) >= 40 and {r["route"] for r in rows} == {"small", "large"}
    vectors = shared_embedder.embed([r["text"] for r in rows])
    choices = [
        router.choose(params(row["text"]), Features(), vector)
        for row, vector in zip(rows, vectors, strict=True)
    ]
    misses = [
        f"{r['route']} expected, {c.name} chosen ({c.reason}): {r['text'][:70]!r}"
        for r, c in zip(rows, choices, strict=True)
        if c.name != r["route"]
    ]
    print(f"\nrouter: {len(rows) - len(misses)}/{len(rows)} right; misses:", *misses, sep="\n  ")
    accuracy = 1 - len(misses) / len(rows)
    assert accuracy >= MIN_ACCURACY, f"accuracy {accuracy:.2%}; misses:\n" + "\n".join(misses)
    # Both steps took part: the rules settled most, the centroids the ones left open.
    reasons = [c.reason.split(":")[0] for c in choices]
    assert reasons.count("rule") >= len(rows) // 2 and reasons.count("centroid") >= 2


def test_centroids_alone_separate_the_labelled_queries(
    centroids: Centroids, shared_embedder: Embedder
) -> None:
    """The nearest-centroid step is worth having on its own, not only where rules are silent."""
    rows = labelled()
    vectors = shared_embedder.embed([r["text"] for r in rows])
    right = 0
    for row, vector in zip(rows, vectors, strict=True):
        scores = centroids.scores(vector)
        right += max(scores, key=lambda intent: scores[intent]) == row["route"]
    assert right / len(rows) >= 0.8, f"centroids alone: {right}/{len(rows)}"


def test_rule_reasons_name_the_rule(router: Router) -> None:
    cases = {
        "Explain step by step how DNS resolution works.": ("large", "rule:step_by_step"),
        "Planeje a migração do servidor de e-mail.": ("large", "rule:plan"),
        "Planeje a migracao do servidor de e-mail.": ("large", "rule:plan"),
        "Classify this review: 'compare it to the old one, prove me wrong'": (
            "small",
            "rule:classify",
        ),
        "Is it raining in Lisbon? Should I take an umbrella? What about tomorrow?": (
            "large",
            "rule:several_questions",
        ),
        "What is the capital of Peru?": ("small", "rule:factual"),
        " ".join(["word"] * 80): ("large", "rule:long"),
    }
    for text, (name, reason) in cases.items():
        choice = router.decide(params(text), Features())
        assert choice == RouteChoice(name, "smollm2", reason), text


def test_a_pinned_route_wins_over_the_rules(router: Router) -> None:
    small_ask = "Translate 'hello' into Portuguese."
    assert router.decide(params(small_ask), Features()) == RouteChoice(
        "small", "smollm2", "rule:translate"
    )
    by_option = router.decide(params(small_ask, route="large"), Features())
    by_name = router.decide(params(small_ask, model="large"), Features())
    assert by_option == by_name == RouteChoice("large", "smollm2", "pinned")


def test_a_model_served_by_one_route_takes_it_and_auto_lets_the_router_choose(
    router: Router,
) -> None:
    ask = "Explain step by step how a compiler works."
    assert router.decide(params(ask, model="other-model"), Features()) == RouteChoice(
        "other", "other-model", "only_candidate"
    )
    assert router.decide(params(ask, model="auto"), Features()) == RouteChoice(
        "large", "smollm2", "rule:step_by_step"
    )
    # Served by two routes: the router chooses between them.
    assert router.decide(params(ask, model="smollm2"), Features()) == RouteChoice(
        "large", "smollm2", "rule:step_by_step"
    )


def test_an_unknown_route_is_a_400_in_openai_shape(router: Router) -> None:
    with pytest.raises(InvalidRequest) as caught:
        router.decide(params("hi", route="huge"), Features())
    assert caught.value.status_code == 400
    error = caught.value.to_dict()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == "rag.route"
    assert error["code"] == "unknown_route" and "huge" in error["message"]


def test_a_free_tier_user_is_capped_at_the_small_route_unless_pinned(router: Router) -> None:
    ask = "Compare Rust and Go for a CLI tool and recommend one."
    free = Features(values={"tier": "free"})
    assert router.decide(params(ask), free) == RouteChoice("small", "smollm2", "feature:tier=free")
    assert router.decide(params(ask, route="large"), free) == RouteChoice(
        "large", "smollm2", "pinned"
    )
    paying = Features(values={"tier": "pro"})
    assert router.decide(params(ask), paying) == RouteChoice("large", "smollm2", "rule:compare")
    # A tier that fell back to its default (feature store miss or outage) caps nobody.
    unknown = Features(values={"tier": "free"}, defaulted=frozenset({"tier"}))
    assert router.decide(params(ask), unknown) == RouteChoice("large", "smollm2", "rule:compare")


def test_intents_map_to_configured_route_names(routes: RouteTable) -> None:
    policy = RouterPolicy(intents={"small": "other", "large": "large"})
    router = Router(routes, policy)
    choice = router.decide(params("What is the capital of Peru?"), Features())
    assert choice == RouteChoice("other", "other-model", "rule:factual")
    # The intent's route cannot serve this model: the default route, and the reason says so.
    choice = router.decide(params("What is the capital of Peru?", model="smollm2"), Features())
    assert choice == RouteChoice("small", "smollm2", "rule:factual;no_route=other")


def test_without_centroids_open_requests_go_by_length(routes: RouteTable) -> None:
    router = Router(routes)
    assert router.decide(params("A baleia é um mamífero?"), Features()) == RouteChoice(
        "small", "smollm2", "length:short"
    )
    medium = "Tell me about the history of the printing press and its effects on Europe " * 2
    assert router.decide(params(medium), Features()) == RouteChoice(
        "large", "smollm2", "length:medium"
    )


def test_version_changes_with_thresholds_and_examples(
    routes: RouteTable, centroids: Centroids, shared_embedder: Embedder
) -> None:
    base = Router(routes, RouterPolicy(), centroids)
    assert base.version.startswith(f"{ROUTER_VERSION}-")
    assert base.version == Router(routes, RouterPolicy(), centroids).version
    stricter = RouterPolicy(thresholds=Thresholds(long_words=30))
    assert Router(routes, stricter, centroids).version != base.version
    fewer = Centroids(load_examples()[:-1], shared_embedder.embed)
    assert Router(routes, RouterPolicy(), fewer).version != base.version


# --- the stage, in a runner --------------------------------------------------------------


class Recorder:
    """Stands in for generation: records the route the request reached it with."""

    spec = StageSpec.of("generate", reads={"route"})

    def __init__(self) -> None:
        self.seen: list[RouteChoice | None] = []

    async def __call__(self, ctx: RequestContext) -> RequestContext:
        self.seen.append(ctx.route)
        return ctx


async def run_route(
    stage: ChooseRoute,
    tracing: tuple[TracerProvider, InMemorySpanExporter],
    text: str,
    **fields: Any,
) -> tuple[RequestContext, Recorder]:
    recorder = Recorder()
    # Fields given here stand for what earlier stages (auth, features, retrieve) wrote.
    fields.setdefault("principal", Principal("acme", "alice", frozenset({"chat"}), "k1"))
    runner = Runner(
        [stage, recorder], tracing[0].get_tracer("test"), inputs=INPUTS | frozenset(fields)
    )
    ctx = RequestContext(
        params=params(text), credential=None, deadline=asyncio.get_running_loop().time() + 30
    )
    for name, value in fields.items():
        setattr(ctx, name, value)
    await runner.run(ctx)
    return ctx, recorder


def route_span(exporter: InMemorySpanExporter) -> Any:
    return next(s for s in exporter.get_finished_spans() if s.name == "stage route")


async def test_stage_embeds_only_what_the_rules_leave_open_and_sets_span_attributes(
    router: Router,
    shared_embedder: Embedder,
    tracing: tuple[TracerProvider, InMemorySpanExporter],
) -> None:
    asked: list[str] = []

    async def embed(text: str, *, scope: str = "") -> Any:
        asked.append(text)
        return (await asyncio.to_thread(shared_embedder.embed, [text]))[0]

    stage = ChooseRoute(router, embed=embed, memo_scope=MemoScope())
    ctx, recorder = await run_route(stage, tracing, "Explain step by step how TLS works.")
    assert asked == [] and recorder.seen == [RouteChoice("large", "smollm2", "rule:step_by_step")]
    span = route_span(tracing[1])
    assert span.attributes[attr.ROUTE] == "large"
    assert span.attributes[attr.ROUTE_REASON] == "rule:step_by_step"
    assert ctx.records[0].info == {"route": "large", "route.reason": "rule:step_by_step"}

    tracing[1].clear()
    ctx, recorder = await run_route(stage, tracing, "A baleia é um mamífero?")
    assert asked == ["A baleia é um mamífero?"]
    assert ctx.route is not None and ctx.route.reason.startswith("centroid:small (")
    assert route_span(tracing[1]).attributes[attr.ROUTE_REASON] == ctx.route.reason


async def test_stage_embeds_under_the_callers_memo_scope(
    router: Router,
    shared_embedder: Embedder,
    tracing: tuple[TracerProvider, InMemorySpanExporter],
) -> None:
    # Callers waiting for the same text at once share one embedding (QueryBatcher), so the
    # stage asks under the caller's memo scope: with access lists, its access scope, not only
    # its tenant (whoever may see what alice may not learns nothing from how soon hers is done).
    scopes: list[str] = []

    async def embed(text: str, *, scope: str = "") -> Any:
        scopes.append(scope)
        return (await asyncio.to_thread(shared_embedder.embed, [text]))[0]

    listed = MemoScope(lambda principal: ("v1", {"user": principal.user}))
    stage = ChooseRoute(router, embed=embed, memo_scope=listed)
    await run_route(stage, tracing, "A baleia é um mamífero?")
    alice = Principal("acme", "alice", frozenset({"chat"}), "k1")
    assert scopes == [listed(alice)] and scopes != ["acme"]


async def test_stage_reuses_the_query_vector_retrieval_computed(
    router: Router,
    shared_embedder: Embedder,
    tracing: tuple[TracerProvider, InMemorySpanExporter],
) -> None:
    async def must_not_embed(text: str, *, scope: str = "") -> Any:
        raise AssertionError("the stage embedded a query retrieval had embedded already")

    text = "A baleia é um mamífero?"
    vector = shared_embedder.embed([text])[0]
    stage = ChooseRoute(
        router, embed=must_not_embed, with_query_vector=True, memo_scope=MemoScope()
    )
    ctx, _ = await run_route(stage, tracing, text, query_vector=vector)
    assert ctx.route is not None and ctx.route.reason.startswith("centroid:")
    assert ctx.records[0].status == "ok"


async def test_failed_embedding_degrades_to_the_default_route_and_the_request_goes_on(
    router: Router, tracing: tuple[TracerProvider, InMemorySpanExporter]
) -> None:
    async def broken(text: str, *, scope: str = "") -> Any:
        raise RuntimeError("embedding model unavailable")

    text = "A baleia é um mamífero?"  # left open by the rules: it needs the embedding
    assert router.decide(params(text), Features()) is None
    ctx, recorder = await run_route(
        ChooseRoute(router, embed=broken, memo_scope=MemoScope()), tracing, text
    )
    expected = RouteChoice("small", "smollm2", "fallback:RuntimeError: embedding model unavailable")
    assert recorder.seen == [expected]
    assert ctx.records[0].status == "degraded"
    assert ctx.records[0].info["error_type"] == "RuntimeError"
    span = route_span(tracing[1])
    assert span.attributes[attr.ROUTE] == "small"
    assert span.attributes[attr.ROUTE_REASON] == expected.reason
    assert span.attributes["error.type"] == "RuntimeError"


async def test_an_embedding_past_the_budget_degrades_in_time(
    router: Router, tracing: tuple[TracerProvider, InMemorySpanExporter]
) -> None:
    async def hangs(text: str, *, scope: str = "") -> Any:
        await asyncio.sleep(30)

    stage = ChooseRoute(router, embed=hangs, timeout_s=0.05, memo_scope=MemoScope())
    ctx, recorder = await run_route(stage, tracing, "A baleia é um mamífero?")
    assert ctx.route is not None and ctx.route.name == "small"
    assert ctx.route.reason == "fallback:StageTimeout: route ran past its budget of 50 ms"
    assert recorder.seen == [ctx.route]


async def test_reads_follow_the_path(router: Router) -> None:
    async def embed(text: str, *, scope: str = "") -> Any:
        return np.zeros(384, dtype=np.float32)

    assert ChooseRoute(router, embed=embed, memo_scope=MemoScope()).spec.reads == frozenset(
        {"params", "principal"}
    )
    both = ChooseRoute(
        router, embed=embed, with_features=True, with_query_vector=True, memo_scope=MemoScope()
    )
    assert both.spec.reads == frozenset({"params", "principal", "features", "query_vector"})
    with pytest.raises(PathError, match="route reads"):
        Runner([both], TracerProvider().get_tracer("test"))
    with pytest.raises(ValueError, match="embed"):
        ChooseRoute(router, memo_scope=MemoScope())
