"""Per-tenant index snapshots on disk, versioned, swapped atomically, safe across processes.

Layout under `root`, one directory per tenant (tenancy is a security boundary: a tenant's search
only ever loads its own directory)::

    <tenant>/CURRENT          the published version, replaced atomically (os.replace)
    <tenant>/.lock            writers hold an fcntl lock on it, so ingests are serialised
    <tenant>/<version>/       a complete snapshot (see retrieval.snapshots)
    <tenant>/.tmp-<version>/  a snapshot being written; left over only by a crashed writer

The lock's holder touches ``.lock`` every few seconds while it writes (a heartbeat). Another
writer waits for the lock as long as the holder shows progress (a large tenant's publish can
take minutes), but gives up once it has waited ``lock_wait_s`` and ``.lock`` has not been
touched for as long: the holder has stalled (a stopped process, a hung disk), and it must not
hold every other write of the tenant, on every replica, for ever. Then ``IndexBusy``, and
nothing is written.

A writer builds the next snapshot in a temp directory, fsyncs it, renames it into place and only
then replaces CURRENT, so a crash at any point leaves the previous version serving. The next
writer removes leftovers and keeps the last two versions (a reader that has just read the old
pointer can still open it). When the published version cannot be read (a disk fault, an
operator's edit), ``restore`` publishes the newest kept one that can (``rag restore``).
"""

from __future__ import annotations

import errno
import fcntl
import functools
import logging
import shutil
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from retrieval.documents import (
    DEFAULT_MAX_WORDS,
    DEFAULT_OVERLAP_WORDS,
    Chunk,
    Document,
    chunk_document,
    indexed_text,
)
from retrieval.embeddings import Embedder
from retrieval.index import TenantIndex, derive
from retrieval.snapshots import IndexUnreadable, read_snapshot, write_snapshot
from retrieval.tenants import check_tenant
from retrieval.tokenize import tokenize
from retrieval.vectors import FloatArray
from retrieval.versions import (
    NO_VERSION,
    POINTER,
    clean_leftovers,
    is_version,
    next_version,
    point,
    prune,
    publish,
    read_pointer,
    temp_dir,
)

# How long a snapshot that could not be read is not read again (each try parses it whole, under
# the tenant's lock, while that tenant's requests wait).
UNREADABLE_RETRY_S = 5.0

log = logging.getLogger(__name__)


class IndexStorageFull(Exception):
    """The index directory had no room for the tenant's next snapshot (no space left, or over
    a quota): nothing was published, the previous version serves on, and what the write had
    put on disk was removed."""

    def __init__(self, tenant: str) -> None:
        super().__init__(
            f"The index of tenant {tenant!r} has no room on its disk for this write; nothing "
            "was written. Free space or grow the volume, then try again."
        )
        self.tenant = tenant


class IndexBusy(Exception):
    """Another writer held the tenant's write lock without progress for ``waited_s``:
    nothing was written; the write may be tried again."""

    def __init__(self, tenant: str, waited_s: float) -> None:
        super().__init__(
            f"Another write to the index of tenant {tenant!r} held it for {waited_s:g} s "
            "without progress; nothing was written."
        )
        self.tenant = tenant
        self.waited_s = waited_s


@contextmanager
def _heartbeat(path: Path, interval_s: float) -> Iterator[None]:
    """Touch ``path`` now and every ``interval_s`` until the block ends (from a thread of its
    own: the writer's own work, an HNSW build, may hold the thread for minutes)."""
    stop = threading.Event()

    def beat() -> None:
        while True:
            try:
                path.touch()
            except OSError as exc:  # a full or read-only disk: the write itself will fail
                log.warning("cannot mark progress on %s: %s", path, exc)
            if stop.wait(interval_s):
                return

    beating = threading.Thread(target=beat, name="index-lock-heartbeat", daemon=True)
    beating.start()
    try:
        yield
    finally:
        stop.set()
        beating.join()


def _idle_s(path: Path) -> float:
    """Seconds since ``path`` was last touched (its holder's heartbeat); unknown: for ever."""
    try:
        return time.time() - path.stat().st_mtime
    except OSError:
        return float("inf")


