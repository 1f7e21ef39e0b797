"""A backend built on its first use, so that one that cannot be reached holds up only its own
tenants.

Milvus is built when the settings give its URI, so that tenants can be moved to it, even while
every tenant is on the embedded index. Built eagerly, its connection was a cost and a risk for
everyone: each `rag` command started Milvus Lite (about a second, four the first time), and a
Milvus server that could not be reached failed every command, and the app's start, whatever
tenant they were for. Behind ``LazyBackend`` a command builds it only when a tenant on it is
touched, and the app tries it at start (``try_build``) but starts without it. Until it can be
built, a call for one of its tenants is ``BackendUnavailable`` (503, or "run it again later" in
a command), and it is tried again at most every ``retry_s`` seconds: the calls in between are
refused at once rather than each waiting out a connection timeout.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

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


class LazyBackend:
    """``build()``'s backend, made on the first call that needs it (see the module docstring)."""

    def __init__(
        self, name: str, build: Callable[[], RetrievalBackend], *, retry_s: float = RETRY_S
    ) -> None:
        self.name = name
        self._build = build
        self.retry_s = retry_s
        self._backend: RetrievalBackend | None = None
        self._failed_at = -float("inf")
        self._failure = ""
        self._lock = threading.Lock()

    @property
    def built(self) -> bool:
        return self._backend is not None

    def try_build(self) -> bool:
        """Build it now (the app's start); False, logged, when it cannot be reached yet."""
        try:
            self.get()
        except BackendUnavailable:
            return False
        return True

    def get(self) -> RetrievalBackend:
        backend = self._backend
        if backend is not None:
            return backend
        with self._lock:  # one thread connects; the others wait for its outcome
            if self._backend is not None:
                return self._backend
            if time.monotonic() - self._failed_at < self.retry_s:
                raise BackendUnavailable(self._failure)
            try:
                self._backend = self._build()
            except Exception as exc:  # whatever the client raises when it cannot connect
                self._failed_at = time.monotonic()
                # Said to API callers too: the cause (an address, a path) only in the log.
                self._failure = (
                    f"The {self.name} retrieval backend cannot be reached "
                    f"({type(exc).__name__}); the service's log says why."
                )
                log.warning(
                    "the %s retrieval backend cannot be reached (%s: %s); tried again on use, "
                    "at most every %.0f s",
                    self.name,
                    type(exc).__name__,
                    str(exc)[:1000],
                    self.retry_s,
                )
                raise BackendUnavailable(self._failure) from exc
            return self._backend

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
        return self.get().search(
            tenant,
            query,
            query_vector,
            top_k=top_k,
            filters=filters,
            defaults=defaults,
            viewer=viewer,
            context_terms=context_terms,
        )

    def upsert(self, tenant: str, documents: Sequence[Document]) -> IngestResult:
        return self.get().upsert(tenant, documents)

    def delete(self, tenant: str, document_ids: Sequence[str]) -> IngestResult:
        return self.get().delete(tenant, document_ids)

    def version(self, tenant: str) -> str:
        return self.get().version(tenant)

    def stats(self, tenant: str) -> BackendStats:
        return self.get().stats(tenant)

    def has_index(self, tenant: str) -> bool:
        return self.get().has_index(tenant)

    def document_ids(self, tenant: str) -> set[str]:
        return self.get().document_ids(tenant)

    def idf(self, tenant: str, viewer: Viewer | None, query: str) -> dict[str, float]:
        return self.get().idf(tenant, viewer, query)

    def access_scope(self, tenant: str, viewer: Viewer | None) -> tuple[str, dict[str, Any] | None]:
        return self.get().access_scope(tenant, viewer)

    def export(self, tenant: str, batch: int = 500) -> Iterator[ChunkBatch]:
        return self.get().export(tenant, batch)

    def import_chunks(self, tenant: str, batch: ChunkBatch) -> IngestResult:
        return self.get().import_chunks(tenant, batch)

    def close(self) -> None:
        with self._lock:
            if self._backend is not None:
                self._backend.close()
