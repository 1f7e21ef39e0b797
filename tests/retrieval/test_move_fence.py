"""The fence that keeps writes out of a tenant's move (retrieval.backends.moves), on a real
Redis: a write under way when a move starts is waited for and moved with the tenant, a write
while the move runs is refused, a killed mover or writer frees the tenant, and a move whose
source changed during the copy does not switch. Real embedded index and Milvus Lite."""

from __future__ import annotations

import argparse
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from app.cli import backend as backend_cli
from retrieval.backends import ChunkBatch
from retrieval.backends.embedded import EmbeddedBackend
from retrieval.backends.milvus import MilvusBackend
from retrieval.backends.moves import MoveFence, MoveUnderway, TenantMoving, WriteLapsed
from retrieval.backends.router import BackendRouter, RedisOverrides
from retrieval.documents import Document
from retrieval.embeddings import Embedder
from retrieval.hybrid import HybridRetriever
from retrieval.store import IndexStore
from tests.retrieval.backends_support import new_tenant
from tests.support.servers import RedisServer


class Setup:
    def __init__(self, tmp_path: Path, embedder: Embedder, milvus: MilvusBackend, url: str):
        self.tenant = new_tenant("mv")
        self.prefix = f"{self.tenant}:"
        store = IndexStore(tmp_path / "indexes", embedder)
        self.embedded = EmbeddedBackend(store, HybridRetriever(store))
        self.milvus = milvus
        self.overrides = RedisOverrides(url, self.prefix, reload_interval_s=0.0)
        self.fence = self.overrides.fence()
        self.router = BackendRouter(
            {"embedded": self.embedded, "milvus": milvus},
            overrides=self.overrides,
            fence=self.fence,
        )
        self.redis = redis.Redis.from_url(url)

    def moving(self) -> bool:
        return bool(self.redis.exists(f"{self.prefix}backend-move:{self.tenant}"))

    def close(self) -> None:
        self.fence.close()
        self.overrides.close()
        self.redis.close()


