"""Ingest, replace, delete, versions, and snapshots that survive concurrency and crashes."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from prometheus_client import REGISTRY

import retrieval.store as store_module
from app.services import build_index_store
from app.settings import RetrievalSettings
from bench.snapshot_memory import corpus
from retrieval.access import AccessList, Viewer
from retrieval.documents import Document
from retrieval.embeddings import Embedder
from retrieval.filters import parse_filters
from retrieval.hybrid import HybridRetriever, SearchResult
from retrieval.index import TenantIndex
from retrieval.snapshots import IndexUnreadable, read_snapshot
from retrieval.store import IndexStore

from .conftest import CORPUS, CountingEmbedder

REPO = Path(__file__).resolve().parents[2]


def _search(store: IndexStore, embedder: Embedder, query: str, tenant: str = "t") -> SearchResult:
    return HybridRetriever(store).search(tenant, query, embedder.embed([query])[0], top_k=3)


def test_ingest_then_search_finds_the_document(store: IndexStore, embedder: Embedder) -> None:
    result = store.upsert("t", CORPUS)
    assert (result.documents, result.chunks) == (len(CORPUS), len(CORPUS))
    found = _search(store, embedder, "what causes ocean tides")
    assert found.hits[0].document_id == "tides"
    assert found.version == result.version == store.version("t")
    assert set(found.timings_ms) == {"filter", "bm25", "vector", "fusion"}


def test_reingesting_a_document_replaces_it(store: IndexStore, embedder: Embedder) -> None:
    store.upsert("t", CORPUS)
    store.upsert("t", [Document("tides", "Glaciers carve valleys as they slowly move downhill.")])
    index = store.current("t")
    assert index is not None and index.documents == len(CORPUS)
    texts = [h.text for h in _search(store, embedder, "glaciers carving valleys").hits]
    assert texts[0] == "Glaciers carve valleys as they slowly move downhill."
    assert all("Moon" not in h.text for h in _search(store, embedder, "moon gravity tides").hits)


def test_delete_removes_the_document(store: IndexStore, embedder: Embedder) -> None:
    store.upsert("t", CORPUS)
    result = store.delete("t", ["jazz", "not-there"])
    assert (result.documents, result.chunks, result.total_documents) == (1, 1, len(CORPUS) - 1)
    hits = _search(store, embedder, "jazz music from New Orleans").hits
    assert "jazz" not in {h.document_id for h in hits}


def test_every_ingest_and_delete_publishes_a_new_version(store: IndexStore) -> None:
    assert store.version("t") == "0" and store.current("t") is None
    versions = [store.upsert("t", CORPUS[:2]).version]
    versions.append(store.upsert("t", CORPUS[:2]).version)
    versions.append(store.delete("t", ["aspirin"]).version)
    versions.append(store.upsert("t", CORPUS[2:3]).version)
    assert len(set(versions)) == 4 and store.version("t") == versions[-1]
    # Only the last two versions are kept on disk (none before a delete: see below).
    on_disk = sorted(p.name for p in (store.root / "t").iterdir() if not p.name.startswith("."))
    assert on_disk == sorted(["CURRENT", *versions[-2:]])


def test_only_new_text_is_embedded_on_reingest(
    tmp_path: Path, counting_embedder: CountingEmbedder
) -> None:
    store = IndexStore(tmp_path, counting_embedder)
    store.upsert("t", CORPUS)
    assert sum(counting_embedder.calls) == len(CORPUS)
    store.upsert("t", [*CORPUS[:3], Document("new", "A brand new passage about owls.")])
    assert sum(counting_embedder.calls) == len(CORPUS) + 1


def test_an_ingest_embeds_its_texts_longest_first_so_each_call_pads_little(
    tmp_path: Path, counting_embedder: CountingEmbedder, embedder: Embedder
) -> None:
    """Calls of 64 texts in length order (each call pads to its longest)."""
    docs = [Document(f"d{i}", "word " * (1 + (i * 37) % 150)) for i in range(150)]
    store = IndexStore(tmp_path / "sorted", counting_embedder)
    store.upsert("t", docs)
    sent = [len(t) for call in counting_embedder.texts for t in call]
    assert counting_embedder.calls == [64, 64, 22]
    assert sent == sorted(sent, reverse=True)
    # Each vector is its own text's (reordering must not shuffle them): the best passage for
    # a query is still the one about it.
    store.upsert("t", CORPUS)
    query = "what causes ocean tides"
    hits = HybridRetriever(store).search("t", query, embedder.embed([query])[0], top_k=1).hits
    assert hits[0].document_id == "tides"

    counting_embedder.texts.clear()
    IndexStore(tmp_path / "unsorted", counting_embedder, sort_for_embedding=False).upsert("t", docs)
    unsorted = [len(t) for call in counting_embedder.texts for t in call]
    assert unsorted != sorted(unsorted, reverse=True)  # document order, as before


def test_another_store_on_the_same_root_sees_new_versions(
    store: IndexStore, embedder: Embedder
) -> None:
    reader = IndexStore(store.root, embedder, reload_interval_s=0.0)
    store.upsert("t", CORPUS[:3])
    first = reader.current("t")
    assert first is not None and len(first) == 3
    store.upsert("t", CORPUS[3:6])
    second = reader.current("t")
    assert second is not None and len(second) == 6 and second.version == store.version("t")


def test_loaded_says_whether_current_would_load_a_snapshot_and_never_loads_one(
    store: IndexStore, embedder: Embedder
) -> None:
    # The request path asks on the event loop, and loads in the search pool when it says no.
    reader = IndexStore(store.root, embedder, reload_interval_s=0.0)
    assert reader.loaded("t"), "no index: nothing to load"
    store.upsert("t", CORPUS[:3])
    assert store.loaded("t"), "the writer holds what it published"
    assert not reader.loaded("t") and not reader.loaded("t"), "another replica: not yet"
    assert reader._entry("t").index is None, "asking loads nothing"
    assert reader.current("t") is not None and reader.loaded("t")
    store.upsert("t", CORPUS[3:6])
    assert not reader.loaded("t"), "a newer version published elsewhere"
    assert reader.current("t") is not None and reader.loaded("t")


def test_reads_on_the_event_loop_never_load_a_snapshot_nor_wait_for_one(
    store: IndexStore, embedder: Embedder
) -> None:
    # A review (2026-12-07, sixth session): a request past its auth stage read the access scope
    # on the event loop while another request's load of a new version held the tenant's lock,
    # and waited for it there (352 ms). `peek` answers from what is loaded, or not at all.
    from retrieval.backends.embedded import EmbeddedBackend

    reader = IndexStore(store.root, embedder, reload_interval_s=0.0)
    backend = EmbeddedBackend(reader, HybridRetriever(reader))
    store.upsert("t", [*CORPUS[:3], Document("memo", "The merger.", access=AccessList(
        frozenset({"board"}), frozenset()))])  # fmt: skip
    viewer = Viewer("ann", frozenset({"board", "staff"}))
    version = store.version("t")
    assert backend.access_scope("t", viewer) == (
        version,
        {"viewer": {"groups": ["board", "staff"], "user": "ann"}},
    ), "not loaded here: the whole viewer, and nothing loaded"
    assert reader._entry("t").index is None and backend.idf("t", viewer, "merger") == {}
    assert backend.has_index("t") and reader._entry("t").index is None
    assert reader.current("t") is not None
    assert backend.access_scope("t", viewer) == (version, {"groups": ["board"], "user": None})
    store.upsert("t", CORPUS[3:5])  # a new version, published by another replica
    entry = reader._entry("t")
    with entry.lock:  # another thread loading it
        done = threading.Event()
        answers: list[Any] = []
        thread = threading.Thread(
            target=lambda: (answers.append(backend.access_scope("t", viewer)), done.set())
        )
        thread.start()
        assert done.wait(5), "the read waited for the lock"
    thread.join()
    assert answers == [(store.version("t"), {"viewer": {"groups": ["board", "staff"],
                                                         "user": "ann"}})]  # fmt: skip
    assert entry.index is not None and entry.index.version == version, "and loaded nothing"


def test_snapshots_published_during_searches_do_not_disturb_them(
    store: IndexStore, embedder: Embedder
) -> None:
    store.upsert("t", CORPUS)
    fast = IndexStore(store.root, embedder, reload_interval_s=0.0)
    retriever = HybridRetriever(fast)
    query = "aspirin heart attack"
    vector = embedder.embed([query])[0]
    seen: list[SearchResult] = []
    errors: list[BaseException] = []
    stop = threading.Event()

    def search_loop() -> None:
        try:
            while not stop.is_set():
                seen.append(retriever.search("t", query, vector, top_k=3))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=search_loop) for _ in range(3)]
    for t in threads:
        t.start()
    versions = {}
    for i in range(4):
        extra = Document(f"extra{i}", f"Aspirin trial number {i} on heart attack prevention.")
        versions[store.upsert("t", [extra]).version] = i + 1
    stop.set()
    for t in threads:
        t.join()
    assert not errors
    assert len({r.version for r in seen}) >= 2
    for result in seen:
        # Each result is internally consistent with the version it reports.
        extras = {h.document_id for h in result.hits if h.document_id.startswith("extra")}
        allowed = {f"extra{i}" for i in range(versions.get(result.version, 0))}
        assert extras <= allowed
        assert result.allowed == len(CORPUS) + versions.get(result.version, 0)


_KILLED_WRITER = """
import sys, time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from retrieval import Document, Embedder, IndexStore
store = IndexStore(Path(sys.argv[1]), Embedder())
def hang(path):
    print("written", path, flush=True)
    time.sleep(120)
