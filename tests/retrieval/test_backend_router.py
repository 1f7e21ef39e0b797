"""Which backend serves a tenant: the default, settings' per-tenant overrides, and run-time
overrides in Redis (what `rag backend move` records), which win."""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import pytest

from app.services import build_backends
from app.settings import SettingsError
from retrieval import Embedder, HybridRetriever, IndexStore
from retrieval.access import Viewer
from retrieval.backends import RetrievalBackend
from retrieval.backends.embedded import EmbeddedBackend
from retrieval.backends.router import BackendRouter, RedisOverrides
from retrieval.backends.versions import RedisVersions
from tests.conftest import make_settings
from tests.support.servers import RedisServer, wait_for


class Named(EmbeddedBackend):
    def __init__(self, name: str, store: IndexStore) -> None:
        super().__init__(store, HybridRetriever(store))
        self.name = name


def backends(tmp_path: Path, embedder: Embedder) -> dict[str, RetrievalBackend]:
    store = IndexStore(tmp_path, embedder)
    return {"embedded": Named("embedded", store), "milvus": Named("milvus", store)}


def test_settings_overrides_and_recorded_moves_decide_in_that_order(
    tmp_path: Path, embedder: Embedder, redis_server: RedisServer
) -> None:
    prefix = f"r{uuid.uuid4().hex[:6]}:"
    overrides = RedisOverrides(redis_server.url, prefix, reload_interval_s=0.0)
    router = BackendRouter(backends(tmp_path, embedder), "embedded", {"big": "milvus"}, overrides)
    assert router.name_for("small") == "embedded" and router.name_for("big") == "milvus"
    router.record("small", "milvus")
    router.record("big", "embedded")
    # Another process (another replica) reads the same record.
    other = RedisOverrides(redis_server.url, prefix, reload_interval_s=0.0)
    follower = BackendRouter(backends(tmp_path, embedder), "embedded", {"big": "milvus"}, other)
    assert (follower.name_for("small"), follower.name_for("big")) == ("milvus", "embedded")
    with pytest.raises(KeyError):
        router.record("small", "elsewhere")


def test_redis_down_keeps_the_last_override_and_versions_seen(
    tmp_path: Path, embedder: Embedder
) -> None:
    server = RedisServer()
    server.start()
    try:
        # 5 s for the writes while it is up; once it is stopped, connections are refused at once.
        overrides = RedisOverrides(server.url, "x:", reload_interval_s=0.0, timeout_s=5.0)
        versions = RedisVersions(server.url, "x:", reload_interval_s=0.0, timeout_s=5.0)
        overrides.set("t", "milvus")
        assert versions.bump("t") == "1" and versions.bump("t") == "2"
    finally:
        server.stop()
    assert overrides.get("t") == "milvus"
    assert versions.get("t") == "2"
    assert versions.get("never-seen") == "0"


def test_a_backend_named_in_settings_but_not_built_is_a_settings_error(
    tmp_path: Path, embedder: Embedder, redis_server: RedisServer
) -> None:
    store = IndexStore(tmp_path, embedder)
    settings = make_settings(redis_server.url, "http://127.0.0.1:9")
    router = build_backends(settings, store, HybridRetriever(store), embedder)
    assert set(router.backends) == {"embedded"} and router.overrides is None
    with pytest.raises(ValueError, match="not configured"):
        BackendRouter({"embedded": EmbeddedBackend(store, HybridRetriever(store))}, "milvus")
    assert issubclass(SettingsError, ValueError)


def test_a_milvus_that_cannot_be_reached_is_an_error_saying_how_to_install_it() -> None:
    from retrieval.backends.milvus import MilvusUnavailable, connect
    from tests.support.servers import free_port

    with pytest.raises(MilvusUnavailable, match="make install"):
        connect(f"http://127.0.0.1:{free_port()}", timeout_s=1.0)


