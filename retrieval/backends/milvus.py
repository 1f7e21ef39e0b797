"""The Milvus backend: every tenant of a deployment in one collection, searched with the same
cascade as the embedded index (BM25 candidates, their vectors, the same fusion).

Schema (`COLLECTION_FIELDS`): `pk` (a digest of tenant and chunk id), `tenant` (an ordinary
VARCHAR every query filters on: a partition key misbehaved in Milvus Lite 2.5), chunk and
document ids, `doc_key` (a digest of tenant and document id, what writes delete by), `indexed`
(title, headings and text: what BM25 reads, through Milvus's English analyzer and its BM25
function into `sparse`), `text`, `title`, `dense` (384-d, FLAT index, inner product over the
normalised embeddings), `metadata` (JSON), `eq_terms` (digests of metadata values, for equality
filters: retrieval.backends.milvus_expr), `access` (JSON) with `public` and `access_terms`.

A search: (1) BM25 top `candidates` inside Milvus, the tenant, the viewer's access and both
filters applied by the server; when every allowed chunk fits in `candidates` and a query vector
is given, all allowed chunks are candidates (as `select_candidates` does); (2) the candidates'
stored vectors scored against the query; (3) `retrieval.fusion.fuse` and
`retrieval.hybrid.top_positions`, the embedded index's own code.

Differences from the embedded index, each cheap there and dear here:
- BM25 statistics are Milvus's, over the whole collection, not per viewer; `bm25_norm` is None
  (Milvus gives no attainable maximum). `relevance` is the same model's score where the model
  does not weigh BM25 (the tuned default reads the cosine only, so the relevance gate decides
  exactly as on the embedded index); with a model that weighs BM25 it is None and the gate keeps
  the hit.
- `context_terms` (a conversation's earlier turns at a lower weight) are one more BM25 search
  each, their scores added at their weight to the candidates they found (`_candidates`).
- `idf` is empty: compression falls back to IDF over the passages it compresses.
- A range filter compares scalar values only (not the elements of a list-valued field).
- Upserts delete a document's old chunks and then insert the new ones: a search in between may
  see the document missing, never half old and half new.

Milvus calls block: PassageSearch runs them in its search and ingest thread pools.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.metadata
import json
import logging
import math
import sys
import threading
import time
import types
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import redis

from retrieval.access import Viewer, access_from_json
from retrieval.backends import BackendStats, BackendUnavailable, ChunkBatch
from retrieval.backends.milvus_expr import (
    NO_TYPED_FIELDS,
    TypedFields,
    TypedKind,
    access_digests,
    check_collection,
    check_key,
    filter_expr,
    metadata_digests,
    present_column,
    scoped_expr,
    typed_column,
    typed_value,
)
from retrieval.backends.versions import VersionCounter
from retrieval.documents import (
    DEFAULT_MAX_WORDS,
    DEFAULT_OVERLAP_WORDS,
    Chunk,
    Document,
    DocumentError,
    chunk_document,
)
from retrieval.embeddings import Embedder
from retrieval.filters import Filter, FilterError
from retrieval.fusion import FusionMethod, fuse
from retrieval.hybrid import (
    DEFAULT_CANDIDATES,
    DEFAULT_FUSION,
    DEFAULT_RRF_K,
    DEFAULT_VECTOR_WEIGHT,
    Hit,
    SearchResult,
    top_positions,
)
from retrieval.relevance import DEFAULT_MODEL, RelevanceModel
from retrieval.store import IngestResult, absent_from
from retrieval.tenants import check_tenant
from retrieval.vectors import FloatArray
from retrieval.versions import NO_VERSION

MAX_TEXT_BYTES = 65_535
# Every read sees every write acknowledged before it (pymilvus creates collections "Bounded":
# on a Milvus server a search may miss the last few seconds' writes). A write bumps the
# tenant's version once Milvus has acknowledged it, and answers are cached under the version:
# a search keyed on the new version that still saw a deleted document (or missed a new one)
# would be cached under it for the cache's TTL. Milvus Lite is strongly consistent anyway.
CONSISTENCY = "Strong"
MAX_ID_BYTES = 2048
MAX_EQ_TERMS = 4096
MAX_ACCESS_TERMS = 64
_OUTPUT = ["chunk_id", "document_id", "text", "title", "metadata", "dense"]
_EXPORT = ["chunk_id", "document_id", "text", "title", "metadata", "access", "dense", "position"]
# What an insert writes (`_row`); `sparse` is the BM25 function's, computed by Milvus.
_STORED_FIELDS = (
    "pk",
    "tenant",
    "chunk_id",
    "document_id",
    "doc_key",
    "position",
    "indexed",
    "text",
    "title",
    "dense",
    "metadata",
    "access",
    "public",
    "eq_terms",
    "access_terms",
)
# Milvus Lite 2.5.1 answers a query whose result is empty with this error (it cannot type the
# output columns of no rows): seen for a tenant with no chunk, a value no row holds, a JSON path
# no row has. It means "no rows".
_EMPTY_RESULT = "Unsupported data type: 0"
# Milvus (its segcore, in Lite 2.5.1 too) can refuse a BM25 search with this while rows are
# being deleted: its corpus statistics race the delete, a term's IDF comes out negative, and
# the query's sparse row is refused. Seen once in CI (a search during an upsert's delete), not
# in 9,000 searches beside 4,000 upserts here: rare, and gone a moment later. Such a search is
# asked again (`_BM25_TRIES` in all, a few milliseconds apart); only then is it a failure.
_NEGATIVE_IDF = "Invalid sparse row: negative value"
_BM25_TRIES = 3


class MilvusUnavailable(RuntimeError):
    """Milvus (or Milvus Lite) could not be started or reached."""


class MilvusNotInstalled(MilvusUnavailable):
    """pymilvus is missing: no retry will reach Milvus (the app does not start without it)."""


class VersionAnswers:
    """What the Milvus backend answers from its tenants' version counters alone, with no call
    to Milvus: cheap enough for the event loop (the cache key, the retrieve stage's first look),
    and answered while Milvus itself cannot be reached (``retrieval.backends.lazy``)."""

    def __init__(self, versions: VersionCounter) -> None:
        self.versions = versions

    def version(self, tenant: str) -> str:
        return self.versions.get(check_tenant(tenant))

    def has_index(self, tenant: str) -> bool:
        """Whether the tenant was ever written to (its version counter exists)."""
        return self.version(tenant) != NO_VERSION

    def idf(self, tenant: str, viewer: Viewer | None, query: str) -> dict[str, float]:
        """Empty: Milvus does not expose its BM25 statistics; compression then weighs words
        by an IDF over the passages it compresses (pipeline.sources.compress)."""
        return {}

    def access_scope(self, tenant: str, viewer: Viewer | None) -> tuple[str, dict[str, Any] | None]:
        """The whole viewer: which of its groups some list names is not known cheaply here, so
        answers are shared only between viewers with the same user and groups."""
        version = self.version(tenant)
        if viewer is None:
            return version, {"groups": [], "user": None}
        return version, {"groups": sorted(viewer.groups), "user": viewer.user}

    def close(self) -> None:
        closer = getattr(self.versions, "close", None)
        if closer is not None:
            closer()


F = TypeVar("F", bound=Callable[..., Any])
# What a failing store raises through pymilvus (its MilvusException, gRPC's errors, sockets)
# and through redis-py; the caller's own errors (DocumentError, FilterError) pass as they are.
_STORE_ERRORS: tuple[type[BaseException], ...] = (redis.RedisError, ConnectionError, TimeoutError)


def _store_errors() -> tuple[type[BaseException], ...]:
    try:
        from pymilvus.exceptions import MilvusException
    except ImportError:
        return _STORE_ERRORS
    return (*_STORE_ERRORS, MilvusException)


def unavailable_on_store_failure(method: F) -> F:
    """Turns a store's failure inside `method` into BackendUnavailable (503 on the request
    path), naming what failed."""

    @functools.wraps(method)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return method(*args, **kwargs)
        except _store_errors() as exc:
            store = "Redis (index versions)" if isinstance(exc, redis.RedisError) else "Milvus"
            raise BackendUnavailable(
                f"The retrieval backend's store did not answer: {store} ({type(exc).__name__})."
            ) from exc

    return wrapper  # type: ignore[return-value]


class _EmptyResultNoise(logging.Filter):
    """Drops pymilvus's ERROR records of Milvus Lite's empty-result error (`_EMPTY_RESULT`),
    which the backend reads as "no rows", and the client's "Failed to query" record that
    follows each (it names no cause; a real failure still reaches the caller as the exception
    it re-raises). Every other record passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return _EMPTY_RESULT not in message and not message.startswith("Failed to query")