store.before_publish = hang
store.upsert("t", [Document("intruder", "A document that must never be published.")])
"""


def test_killed_ingest_leaves_the_old_version_serving_and_the_store_writable(
    store: IndexStore, embedder: Embedder
) -> None:
    before = store.upsert("t", CORPUS).version
    with subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(_KILLED_WRITER), str(store.root)],
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    ) as proc:
        try:
            assert proc.stdout is not None
            line = proc.stdout.readline()
            assert line.startswith("written"), line
            temp = Path(line.split()[1])
            assert (temp / "meta.json").exists()
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL

    fresh = IndexStore(store.root, embedder)
    assert fresh.version("t") == before
    index = fresh.current("t")
    assert index is not None and "intruder" not in index.rows_by_document
    assert _search(fresh, embedder, "never be published").hits[0].document_id != "intruder"

    after = fresh.upsert("t", [Document("later", "Written after the crash.")])
    assert after.version != before and after.total_documents == len(CORPUS) + 1
    assert not temp.exists()


@pytest.mark.parametrize("tenant", ["", "../etc", "a/b", ".", "..", "x" * 65, "sp ace"])
def test_invalid_tenant_names_are_refused(store: IndexStore, tenant: str) -> None:
    with pytest.raises(ValueError, match="invalid tenant"):
        store.version(tenant)
    with pytest.raises(ValueError, match="invalid tenant"):
        store.upsert(tenant, CORPUS[:1])


def test_calls_that_change_nothing_publish_no_version(store: IndexStore) -> None:
    assert store.delete("t", ["x"]).version == "0" and not (store.root / "t" / "CURRENT").exists()
    version = store.upsert("t", CORPUS[:2]).version
    assert store.upsert("t", []).version == version
    unchanged = store.delete("t", ["not-there"])
    assert (unchanged.version, unchanged.documents, unchanged.total_documents) == (version, 0, 2)


# A published snapshot that cannot be read (a review's reproducers, 2026-12-05: each was a
# 500 for every search, ingest and delete of the tenant; a pointer naming another tenant's
# directory served that tenant's documents, and the next ingest copied them in).


def damage(directory: Path, how: str) -> None:
    """Damage the snapshot ``directory`` as a partial copy or an edit would."""
    if how == "chunks not JSON":
        (directory / "chunks.json").write_text("{not json")
    elif how == "chunks emptied":
        (directory / "chunks.json").write_text("")
    elif how == "vectors halved":
        data = (directory / "vectors.npy").read_bytes()
        (directory / "vectors.npy").write_bytes(data[: len(data) // 2])
    elif how == "vectors of another dimension":
        rows = np.load(directory / "vectors.npy").shape[0]
        np.save(directory / "vectors.npy", np.zeros((rows, 128), dtype=np.float32))
    elif how == "terms cut short":
        (directory / "terms.json").write_text('["a"]')
    elif how == "a file missing":
        (directory / "tf.npz").unlink()
    elif how == "another format":
        meta = json.loads((directory / "meta.json").read_text())
        (directory / "meta.json").write_text(json.dumps({**meta, "format": 999}))
    elif how == "metadata not an object":
        # A review's find (2026-12-07): counting what the snapshot holds raised after it was
        # loaded, two searches were a 500, and the tenant was then served uncounted.
        chunks = json.loads((directory / "chunks.json").read_text())
        chunks["metadata"][0] = ["year", 2019]
        (directory / "chunks.json").write_text(json.dumps(chunks))


DAMAGE = [
    "chunks not JSON",
    "chunks emptied",
    "vectors halved",
    "vectors of another dimension",
    "terms cut short",
    "a file missing",
    "another format",
    "metadata not an object",
]


@pytest.mark.parametrize("how", DAMAGE)
def test_a_snapshot_that_cannot_be_read_is_index_unreadable_for_its_tenant_only(
    store: IndexStore, embedder: Embedder, how: str
) -> None:
    store.upsert("t", CORPUS[:3])
    store.upsert("other", CORPUS[3:5])
    damage(store.root / "t" / store.version("t"), how)
    fresh = IndexStore(store.root, embedder)
    with pytest.raises(IndexUnreadable) as raised:
        fresh.current("t")
    assert "'t'" in str(raised.value) and str(store.root) not in str(raised.value)
    with pytest.raises(IndexUnreadable):
        fresh.upsert("t", CORPUS[5:6])  # nothing is built on what cannot be read
    assert len(fresh.current("other") or ()) == 2


def test_a_replica_keeps_serving_the_snapshot_it_has_when_the_next_cannot_be_read(
    store: IndexStore, embedder: Embedder, monkeypatch: pytest.MonkeyPatch
) -> None:
    serving = IndexStore(store.root, embedder, reload_interval_s=0.0)
    store.upsert("t", CORPUS[:3])
    first = serving.current("t")
    assert first is not None
    store.upsert("t", CORPUS[3:4])
    damage(store.root / "t" / store.version("t"), "chunks not JSON")
    reads: list[Path] = []
    real = store_module.read_snapshot

    def counted(directory: Path) -> object:
        reads.append(directory)
        return real(directory)

    monkeypatch.setattr(store_module, "read_snapshot", counted)
    assert serving.current("t") is first and serving.current("t") is first
    assert len(reads) == 1, "the damaged snapshot is not parsed again on every request"


@pytest.mark.parametrize("pointer", ["../other/{version}", "", "\xff\xfe", "00000001"])
def test_a_pointer_that_names_no_version_of_the_tenant_is_never_followed(
    store: IndexStore, embedder: Embedder, pointer: str
) -> None:
    store.upsert("t", CORPUS[:3])
    store.upsert("other", CORPUS[3:5])
    text = pointer.format(version=store.version("other"))
    (store.root / "t" / "CURRENT").write_bytes(text.encode("latin-1"))
    fresh = IndexStore(store.root, embedder)
    with pytest.raises(IndexUnreadable):
        fresh.current("t")
    with pytest.raises(IndexUnreadable):
        fresh.upsert("t", CORPUS[5:6])
    assert len(fresh.current("other") or ()) == 2


@pytest.mark.parametrize("how", DAMAGE)
def test_restore_publishes_the_newest_readable_version_and_every_replica_follows(
    store: IndexStore, embedder: Embedder, how: str
) -> None:
    replica = IndexStore(store.root, embedder, reload_interval_s=0.0)
    store.upsert("t", CORPUS[:3])
    good = store.version("t")
    store.upsert("t", CORPUS[3:4])
    bad = store.version("t")
    damage(store.root / "t" / bad, how)
    with pytest.raises(IndexUnreadable):
        replica.current("t")  # it has no earlier snapshot loaded: nothing to serve

    restored = IndexStore(store.root, embedder).restore("t")

    assert restored == store_module.Restored(bad, good, 3, 3)
    assert (store.root / "t" / "CURRENT").read_text() == good
    assert (store.root / "t" / bad).is_dir()  # left for a look; the next write prunes it
    index = replica.current("t")  # past its 5 s wait on the damaged version: a new pointer
    assert index is not None and index.version == good
    assert sorted(index.rows_by_document) == sorted(d.id for d in CORPUS[:3])
    assert IndexStore(store.root, embedder).restore("t") is None  # nothing left to restore
    after = IndexStore(store.root, embedder)
    after.upsert("t", CORPUS[3:5])  # writes work again, on the restored version
    version = after.version("t")
    assert version > bad, "a new version never reuses the unreadable one's number"
    assert sorted(p.name for p in (store.root / "t").iterdir() if not p.name.startswith(".")) == [
        good,
        version,
        "CURRENT",
    ]
    assert len(replica.current("t") or ()) == 5


def test_restore_follows_no_pointer_and_picks_the_newest_kept_version(
    store: IndexStore, embedder: Embedder
) -> None:
    store.upsert("t", CORPUS[:3])
    store.upsert("t", CORPUS[3:4])
    newest = store.version("t")
    store.upsert("other", CORPUS[4:5])
    (store.root / "t" / "CURRENT").write_text(f"../other/{store.version('other')}")
    restored = IndexStore(store.root, embedder).restore("t")
    assert restored is not None and (restored.version, restored.documents) == (newest, 4)
    assert restored.replaced == f"../other/{store.version('other')}"
    assert len(IndexStore(store.root, embedder).current("other") or ()) == 1


def test_restore_never_publishes_a_version_its_writer_did_not(
    store: IndexStore, embedder: Embedder
) -> None:
    store.upsert("t", CORPUS[:2])
    first = store.version("t")
    store.upsert("t", CORPUS[2:3])
    second = store.version("t")
    # A third, complete, whose writer died between moving it into place and the pointer swap.
    third = store.root / "t" / "00000099-abcdef"
    shutil.copytree(store.root / "t" / second, third)
    meta = json.loads((third / "meta.json").read_text())
    (third / "meta.json").write_text(json.dumps({**meta, "version": third.name}))
    damage(store.root / "t" / second, "chunks not JSON")
    restored = IndexStore(store.root, embedder).restore("t")
    assert restored is not None and (restored.version, restored.documents) == (first, 2)


@pytest.mark.parametrize("pointer", ["deleted", "0", "a directory", "a version not on disk"])
def test_a_lost_pointer_beside_versions_refuses_writes_and_restore_brings_back_the_newest(
    store: IndexStore, embedder: Embedder, pointer: str
) -> None:
    # A review's reproducer (2026-12-06): CURRENT deleted or "0" read as "no index", so the
    # next ingest started empty and pruned every version; as a directory it was a traceback.
    store.upsert("t", CORPUS[:2])
    store.upsert("t", CORPUS[2:3])
    newest = store.version("t")
    current = store.root / "t" / "CURRENT"
    current.unlink()
    if pointer == "0":
        current.write_text("0")
    elif pointer == "a directory":
        current.mkdir()
    elif pointer == "a version not on disk":
        current.write_text("00000000-000000")  # below every version there
    fresh = IndexStore(store.root, embedder)
    if pointer in ("a directory", "a version not on disk"):
        with pytest.raises(IndexUnreadable):
            fresh.current("t")
    with pytest.raises(IndexUnreadable):
        fresh.upsert("t", CORPUS[3:4])
    assert len(_versions_of(store.root / "t")) == 2, "nothing was pruned"
    if pointer == "a directory":
        current.rmdir()  # point() replaces a file, not a directory: the operator removes it
    restored = IndexStore(store.root, embedder).restore("t")
    assert restored is not None and (restored.version, restored.documents) == (newest, 3)
    IndexStore(store.root, embedder).upsert("t", CORPUS[3:4])
    assert len(IndexStore(store.root, embedder).current("t") or ()) == 4


def _versions_of(directory: Path) -> list[str]:
    return [p.name for p in directory.iterdir() if p.name[0].isdigit()]


def test_restore_of_a_chosen_version_takes_back_a_readable_ingest(
    store: IndexStore, embedder: Embedder
) -> None:
    replica = IndexStore(store.root, embedder, reload_interval_s=0.0)
    store.upsert("t", CORPUS[:2])
    good = store.version("t")
    store.upsert("t", CORPUS[2:4])  # an ingest to take back: readable, but wrong
    wrong = store.version("t")
    assert len(replica.current("t") or ()) == 4
    with pytest.raises(ValueError, match="no version '00000009-abcdef' on disk"):
        store.restore("t", "00000009-abcdef")
    with pytest.raises(ValueError, match="has no index"):
        store.restore("nobody", good)
    assert store.restore("t", wrong) is None  # already the one published

    restored = IndexStore(store.root, embedder).restore("t", good)

    assert restored == store_module.Restored(wrong, good, 2, 2)
    assert len(replica.current("t") or ()) == 2
    after = IndexStore(store.root, embedder)
    after.upsert("t", CORPUS[4:5])
    assert sorted(_versions_of(store.root / "t")) == sorted([good, after.version("t")])
    assert after.version("t") > wrong  # never the taken-back version's name again
    damage(store.root / "t" / good, "chunks not JSON")
    with pytest.raises(IndexUnreadable):
        after.restore("t", good)
    assert (store.root / "t" / "CURRENT").read_text() == after.version("t")  # nothing changed


def test_restore_gives_up_no_snapshot_for_a_fault_of_the_machine(
    store: IndexStore, embedder: Embedder, monkeypatch: pytest.MonkeyPatch
) -> None:
    store.upsert("t", CORPUS[:2])
    store.upsert("t", CORPUS[2:3])
    published = store.version("t")

    def no_files(directory: Path) -> object:
        raise OSError(24, "Too many open files")

    monkeypatch.setattr(store_module, "read_snapshot", no_files)
    with pytest.raises(OSError, match="Too many open files"):
        IndexStore(store.root, embedder).restore("t")
    assert (store.root / "t" / "CURRENT").read_text() == published
    assert IndexStore(store.root, embedder).restore("nobody") is None
    assert not (store.root / "nobody").exists(), "nothing is created for an unknown tenant"


def test_restore_with_nothing_readable_is_index_unreadable_and_changes_nothing(
    store: IndexStore, embedder: Embedder
) -> None:
    assert store.restore("none") is None  # no index: nothing to restore
    store.upsert("t", CORPUS[:3])
    assert store.restore("t") is None  # readable: nothing to restore
    first = store.version("t")
    store.upsert("t", CORPUS[3:4])
    second = store.version("t")
    damage(store.root / "t" / first, "chunks emptied")
    damage(store.root / "t" / second, "another format")
    with pytest.raises(IndexUnreadable):
        IndexStore(store.root, embedder).restore("t")
    assert (store.root / "t" / "CURRENT").read_text() == second


def _holder(lock: Path, seconds: float, beat: bool, taken: threading.Event) -> None:
    """Another writer: holds the tenant's lock for ``seconds``, touching it (its heartbeat)
    every 50 ms when ``beat``."""
    import fcntl
    import time

    with lock.open("a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        taken.set()
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            if beat:
                lock.touch()
            time.sleep(0.05)
        fcntl.flock(held, fcntl.LOCK_UN)


@pytest.mark.parametrize("beat", [True, False], ids=["making progress", "stalled"])
def test_a_writer_waits_for_one_that_makes_progress_and_gives_up_on_one_that_stalled(
    tmp_path: Path, embedder: Embedder, beat: bool
) -> None:
    # A large tenant's publish (an HNSW build) can hold the lock for minutes: a write waits
    # for it as long as the holder's heartbeat goes on, and gives up on a holder that has
    # stopped (lock_wait_s without progress), with nothing written.
    store = IndexStore(tmp_path, embedder, lock_wait_s=0.3)
    store.upsert("t", [Document("a", "The first document.")])
    version = store.version("t")
    taken = threading.Event()
    holder = threading.Thread(target=_holder, args=(tmp_path / "t" / ".lock", 2.0, beat, taken))
    holder.start()
    try:
        assert taken.wait(10)
        if beat:
            result = store.upsert("t", [Document("b", "The second document.")])
            assert result.total_documents == 2 and result.version != version
        else:
            with pytest.raises(store_module.IndexBusy, match="without progress"):
                store.upsert("t", [Document("b", "The second document.")])
            assert store.version("t") == version
            assert holder.is_alive(), "the write waited for the stalled holder to end"
    finally:
        holder.join()


def _searched_bytes(store: IndexStore, tenant: str) -> int:
    """What the tenant's published snapshot holds once loaded and searched (a search builds
    its access columns), read apart from ``store``."""
    index = read_snapshot(store.root / tenant / store.version(tenant))
    index.visible_to(None)
    return index.resident_bytes


def _budgeted(
    root: Path, embedder: Embedder, tenants: tuple[str, ...], room: float
) -> tuple[IndexStore, IndexStore]:
    """A writer that has indexed CORPUS for each of ``tenants``, and a replica of the same
    root whose loaded snapshots' budget has room for ``room`` of them."""
    writer = IndexStore(root, embedder)
    for tenant in tenants:
        writer.upsert(tenant, CORPUS)
    budget = int(_searched_bytes(writer, tenants[0]) * room)
    return writer, IndexStore(root, embedder, loaded_bytes=budget, reload_interval_s=0)


