"""A backend built on its first use, so that one that cannot be reached holds up only its own
tenants.

Milvus is built when the settings give its URI, so that tenants can be moved to it, even while
every tenant is on the embedded index. Built eagerly, its connection was a cost and a risk for
everyone: each `rag` command started Milvus Lite (about a second, four the first time), and a
Milvus server that could not be reached failed every command, and the app's start, whatever
tenant they were for. Behind ``LazyBackend`` a command builds it only when a tenant on it is
touched, and the app tries it at start (``try_build``) but starts without it.

Until it is built:
- what the backend answers without its store (the index version, for cache keys; whether a
  tenant has an index) comes from ``answers``, which the event loop may call: nothing there
  ever waits for a connection;
- any other call is ``BackendUnavailable`` (503, or "run it again later" in a command). In
  the app (``background``) it starts a connection in a thread of its own and is refused at
  once: the search and ingest pools' threads, which every tenant shares, never wait out a
  connection timeout for Milvus. In a command it connects in the calling thread.
- a connection is tried again at most every ``retry_s`` seconds, and one at a time: while one
  is under way, calls are refused at once.
An error of ``permanent`` kinds (pymilvus not installed) is raised as it is: no wait mends it,
and the app's start fails on it as before.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from retrieval.backends import BackendStats, BackendUnavailable, ChunkBatch, RetrievalBackend

if TYPE_CHECKING:  # annotations only, as in retrieval.backends
    from retrieval.access import Viewer
    from retrieval.documents import Document
    from retrieval.filters import Filter
    from retrieval.hybrid import SearchResult
    from retrieval.store import IngestResult
    from retrieval.vectors import FloatArray

log = logging.getLogger(__name__)

RETRY_S = 5.0
CONNECTING = "is being connected to; try again shortly"
T = TypeVar("T")


class StorelessAnswers(Protocol):
    """What a backend answers without its store (``retrieval.backends.milvus.VersionAnswers``)."""

    def version(self, tenant: str) -> str: ...

    def has_index(self, tenant: str) -> bool: ...

    def idf(self, tenant: str, viewer: Viewer | None, query: str) -> dict[str, float]: ...

    def access_scope(
        self, tenant: str, viewer: Viewer | None
    ) -> tuple[str, dict[str, Any] | None]: ...

    def close(self) -> None: ...


class LazyBackend:
    """``build()``'s backend, made on the first call that needs it (see the module docstring)."""

    def __init__(
        self,
        name: str,
        build: Callable[[], RetrievalBackend],
        answers: StorelessAnswers,
        *,
        retry_s: float = RETRY_S,
        permanent: tuple[type[Exception], ...] = (),
        background: bool = False,
    ) -> None:
        self.name = name
        self.background = background
        self._build = build
        self._answers = answers
        self.retry_s = retry_s
        self._permanent = permanent
        self._backend: RetrievalBackend | None = None
        self._closed = False
        self._failed_at = -float("inf")
        self._failure = ""
        self._last_failed = False
        self._lock = threading.Lock()  # held while connecting

    @property
    def built(self) -> bool:
        return self._backend is not None

    def try_build(self) -> bool:
        """Build it now, in this thread (the app's start); False, logged, when it cannot be
        reached yet."""
        try:
            self._build_here()
        except BackendUnavailable:
            return False
        return True

    def reconnect(self) -> None:
        """In ``background`` mode, start a connection in a thread of its own unless one is under
        way or the last failed less than ``retry_s`` ago (``/readyz`` calls this too, so that
        a Milvus back after an outage is found without a request for one of its tenants)."""
        if (
            self._backend is None
            and not self._closed
            and not self._lock.locked()
            and time.monotonic() - self._failed_at >= self.retry_s
        ):
            name = f"{self.name}-connect"
            threading.Thread(target=self.try_build, name=name, daemon=True).start()

    def get(self) -> RetrievalBackend:
        """The backend; ``BackendUnavailable`` when it is not built. In ``background`` mode
        (the app: its pools' threads are shared by every tenant) a connection is started in a
        thread of its own and this call is refused at once; otherwise (a command) it connects
        here."""
        backend = self._backend
        if backend is not None:
            return backend
        if self._closed:
            raise self._refused("is closed")
        if self.background:
            self.reconnect()
            raise self._refused(self._failure or CONNECTING)
        return self._build_here()

    def _build_here(self) -> RetrievalBackend:
        if not self._lock.acquire(blocking=False):
            raise self._refused(CONNECTING)
        try:
            backend = self._connect()
        finally:
            self._lock.release()
        if self._closed:  # closed while this thread connected: what it built is closed
            self.close()
            raise self._refused("is closed")
        return backend

    def _connect(self) -> RetrievalBackend:
        if self._backend is not None:
            return self._backend
        if self._closed:
            raise self._refused("is closed")
        if time.monotonic() - self._failed_at < self.retry_s:
            raise self._refused(self._failure)
        try:
            backend = self._build()
        except self._permanent:
            raise
        except Exception as exc:  # whatever the client raises when it cannot connect
            self._failed_at = time.monotonic()
            # Said to API callers too: the cause (an address, a path) only in the log.
            self._failure = f"cannot be reached ({type(exc).__name__}); the log says why"
            log.warning(
                "the %s retrieval backend cannot be reached (%s: %s)",
                self.name,
                type(exc).__name__,
                str(exc)[:1000],
            )
            raise self._refused(self._failure) from exc
        self._backend = backend
        return backend

    def _refused(self, why: str) -> BackendUnavailable:
        return BackendUnavailable(f"The {self.name} retrieval backend {why}.")

    def _storeless(self) -> StorelessAnswers:
        """The backend once built (the same answers, from the same counters), else ``answers``."""
        return self._backend if self._backend is not None else self._answers

    @property
    def answering(self) -> bool:
        """Whether it is built and the last call that reached it did not find it unavailable
        (``/readyz`` says so)."""
        return self._backend is not None and not self._last_failed

    def _through(self, call: Callable[[RetrievalBackend], T]) -> T:
        """``call`` on the backend (built now if need be), noting whether it was available."""
        try:
            result = call(self.get())
        except BackendUnavailable:
            self._last_failed = True
            raise
        self._last_failed = False
        return result

    def search(
        self,
        tenant: str,
        query: str,
        query_vector: FloatArray | None,
        *,
        top_k: int = 5,
        filters: Filter | None = None,
        defaults: Filter | None = None,
        viewer: Viewer | None = None,
        context_terms: Sequence[tuple[str, float]] = (),
    ) -> SearchResult:
        return self._through(
            lambda backend: backend.search(
                tenant,
                query,
                query_vector,
                top_k=top_k,
                filters=filters,
                defaults=defaults,
                viewer=viewer,
                context_terms=context_terms,
            )
        )

    def upsert(self, tenant: str, documents: Sequence[Document]) -> IngestResult:
        return self._through(lambda backend: backend.upsert(tenant, documents))

    def delete(self, tenant: str, document_ids: Sequence[str]) -> IngestResult:
        return self._through(lambda backend: backend.delete(tenant, document_ids))

    def version(self, tenant: str) -> str:
        return self._storeless().version(tenant)

    def stats(self, tenant: str) -> BackendStats:
        return self._through(lambda backend: backend.stats(tenant))

    def has_index(self, tenant: str) -> bool:
        return self._storeless().has_index(tenant)

    def document_ids(self, tenant: str) -> set[str]:
        return self._through(lambda backend: backend.document_ids(tenant))

    def idf(self, tenant: str, viewer: Viewer | None, query: str) -> dict[str, float]:
        return self._storeless().idf(tenant, viewer, query)

    def access_scope(self, tenant: str, viewer: Viewer | None) -> tuple[str, dict[str, Any] | None]:
        return self._storeless().access_scope(tenant, viewer)

    def export(self, tenant: str, batch: int = 500) -> Iterator[ChunkBatch]:
        return self.get().export(tenant, batch)

    def import_chunks(self, tenant: str, batch: ChunkBatch) -> IngestResult:
        return self._through(lambda backend: backend.import_chunks(tenant, batch))

    def close(self) -> None:
        """Close it if it was built; a call after this is refused. A thread connecting now
        closes what it builds (``get``)."""
        self._closed = True
        if not self._lock.acquire(blocking=False):
            return
        try:
            backend, self._backend = self._backend, None
        finally:
            self._lock.release()
        if backend is not None:
            backend.close()
        else:
            self._answers.close()