def test_versions_and_overrides_are_read_from_memory_and_follow_other_processes(
    redis_server: RedisServer,
) -> None:
    """The request path asks for a tenant's version and backend on the event loop: after the
    first read of a tenant, neither waits on Redis; a poller thread follows other processes'
    writes within its interval."""
    prefix = f"p{uuid.uuid4().hex[:6]}:"
    versions = RedisVersions(redis_server.url, prefix, reload_interval_s=0.05)
    overrides = RedisOverrides(redis_server.url, prefix, reload_interval_s=0.05)
    writer = RedisVersions(redis_server.url, prefix, reload_interval_s=0.0)
    mover = RedisOverrides(redis_server.url, prefix, reload_interval_s=0.0)
    try:
        assert versions.get("t") == "0"  # never written: the first read goes to Redis
        reads: list[str] = []
        real_get = versions.client.get
        versions.client.get = lambda key: reads.append(key) or real_get(key)  # type: ignore[method-assign]
        assert writer.bump("t") == "1"
        mover.set("t", "milvus")
        wait_for(lambda: versions.get("t") == "1", 10, "the poller's read of another's bump")
        wait_for(lambda: overrides.get("t") == "milvus", 10, "the poller's read of a move")
        assert reads == [], "a known tenant's version was read from Redis on the caller's thread"
        assert versions.bump("t") == "2" and versions.get("t") == "2"  # its own write at once
    finally:
        for closing in (versions, overrides, writer, mover):
            closing.close()


def test_with_redis_down_a_known_tenants_version_is_answered_without_waiting_on_it() -> None:
    server = RedisServer()
    server.start()
    versions = RedisVersions(server.url, "d:", reload_interval_s=0.05, timeout_s=5.0)
    try:
        assert versions.bump("t") == "1" and versions.get("t") == "1"
    finally:
        server.stop()
    try:
        # A read that went to the stopped Redis would raise or wait out its 5 s timeout inside
        # get(); from memory it returns the last value seen, whatever the poller meets.
        reads: list[str] = []
        versions.client.get = lambda key: reads.append(key)  # type: ignore[method-assign]
        assert [versions.get("t") for _ in range(100)] == ["1"] * 100
        assert reads == []
    finally:
        versions.close()


def test_a_version_or_override_that_is_not_text_neither_stops_the_poller_nor_raises(
    redis_server: RedisServer,
) -> None:
    """A damaged value (a review's reproducer, 2026-12-05): `get` raised, and the poller's
    thread died on it, so every later bump of every tenant went unseen by this process (its
    cache keys never changed again)."""
    prefix = f"p{uuid.uuid4().hex[:6]}:"
    versions = RedisVersions(redis_server.url, prefix, reload_interval_s=0.05)
    overrides = RedisOverrides(redis_server.url, prefix, reload_interval_s=0.05)
    writer = RedisVersions(redis_server.url, prefix, reload_interval_s=0.0)
    try:
        assert versions.get("good") == "0" and versions.get("bad") == "0"
        versions.client.set(versions._key("bad"), b"\xff\xfe")
        versions.client.hset(overrides.key, "bad", b"\xff")
        wait_for(lambda: versions.get("bad") != "0", 10, "the poller's read of the damage")
        assert writer.bump("good") == "1"
        wait_for(lambda: versions.get("good") == "1", 10, "the poller's read of a later bump")
        wait_for(lambda: overrides.get("bad") is not None, 10, "the overrides' read")
        assert RedisVersions(redis_server.url, prefix, reload_interval_s=0.0).get("bad")
    finally:
        for closing in (versions, overrides, writer):
            closing.close()