def _quiet_empty_results() -> None:
    for name in ("pymilvus.decorators", "pymilvus.milvus_client.milvus_client"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _EmptyResultNoise) for f in logger.filters):
            logger.addFilter(_EmptyResultNoise())


def _provide_pkg_resources() -> None:
    """milvus-lite 2.5.1 imports `pkg_resources` (for its own version only), which setuptools
    82 removed. Where it is missing, give it the two names it uses, from importlib.metadata."""
    try:
        import pkg_resources  # noqa: F401
    except ImportError:
        module = types.ModuleType("pkg_resources")

        class DistributionNotFound(Exception):
            pass

        def get_distribution(name: str) -> Any:
            try:
                return types.SimpleNamespace(version=importlib.metadata.version(name))
            except importlib.metadata.PackageNotFoundError as exc:
                raise DistributionNotFound(name) from exc

        module.DistributionNotFound = DistributionNotFound  # type: ignore[attr-defined]
        module.get_distribution = get_distribution  # type: ignore[attr-defined]
        sys.modules["pkg_resources"] = module


def connect(uri: str, timeout_s: float = 30.0) -> Any:
    """A MilvusClient for `uri`: a file path starts Milvus Lite on it, `http://host:19530` is a
    server. MilvusUnavailable, saying how to install it, when it cannot start."""
    _provide_pkg_resources()
    _quiet_empty_results()
    try:
        from pymilvus import MilvusClient
    except ImportError as exc:
        raise MilvusNotInstalled(
            "pymilvus is not installed: run `make install` (it installs pymilvus and milvus-lite)"
        ) from exc
    try:
        client = MilvusClient(uri, timeout=timeout_s)
    except Exception as exc:
        raise MilvusUnavailable(
            f"Milvus at {uri!r} could not be reached or started ({type(exc).__name__}: {exc}); "
            "for a file path, milvus-lite 2.5 must be installed (run `make install`), and no "
            "other process may have the file open"
        ) from exc
    if not uri.startswith(("http://", "https://", "tcp://", "unix:")):
        client._lite_path = uri  # for close(): stop the embedded server
    return client


