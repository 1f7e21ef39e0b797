"""Retrieval as the request path uses it: async, traced, tenant-scoped.

Chat's retrieve stage and the ``/v1/retrieve`` and ``/v1/documents`` routes all go through
this one class, so they share the filter parsing, the query batching and the spans.

Every search is for a viewer (``viewer_of(principal)``: the caller's user and groups), and sees
only the documents whose access list admits it (``retrieval.access``); a search without a
viewer sees only the documents without an access list.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import logging
import time
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from opentelemetry import trace

from pipeline.context import Principal
from pipeline.errors import InvalidRequest, ServiceUnavailable, StorageFull, retry_after
from pipeline.model.salt import MemoScope
from pipeline.telemetry import attributes as attr
from pipeline.telemetry.spans import current_span
from retrieval import (
    Document,
    Filter,
    FilterError,
    HybridRetriever,
    IndexStore,
    IngestResult,
    QueryBatcher,
    SearchResult,
)
from retrieval.access import Viewer
from retrieval.backends import BackendUnavailable, RetrievalBackend
from retrieval.backends.embedded import EmbeddedBackend
from retrieval.backends.moves import TenantMoving
from retrieval.backends.router import BackendRouter
from retrieval.embeddings import embedding_executor
from retrieval.snapshots import IndexUnreadable
from retrieval.store import IndexBusy, IndexStorageFull
from retrieval.vectors import FloatArray

T = TypeVar("T")
log = logging.getLogger(__name__)
# The wait a write refused with index_busy is told to take before trying again.
INDEX_BUSY_RETRY_S = 5.0


def viewer_of(principal: Principal) -> Viewer:
    """Who a search is for: the principal's user and groups (its tenant picks the index)."""
    return Viewer(principal.user, principal.groups)