def test_a_backend_that_cannot_be_reached_is_refused_then_tried_again_and_used_once_built(
    tmp_path: Path, embedder: Embedder, redis_server: RedisServer
) -> None:
    from retrieval.backends import BackendUnavailable
    from retrieval.backends.lazy import LazyBackend
    from retrieval.backends.milvus import VersionAnswers, connect
    from tests.support.servers import free_port

    store = IndexStore(tmp_path, embedder)
    prefix = f"z{uuid.uuid4().hex[:6]}:"
    versions = RedisVersions(redis_server.url, prefix, reload_interval_s=0.0)
    RedisVersions(redis_server.url, prefix, reload_interval_s=0.0).bump("t")
    attempts: list[str] = []

    def build() -> RetrievalBackend:
        attempts.append("tried")
        if len(attempts) == 1:  # a Milvus server that is not there
            connect(f"http://127.0.0.1:{free_port()}", timeout_s=1.0)
        return Named("milvus", store)

    lazy = LazyBackend("milvus", build, VersionAnswers(versions), retry_s=0.3)
    # What needs no store (the event loop asks it) is answered without connecting.
    assert (lazy.version("t"), lazy.has_index("t"), lazy.has_index("u")) == ("1", True, False)
    assert lazy.access_scope("t", None) == ("1", {"groups": [], "user": None})
    viewer = Viewer("ann", frozenset({"b", "a"}))  # as MilvusBackend answered: the cache keys
    assert lazy.access_scope("t", viewer) == ("1", {"groups": ["a", "b"], "user": "ann"})
    assert lazy.idf("t", None, "q") == {}
    assert not lazy.built and attempts == []
    with pytest.raises(BackendUnavailable, match="cannot be reached") as refused:
        lazy.document_ids("t")
    assert "127.0.0.1" not in str(refused.value)  # the address only in the log
    with pytest.raises(BackendUnavailable):
        lazy.stats("t")  # within retry_s: refused at once, not tried again
    assert attempts == ["tried"]
    wait_for(lazy.try_build, timeout=5.0, what="the retry after retry_s")
    assert lazy.built and attempts == ["tried", "tried"]
    assert lazy.document_ids("t") == set() and lazy.stats("t").backend == "milvus"
    assert lazy.get() is lazy.get() and attempts == ["tried", "tried"]  # built once
    assert lazy.answering
    built = lazy.get()
    real = built.document_ids

    def unavailable(tenant: str) -> set[str]:
        raise BackendUnavailable("the store did not answer")

    built.document_ids = unavailable  # type: ignore[method-assign]
    with pytest.raises(BackendUnavailable):
        lazy.document_ids("t")  # a call that found it unavailable: /readyz says so
    assert not lazy.answering
    built.document_ids = real  # type: ignore[method-assign]
    assert lazy.document_ids("t") == set() and lazy.answering
    lazy.close()
    with pytest.raises(BackendUnavailable, match="closed"):
        lazy.document_ids("t")
    versions.close()


def test_while_one_thread_connects_the_others_are_refused_at_once_and_a_close_is_kept(
    tmp_path: Path, embedder: Embedder, redis_server: RedisServer
) -> None:
    import threading

    from retrieval.backends import BackendUnavailable
    from retrieval.backends.lazy import LazyBackend
    from retrieval.backends.milvus import VersionAnswers

    store = IndexStore(tmp_path, embedder)
    connecting, connected = threading.Event(), threading.Event()
    closed: list[str] = []

    class Closing(Named):
        def close(self) -> None:
            closed.append(self.name)

    def slow_build() -> RetrievalBackend:
        connecting.set()
        connected.wait(10)
        return Closing("milvus", store)

    versions = RedisVersions(redis_server.url, "w:", reload_interval_s=0.0)
    lazy = LazyBackend("milvus", slow_build, VersionAnswers(versions))
    results: list[object] = []

    def list_documents() -> None:
        try:
            results.append(lazy.document_ids("t"))
        except BackendUnavailable as exc:
            results.append(str(exc))

    first = threading.Thread(target=list_documents)
    first.start()
    assert connecting.wait(10)
    with pytest.raises(BackendUnavailable, match="being connected"):
        lazy.document_ids("t")  # not a wait for the connection under way
    assert lazy.version("t") == "0"
    lazy.close()  # returns at once: the thread connecting closes what it builds
    connected.set()
    first.join(10)
    assert results == ["The milvus retrieval backend is closed."]
    assert closed == ["milvus"] and not lazy.built  # what it built is closed, not handed out
    with pytest.raises(BackendUnavailable, match="closed"):
        lazy.get()
    versions.close()