def test_snapshots_past_the_loaded_budget_are_let_go_least_recently_searched_first(
    tmp_path: Path, embedder: Embedder
) -> None:
    # A replica kept every tenant's snapshot it had searched loaded for ever: its memory grew
    # with the tenants it served (SciFact alone is about 60 MB resident).
    writer, replica = _budgeted(tmp_path / "indexes", embedder, ("a", "b", "c"), room=2.5)
    budget = replica._kept.budget or 0
    let_go: list[str] = []
    replica.on_let_go = let_go.append
    question = "what causes ocean tides"
    before = {t: _search(replica, embedder, question, t).hits for t in ("a", "b")}
    _search(replica, embedder, question, "a")  # b is now the least recently searched
    _search(replica, embedder, question, "c")
    assert let_go == ["b"]
    assert replica._loaded["b"].index is None and replica._loaded["a"].index is not None
    assert 0 < replica.loaded_bytes <= budget
    again = _search(replica, embedder, question, "b")  # loaded again from disk
    assert again.hits == before["b"] and again.version == writer.version("b")
    assert let_go == ["b", "a"]
    writer.upsert("c", CORPUS[:2])  # another replica's write: the next search loads it
    found = _search(replica, embedder, question, "c")
    assert found.version == writer.version("c") and let_go == ["b", "a"]
    assert replica.loaded_bytes == _searched_bytes(writer, "b") + _searched_bytes(writer, "c")


