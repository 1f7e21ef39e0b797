"""Documents in, passages out: POST /v1/documents, DELETE /v1/documents/{id},
POST /v1/documents/delete (many at once), POST /v1/retrieve.

The tenant always comes from the API key. Ingest needs the ``ingest`` scope; search needs
``retrieve``. Search runs through the same filter, retrieval and relevance gate code as chat,
with chat's bounds (``top_k``, ``min_relevance``) and its default threshold.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field

from app.http import answers
from app.http.auth import IngestPrincipal, RetrievePrincipal
from app.http.bodies import BodyLimits, read_body, request_body
from app.http.openapi import answers as declared
from app.http.openapi import link
from app.http.schemas import Filters
from app.path import erase_cached_answers
from app.services import ServicesDep
from pipeline.errors import InvalidRequest, NotFound, PayloadTooLarge, ServiceUnavailable
from pipeline.sources.filters import parse_request_filters
from pipeline.sources.search import PassageSearch, viewer_of
from retrieval import Document, DocumentError, IngestResult, RelevanceGate
from retrieval.access import MAX_ENTRIES, MAX_NAME_CHARS
from retrieval.documents import (
    INVISIBLE,
    MAX_METADATA_KEYS,
    MAX_METADATA_LIST_ITEMS,
    MAX_METADATA_TEXT_CHARS,
    SPACE,
    parse_access,
)

router = APIRouter(tags=["retrieval"])

LIMITS = BodyLimits()
METADATA_KEY = r"^[A-Za-z0-9_.:-]+$"
MetadataText = Annotated[str, Field(max_length=MAX_METADATA_TEXT_CHARS)]
MetadataValue = (
    MetadataText
    | int
    | float
    | bool
    | Annotated[list[MetadataText], Field(max_length=MAX_METADATA_LIST_ITEMS)]
)
# A document id, as ``retrieval.Document`` checks it, so the schema says it: no whitespace,
# control characters or '#'.
DocumentId = Annotated[
    str, Field(min_length=1, max_length=256, pattern=rf"^[^#\x00-\x1f\x7f{SPACE}]+$")
]
# A group or user name of an access list (retrieval.access): the id rules, and no ',' either.
AccessName = Annotated[
    str, Field(min_length=1, max_length=MAX_NAME_CHARS, pattern=rf"^[^#,\x00-\x1f\x7f{SPACE}]+$")
]


class AccessIn(BaseModel):
    """Who may see the document: members of any of ``groups`` (a key's groups, ``rag keys
    groups``) and the ``users`` named, at least one of either (``retrieval.access``'s rule;
    the schema says it). Leave it out for a document the whole tenant sees."""

    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={
            "anyOf": [
                {"required": [name], "properties": {name: {"minItems": 1}}}
                for name in ("groups", "users")
            ]
        },
    )

    groups: list[AccessName] = Field(default_factory=list, max_length=MAX_ENTRIES)
    users: list[AccessName] = Field(default_factory=list, max_length=MAX_ENTRIES)


class DocumentIn(BaseModel):
    """One document; its title and metadata are copied onto every chunk, hence their limits."""

    model_config = ConfigDict(extra="forbid")

    # As ``retrieval.Document`` checks them, so the schema says it: a text with something that
    # shows, metadata keys of word characters.
    id: DocumentId
    text: str = Field(pattern=rf"[^{INVISIBLE}]")  # something that shows
    title: str = Field("", max_length=1000)
    metadata: dict[Annotated[str, Field(max_length=64, pattern=METADATA_KEY)], MetadataValue] = (
        Field(
            default_factory=dict,
            max_length=MAX_METADATA_KEYS,
            json_schema_extra={"propertyNames": {"maxLength": 64, "pattern": METADATA_KEY}},
        )
    )
    access: AccessIn | None = None


class IngestRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    documents: list[DocumentIn] = Field(
        min_length=1,
        description="Upserted in order, as one new version: an id given twice keeps its last copy.",
    )


class DeleteRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    ids: list[DocumentId] = Field(
        min_length=1,
        description="Deleted as one new version; an id the tenant does not have is listed in "
        "`not_found`, and an id given twice is deleted once. An id that breaks the id rules "
        "refuses the whole request (400).",
    )


class RetrieveRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    query: str = Field(min_length=1, max_length=10_000)
    top_k: int = Field(5, ge=1, le=50)  # chat's rag.top_k bounds
    filters: Filters = None
    min_relevance: float | None = Field(None, ge=0.0, le=1.0)  # None: the server's threshold


def _ingest_body(result: IngestResult) -> dict[str, Any]:
    return {
        "object": "ingest.result",
        "version": result.version,
        "documents": result.documents,
        "chunks": result.chunks,
        "seconds": round(result.seconds, 3),
        "total_documents": result.total_documents,
        "total_chunks": result.total_chunks,
    }


def _check_batch(services: ServicesDep, count: int, field: str) -> None:
    """A 413 for more items in one request than ``RAG_RETRIEVAL__MAX_BATCH_DOCUMENTS``."""
    limit = services.settings.retrieval.max_batch_documents
    if count > limit:
        raise PayloadTooLarge(f"{count} {field} in one request; the limit is {limit}.", param=field)


def _search(services: ServicesDep) -> PassageSearch:
    if services.retrieval is None:
        raise ServiceUnavailable("Retrieval is switched off on this server.", code="disabled")
    return services.retrieval


INGESTED_LINKS = {
    "DeleteDocument": link(
        "deleteDocument",
        "Delete the first document just ingested.",
        document_id="$request.body#/documents/0/id",
    )
}


@router.post(
    "/v1/documents",
    response_model=None,
    openapi_extra=request_body(IngestRequest),
    operation_id="ingestDocuments",
    responses=declared(200, answers.IngestResult, 400, 403, 413, 507, links=INGESTED_LINKS),
)
async def ingest_documents(
    request: Request, services: ServicesDep, principal: IngestPrincipal
) -> dict[str, Any]:
    search = _search(services)
    body = await read_body(await request.body(), IngestRequest, LIMITS)
    _check_batch(services, len(body.documents), "documents")
    documents = []
    for position, item in enumerate(body.documents):
        try:
            access = None if item.access is None else parse_access(item.access.model_dump())
            documents.append(
                Document(
                    id=item.id,
                    text=item.text,
                    title=item.title,
                    metadata=item.metadata,
                    access=access,
                )
            )
        except DocumentError as exc:
            raise InvalidRequest(str(exc), param=f"documents.{position}") from exc
    try:
        result = await search.ingest(principal.tenant, documents)
    except DocumentError as exc:
        error = PayloadTooLarge if exc.too_large else InvalidRequest
        raise error(str(exc), param="documents") from exc
    return _ingest_body(result)


@router.delete(
    "/v1/documents/{document_id:path}",
    response_model=None,
    operation_id="deleteDocument",
    responses=declared(200, answers.DeleteResult, 403, 404, 507),
)
async def delete_document(
    document_id: str, services: ServicesDep, principal: IngestPrincipal
) -> dict[str, Any]:
    result = await _search(services).delete(principal.tenant, [document_id])
    if result.documents == 0:
        raise NotFound(
            f"No document '{document_id}' in this tenant's index.",
            param="document_id",
            code="document_not_found",
        )
    return {**await _deleted(services, principal.tenant, result), "deleted": True}


@router.post(
    "/v1/documents/delete",
    response_model=None,
    openapi_extra=request_body(DeleteRequest),
    operation_id="deleteDocuments",
    responses=declared(200, answers.DeleteBatchResult, 400, 403, 413, 507),
)
async def delete_documents(
    request: Request, services: ServicesDep, principal: IngestPrincipal
) -> dict[str, Any]:
    """Many documents at once: one new version and one erasure of cached answers, where one
    request per id publishes (and writes whole) a version each."""
    search = _search(services)  # retrieval off: a 503 before the body is read
    body = await read_body(await request.body(), DeleteRequest, LIMITS)
    _check_batch(services, len(body.ids), "ids")
    result = await search.delete(principal.tenant, body.ids)
    return {**await _deleted(services, principal.tenant, result), "not_found": list(result.absent)}


async def _deleted(services: ServicesDep, tenant: str, result: IngestResult) -> dict[str, Any]:
    """A delete's answer. Cached answers that may quote what it removed go too: all the
    tenant's, since a key does not say what made it (none when nothing was removed)."""
    erased = (
        await erase_cached_answers(services.settings, services.kv, tenant, result.version)
        if result.documents
        else 0
    )
    return {**_ingest_body(result), "object": "delete.result", "cached_answers_removed": erased}