def close(client: Any) -> None:
    """Close `client`; for Milvus Lite, also stop the embedded server of its file."""
    path = getattr(client, "_lite_path", None)
    client.close()
    if path is not None:
        from milvus_lite.server_manager import server_manager_instance

        server_manager_instance.release_server(path)


def _digest(*parts: str) -> str:
    return hashlib.blake2b("\x00".join(parts).encode(), digest_size=16).hexdigest()


def _doc_key(tenant: str, document_id: str) -> str:
    return _digest("d", tenant, document_id)


@dataclass(frozen=True)
class Collection:
    """A collection as this backend writes it: its name and its typed metadata columns (as
    the collection has them: they are fixed when it is created)."""

    name: str
    typed: dict[str, TypedKind]


class MilvusBackend:
    """Tenants' chunks in the Milvus `collection` at `client`, or, for the tenants
    `tenant_collections` names, in a collection of their own (a very large tenant: its
    searches and statistics then touch none of the others' rows; the tenant clause is still
    written into every expression); `embedder` embeds at ingest; `versions` holds each
    tenant's index version (RedisVersions). `typed_fields` are the metadata keys a new
    collection gets typed columns for (`retrieval.backends.milvus_expr`)."""

    name = "milvus"

    def __init__(
        self,
        client: Any,
        collection: str,
        embedder: Embedder,
        versions: VersionCounter,
        *,
        candidates: int = DEFAULT_CANDIDATES,
        fusion: FusionMethod = DEFAULT_FUSION,
        vector_weight: float = DEFAULT_VECTOR_WEIGHT,
        rrf_k: float = DEFAULT_RRF_K,
        chunk_words: int = DEFAULT_MAX_WORDS,
        overlap_words: int = DEFAULT_OVERLAP_WORDS,
        max_document_chars: int = 1_000_000,
        timeout_s: float = 30.0,
        relevance: RelevanceModel = DEFAULT_MODEL,
        typed_fields: TypedFields = NO_TYPED_FIELDS,
        tenant_collections: Mapping[str, str] | None = None,
    ) -> None:
        self.client = client
        self.collection = check_collection(collection)
        self.tenant_collections = {
            check_tenant(t): check_collection(c) for t, c in (tenant_collections or {}).items()
        }
        self.typed_fields = {check_key(k): kind for k, kind in typed_fields.items()}
        self.embedder = embedder
        self.versions = versions
        self._answers = VersionAnswers(versions)
        self.candidates = candidates
        self.fusion = fusion
        self.vector_weight = vector_weight
        self.rrf_k = rrf_k
        self.chunk_words = chunk_words
        self.overlap_words = overlap_words
        self.max_document_chars = max_document_chars
        # pymilvus bounds its retries of a failing call by `timeout` only when it is an int (a
        # float is ignored, and a stopped server is then retried 75 times: minutes per call).
        self.timeout_s = max(1, math.ceil(timeout_s))
        self.relevance = relevance
        # Writes of one tenant are serialised in this process (delete-then-insert of a document
        # must not interleave with another write of it); across processes, Milvus's own order.
        self._write_locks: dict[str, threading.Lock] = {}
        self._guard = threading.Lock()
        names = {self.collection, *self.tenant_collections.values()}
        self._collections = {name: self.ensure_collection(name) for name in sorted(names)}

    # -- the collection ----------------------------------------------------------------------

    def collection_of(self, tenant: str) -> Collection:
        """The collection that holds `tenant`'s chunks."""
        return self._collections[self.tenant_collections.get(tenant, self.collection)]

    def ensure_collection(self, name: str) -> Collection:
        """Create the collection `name` when it does not exist yet, and load it. An existing
        collection keeps the typed columns it was created with; where they differ from
        `typed_fields` a warning says so (ranges on a key without a column read the JSON path:
        the same answer, unindexed)."""
        if self.client.has_collection(name, timeout=self.timeout_s):
            self.client.load_collection(name, timeout=self.timeout_s)
            typed = _typed_columns_of(self.client.describe_collection(name, timeout=self.timeout_s))
            if typed != self.typed_fields:
                logging.getLogger(__name__).warning(
                    "milvus: collection %s has typed columns %s, the settings ask for %s; a "
                    "collection's columns are fixed when it is created (to change them, move "
                    "its tenants to a new collection)",
                    name,
                    typed,
                    self.typed_fields,
                )
            return Collection(name, typed)
        from pymilvus import DataType, Function, FunctionType, MilvusClient

        schema = MilvusClient.create_schema(auto_id=False, enable_dynamic_field=False)
        schema.add_field("pk", DataType.VARCHAR, is_primary=True, max_length=64)
        schema.add_field("tenant", DataType.VARCHAR, max_length=64)
        schema.add_field("chunk_id", DataType.VARCHAR, max_length=MAX_ID_BYTES)
        schema.add_field("document_id", DataType.VARCHAR, max_length=MAX_ID_BYTES)
        schema.add_field("doc_key", DataType.VARCHAR, max_length=64)
        schema.add_field("position", DataType.INT64)
        schema.add_field(
            "indexed",
            DataType.VARCHAR,
            max_length=MAX_TEXT_BYTES,
            enable_analyzer=True,
            analyzer_params={"type": "english"},
        )
        schema.add_field("text", DataType.VARCHAR, max_length=MAX_TEXT_BYTES)
        schema.add_field("title", DataType.VARCHAR, max_length=4096)
        schema.add_field("sparse", DataType.SPARSE_FLOAT_VECTOR)
        schema.add_field("dense", DataType.FLOAT_VECTOR, dim=self.embedder.dimension)
        schema.add_field("metadata", DataType.JSON)
        schema.add_field("access", DataType.JSON)  # Milvus Lite: no nullable fields
        schema.add_field("public", DataType.BOOL)
        schema.add_field(
            "eq_terms",
            DataType.ARRAY,
            element_type=DataType.VARCHAR,
            max_capacity=MAX_EQ_TERMS,
            max_length=32,
        )
        schema.add_field(
            "access_terms",
            DataType.ARRAY,
            element_type=DataType.VARCHAR,
            max_capacity=MAX_ACCESS_TERMS,
            max_length=32,
        )
        for key, kind in self.typed_fields.items():
            if kind == "number":
                schema.add_field(typed_column(key), DataType.DOUBLE)
            else:
                schema.add_field(typed_column(key), DataType.VARCHAR, max_length=MAX_TEXT_BYTES)
            schema.add_field(present_column(key), DataType.BOOL)
        schema.add_function(
            Function(
                name="bm25",
                function_type=FunctionType.BM25,
                input_field_names=["indexed"],
                output_field_names=["sparse"],
            )
        )
        index = self.client.prepare_index_params()
        index.add_index("sparse", index_type="SPARSE_INVERTED_INDEX", metric_type="BM25")
        # Milvus Lite 2.5 has only FLAT; the embeddings are normalised, so IP is cosine.
        index.add_index("dense", index_type="FLAT", metric_type="IP")
        # Scalar indexes: a Milvus server reads them for the clauses every search has (the
        # tenant) and for typed ranges; Milvus Lite accepts them (INVERTED is its only kind).
        index.add_index("tenant", index_type="INVERTED")
        for key in self.typed_fields:
            index.add_index(typed_column(key), index_type="INVERTED")
        self.client.create_collection(
            name,
            schema=schema,
            index_params=index,
            timeout=self.timeout_s,
            consistency_level=CONSISTENCY,
        )
        return Collection(name, dict(self.typed_fields))

    # -- reading -----------------------------------------------------------------------------

    def _query(
        self, tenant: str, expr: str, fields: list[str], limit: int | None = None
    ) -> list[Any]:
        """Rows of `tenant`'s collection matching `expr` (which names the tenant) ([] where
        Milvus Lite reports an empty result as an error)."""
        options: dict[str, Any] = {} if limit is None else {"limit": limit}
        try:
            return list(
                self.client.query(
                    self.collection_of(tenant).name,
                    filter=expr,
                    output_fields=fields,
                    timeout=self.timeout_s,
                    consistency_level=CONSISTENCY,
                    **options,
                )
            )
        except Exception as exc:
            if _EMPTY_RESULT in str(exc):
                return []
            raise

    def _count(self, tenant: str, expr: str) -> int:
        rows = self._query(tenant, expr, ["count(*)"])
        return int(rows[0]["count(*)"]) if rows else 0

    @unavailable_on_store_failure
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
        """See the module docstring."""
        started = time.perf_counter()
        version = self.version(tenant)
        typed = self.collection_of(tenant).typed
        caller, narrower = filter_expr(filters, typed), filter_expr(defaults, typed)
        visible = self._count(tenant, scoped_expr(tenant, viewer))
        if visible == 0:
            return SearchResult([], 0, 0, _timings(), version)
        requested = self._count(tenant, scoped_expr(tenant, viewer, caller)) if caller else visible
        expr = scoped_expr(tenant, viewer, caller, narrower)
        allowed = self._count(tenant, expr) if narrower else requested
        timings = {"filter": _ms(started)}
        rows, bm25, matched = self._candidates(
            tenant, query, expr, allowed, query_vector is not None, context_terms
        )
        timings["bm25"] = _ms(started) - timings["filter"]
        step = time.perf_counter()
        vector = None
        if query_vector is not None and rows:
            dense = np.asarray([r["dense"] for r in rows], dtype=np.float32)
            vector = dense @ query_vector.astype(np.float32, copy=False)
        timings["vector"] = _ms(step)
        step = time.perf_counter()
        hits = self._ranked(rows, bm25, matched, vector, top_k)
        timings["fusion"] = _ms(step)
        return SearchResult(
            hits,
            len(rows),
            allowed,
            timings,
            version,
            excluded_by_filters=visible - requested,
            excluded_by_defaults=requested - allowed,
        )

    def _candidates(
        self,
        tenant: str,
        query: str,
        expr: str,
        allowed: int,
        by_vector: bool,
        context_terms: Sequence[tuple[str, float]] = (),
    ) -> tuple[list[dict[str, Any]], np.ndarray, np.ndarray]:
        """Candidate rows with their BM25 scores and whether they hold a query term.

        BM25 is a sum over the query's terms, so the embedded index's weighted context terms
        (a conversation's earlier turns, `retrieval.hybrid.query_terms`) are each context
        text's own BM25 search, its scores times its weight added to the query's; a chunk
        outside a context search's top `candidates` gets none of that text's share (the one
        approximation)."""
        if allowed == 0:
            return [], np.zeros(0, np.float32), np.zeros(0, np.bool_)
        limit = min(allowed, self.candidates)
        scores: dict[str, float] = {}
        entities: dict[str, dict[str, Any]] = {}
        for text, weight in [(query, 1.0), *context_terms]:
            for hit in self._bm25(tenant, text, expr, limit):
                scores[hit["id"]] = scores.get(hit["id"], 0.0) + weight * float(hit["distance"])
                entities.setdefault(hit["id"], hit["entity"])
        if by_vector and allowed <= self.candidates:
            rows = self._query(tenant, expr, ["pk", *_OUTPUT], limit=allowed)
        else:
            best = sorted(scores, key=lambda pk: -scores[pk])[:limit]
            rows = [entities[pk] | {"pk": pk} for pk in best]
        bm25 = np.array([scores.get(r["pk"], 0.0) for r in rows], dtype=np.float32)
        matched = np.array([r["pk"] in scores for r in rows], dtype=np.bool_)
        return rows, bm25, matched

    def _bm25(self, tenant: str, query: str, expr: str, limit: int) -> list[dict[str, Any]]:
        if not query.strip():
            return []
        for attempt in range(1, _BM25_TRIES + 1):
            try:
                result = self.client.search(
                    self.collection_of(tenant).name,
                    data=[query],
                    anns_field="sparse",
                    limit=limit,
                    filter=expr,
                    output_fields=_OUTPUT,
                    search_params={"metric_type": "BM25"},
                    timeout=self.timeout_s,
                    consistency_level=CONSISTENCY,
                )
                break
            except Exception as exc:
                if _EMPTY_RESULT in str(exc):
                    return []
                if _NEGATIVE_IDF not in str(exc) or attempt == _BM25_TRIES:
                    raise
                time.sleep(0.005 * attempt)  # a delete's statistics, settling
        # A hit with no query term scores 0 (the BM25 function's sparse dot product).
        return [hit for hit in result[0] if float(hit["distance"]) > 0.0]

    def _ranked(
        self,
        rows: list[dict[str, Any]],
        bm25: np.ndarray,
        matched: np.ndarray,
        vector: np.ndarray | None,
        top_k: int,
    ) -> list[Hit]:
        if not rows:
            return []
        if vector is None:
            fused: np.ndarray = bm25
        else:
            fused = fuse(
                bm25,
                matched,
                vector,
                method=self.fusion,
                vector_weight=self.vector_weight,
                rrf_k=self.rrf_k,
            )
        # Ties go to the lower chunk id, as the embedded index's go to the lower row.
        order = np.argsort(np.argsort([r["chunk_id"] for r in rows])).astype(np.int64)
        hits = []
        for i in top_positions(fused, top_k, order):
            row = rows[int(i)]
            hits.append(
                Hit(
                    chunk_id=row["chunk_id"],
                    document_id=row["document_id"],
                    score=float(fused[i]),
                    text=row["text"],
                    title=row["title"],
                    metadata=dict(row["metadata"] or {}),
                    bm25_score=float(bm25[i]) if matched[i] else None,
                    vector_score=None if vector is None else float(vector[i]),
                    relevance=self._relevance(None if vector is None else float(vector[i])),
                )
            )
        return hits

    def _relevance(self, cosine: float | None) -> float | None:
        """The relevance model's score when it needs only the cosine (see the module
        docstring), else None."""
        if cosine is None or self.relevance.bm25_weight != 0.0:
            return None
        return self.relevance.score(0.0, cosine)

    def version(self, tenant: str) -> str:
        return self._answers.version(tenant)

    @unavailable_on_store_failure
    def stats(self, tenant: str) -> BackendStats:
        chunks = self._count(tenant, f'tenant == "{check_tenant(tenant)}"')
        return BackendStats(self.name, self.version(tenant), self._documents(tenant), chunks)

    def has_index(self, tenant: str) -> bool:
        """Whether the tenant was ever written to: no Milvus call on the event loop."""
        return self._answers.has_index(tenant)

    def _documents(self, tenant: str) -> int:
        """How many documents the tenant has, counted by the server: every document has
        exactly one chunk numbered 0 (`f"{document_id}#0"`, retrieval.documents), so this
        costs one count, not a listing of the tenant (which a write would pay for each time)."""
        return self._count(tenant, f'tenant == "{check_tenant(tenant)}" and position == 0')

    @unavailable_on_store_failure
    def document_ids(self, tenant: str) -> set[str]:
        return {row["document_id"] for row in self._iterate(tenant, ["document_id"])}

    def idf(self, tenant: str, viewer: Viewer | None, query: str) -> dict[str, float]:
        return self._answers.idf(tenant, viewer, query)

    def access_scope(self, tenant: str, viewer: Viewer | None) -> tuple[str, dict[str, Any] | None]:
        return self._answers.access_scope(tenant, viewer)

    def _iterate(
        self, tenant: str, fields: list[str], batch: int = 1000
    ) -> Iterator[dict[str, Any]]:
        """Every chunk of the tenant, in pages ordered by primary key (our own hex digests, so
        the paging clause holds nothing of the caller's)."""
        last = ""
        while True:
            expr = f'tenant == "{check_tenant(tenant)}" and pk > "{last}"'
            page = self._query(tenant, expr, ["pk", *fields], limit=batch)
            page.sort(key=lambda row: str(row["pk"]))
            yield from page
            if len(page) < batch:
                return
            last = str(page[-1]["pk"])

    def export(self, tenant: str, batch: int = 500) -> Iterator[ChunkBatch]:
        """Whole documents per batch (an import replaces its documents' chunks)."""
        by_document: dict[str, list[dict[str, Any]]] = {}
        for row in self._iterate(tenant, _EXPORT):
            by_document.setdefault(row["document_id"], []).append(row)
        rows: list[dict[str, Any]] = []
        for document_rows in by_document.values():
            rows.extend(sorted(document_rows, key=lambda r: int(r["position"])))
            if len(rows) >= batch:
                yield _chunk_batch(rows)
                rows = []
        if rows:
            yield _chunk_batch(rows)

    # -- writing -----------------------------------------------------------------------------

    def _lock(self, tenant: str) -> threading.Lock:
        with self._guard:
            return self._write_locks.setdefault(tenant, threading.Lock())

    @unavailable_on_store_failure
    def upsert(self, tenant: str, documents: Sequence[Document]) -> IngestResult:
        """Chunk and embed, then replace each document's chunks (delete by document, insert)."""
        started = time.perf_counter()
        check_tenant(tenant)
        latest = {d.id: d for d in documents}
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
        if not chunks:
            return self._result(tenant, started, 0, 0, self.version(tenant))
        for chunk in chunks:
            _checked_terms(chunk)
        texts = [c.indexed_text for c in chunks]
        vectors = np.concatenate(
            [self.embedder.embed(texts[i : i + 64]) for i in range(0, len(texts), 64)]
        )
        return self._write(tenant, chunks, vectors, set(latest), started)

    @unavailable_on_store_failure
    def import_chunks(self, tenant: str, batch: ChunkBatch) -> IngestResult:
        started = time.perf_counter()
        check_tenant(tenant)
        if not batch.chunks:
            return self._result(tenant, started, 0, 0, self.version(tenant))
        documents = {c.document_id for c in batch.chunks}
        return self._write(tenant, batch.chunks, batch.vectors, documents, started)

    def _write(
        self,
        tenant: str,
        chunks: Sequence[Chunk],
        vectors: FloatArray,
        documents: set[str],
        started: float,
    ) -> IngestResult:
        typed = self.collection_of(tenant).typed
        rows = [_row(tenant, c, v, typed) for c, v in zip(chunks, vectors, strict=True)]
        with self._lock(tenant):
            # Redis must answer before anything changes: a write it could not version (cache
            # keys unchanged) is refused whole, not done and then reported failed.
            self.versions.check()
            # Nothing stored may be lost: the documents' current chunks are kept, to be put
            # back if the new ones cannot be inserted after the old ones were deleted.
            previous = self._stored_rows(tenant, documents)
            self._delete_documents(tenant, documents)
            try:
                self._insert(tenant, rows)
            except BaseException:
                self._put_back(tenant, documents, previous)
                raise
            version = self.versions.bump(tenant)
        return self._result(tenant, started, len(documents), len(rows), version)

    def _insert(self, tenant: str, rows: Sequence[dict[str, Any]]) -> None:
        name = self.collection_of(tenant).name
        for start in range(0, len(rows), 500):
            self.client.insert(name, rows[start : start + 500], timeout=self.timeout_s)

    def _stored_rows(self, tenant: str, document_ids: set[str]) -> list[dict[str, Any]]:
        """Every stored field of the documents' chunks (all but the BM25 function's output),
        as an insert takes them."""
        keys = sorted(_doc_key(tenant, d) for d in document_ids)
        fields = [*_STORED_FIELDS, *typed_columns(self.collection_of(tenant).typed)]
        stored: list[dict[str, Any]] = []
        for part in _parts(keys, 500):
            expr = f'tenant == "{tenant}" and doc_key in [{_quoted(part)}]'
            stored += self._query(tenant, expr, fields)
        return [{name: row[name] for name in fields} for row in stored]

    def _put_back(self, tenant: str, document_ids: set[str], rows: list[dict[str, Any]]) -> None:
        """After a failed insert: the documents as they were (whatever of the new chunks went
        in removed first). Best effort: if Milvus refuses this too, the failure is logged and
        the insert's error is the one raised."""
        try:
            self._delete_documents(tenant, document_ids)
            self._insert(tenant, rows)
        except Exception:
            logging.getLogger(__name__).exception(
                "milvus: could not put back %d chunks of tenant %s after a failed write",
                len(rows),
                tenant,
            )

    @unavailable_on_store_failure
    def delete(self, tenant: str, document_ids: Sequence[str]) -> IngestResult:
        """Remove every chunk of each document; a new version only when one was there."""
        started = time.perf_counter()
        check_tenant(tenant)
        wanted = set(document_ids)
        with self._lock(tenant):
            present = self._present(tenant, wanted)
            absent = absent_from(document_ids, present)
            if not present:
                return self._result(tenant, started, 0, 0, self.version(tenant), absent)
            self.versions.check()  # as a write: refused whole while Redis cannot version it
            try:
                removed = self._delete_documents(tenant, present)
            except BaseException:
                # A part of 500 may be gone already: the version moves on all the same, so no
                # answer keyed on the old one is served again (the caller is told to retry).
                with contextlib.suppress(Exception):
                    self.versions.bump(tenant)
                raise
            version = self.versions.bump(tenant)
        return self._result(tenant, started, len(present), removed, version, absent)

    def _present(self, tenant: str, document_ids: set[str]) -> set[str]:
        """Which of ``document_ids`` the tenant has: one row a document (its first chunk's),
        never every chunk's: Milvus caps a query at 16,384 rows, and 500 long documents hold
        more, so documents past the cap were reported absent and left in place (a review's
        reproducer: 61 of 304 documents of a batch delete)."""
        keys = {_doc_key(tenant, d): d for d in document_ids}
        found: set[str] = set()
        for part in _parts(sorted(keys), 500):
            expr = f'tenant == "{tenant}" and position == 0 and doc_key in [{_quoted(part)}]'
            if not self._count(tenant, expr):
                continue
            rows = self._query(tenant, expr, ["doc_key"])
            found.update(keys[r["doc_key"]] for r in rows)
        return found

    def _delete_documents(self, tenant: str, document_ids: set[str]) -> int:
        """Delete every chunk of `document_ids`; how many there were (counted first: Milvus
        Lite's delete does not say)."""
        removed = 0
        keys = sorted(_doc_key(tenant, d) for d in document_ids)
        for part in _parts(keys, 500):
            expr = f'tenant == "{tenant}" and doc_key in [{_quoted(part)}]'
            count = self._count(tenant, expr)
            if count:
                self.client.delete(
                    self.collection_of(tenant).name, filter=expr, timeout=self.timeout_s
                )
            removed += count
        return removed

    def _result(
        self,
        tenant: str,
        started: float,
        documents: int,
        chunks: int,
        version: str,
        absent: tuple[str, ...] = (),
    ) -> IngestResult:
        total = self._count(tenant, f'tenant == "{tenant}"')
        return IngestResult(
            version,
            documents,
            chunks,
            time.perf_counter() - started,
            self._documents(tenant) if total else 0,
            total,
            absent,
        )

    def close(self) -> None:
        """Close the client, and stop Milvus Lite if this client started it (one process at a
        time may hold a Milvus Lite database file)."""
        close(self.client)
        self._answers.close()  # its version counters