@dataclass(frozen=True)
class IngestResult:
    """What an upsert or delete did: the new version, the documents and chunks it added (upsert)
    or removed (delete), its wall time, and the index totals after it; for a delete, the ids it
    was given that the tenant does not have (``absent``, in the order given, once each)."""

    version: str
    documents: int
    chunks: int
    seconds: float
    total_documents: int = 0
    total_chunks: int = 0
    absent: tuple[str, ...] = ()


def absent_from(document_ids: Sequence[str], present: Collection[str]) -> tuple[str, ...]:
    """The ids of a delete that are not ``present``, in the order given, once each."""
    return tuple(d for d in dict.fromkeys(document_ids) if d not in present)


@dataclass(frozen=True)
class Restored:
    """What ``IndexStore.restore`` did: the version CURRENT held (the one that could not be
    read, or the one rolled back) and the one published in its place, with its totals."""

    replaced: str
    version: str
    documents: int
    chunks: int


@dataclass
class _Loaded:
    """What this process knows of one tenant: the loaded snapshot and the last pointer seen."""

    index: TenantIndex | None
    pointer: str
    checked: float
    lock: threading.Lock = field(default_factory=threading.Lock)
    # The last pointer that could not be loaded, until when it is not tried again, and why.
    failed: tuple[str, float, IndexUnreadable] | None = None

    @property
    def serves_unreadable(self) -> bool:
        """Whether its loaded snapshot is served in place of a newer one that cannot be read."""
        return self.failed is not None and self.index is not None

    def published(self, index: TenantIndex) -> None:
        """This process has just pointed CURRENT at ``index`` (a write, a restore)."""
        self.index, self.pointer, self.failed = index, index.version, None
        self.checked = time.monotonic()


class _Kept:
    """The tenants whose snapshots this process holds loaded, least recently searched first,
    each with what its snapshot holds in memory (``TenantIndex.resident_bytes``). Past
    ``budget`` bytes (None: no limit) the least recent are let go: loaded again from disk on
    their next search. The one just loaded or searched is never let go, however large."""

    def __init__(self, budget: int | None) -> None:
        self.budget = budget
        self.sizes: OrderedDict[str, int] = OrderedDict()
        self.total = 0
        self._lock = threading.Lock()

    def searched(self, tenant: str) -> None:
        if self.budget is None:
            return
        with self._lock:
            if tenant in self.sizes:
                self.sizes.move_to_end(tenant)

    def loaded(self, tenant: str, index: TenantIndex, entries: dict[str, _Loaded]) -> list[str]:
        """``tenant``'s snapshot ``index`` is loaded or grew: counted at what it holds now,
        unless ``entries`` (the store's) no longer hold it for the tenant (replaced or let go
        meanwhile). Then the tenants past the budget are let go (their entries' snapshot
        dropped), least recently searched first, passing over one served in place of a newer
        that cannot be read (the process's only readable copy); their names returned. All
        under one lock, so a late count never brings back a tenant let go, nor writes back an
        older figure (a review's finds)."""
        with self._lock:
            entry = entries.get(tenant)
            if entry is None or entry.index is not index:
                return []
            size = index.resident_bytes
            self.total += size - self.sizes.pop(tenant, 0)
            self.sizes[tenant] = size
            gone: list[str] = []
            if self.budget is None or self.total <= self.budget:
                return gone
            for name in list(self.sizes):
                if self.total <= self.budget:
                    break
                other = entries.get(name)
                if name != tenant and not (other is not None and other.serves_unreadable):
                    self.total -= self.sizes.pop(name)
                    if other is not None:
                        other.index = None
                    gone.append(name)
            return gone


def _published(directory: Path, pointer: str) -> TenantIndex:
    """The snapshot ``pointer`` names, in ``directory``: ValueError where the pointer names no
    version (it is never followed out of the tenant's directory) or the snapshot another."""
    if not is_version(pointer):
        raise ValueError(f"{POINTER} holds {pointer[:40]!r}, not a version")
    index = read_snapshot(directory)
    if index.version != pointer:
        raise ValueError(f"meta.json names version {index.version!r}")
    return index