def test_a_snapshot_larger_than_the_whole_budget_is_still_served(
    tmp_path: Path, embedder: Embedder
) -> None:
    replica = IndexStore(tmp_path / "indexes", embedder, loaded_bytes=1)
    replica.upsert("a", CORPUS)
    replica.upsert("b", CORPUS)  # a is let go, b is kept however large
    assert replica._loaded["a"].index is None and replica._loaded["b"].index is not None
    assert _search(replica, embedder, "what causes ocean tides", "a").hits[0].document_id == "tides"
    assert replica._loaded["b"].index is None
    assert replica.loaded_bytes == _searched_bytes(replica, "a")


def test_what_searches_build_counts_against_the_budget_at_once(
    tmp_path: Path, embedder: Embedder
) -> None:
    # A review (2026-12-07): the budget counted snapshots by their size on disk, once, at
    # load. A tenant whose metadata is as dense as an ingest key may send held 11.5x that
    # loaded and 19.5x once a filtered search had built its filter columns, which were never
    # counted: the default 1 GB budget could mean 20 GB. Now what a search builds (filter
    # columns, a viewer's view) counts as it is built, and lets other tenants go.
    writer = IndexStore(tmp_path / "indexes", embedder)
    writer.upsert("a", CORPUS)
    writer.upsert("m", corpus("metadata", 60))
    writer.upsert("v", corpus("access", 60))
    plain, dense = _searched_bytes(writer, "a"), _searched_bytes(writer, "m")
    on_disk = sum(p.stat().st_size for p in (writer.root / "m" / writer.version("m")).iterdir())
    assert dense > 5 * on_disk, "loaded, it holds far more than its files"
    index = read_snapshot(writer.root / "m" / writer.version("m"))
    index.visible_to(None)
    _ = index.columns
    columns = index.resident_bytes - dense
    assert columns > dense // 3, "a filter's columns are most of a snapshot again"
    budget = plain + dense + columns // 2
    replica = IndexStore(writer.root, embedder, loaded_bytes=budget, reload_interval_s=0)
    let_go: list[str] = []
    replica.on_let_go = let_go.append
    question = "what causes ocean tides"
    _search(replica, embedder, question, "a")
    retriever = HybridRetriever(replica)
    retriever.search("m", "a question", None, top_k=3)
    assert replica.loaded_bytes == plain + dense and let_go == []
    filtered = retriever.search(
        "m", "a question", None, top_k=3, filters=parse_filters({"k00": "x"})
    )
    assert filtered.version == writer.version("m")
    assert let_go == ["a"], "the columns were counted as they were built"
    assert replica.loaded_bytes == dense + columns
    # A viewer's view counts as it is built too.
    viewer = Viewer("user-1", frozenset({"group-1"}))
    retriever.search("v", "a question", None, top_k=3, viewer=viewer)
    loaded = replica._loaded["v"].index
    assert loaded is not None and len(loaded._views) == 1
    view = next(iter(loaded._views.values()))
    assert view.resident_bytes > 0
    assert (
        replica._kept.sizes["v"]
        == loaded.resident_bytes
        == loaded._own_bytes() + view.resident_bytes
    )