@router.post(
    "/v1/retrieve",
    response_model=None,
    openapi_extra=request_body(RetrieveRequest),
    operation_id="retrieve",
    responses=declared(200, answers.RetrieveResult, 400, 403, 413),
)
async def retrieve(
    request: Request, services: ServicesDep, principal: RetrievePrincipal
) -> dict[str, Any]:
    body = await read_body(await request.body(), RetrieveRequest, LIMITS)
    filters = parse_request_filters(body.filters, "filters")
    search = _search(services)
    result = await search.search(
        principal.tenant,
        body.query,
        top_k=body.top_k,
        filters=filters,
        viewer=viewer_of(principal),  # documents with an access list: only those it admits
        embed_scope=search.memo_scope(principal),
    )
    gate = RelevanceGate.configured(services.settings.retrieval.relevance_threshold)
    kept, dropped = gate.apply(result.hits, body.min_relevance)
    return {
        "object": "list",
        "index_version": result.version,
        "candidates": result.candidates,
        "allowed": result.allowed,
        "dropped": len(dropped),
        "timings_ms": {k: round(v, 3) for k, v in result.timings_ms.items()},
        "data": [
            {
                "document_id": hit.document_id,
                "chunk_id": hit.chunk_id,
                "score": hit.score,
                "relevance": hit.relevance,
                "bm25_score": hit.bm25_score,
                "vector_score": hit.vector_score,
                "title": hit.title,
                "text": hit.text,
                "metadata": hit.metadata,
            }
            for hit in kept
        ],
    }