class IndexStore:
    """Versioned per-tenant indexes under `root`; `embedder` embeds new chunks at ingest.

    Documents are split into passages of `chunk_words` words (`overlap_words` shared between
    neighbours); a document longer than `max_document_chars` is refused (DocumentError with
    too_large). Above `approximate_above` chunks a tenant also gets an HNSW index for dense-only
    search. `reload_interval_s` bounds how often `current()` looks at the CURRENT pointer.
    A write waits for another writer of the tenant while it shows progress, and gives up after
    `lock_wait_s` without any (None: waits for ever). `loaded_bytes` bounds what the snapshots
    this process keeps loaded hold in memory, what searches build on them included (None: no
    bound): past it the least recently searched tenants' are let go, and loaded again on their
    next search.
    """

    def __init__(
        self,
        root: Path,
        embedder: Embedder,
        *,
        chunk_words: int = DEFAULT_MAX_WORDS,
        overlap_words: int = DEFAULT_OVERLAP_WORDS,
        max_document_chars: int = 1_000_000,
        approximate_above: int = 200_000,
        reload_interval_s: float = 0.2,
        sort_for_embedding: bool = True,
        lock_wait_s: float | None = 30.0,
        loaded_bytes: int | None = None,
    ) -> None:
        self.root = Path(root)
        self.sort_for_embedding = sort_for_embedding  # False: document order (the bench's
        # baseline of before issue 18)
        self.embedder = embedder
        self.chunk_words = chunk_words
        self.overlap_words = overlap_words
        self.max_document_chars = max_document_chars
        self.approximate_above = approximate_above
        self.reload_interval_s = reload_interval_s
        self.lock_wait_s = lock_wait_s
        # Test hook: called with the temp directory once the snapshot is written, just before
        # it is published. Lets a test kill a writer at the worst moment.
        self.before_publish: Callable[[Path], None] | None = None
        # Told the tenant whose snapshot is let go for the budget (the app counts them).
        self.on_let_go: Callable[[str], None] | None = None
        self._loaded: dict[str, _Loaded] = {}
        self._guard = threading.Lock()
        self._kept = _Kept(loaded_bytes)

    # -- reading ---------------------------------------------------------------------------

    def _dir(self, tenant: str) -> Path:
        return self.root / check_tenant(tenant)

    def _read_pointer(self, tenant: str) -> str:
        return read_pointer(self._dir(tenant))

    def _entry(self, tenant: str) -> _Loaded:
        entry = self._loaded.get(tenant)
        if entry is None:
            check_tenant(tenant)
            with self._guard:
                entry = self._loaded.setdefault(tenant, _Loaded(None, NO_VERSION, -1e18))
        return entry

    def _pointer(self, entry: _Loaded, tenant: str) -> str:
        now = time.monotonic()
        if now - entry.checked >= self.reload_interval_s:
            entry.pointer = self._read_pointer(tenant)
            entry.checked = now
        return entry.pointer

    def _load(self, tenant: str, pointer: str) -> TenantIndex:
        """The published snapshot ``pointer``; ``IndexUnreadable`` (logged) when it cannot be
        read, or the pointer names no version of this tenant's directory."""
        failure: Exception | None = None
        for attempt in range(6):
            directory = self._dir(tenant) / pointer
            try:
                return _published(directory, pointer)
            except FileNotFoundError as exc:
                failure = exc
                if attempt < 5:
                    # Pruned between reading the pointer and opening it: a newer one is
                    # published.
                    pointer = self._read_pointer(tenant)
            except Exception as exc:  # whatever the parsers raise for what they cannot read
                failure = exc
                break
        log.error("the index snapshot %s cannot be read: %s", directory, failure)
        raise IndexUnreadable(tenant, pointer) from failure

    def version(self, tenant: str) -> str:
        """The published version of `tenant`'s index ("0" when it has none). Cheap."""
        return self._pointer(self._entry(tenant), tenant)

    def peek(self, tenant: str) -> TenantIndex | None:
        """The snapshot ``current`` answers with, when it has it without loading or waiting:
        the loaded one when it is the published one, or when the published one could not be
        read (it is served in its place, ``_reload``); else None. Never loads, never takes the
        tenant's lock: for reads on the event loop (a load there, 75-430 ms, answered no one,
        and waiting for another thread's load was as long)."""
        entry = self._entry(tenant)
        pointer = self._pointer(entry, tenant)
        index, failed = entry.index, entry.failed  # each read once: others change them
        if index is None:
            return None
        if index.version == pointer or (failed is not None and failed[0] == pointer):
            self._kept.searched(tenant)
            return index
        return None

    def loaded(self, tenant: str) -> bool:
        """Whether ``peek`` answers (or the tenant has no index): ``current`` would answer
        without loading a snapshot. Never loads."""
        return self.peek(tenant) is not None or self.version(tenant) == NO_VERSION

    def current(self, tenant: str) -> TenantIndex | None:
        """The tenant's loaded snapshot, reloaded when a newer one has been published."""
        entry = self._entry(tenant)
        pointer = self._pointer(entry, tenant)
        index = entry.index
        if pointer == NO_VERSION:
            return None
        if index is not None and index.version == pointer:
            self._kept.searched(tenant)
            return index
        with entry.lock:
            index = entry.index
            if index is None or index.version != entry.pointer:
                index = self._reload(entry, tenant)
            return index

    def _reload(self, entry: _Loaded, tenant: str) -> TenantIndex:
        """Load the tenant's newly published snapshot. One that cannot be read is not tried
        again for ``UNREADABLE_RETRY_S``; meanwhile the snapshot loaded before it (intact, one
        version older) is served, or, with none, ``IndexUnreadable``."""
        now = time.monotonic()
        failed = entry.failed
        if failed is None or failed[0] != entry.pointer or failed[1] <= now:
            try:
                index = self._load(tenant, entry.pointer)
            except IndexUnreadable as exc:
                failed = entry.failed = (entry.pointer, now + UNREADABLE_RETRY_S, exc)
            else:
                entry.index, entry.pointer, entry.failed = index, index.version, None
                self._loaded_now(tenant, index)
                return index
        kept = entry.index  # read once: it may be let go meanwhile
        if kept is not None:
            self._kept.searched(tenant)
            return kept
        raise failed[2]

    # -- writing ---------------------------------------------------------------------------

    def upsert(self, tenant: str, docs: Sequence[Document], progress: bool = False) -> IngestResult:
        """Add or replace documents (by id) and publish a new version. CPU heavy: run it in a
        thread. Only chunks whose text is new are embedded; the others keep their vectors."""
        started = time.perf_counter()
        if not docs:
            return self._unchanged(tenant, started)
        latest: dict[str, Document] = {d.id: d for d in docs}
        chunks: list[Chunk] = []
        for doc in latest.values():
            chunks.extend(
                chunk_document(
                    doc,
                    max_words=self.chunk_words,
                    overlap_words=self.overlap_words,
                    max_chars=self.max_document_chars,
                )
            )
        tokens = [tokenize(c.indexed_text) for c in chunks]
        # Embed outside the lock (it is the slow part), reusing what the current version has.
        known = _known_vectors(self.current(tenant), set(latest))
        self._embed_missing(chunks, known, progress)
        with self._writer(tenant) as old:
            # Another writer may have published in between: take its vectors too.
            known.update(_known_vectors(old, set(latest)))
            self._embed_missing(chunks, known, progress)
            vectors = np.stack([known[c.indexed_text] for c in chunks]) if chunks else None
            index = self._publish(tenant, old, set(latest), chunks, tokens, vectors)
        return IngestResult(
            index.version,
            len(latest),
            len(chunks),
            time.perf_counter() - started,
            index.documents,
            len(index),
        )

    def delete(self, tenant: str, document_ids: Sequence[str]) -> IngestResult:
        """Remove documents by id and publish a new version (none when no id is indexed). No
        version that holds them is kept on disk: the one before is removed once the new one is
        published (a delete cannot be taken back with ``restore``), and first when the disk
        has no room for the new one (a delete is how a tenant frees room)."""
        started = time.perf_counter()
        with self._writer(tenant) as old:
            present = {d for d in document_ids if old is not None and d in old.rows_by_document}
            if old is None or not present:
                return self._unchanged(tenant, started, absent_from(document_ids, present))
            removed = sum(len(old.rows_by_document[d]) for d in present)
            try:
                index = self._publish(tenant, old, present, [], [], None, keep_previous=False)
            except IndexStorageFull:
                if not prune(self._dir(tenant), current=old.version, previous=None):
                    raise
                log.warning("no room for tenant %s's delete: the version before it goes", tenant)
                index = self._publish(tenant, old, present, [], [], None, keep_previous=False)
        return IngestResult(
            index.version,
            len(present),
            removed,
            time.perf_counter() - started,
            index.documents,
            len(index),
            absent_from(document_ids, present),
        )

    def import_chunks(
        self, tenant: str, chunks: Sequence[Chunk], vectors: FloatArray
    ) -> IngestResult:
        """Index chunks already made and embedded (a move from another backend: the same
        passages and vectors), replacing every chunk of their documents; one new version."""
        started = time.perf_counter()
        if not chunks:
            return self._unchanged(tenant, started)
        if len(vectors) != len(chunks):
            raise ValueError("one vector per chunk is needed")
        documents = {c.document_id for c in chunks}
        tokens = [tokenize(c.indexed_text) for c in chunks]
        matrix = np.ascontiguousarray(vectors, dtype=np.float32)
        with self._writer(tenant) as old:
            index = self._publish(tenant, old, documents, list(chunks), tokens, matrix)
        return IngestResult(
            index.version,
            len(documents),
            len(chunks),
            time.perf_counter() - started,
            index.documents,
            len(index),
        )

    def _unchanged(self, tenant: str, started: float, absent: tuple[str, ...] = ()) -> IngestResult:
        """The result of a call that changed nothing (no version is published); ``absent``: a
        delete's ids the tenant does not have."""
        index = self.current(tenant)
        return IngestResult(
            index.version if index else NO_VERSION,
            0,
            0,
            time.perf_counter() - started,
            index.documents if index else 0,
            len(index) if index else 0,
            absent,
        )

    def _embed_missing(
        self, chunks: list[Chunk], known: dict[str, FloatArray], progress: bool
    ) -> None:
        missing = list(dict.fromkeys(c.indexed_text for c in chunks if c.indexed_text not in known))
        if not missing:
            return
        # Longest first, so each call's texts are of about one length: a batch pads to its
        # longest text, and the embedders sort only within a call (BENCHMARKS.md, issue 18).
        if self.sort_for_embedding:
            missing.sort(key=len, reverse=True)
        step = 64  # small calls, so a query sharing the embedder waits at most one of them
        bar = None
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=len(missing), unit="chunk", desc="embedding")
        for start in range(0, len(missing), step):
            batch = missing[start : start + step]
            known.update(zip(batch, self.embedder.embed(batch), strict=True))
            if bar is not None:
                bar.update(len(batch))
        if bar is not None:
            bar.close()

    @contextmanager
    def _writer(self, tenant: str) -> Iterator[TenantIndex | None]:
        """Hold the tenant's write lock, with a heartbeat on it; yield the latest published
        snapshot (from disk)."""
        with self._locked(tenant):
            pointer = self._read_pointer(tenant)
            cached = self._entry(tenant).index
            if pointer == NO_VERSION:
                if _versions(self._dir(tenant)):
                    # CURRENT deleted or emptied beside published versions: writing now would
                    # start an empty index and prune them. `rag restore` publishes the last.
                    log.error("tenant %s has index versions on disk but no %s", tenant, POINTER)
                    raise IndexUnreadable(tenant, pointer)
                yield None
            elif cached is not None and cached.version == pointer:
                yield cached
            else:
                yield self._load(tenant, pointer)

    @contextmanager
    def _locked(self, tenant: str) -> Iterator[None]:
        """Hold the tenant's write lock, with a heartbeat on it."""
        directory = self._dir(tenant)
        path = directory / ".lock"
        try:  # a new tenant's directory and lock take room (an inode) too
            directory.mkdir(parents=True, exist_ok=True)
            lock = path.open("a")
        except OSError as exc:
            if _no_room(exc):
                raise IndexStorageFull(tenant) from exc
            raise
        with lock:
            self._lock(lock.fileno(), path, tenant)
            try:
                with _heartbeat(path, self._beat_s):
                    yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def restore(self, tenant: str, version: str | None = None) -> Restored | None:
        """When the published snapshot cannot be read, or CURRENT names none beside versions on
        disk (deleted, emptied), publish the newest version before it that can be read, under
        the write lock, so that searches and ingests work again: what the unreadable version
        changed is lost, and it is left on disk (the next write prunes it). None when there is
        nothing to restore: the published snapshot can be read, or the tenant has no version.
        ``IndexUnreadable`` when none can be read. A fault of the machine rather than of the
        files (too many open files, no memory, no permission) is raised as it is, with
        nothing changed: a snapshot is not given up for it.

        With ``version``: publish that kept version, readable or not the published one (an
        ingest to take back); ``ValueError`` naming the versions on disk when it is not one,
        ``IndexUnreadable`` when it cannot be read, None when it is already published."""
        directory = self._dir(tenant)
        if not directory.is_dir():
            if version is not None:
                raise ValueError(f"tenant {tenant!r} has no index")
            return None  # no such tenant: nothing is created for it
        with self._locked(tenant):
            pointer = self._read_pointer(tenant)
            candidates = _candidates(directory, pointer, version)
            for name in candidates or ():
                index = _readable(directory, name)
                if index is None:
                    continue
                point(directory, name)
                self._entry(tenant).published(index)
                self._loaded_now(tenant, index)
                return Restored(pointer, name, index.documents, len(index))
        if candidates is None:
            return None
        raise IndexUnreadable(tenant, pointer if version is None else version)

    @property
    def _beat_s(self) -> float:
        """How often a writer touches ``.lock``: well within any waiter's ``lock_wait_s``."""
        return min(5.0, (self.lock_wait_s or 20.0) / 4)

    def _lock(self, fd: int, path: Path, tenant: str) -> None:
        """Take the tenant's write lock on ``fd``; ``IndexBusy`` once this writer has waited
        ``lock_wait_s`` and the holder has not touched ``path`` for as long (it stalled). The
        lock is tried again at growing intervals up to 0.25 s: an flock cannot be waited for
        with a time limit."""
        if self.lock_wait_s is None:
            fcntl.flock(fd, fcntl.LOCK_EX)
            return
        started, pause = time.monotonic(), 0.005
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                waited = time.monotonic() - started
                if waited >= self.lock_wait_s and _idle_s(path) >= self.lock_wait_s:
                    raise IndexBusy(tenant, self.lock_wait_s) from None
                time.sleep(pause)
                pause = min(pause * 2, 0.25)

    def _publish(
        self,
        tenant: str,
        old: TenantIndex | None,
        remove: set[str],
        chunks: list[Chunk],
        tokens: list[list[str]],
        vectors: FloatArray | None,
        *,
        keep_previous: bool = True,
    ) -> TenantIndex:
        """Derive, write and publish the next version; the version before it is kept on disk
        (``restore`` may publish it again) unless ``keep_previous`` is False."""
        directory = self._dir(tenant)
        clean_leftovers(directory)
        version = next_version(directory)
        if vectors is None:
            vectors = np.zeros((0, self.embedder.dimension), dtype=np.float32)
        index = derive(
            old,
            version,
            remove=remove,
            chunks=chunks,
            tokens=tokens,
            vectors=vectors,
            approximate_above=self.approximate_above,
        )
        temp = temp_dir(directory, version)
        try:
            write_snapshot(index, temp)
            if self.before_publish is not None:
                self.before_publish(temp)
            publish(directory, version)
        except BaseException as exc:
            published = read_pointer(directory) == version  # the swap is the publication
            if isinstance(exc, OSError) and published:
                # Failed after the swap (its directory's fsync): other replicas serve it already.
                log.error("tenant %s's version %s is published, then: %s", tenant, version, exc)
            else:
                # What it wrote would fill the disk for every tenant until this tenant's next
                # write (a full disk left it there: another tenant's ingest then failed too).
                _discard_unpublished(directory, version, published)
                if isinstance(exc, OSError) and _no_room(exc):
                    log.error("no room for tenant %s's next index snapshot: %s", tenant, exc)
                    raise IndexStorageFull(tenant) from exc
                raise
        prune(directory, current=version, previous=old.version if old and keep_previous else None)
        self._entry(tenant).published(index)
        self._loaded_now(tenant, index)
        return index

    def _loaded_now(self, tenant: str, index: TenantIndex) -> None:
        """``index`` is the tenant's loaded snapshot now: counted, now and whenever a search
        builds more on it (``_count``)."""
        index.on_grew = functools.partial(self._count, tenant)
        _ = index.resident_bytes  # the first count is O(chunks): not under the budget's lock
        self._count(tenant, index)

    def _count(self, tenant: str, index: TenantIndex) -> None:
        """Count what ``index`` holds, if it is still the tenant's loaded snapshot, and let
        the least recently searched others go while the loaded ones hold more than
        ``loaded_bytes``. (Not under their locks: a search that holds a snapshot keeps it; the
        next loads it again.)"""
        gone = self._kept.loaded(tenant, index, self._loaded)
        if self.on_let_go is not None:
            for name in gone:
                self.on_let_go(name)

    @property
    def loaded_bytes(self) -> int:
        """What the loaded snapshots hold in memory, as the budget counts it."""
        return self._kept.total