def _tiny_docs(n: int, words: int = 3) -> list[Document]:
    return [
        Document(f"d{i}", " ".join(f"w{i}x{j}" for j in range(words)), metadata={"k": "v"})
        for i in range(n)
    ]


def _paused_count(store: IndexStore, thread: str) -> tuple[threading.Event, threading.Event]:
    """Make ``thread``'s next count wait, before it takes the budget's lock, until ``go``."""
    waiting, go = threading.Event(), threading.Event()
    original = store._kept.loaded

    def loaded(*args: Any) -> list[str]:
        if threading.current_thread().name == thread and not go.is_set():
            waiting.set()
            go.wait(10)
        return original(*args)

    store._kept.loaded = loaded  # type: ignore[method-assign]
    return waiting, go


@contextmanager
def _columns_built_meanwhile(store: IndexStore, index: TenantIndex) -> Iterator[None]:
    """A filtered search builds ``index``'s columns in a thread; its count waits (before the
    budget's lock) until the block ends."""
    waiting, go = _paused_count(store, "search")
    search = threading.Thread(target=lambda: index.columns, name="search")
    search.start()
    assert waiting.wait(10)
    try:
        yield
    finally:
        go.set()
        search.join()


def test_a_late_count_changes_nothing_it_should_not(tmp_path: Path) -> None:
    # A review's finds (2026-12-07): the check that a snapshot was still the tenant's loaded
    # one and its count were not under one lock, nor was the size read there. (1) A search
    # that built columns on a snapshot just replaced wrote the old one's size back. (2) A
    # tenant let go meanwhile was counted again as loaded, and then let the tenant just
    # loaded go. (3) A load's count that came after a search's wrote the older figure back.
    from bench.replica_memory import RandomEmbedder

    root = tmp_path / "indexes"
    store = IndexStore(root, RandomEmbedder(), loaded_bytes=2**40, reload_interval_s=0)
    store.upsert("t", _tiny_docs(10))
    small = store.current("t")
    assert small is not None
    with _columns_built_meanwhile(store, small):
        store.upsert("t", _tiny_docs(600, 30))
        large = store.current("t")
        assert large is not None and store.loaded_bytes == large.resident_bytes
    assert store.loaded_bytes == large.resident_bytes, "(1) the old snapshot's count is dropped"

    seed = IndexStore(tmp_path / "two", RandomEmbedder())
    seed.upsert("a", _tiny_docs(300, 20))
    seed.upsert("b", _tiny_docs(300, 20))
    store = IndexStore(tmp_path / "two", RandomEmbedder(), loaded_bytes=1)  # one at a time
    a = store.current("a")
    assert a is not None
    with _columns_built_meanwhile(store, a):
        b = store.current("b")  # lets a go
        assert store._loaded["a"].index is None and list(store._kept.sizes) == ["b"]
    assert list(store._kept.sizes) == ["b"], "(2) a, let go, is not counted again"
    assert store._loaded["b"].index is b and store.loaded_bytes == b.resident_bytes

    store = IndexStore(tmp_path / "two", RandomEmbedder(), loaded_bytes=2**40)
    waiting, go = _paused_count(store, "loader")
    loader = threading.Thread(target=lambda: store.current("a"), name="loader")
    loader.start()
    assert waiting.wait(10)
    index = store._loaded["a"].index  # the entry has it: a search gets it
    assert index is not None
    _ = index.columns  # a filtered search builds its columns, counted at once
    assert store.loaded_bytes == index.resident_bytes
    go.set()
    loader.join()
    assert store.loaded_bytes == index.resident_bytes, "(3) the load's older figure is not kept"


