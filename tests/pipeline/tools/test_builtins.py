"""The built-ins besides the calculator: the clock, the profile, the search of one's documents."""

from __future__ import annotations

import datetime
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.sdk.trace import TracerProvider

from pipeline.answer.events import ToolCall
from pipeline.context import Features, Principal
from pipeline.sources.search import PassageSearch
from pipeline.tools.base import ToolContext
from pipeline.tools.builtins import builtin_tools, profile_tool, search_tool
from pipeline.tools.clock import clock_tool, describe_now, zone_names
from pipeline.tools.invoker import ToolInvoker
from pipeline.tools.registry import ToolRegistry
from retrieval import Document, Embedder, HybridRetriever, IndexStore, QueryBatcher
from tests.pipeline.tools.support import Tracing, caller


@pytest.mark.parametrize(
    ("place", "zone"),
    [
        ("Asia/Tokyo", "Asia/Tokyo"),
        ("asia/tokyo", "Asia/Tokyo"),
        ("Tokyo", "Asia/Tokyo"),
        ("Lisboa", "Europe/Lisbon"),
        ("São Paulo", "America/Sao_Paulo"),
        ("new york", "America/New_York"),
        ("the UK", "Europe/London"),
        ("Brazil", "America/Sao_Paulo"),
        ("UTC", "UTC"),
    ],
)
def test_zones_are_found_by_name_city_or_country(place: str, zone: str) -> None:
    assert zone_names().find(place) == zone


def test_unknown_places_and_paths_find_no_zone() -> None:
    for place in ("Narnia", "../../etc/passwd", "", "Europe/../../etc"):
        assert zone_names().find(place) is None


def test_the_time_is_told_in_the_zone_with_its_offset() -> None:
    noon_utc = datetime.datetime(2025, 1, 15, 12, 0, tzinfo=datetime.UTC)
    assert describe_now("Asia/Tokyo", noon_utc) == (
        "Wednesday, 2025-01-15 21:00:00 JST (time zone Asia/Tokyo, UTC+09:00)"
    )
    summer = datetime.datetime(2025, 7, 15, 12, 0, tzinfo=datetime.UTC)
    assert "13:00:00 WEST" in describe_now("Europe/Lisbon", summer)


async def test_the_clock_tool_is_never_cached_and_refuses_unknown_zones(tracing: Tracing) -> None:
    invoker = ToolInvoker(ToolRegistry([clock_tool()]), tracing.tracer)
    tokyo, utc, narnia = await invoker.run(
        [
            ToolCall("1", "clock", '{"timezone": "Tokyo"}'),
            ToolCall("2", "clock", "{}"),
            ToolCall("3", "clock", '{"timezone": "Narnia"}'),
        ],
        caller(),
    )
    assert tokyo.status == "ok" and "(time zone Asia/Tokyo, UTC+09:00)" in tokyo.content
    year = datetime.datetime.now(datetime.UTC).year
    assert str(year) in tokyo.content or str(year + 1) in tokyo.content
    assert "time zone UTC" in utc.content
    assert narnia.status == "error" and "Unknown time zone 'Narnia'" in narnia.content
    assert {tokyo.cache_ttl, utc.cache_ttl, narnia.cache_ttl} == {0}


def with_features(features: Features) -> ToolContext:
    async def load() -> Features:
        return features

    return ToolContext(Principal("acme", "alice", frozenset({"chat"}), "k"), features=load)


async def test_the_profile_shows_the_features_that_are_not_defaults(tracing: Tracing) -> None:
    invoker = ToolInvoker(ToolRegistry([profile_tool()]), tracing.tracer)
    features = Features(
        values={"tier": "pro", "language": "pt", "requests_last_hour": 7, "department": "x"},
        defaulted=frozenset({"department"}),
        version="v3",
    )
    (run,) = await invoker.run([ToolCall("1", "profile", "")], with_features(features))
    assert run.status == "ok"
    assert run.content.splitlines() == [
        "The user's profile (feature set v3):",
        "- language: pt",
        "- requests_last_hour: 7",
        "- tier: pro",
    ]
    assert run.cache_ttl == 60