def _no_room(exc: OSError) -> bool:
    return exc.errno in (errno.ENOSPC, errno.EDQUOT)


def _discard_unpublished(directory: Path, version: str, published: bool) -> None:
    """Remove what a write that failed put on disk: its temp directory, its pointer's temp
    file, and the version's directory unless it was ``published`` (CURRENT names it)."""
    shutil.rmtree(temp_dir(directory, version), ignore_errors=True)
    (directory / f".{POINTER}-{version}").unlink(missing_ok=True)
    if not published:
        shutil.rmtree(directory / version, ignore_errors=True)


def _candidates(directory: Path, pointer: str, version: str | None) -> list[str] | None:
    """The versions ``restore`` may publish, best first; None when there is nothing to do."""
    on_disk = _versions(directory)
    if version is not None:  # the operator's choice
        if version not in on_disk:
            raise ValueError(
                f"there is no version {version[:40]!r} on disk "
                f"(there are: {', '.join(on_disk) or 'none'})"
            )
        return None if version == pointer else [version]
    if pointer == NO_VERSION:
        return on_disk or None  # a pointer lost beside versions, or no index at all
    if _readable(directory, pointer) is not None:
        return None
    if is_version(pointer) and (directory / pointer).is_dir():
        # Only older ones: a newer one was never published (its writer died between moving
        # it into place and the pointer swap).
        return [v for v in on_disk if _sequence(v) < _sequence(pointer)]
    return on_disk