@pytest.fixture
def setup(
    tmp_path: Path,
    embedder: Embedder,
    milvus: MilvusBackend,
    redis_server: RedisServer,
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[Setup]:
    s = Setup(tmp_path, embedder, milvus, redis_server.url)
    monkeypatch.setattr(backend_cli, "backend_router", lambda: s.router)
    monkeypatch.setattr(backend_cli, "SETTLE_S", 0.0)  # one process here: nothing to settle
    yield s
    s.close()


def wait_for(condition: Callable[[], bool], what: str, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def enter(router: BackendRouter, tenant: str) -> str:
    """Start (and at once end) a write of `tenant`: the backend it would go to."""
    with router.writing(tenant) as backend:
        return backend.name


def docs(*ids: str) -> list[Document]:
    return [Document(i, f"Harbour note {i} on the tides.") for i in ids]


def test_a_write_while_a_move_runs_is_refused_and_other_tenants_write_on(setup: Setup) -> None:
    other = new_tenant()
    token = setup.fence.begin(setup.tenant)
    with pytest.raises(TenantMoving) as refused:
        enter(setup.router, setup.tenant)
    assert refused.value.retry_after_s > 0
    with setup.router.writing(other) as backend:
        backend.upsert(other, docs("a"))
    with pytest.raises(MoveUnderway):
        setup.fence.begin(setup.tenant)  # one move of a tenant at a time
    setup.fence.end(setup.tenant, token)
    with setup.router.writing(setup.tenant) as backend:
        assert backend.upsert(setup.tenant, docs("a")).documents == 1
    assert setup.fence.writes_in_flight(setup.tenant) == 0


def test_a_killed_movers_fence_lapses_and_a_killed_writers_lease_ends(setup: Setup) -> None:
    setup.fence.begin(setup.tenant, ttl_s=0.3)  # never renewed, never ended: killed
    wait_for(lambda: not setup.moving(), "the fence to lapse")
    enter(setup.router, setup.tenant)

    # A lease of 3 s: long enough that the count just after the enter sees it on a loaded
    # machine, short enough to wait out.
    writer = MoveFence(setup.overrides.client, setup.prefix, setup.overrides.key, lease_s=3.0)
    writer.enter(setup.tenant)
    writer.close()  # the process dies mid-write: no renewal, no leave
    assert setup.fence.writes_in_flight(setup.tenant) == 1
    wait_for(lambda: setup.fence.writes_in_flight(setup.tenant) == 0, "the lease to end")


def test_a_write_longer_than_its_lease_keeps_it_while_it_runs(setup: Setup) -> None:
    # Renewed every 2/3 s: a renewal can be over a second late on a loaded machine and still
    # keep the lease.
    writer = MoveFence(setup.overrides.client, setup.prefix, setup.overrides.key, lease_s=2.0)
    token, _ = writer.enter(setup.tenant)
    time.sleep(5.0)  # two and a half leases: renewed by the writer's thread
    assert setup.fence.writes_in_flight(setup.tenant) == 1
    writer.leave(setup.tenant, token)
    assert setup.fence.writes_in_flight(setup.tenant) == 0
    writer.close()


def test_a_write_under_way_when_a_move_starts_is_waited_for_and_moved_with_the_tenant(
    setup: Setup,
) -> None:
    tenant = setup.tenant
    setup.embedded.upsert(tenant, docs("d1", "d2", "d3"))
    inside, release = threading.Event(), threading.Event()
    errors: list[BaseException] = []

    def slow_write() -> None:
        try:
            with setup.router.writing(tenant) as backend:
                inside.set()
                release.wait(30)
                backend.upsert(tenant, docs("late"))
        except BaseException as exc:
            errors.append(exc)

    writer = threading.Thread(target=slow_write)
    writer.start()
    assert inside.wait(10)
    outcome: list[int] = []
    mover = threading.Thread(
        target=lambda: outcome.append(
            backend_cli.move(argparse.Namespace(tenant=tenant, to="milvus", batch=2))
        )
    )
    mover.start()
    wait_for(setup.moving, "the move to fence the tenant")
    with pytest.raises(TenantMoving):  # a new write waits for the move
        enter(setup.router, tenant)
    time.sleep(0.3)
    assert mover.is_alive() and setup.milvus.document_ids(tenant) == set()  # waiting
    release.set()
    writer.join(30)
    mover.join(60)
    assert not errors and outcome == [0]
    assert setup.router.name_for(tenant) == "milvus"
    assert setup.milvus.document_ids(tenant) == {"d1", "d2", "d3", "late"}  # nothing lost
    assert setup.embedded.document_ids(tenant) == set()
    assert not setup.moving()
    with setup.router.writing(tenant) as backend:  # writes follow the tenant at once
        assert backend.name == "milvus"
        backend.upsert(tenant, docs("after"))
    assert "after" in setup.milvus.document_ids(tenant)


def test_a_move_whose_source_changed_during_the_copy_does_not_switch(
    setup: Setup, monkeypatch: pytest.MonkeyPatch
) -> None:
    tenant = setup.tenant
    setup.embedded.upsert(tenant, docs("d1", "d2", "d3", "d4"))
    real = setup.milvus.import_chunks
    calls: list[int] = []

    def import_then_write_behind(t: str, batch: ChunkBatch) -> Any:
        calls.append(1)
        if len(calls) == 1:  # a write the fence missed (as if it had lapsed)
            setup.embedded.upsert(tenant, docs("sneaked"))
        return real(t, batch)

    monkeypatch.setattr(setup.milvus, "import_chunks", import_then_write_behind)
    args = argparse.Namespace(tenant=tenant, to="milvus", batch=2)
    assert backend_cli.move(args) == 1
    assert setup.router.name_for(tenant) == "embedded"
    assert "sneaked" in setup.embedded.document_ids(tenant)
    monkeypatch.setattr(setup.milvus, "import_chunks", real)
    assert backend_cli.move(args) == 0  # run again: it completes
    assert setup.milvus.document_ids(tenant) == {"d1", "d2", "d3", "d4", "sneaked"}


def test_a_write_when_redis_does_not_answer_is_refused_not_guessed(
    setup: Setup, monkeypatch: pytest.MonkeyPatch
) -> None:
    from retrieval.backends import BackendUnavailable

    def down(**_: Any) -> Any:
        raise redis.ConnectionError("refused")

    monkeypatch.setattr(setup.fence, "_enter", down)
    with pytest.raises(BackendUnavailable, match="moves"):
        enter(setup.router, setup.tenant)


def test_a_write_that_outlived_its_lease_is_refused_so_it_is_sent_again(
    setup: Setup, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A process that could not renew its write's lease (paused, cut off from Redis) while a
    move pruned it: the write may have missed the copy, so its caller is told to retry."""
    # 3 s: the write at the end, entered and left at once, ends within its lease however
    # loaded the machine.
    paused = MoveFence(setup.overrides.client, setup.prefix, setup.overrides.key, lease_s=3.0)
    paused._renewer.stop()  # its renewals never run
    router = BackendRouter(
        {"embedded": setup.embedded, "milvus": setup.milvus},
        overrides=setup.overrides,
        fence=paused,
    )
    with pytest.raises(WriteLapsed) as lapsed, router.writing(setup.tenant) as backend:
        wait_for(lambda: setup.fence.writes_in_flight(setup.tenant) == 0, "the prune")
        backend.upsert(setup.tenant, docs("late"))
    assert isinstance(lapsed.value, TenantMoving)  # the same 503 index_moving on the API
    assert enter(router, setup.tenant) == "embedded"  # a write within its lease is fine
    paused.close()


def test_a_move_cut_short_after_its_record_is_completed_by_running_it_again(
    setup: Setup, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    tenant = setup.tenant
    setup.embedded.upsert(tenant, docs("d1", "d2"))
    real = setup.embedded.delete

    def killed(t: str, ids: Any) -> Any:
        raise KeyboardInterrupt  # the mover stopped between the record and the delete

    monkeypatch.setattr(setup.embedded, "delete", killed)
    args = argparse.Namespace(tenant=tenant, to="milvus", batch=2)
    with pytest.raises(KeyboardInterrupt):
        backend_cli.move(args)
    assert setup.router.name_for(tenant) == "milvus" and not setup.moving()
    assert setup.embedded.document_ids(tenant) == {"d1", "d2"}  # left behind, not served
    monkeypatch.setattr(setup.embedded, "delete", real)
    assert backend_cli.move(args) == 0
    assert "removed 2 documents" in capsys.readouterr().out
    assert setup.embedded.document_ids(tenant) == set()
    assert setup.milvus.document_ids(tenant) == {"d1", "d2"}


def test_a_move_redis_cannot_answer_exits_with_a_message_not_a_traceback(
    setup: Setup, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def down(*_: Any, **__: Any) -> Any:
        raise redis.ConnectionError("refused")

    monkeypatch.setattr(setup.fence, "begin", down)
    assert backend_cli.move(argparse.Namespace(tenant=setup.tenant, to="milvus", batch=2)) == 1
    assert "Redis did not answer" in capsys.readouterr().err