def test_the_apps_connection_runs_in_a_thread_of_its_own_and_a_call_is_refused_meanwhile(
    tmp_path: Path, embedder: Embedder
) -> None:
    import threading

    from retrieval.backends import BackendUnavailable
    from retrieval.backends.lazy import LazyBackend

    store = IndexStore(tmp_path, embedder)
    release, threads, closed = threading.Event(), [], []

    class Answers:
        def close(self) -> None:
            closed.append("answers")

    def build() -> RetrievalBackend:
        threads.append(threading.current_thread().name)
        release.wait(10)
        return Named("milvus", store)

    # In the app a call never waits for the connection: the pools' threads serve every tenant.
    lazy = LazyBackend("milvus", build, Answers(), background=True)  # type: ignore[arg-type]
    with pytest.raises(BackendUnavailable, match="being connected"):
        lazy.document_ids("t")
    wait_for(lambda: threads == ["milvus-connect"], timeout=5.0, what="the connecting thread")
    with pytest.raises(BackendUnavailable, match="being connected"):
        lazy.stats("t")  # refused at once again, and no second connection is started
    release.set()
    wait_for(lambda: lazy.built, timeout=5.0, what="the connection")
    assert lazy.document_ids("t") == set() and threads == ["milvus-connect"]

    never = LazyBackend("milvus", build, Answers())  # type: ignore[arg-type]
    never.close()  # never built: what its answers hold (a Redis poller) is closed
    assert closed == ["answers"]


def test_an_error_no_wait_mends_is_raised_as_it_is() -> None:
    from retrieval.backends.lazy import LazyBackend
    from retrieval.backends.milvus import MilvusNotInstalled

    def build() -> RetrievalBackend:
        raise MilvusNotInstalled("pymilvus is not installed")

    lazy = LazyBackend("milvus", build, None, permanent=(MilvusNotInstalled,))  # type: ignore[arg-type]
    with pytest.raises(MilvusNotInstalled):
        lazy.try_build()  # the app's start fails on it, as before


def test_a_tenant_not_asked_about_for_a_while_is_no_longer_polled() -> None:
    # Every tenant a replica had ever asked about was read by every poll (one MGET each 0.2 s):
    # at 100,000 tenants a poll took 212 ms, longer than its interval (a review's find). A
    # forgotten tenant keeps its last value for a read while Redis is down (a second review:
    # it read as "0", no index, and was answered without its documents).
    server = RedisServer()
    server.start()
    versions = RedisVersions(server.url, "v:", reload_interval_s=0.05, forget_after_s=1.0)
    other = RedisVersions(server.url, "v:", reload_interval_s=0.0)
    try:
        assert other.bump("quiet") == "1"
        assert versions.get("busy") == "0" and versions.get("quiet") == "1"
        for _ in range(200):  # "busy" is asked about all the while, until "quiet" is forgotten
            assert versions.get("busy") in ("0", "1")
            if "quiet" not in versions._seen:
                break
            time.sleep(0.05)
        assert "quiet" not in versions._seen and "busy" in versions._seen
        assert other.bump("quiet") == "2" and other.bump("busy") == "1"
        assert versions.get("quiet") == "2", "read anew from Redis"
        wait_for(lambda: versions.get("busy") == "1", 5, "the poll")
        wait_for(lambda: "quiet" not in versions._seen, 5, "forgotten again")
        server.stop()
        assert versions.get("quiet") == "2", "its last value, while Redis is down"
        assert versions.get("busy") == "1"
    finally:
        versions.close()
        other.close()
        server.stop()


def test_a_poll_that_read_before_this_process_bumped_does_not_take_the_bump_back(
    redis_server: RedisServer,
) -> None:
    # The poll's MGET read the old value, the write's bump came in meanwhile, and the poll then
    # wrote the old value over it: this process's next cache keys used the version before its
    # own write for one interval (a review's find, by reading).
    versions = RedisVersions(redis_server.url, f"b{uuid.uuid4().hex[:6]}:", reload_interval_s=60)
    try:
        assert versions.get("t") == "0"
        real = versions.client.mget

        def racing(keys: list[str]) -> list[bytes | None]:
            read = real(keys)
            assert versions.bump("t") == "1"  # a write of this process, as the read returns
            return read

        versions.client.mget = racing  # type: ignore[method-assign]
        versions._refresh()
        assert versions.get("t") == "1"
        versions.client.mget = real  # type: ignore[method-assign]
        versions._refresh()
        assert versions.get("t") == "1" and not versions._bumped
    finally:
        versions.close()