def _versions(directory: Path) -> list[str]:
    """The versions on disk in a tenant's directory, newest first."""
    found = [p.name for p in directory.iterdir() if is_version(p.name) and p.is_dir()]
    return sorted(found, key=_sequence, reverse=True)


def _sequence(version: str) -> int:
    return int(version.split("-", 1)[0])


def _readable(directory: Path, version: str) -> TenantIndex | None:
    """The snapshot ``version`` when it can be read; None (logged) when its files cannot be
    (damaged, missing, another format). A fault of the machine is raised: ``OSError`` other
    than a missing file, and ``MemoryError``."""
    try:
        return _published(directory / version, version)
    except Exception as exc:  # whatever the parsers raise for what they cannot read
        missing = isinstance(exc, FileNotFoundError | NotADirectoryError | IsADirectoryError)
        if isinstance(exc, MemoryError) or (isinstance(exc, OSError) and not missing):
            raise
        log.warning("the index snapshot %s cannot be read: %s", directory / version[:40], exc)
        return None


def _known_vectors(index: TenantIndex | None, doc_ids: set[str]) -> dict[str, FloatArray]:
    """Stored vectors of the chunks of `doc_ids`, by indexed text (to skip re-embedding them)."""
    if index is None:
        return {}
    known: dict[str, FloatArray] = {}
    records = index.records
    for doc_id in doc_ids:
        for row in index.rows_by_document.get(doc_id, []):
            text = indexed_text(records.title[row], records.text[row], records.metadata[row])
            known[text] = np.asarray(index.vectors[row])
    return known