@pytest.mark.parametrize(("megabytes", "budget"), [(1, 2**20), (0, None)])
def test_the_loaded_budget_is_a_setting_in_megabytes_and_0_is_no_bound(
    tmp_path: Path, embedder: Embedder, megabytes: int, budget: int | None
) -> None:
    config = RetrievalSettings(index_dir=tmp_path, loaded_indexes_mb=megabytes)
    store = build_index_store(config, embedder)
    assert store._kept.budget == budget
    store.upsert("a", CORPUS[:2])
    loaded = REGISTRY.get_sample_value("rag_index_loaded_bytes")
    index = store._loaded["a"].index
    assert index is not None and loaded == store.loaded_bytes == index.resident_bytes


def test_a_snapshot_served_in_place_of_an_unreadable_one_is_never_let_go(
    tmp_path: Path, embedder: Embedder
) -> None:
    # A review's find: the replica's only readable copy of a tenant whose newer snapshot
    # cannot be read was let go like any other, and every search of the tenant then failed
    # with index_unreadable until an operator ran `rag restore`.
    writer, replica = _budgeted(tmp_path / "indexes", embedder, ("t", "a", "b"), room=1.5)
    first = replica.current("t")
    assert first is not None
    writer.upsert("t", CORPUS[:2])
    damage(tmp_path / "indexes" / "t" / writer.version("t"), "chunks not JSON")
    assert replica.current("t") is first, "the snapshot it has is served"
    for tenant in ("a", "b", "a"):
        assert replica.current(tenant) is not None
    assert replica.current("t") is first, "still served, not let go"
    assert replica._loaded["a"].index is not None and replica._loaded["b"].index is None