def _typed_columns_of(description: Mapping[str, Any]) -> dict[str, TypedKind]:
    """The typed metadata columns (`f_<key>`) a described collection has, by key."""
    from pymilvus import DataType

    kinds: dict[Any, TypedKind] = {DataType.DOUBLE: "number", DataType.VARCHAR: "string"}
    typed: dict[str, TypedKind] = {}
    for field in description.get("fields", []):
        name = str(field.get("name", ""))
        if name.startswith("f_") and field.get("type") in kinds:
            typed[name[2:]] = kinds[field["type"]]
    return typed


def typed_columns(typed: TypedFields) -> list[str]:
    """Every column the typed fields `typed` add to a row."""
    return [column for key in typed for column in (typed_column(key), present_column(key))]


def _checked_terms(chunk: Chunk) -> list[str]:
    """The chunk's `eq_terms`; DocumentError for anything Milvus (or the embedder) would
    refuse, checked before anything is embedded or deleted (a write deletes the document's old
    chunks before it inserts the new ones)."""
    metadata = json.dumps(chunk.metadata, ensure_ascii=False)
    for name, value in (
        ("text", chunk.indexed_text),
        ("id", chunk.chunk_id),
        ("metadata", metadata),
    ):
        limit = MAX_ID_BYTES if name == "id" else MAX_TEXT_BYTES
        try:
            size = len(value.encode("utf-8"))
        except UnicodeEncodeError:  # a lone surrogate (JSON allows "\ud800")
            raise DocumentError(
                f"document {chunk.document_id!r}: its {name} is not UTF-8"
            ) from None
        if size > limit:
            raise DocumentError(f"document {chunk.document_id!r}: a passage's {name} is too long")
    try:
        terms = metadata_digests(chunk.metadata)
    except FilterError as exc:
        raise DocumentError(f"document {chunk.document_id!r}: metadata: {exc}") from None
    if len(terms) > MAX_EQ_TERMS:
        raise DocumentError(f"document {chunk.document_id!r}: too many metadata values")
    return terms