class PassageSearch:
    """Search, ingest and delete for the request path, each off the event loop.

    Searches and writes run in two bounded thread pools of their own (``search_threads`` and
    ``ingest_threads`` threads), not in the loop's default pool, which request bodies, guards and
    routing share: however many ingests are queued, they hold at most ``ingest_threads``
    threads, and a search never waits for one of them. The ingest threads run torch with
    ``ingest_torch_threads`` threads (see ``retrieval.embeddings.embedding_executor``), so an
    ingest's batch of passages leaves cores to the queries' embeddings.

    Which index serves a tenant is ``backends``' choice (``retrieval.backends.router``): the
    embedded snapshots of ``store`` (searched by ``retriever``) unless settings or a move sent
    the tenant elsewhere (Milvus). Every method here goes through the tenant's backend.
    """

    def __init__(
        self,
        store: IndexStore,
        retriever: HybridRetriever,
        queries: QueryBatcher,
        tracer: trace.Tracer,
        *,
        search_threads: int = 4,
        ingest_threads: int = 1,
        ingest_torch_threads: int = 0,
        backends: BackendRouter | None = None,
    ) -> None:
        self.store = store
        self.retriever = retriever
        self.backends = backends or BackendRouter({"embedded": EmbeddedBackend(store, retriever)})
        self.queries = queries
        self.tracer = tracer
        self._searches = ThreadPoolExecutor(search_threads, thread_name_prefix="search")
        self._writes = embedding_executor(ingest_threads, ingest_torch_threads, "ingest")
        # Per tenant: the write of this process in the pool, the others waiting (_gated_write);
        # and until when a tenant refused index_busy is refused at once.
        self._gates: weakref.WeakValueDictionary[str, asyncio.Lock] = weakref.WeakValueDictionary()
        self._busy_until: dict[str, float] = {}

    async def _off_loop(
        self, pool: ThreadPoolExecutor, fn: Callable[..., T], *args: Any, **kwargs: Any
    ) -> T:
        """``fn`` in ``pool``, with this context (as ``asyncio.to_thread`` does for its pool)."""
        call = functools.partial(contextvars.copy_context().run, fn, *args, **kwargs)
        return await asyncio.get_running_loop().run_in_executor(pool, call)

    def backend(self, tenant: str) -> RetrievalBackend:
        """The backend that holds ``tenant``'s index."""
        return self.backends.for_tenant(tenant)

    def version(self, tenant: str) -> str:
        return self.backend(tenant).version(tenant)

    def idf(self, principal: Principal, query: str) -> dict[str, float]:
        """The IDF of the query's terms (what compression weighs words by) in the tenant's
        index as ``principal`` may see it: hidden chunks weigh nothing (the view is the one the
        retrieval of the same request built). Empty for a backend that does not expose its
        statistics (Milvus): compression then uses its own estimate."""
        tenant = principal.tenant
        return self.backend(tenant).idf(tenant, viewer_of(principal), query)

    def has_index(self, tenant: str) -> bool:
        return self.backend(tenant).has_index(tenant)

    def access_scope(self, principal: Principal) -> tuple[str, dict[str, Any] | None]:
        """The version of the tenant's index and what of the principal decides which of its
        chunks the principal sees (``AccessColumns.scope`` for the embedded index, read from
        the same snapshot; None when the index has no access lists). Both go into the cache
        key. A snapshot that cannot be read is a 503 ``index_unreadable``, as for a search (it
        was a 500 from the response cache's lookup: a review's find)."""
        tenant = principal.tenant
        return _answered(self.backend(tenant).access_scope, tenant, viewer_of(principal))

    def loaded(self, tenant: str) -> bool:
        """Whether the tenant's index answers the reads made on the event loop (its version,
        a caller's access scope) from memory: always, but for an embedded snapshot not loaded
        yet."""
        backend = self.backend(tenant)
        return not isinstance(backend, EmbeddedBackend) or backend.store.loaded(tenant)

    async def ready(self, tenant: str) -> None:
        """The tenant's published snapshot loaded, in the search pool when it is not yet, so
        that the reads on the event loop that follow (the cache key, the memo scope, the
        prompt's salt) find it in memory. A fresh replica, one whose budget let the snapshot
        go, and every replica once the tenant publishes a new version loaded it on the loop
        at its first read: 75 ms for SciFact, 430 ms for a metadata-dense tenant (BENCHMARKS.md,
        "What a loaded snapshot holds"), during which the replica answered no one."""
        try:
            if self.loaded(tenant):
                return
            backend = self.backend(tenant)
            assert isinstance(backend, EmbeddedBackend)  # the only one that loads
            await self._off_loop(self._searches, backend.store.current, tenant)
        except IndexUnreadable:
            pass  # logged where it was read; the search says so (a 503 index_unreadable)
        except Exception:  # the reads that follow meet it and say so; this one only readies
            log.exception("tenant %s's index could not be loaded ahead of its reads", tenant)

    def memo_scope(self, principal: Principal) -> str:
        """The principal's memo scope (``pipeline.model.salt.MemoScope``) over this index: read
        from the snapshot loaded, never loading one (``IndexStore.peek``)."""
        return MemoScope(self.access_scope)(principal)

    async def embed(self, query: str, *, scope: str) -> FloatArray:
        """The query's vector (batched with other requests' queries, off the event loop; one
        embedding for the callers of ``scope``, the request's memo scope
        (``pipeline.model.salt.MemoScope``), waiting for the same text).

        A failure of the embedding model is converted here: a 503 for the request, never an
        unhandled error."""
        try:
            return await self.queries.embed(query, scope=scope)
        except Exception as exc:
            raise ServiceUnavailable(
                f"The embedding model failed ({type(exc).__name__}).", code="embedding_unavailable"
            ) from exc

    async def search(
        self,
        tenant: str,
        query: str,
        *,
        top_k: int,
        filters: Filter | None = None,
        defaults: Filter | None = None,
        vector: FloatArray | None = None,
        viewer: Viewer | None = None,
        context_terms: Sequence[tuple[str, float]] = (),
        embed_scope: str,
    ) -> SearchResult:
        """The tenant's best passages for ``query``, within the request's ``filters`` and the
        ``defaults`` it did not write (each parsed by ``parse_request_filters``, which names the
        caller's field). ``vector`` is the query's, when the caller has embedded it already.
        ``viewer`` (``viewer_of``) decides which chunks with an access list it may see.
        ``context_terms`` are texts whose words BM25 adds at a lower weight (a conversation's
        earlier turns: ``pipeline.sources.conversation``). ``embed_scope`` is the caller's memo
        scope (``memo_scope``), under which the query is embedded when no ``vector`` is given."""
        with current_span(
            self.tracer, f"retrieval {tenant}", attributes={attr.TENANT: tenant}
        ) as span:
            started = time.perf_counter()
            if vector is None:
                vector = await self.embed(query, scope=embed_scope)
            embed_ms = (time.perf_counter() - started) * 1000.0
            result = await self._off_loop(
                self._searches,
                self._search,
                tenant,
                query,
                vector,
                top_k=top_k,
                filters=filters,
                defaults=defaults,
                viewer=viewer,
                context_terms=context_terms,
            )
            timings = {"embed": embed_ms, **result.timings_ms}
            span.set_attributes(
                {
                    attr.RETRIEVAL_ALLOWED: result.allowed,
                    attr.RETRIEVAL_CANDIDATES: result.candidates,
                    attr.RETRIEVAL_RESULTS: len(result.hits),
                    attr.RETRIEVAL_INDEX_VERSION: result.version,
                    **{
                        f"{attr.RETRIEVAL_TIMING_PREFIX}{step}": round(ms, 3)
                        for step, ms in timings.items()
                    },
                }
            )
        return result

    def _search(self, tenant: str, *args: Any, **kwargs: Any) -> SearchResult:
        """The backend's search; a filter it cannot express is the caller's error (400)."""
        try:
            return _answered(self.backend(tenant).search, tenant, *args, **kwargs)
        except FilterError as exc:
            raise InvalidRequest(f"Invalid filters: {exc}", param="filters") from exc

    async def ingest(self, tenant: str, documents: Sequence[Document]) -> IngestResult:
        with current_span(
            self.tracer,
            f"ingest {tenant}",
            attributes={attr.TENANT: tenant, attr.INGEST_DOCUMENTS: len(documents)},
        ):
            docs = list(documents)
            return await self._gated_write(tenant, lambda b: b.upsert(tenant, docs))

    async def delete(self, tenant: str, document_ids: Sequence[str]) -> IngestResult:
        with current_span(self.tracer, f"delete {tenant}", attributes={attr.TENANT: tenant}):
            ids = list(document_ids)
            return await self._gated_write(tenant, lambda b: b.delete(tenant, ids))

    async def _gated_write(
        self, tenant: str, write: Callable[[RetrievalBackend], IngestResult]
    ) -> IngestResult:
        """``write`` in the ingest pool, at most one of a tenant's at a time: the others wait
        here, on the loop, not in the pool, where a tenant whose lock a stalled writer holds
        would keep every other tenant's writes waiting. A tenant refused ``index_busy`` a
        moment ago is refused again at once until its ``Retry-After`` has passed."""
        gate = self._gates.get(tenant)
        if gate is None:
            gate = self._gates[tenant] = asyncio.Lock()
        async with gate:
            left = self._busy_until.get(tenant, 0.0) - time.monotonic()
            if left > 0:
                raise ServiceUnavailable(
                    f"Another write to the index of tenant {tenant!r} held it without progress "
                    "a moment ago; nothing was written. Try again shortly.",
                    code="index_busy",
                    headers=retry_after(left),
                )
            self._busy_until.pop(tenant, None)
            try:
                return await self._off_loop(self._writes, _answered, self._write, tenant, write)
            except ServiceUnavailable as exc:
                if isinstance(exc.__cause__, IndexBusy):
                    self._busy_until[tenant] = time.monotonic() + INDEX_BUSY_RETRY_S
                raise

    def _write(
        self, tenant: str, write: Callable[[RetrievalBackend], IngestResult]
    ) -> IngestResult:
        """`write` on the tenant's backend, fenced against a move of the tenant
        (``BackendRouter.writing``)."""
        with self.backends.writing(tenant) as backend:
            return write(backend)

    async def aclose(self) -> None:
        await self.queries.aclose()
        self._searches.shutdown(wait=False)
        self._writes.shutdown(wait=False)
        self.backends.close()


def _answered(call: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``call``, with a backend whose store did not answer reported as a 503, a write while
    the tenant's index is being moved as a 503 ``index_moving`` with its wait, and a tenant's
    snapshot that cannot be read as a 503 ``index_unreadable``, and a write that waited its
    whole time for the tenant's lock as a 503 ``index_busy`` (nothing was written)."""
    try:
        return call(*args, **kwargs)
    except TenantMoving as exc:
        raise ServiceUnavailable(
            str(exc), code="index_moving", headers=retry_after(exc.retry_after_s)
        ) from exc
    except BackendUnavailable as exc:
        raise ServiceUnavailable(str(exc), code="retrieval_unavailable") from exc
    except IndexUnreadable as exc:
        raise ServiceUnavailable(str(exc), code="index_unreadable") from exc
    except IndexBusy as exc:
        raise ServiceUnavailable(
            f"{exc} Try again shortly.", code="index_busy", headers=retry_after(INDEX_BUSY_RETRY_S)
        ) from exc
    except IndexStorageFull as exc:
        raise StorageFull(str(exc), code="index_storage_full") from exc