@pytest.mark.parametrize(
    "where", ["writing the snapshot", "writing the pointer", "a new tenant's directory"]
)
def test_a_full_disk_publishes_nothing_and_leaves_nothing_behind(
    store: IndexStore, embedder: Embedder, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    # A probe on a full tmpfs (2026-12-06): the write was a 500 with a traceback, and its
    # half-written snapshot stayed on disk, so the next tenant's ingest found no room either.
    # (The disk's refusal is simulated: a test cannot mount a small filesystem everywhere.)
    import errno

    import retrieval.versions as versions_module

    store.upsert("t", CORPUS[:3])
    before = store.version("t")

    def full(*args: object, **kwargs: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    if where == "a new tenant's directory":
        monkeypatch.setattr(Path, "mkdir", full)
        with pytest.raises(store_module.IndexStorageFull, match="no room"):
            store.upsert("newco", CORPUS[:1])
        return
    if where == "writing the snapshot":
        real = store_module.write_snapshot

        def part_then_full(index: object, directory: Path) -> None:
            real(index, directory)  # its files are on disk when the last write fails
            full()

        monkeypatch.setattr(store_module, "write_snapshot", part_then_full)
    else:

        def pointer_cut_short(directory: Path, version: str) -> None:
            (directory / f".CURRENT-{version}").write_text(version[:3])  # then no room
            full()

        monkeypatch.setattr(versions_module, "point", pointer_cut_short)
    with pytest.raises(store_module.IndexStorageFull, match="no room"):
        store.upsert("t", CORPUS[3:5])
    monkeypatch.undo()
    tenant_dir = store.root / "t"
    assert sorted(p.name for p in tenant_dir.iterdir()) == sorted(["CURRENT", ".lock", before])
    assert store.version("t") == before and len(store.current("t") or ()) == 3
    assert (
        _search(store, embedder, "daily aspirin and heart attacks").hits[0].document_id == "aspirin"
    )
    assert len(store.upsert("t", CORPUS[3:5]).version) > 0 and len(store.current("t") or ()) == 5


def _versions_on_disk(store: IndexStore, tenant: str) -> list[str]:
    return sorted(p.name for p in (store.root / tenant).iterdir() if p.name[0].isdigit())


def test_a_delete_leaves_no_version_on_disk_that_holds_what_it_removed(
    store: IndexStore,
) -> None:
    # A deleted document stayed on disk in the version kept before the delete (for `rag
    # restore`) until the tenant's next write, however long that was, and `rag restore
    # --version` published it again.
    store.upsert("t", CORPUS)
    store.upsert("t", CORPUS[:1])  # so that a version is kept before the one the delete follows
    before = store.version("t")
    assert len(_versions_on_disk(store, "t")) == 2
    result = store.delete("t", ["tides"])
    assert _versions_on_disk(store, "t") == [result.version]
    removed = b"gravitational pull of the Moon"
    for path in (store.root / "t").rglob("*"):
        assert not path.is_file() or removed not in path.read_bytes(), path
    with pytest.raises(ValueError, match="there is no version"):
        store.restore("t", before)
    assert len(store.current("t") or ()) == len(CORPUS) - 1
    # An ingest still keeps the version before it, to be taken back.
    again = store.upsert("t", CORPUS[-1:])
    assert _versions_on_disk(store, "t") == sorted([result.version, again.version])
    assert store.restore("t", result.version) is not None


def test_a_delete_frees_room_on_a_full_disk_and_an_ingest_does_not_take_it(
    store: IndexStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    # On a full disk a delete, written as a new version beside the two kept, was a 507: the
    # way a tenant frees room was refused for want of room. Now it removes the version kept
    # before the current one and tries again. (A disk of fixed size, simulated: no room past
    # what the tenant holds once both versions are written.)
    import errno

    store.upsert("t", CORPUS)
    store.upsert("t", CORPUS[:1])
    size = sum(p.stat().st_size for p in store.root.rglob("*") if p.is_file())
    real = store_module.write_snapshot

    def disk_of_fixed_size(index: TenantIndex, directory: Path) -> None:
        real(index, directory)
        if sum(p.stat().st_size for p in store.root.rglob("*") if p.is_file()) > size:
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(store_module, "write_snapshot", disk_of_fixed_size)
    kept = _versions_on_disk(store, "t")
    with pytest.raises(store_module.IndexStorageFull):
        store.upsert("t", CORPUS[1:2])  # an ingest gives nothing up for room
    assert _versions_on_disk(store, "t") == kept
    current = store.version("t")
    result = store.delete("t", ["aspirin"])
    assert _versions_on_disk(store, "t") == [result.version] and result.version != current
    assert len(store.current("t") or ()) == len(CORPUS) - 1
    assert sum(p.stat().st_size for p in store.root.rglob("*") if p.is_file()) < size


def test_a_failure_after_the_pointers_swap_is_a_published_write(
    store: IndexStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The swap is the publication: other replicas serve the version from then on, so a
    # failure after it (the directory's fsync) must not report "nothing was written" nor
    # remove the version (a review's find).
    import errno

    import retrieval.versions as versions_module

    store.upsert("t", CORPUS[:3])
    real = versions_module.point

    def swapped_then_failed(directory: Path, version: str) -> None:
        real(directory, version)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(versions_module, "point", swapped_then_failed)
    result = store.upsert("t", CORPUS[3:5])
    monkeypatch.undo()
    assert store.version("t") == result.version and (store.root / "t" / result.version).is_dir()
    assert len(IndexStore(store.root, store.embedder).current("t") or ()) == 5