def _row(tenant: str, chunk: Chunk, vector: FloatArray, typed: TypedFields) -> dict[str, Any]:
    terms = _checked_terms(chunk)
    row = {
        "pk": _digest("c", tenant, chunk.chunk_id),
        "tenant": tenant,
        "chunk_id": chunk.chunk_id,
        "document_id": chunk.document_id,
        "doc_key": _doc_key(tenant, chunk.document_id),
        "position": int(chunk.chunk_id.rsplit("#", 1)[-1]),
        # Milvus's analyzer stops at a NUL (a C string): the rest would be missing from BM25.
        "indexed": chunk.indexed_text.replace("\x00", " "),
        "text": chunk.text,
        "title": chunk.title,
        "dense": np.asarray(vector, dtype=np.float32).tolist(),
        "metadata": chunk.metadata,
        "access": chunk.access.to_json() if chunk.access is not None else {},
        "public": chunk.access is None,
        "eq_terms": terms,
        "access_terms": access_digests(chunk.access),
    }
    for key, kind in typed.items():
        row[present_column(key)], row[typed_column(key)] = typed_value(
            kind, chunk.metadata.get(key)
        )
    return row


def _chunk_batch(rows: list[dict[str, Any]]) -> ChunkBatch:
    chunks = [
        Chunk(
            chunk_id=r["chunk_id"],
            document_id=r["document_id"],
            text=r["text"],
            title=r["title"],
            metadata=dict(r["metadata"] or {}),
            access=access_from_json(r["access"] or None),
        )
        for r in rows
    ]
    return ChunkBatch(chunks, np.asarray([r["dense"] for r in rows], dtype=np.float32))


def _parts(items: list[str], size: int) -> Iterator[list[str]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


def _quoted(digests: list[str]) -> str:
    # Our own hex digests only: nothing of the caller's is in them.
    return ", ".join(f'"{d}"' for d in digests)


def _ms(since: float) -> float:
    return (time.perf_counter() - since) * 1000.0


def _timings() -> dict[str, float]:
    return {"filter": 0.0, "bm25": 0.0, "vector": 0.0, "fusion": 0.0}