async def test_a_profile_of_defaults_says_nothing_is_known(tracing: Tracing) -> None:
    invoker = ToolInvoker(ToolRegistry([profile_tool()]), tracing.tracer)
    everything_default = Features({"tier": "free"}, defaulted=frozenset({"tier"}))
    (run,) = await invoker.run([ToolCall("1", "profile", "{}")], with_features(everything_default))
    assert run.content.startswith("Nothing is known about this user's profile")
    (plain,) = await invoker.run([ToolCall("2", "profile", "{}")], caller())
    assert plain.content.startswith("Nothing is known")


class RecordingSearch(PassageSearch):
    """The real search, recording the tenant of every call."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.tenants: list[str] = []

    async def search(self, tenant: str, query: str, **options: Any) -> Any:
        self.tenants.append(tenant)
        return await super().search(tenant, query, **options)


@pytest.fixture
async def search(tmp_path: Path, shared_embedder: Embedder) -> AsyncIterator[RecordingSearch]:
    store = IndexStore(tmp_path / "indexes", shared_embedder)
    found = RecordingSearch(
        store,
        HybridRetriever(store),
        QueryBatcher(shared_embedder),
        TracerProvider().get_tracer("t"),
    )
    await found.ingest(
        "acme",
        [
            Document("acme-volcano", "Volcanoes erupt molten lava and ash.", title="Volcanoes"),
            Document("acme-bread", "Sourdough bread rises with wild yeast.", title="Bread"),
        ],
    )
    await found.ingest(
        "globex",
        [Document("globex-secret", "The secret volcano base of Globex is on an island.")],
    )
    yield found
    await found.aclose()


async def test_the_search_tool_sees_only_the_callers_documents(
    tracing: Tracing, search: RecordingSearch
) -> None:
    invoker = ToolInvoker(ToolRegistry([search_tool(search)]), tracing.tracer)
    runs = await invoker.run(
        [
            ToolCall("1", "search_documents", '{"query": "volcano base island", "top_k": 10}'),
            ToolCall("2", "search_documents", '{"query": "volcano", "tenant": "globex"}'),
        ],
        caller("acme"),
    )
    assert runs[0].status == "ok"
    assert "[acme-volcano] Volcanoes: Volcanoes erupt molten lava and ash." in runs[0].content
    assert "globex" not in runs[0].content.lower()
    # Naming another tenant is not even an argument the tool has.
    assert runs[1].status == "refused" and "Additional properties" in runs[1].content
    (other,) = await invoker.run(
        [ToolCall("3", "search_documents", '{"query": "volcano"}')], caller("globex")
    )
    assert "[globex-secret]" in other.content and "acme" not in other.content
    assert search.tenants == ["acme", "globex"]


async def test_the_search_tool_bounds_top_k_and_says_when_there_is_no_index(
    tracing: Tracing, search: RecordingSearch
) -> None:
    invoker = ToolInvoker(ToolRegistry(builtin_tools(search)), tracing.tracer)
    too_many, fine = await invoker.run(
        [
            ToolCall("1", "search_documents", '{"query": "bread", "top_k": 11}'),
            ToolCall("2", "search_documents", '{"query": "bread", "top_k": 1}'),
        ],
        caller("acme"),
    )
    assert too_many.status == "refused" and "maximum of 10" in too_many.content
    assert fine.status == "ok" and fine.content.startswith("[acme-bread] Bread: Sourdough")
    (empty,) = await invoker.run(
        [ToolCall("3", "search_documents", '{"query": "bread"}')], caller("initech")
    )
    assert empty.content == "The caller has no documents indexed yet."


def test_builtins_include_the_search_only_with_retrieval() -> None:
    assert [t.name for t in builtin_tools()] == ["calculator", "clock", "profile"]
    assert all(t.timeout_s == 0.5 for t in builtin_tools(timeout_s=0.5))
