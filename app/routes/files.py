"""Document files in: ``POST /v1/files`` (multipart), OpenAI's file upload with several files.

Fields, as OpenAI's client sends them: ``file`` (repeat it for several files, an extension)
and ``purpose`` (echoed; any short name). Optional: ``document_id`` (one file only; otherwise
the id is the file's name), ``metadata`` (a JSON object, copied onto every file's passages) and
``access`` (a JSON access list, ``{"groups": [...], "users": [...]}``, as on /v1/documents).
The tenant is always the key's; a ``tenant`` field is ignored. Needs the ``ingest`` scope.

Each file is checked and converted on its own (``retrieval.files``: content sniffed against the
extension, zip bombs refused before any library opens them, conversion in a worker process
that is killed at the file's time limit), then all good files are ingested together, as
/v1/documents does.

Answers:
- one file, accepted: 200 with a File object (OpenAI's fields, plus ``document_id``, ``kind``,
  ``title``, ``chunks`` and ``index_version``);
- several files, at least one accepted: 200 with ``{"object": "list", "data": [File...],
  "errors": [{"filename", "status", "error": {message, type, param, code}}]}``;
- no file accepted: the error in OpenAI's shape, naming each file and its reason, with the
  files' status if they agree (413 too large, 415 an unsupported type or an extension that
  is not the content's, 400 encrypted, no text layer, zip bomb, unreadable, too slow), else 400.

Load: at most ``files.max_pending_uploads`` uploads are in at once (the next: 503
``converter_busy`` with Retry-After, before its body is read); an upload's conversions have
``files.upload_timeout_seconds`` (a file not converted by then: 503 ``upload_timeout``, the
others go in); a text over ``retrieval.max_document_chars`` is refused in the worker (413
``too_large``), so it never crosses back into this process.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any, Final, Literal

from fastapi import APIRouter, Request
from pydantic import BaseModel, RootModel
from starlette.datastructures import FormData, UploadFile

from app.http.auth import IngestPrincipal
from app.http.bodies import BodyError, BodyLimits, parse_json
from app.http.openapi import answers as declared
from app.services import ServicesDep
from app.settings import FileSettings
from pipeline.errors import (
    ConverterBusy,
    InvalidRequest,
    PayloadTooLarge,
    PipelineError,
    ServiceUnavailable,
)
from pipeline.sources.search import PassageSearch
from retrieval import Document, DocumentError, chunk_document
from retrieval.access import AccessList
from retrieval.documents import check_metadata_limits, parse_access
from retrieval.files import EXTENSIONS, Converted, ConverterPool, FileRejected, PoolBusy

router = APIRouter(tags=["files"])

PATH = "/v1/files"
MAX_FIELD_BYTES = 16_384  # a form field that is not a file (metadata, access, purpose)
FIELD_LIMITS = BodyLimits(max_depth=8, max_nodes=10_000)  # metadata and access are flat
# What each file's document adds to the form's metadata, so that the form's metadata is refused
# as such (no room for them) rather than file by file.
_FILE_KEYS: Final = {"filename": "f", "format": "f"}
MAX_FIELDS = 16
# A path, C0 and C1 controls, line and paragraph separators, the bidi embeddings, overrides
# and isolates that make a name read as another ("\u202etxt.exe" shows as "exe.txt"), and
# characters that show nothing (zero-width space, word joiner, BOM, interlinear annotation,
# tag characters, which can carry hidden text): none is kept in a title or an id. Joiners
# (ZWNJ in Persian) and directional marks belong to their scripts and are kept.
_BAD_NAME = re.compile(
    r"[\x00-\x1f\x7f-\x9f/\\\u200b\u2028\u2029\u202a-\u202e\u2060\u2066-\u2069\ufeff"
    r"\ufff9-\ufffb\U000e0000-\U000e007f]"
)
_ID_UNSAFE = re.compile(r"[\s#]+")


class UnsupportedFileType(InvalidRequest):
    status_code = 415


class FileObject(BaseModel):
    """OpenAI's File object, and what ingesting the file did."""

    id: str
    object: Literal["file"]
    bytes: int
    created_at: int
    filename: str
    purpose: str
    status: Literal["processed"]
    document_id: str
    kind: str
    title: str
    chunks: int
    index_version: str


class FileError(BaseModel):
    filename: str
    status: int
    error: dict[str, Any]


class FileList(BaseModel):
    object: Literal["list"]
    data: list[FileObject]
    errors: list[FileError]


class FileUpload(RootModel[FileObject | FileList]):
    """One file's File object, or for several files the list of them and their errors."""


_REASON_ERRORS: dict[str, type[PipelineError]] = {
    "too_large": PayloadTooLarge,
    "unsupported_type": UnsupportedFileType,
    "type_mismatch": UnsupportedFileType,
    "upload_timeout": ServiceUnavailable,  # not the file's fault: the server had no time for it
}

_MULTIPART_BODY = {
    "requestBody": {
        "required": True,
        "content": {
            "multipart/form-data": {
                "schema": {
                    "type": "object",
                    "required": ["file"],
                    "properties": {
                        "file": {
                            "type": "array",
                            "items": {"type": "string", "format": "binary"},
                            "description": "One or more of: " + ", ".join(sorted(EXTENSIONS)),
                        },
                        "purpose": {"type": "string", "maxLength": 64},
                        "document_id": {"type": "string", "maxLength": 256},
                        "metadata": {"type": "string", "description": "A JSON object."},
                        "access": {"type": "string", "description": "A JSON access list."},
                    },
                }
            }
        },
    }
}


@dataclass
class Upload:
    """One file of an upload: its bytes until converted, then its document, or its error."""

    filename: str
    size: int = 0
    data: bytes = b""
    converted: Converted | None = None
    document: Document | None = None
    error: PipelineError | None = None


@dataclass
class UploadForm:
    """The form's fields, checked; `uploads` read (each within the file size limit)."""

    uploads: list[Upload]
    purpose: str
    document_id: str | None
    metadata: dict[str, Any]
    access: AccessList | None


def _file_error(filename: str, exc: FileRejected) -> PipelineError:
    error = _REASON_ERRORS.get(exc.reason, InvalidRequest)
    return error(f"{filename}: {exc}", param="file", code=exc.reason)


def _text_field(form: FormData, name: str) -> str | None:
    value = form.get(name)
    if value is None:
        return None
    if not isinstance(value, str):
        raise InvalidRequest(f"'{name}' must be a text field, not a file.", param=name)
    return value


def _json_field(form: FormData, name: str) -> Any:
    """A JSON form field, parsed as a JSON body is (``app.http.bodies``): integers keep their
    exact value and must fit in 64 bits, numbers are finite, strings hold no lone surrogate."""
    text = _text_field(form, name)
    if text is None:
        return None
    try:
        return parse_json(text.encode("utf-8", "surrogatepass"), FIELD_LIMITS)
    except BodyError as exc:
        raise InvalidRequest(f"'{name}': {exc}", param=name, code=exc.code) from None


def _document_id(filename: str) -> str:
    return _ID_UNSAFE.sub("_", filename)[:256]


async def _read(upload: UploadFile, limit: int) -> Upload:
    """The file's name and bytes, or the error that refuses it (a name with a path or control
    characters, a file over `limit`)."""
    name = upload.filename or ""
    if not name.strip() or _BAD_NAME.search(name) or len(name) > 255:
        shown = repr(name[:80])
        return Upload(
            shown,
            error=InvalidRequest(
                f"{shown}: a file name must be 1-255 characters, without a path or control "
                "characters.",
                param="file",
                code="invalid_filename",
            ),
        )
    data = await upload.read(limit + 1)
    if len(data) > limit:
        return Upload(
            name,
            error=PayloadTooLarge(
                f"{name}: the file is larger than the limit of {limit} bytes.",
                param="file",
                code="too_large",
            ),
        )
    return Upload(name, len(data), data)


def _checked_metadata(value: Any) -> dict[str, Any]:
    """The ``metadata`` field, checked as a document's metadata is, with room for the keys
    each file's document adds (``filename``, ``format``): a 400 naming it."""
    if value is None:
        return {}
    try:
        metadata = Document(id="metadata", text="-", metadata=value).metadata
        check_metadata_limits({**metadata, **_FILE_KEYS})
    except DocumentError as exc:
        raise InvalidRequest(
            f"{exc} (each file's document adds {', '.join(_FILE_KEYS)})", param="metadata"
        ) from None
    return metadata


async def _read_form(request: Request, config: FileSettings) -> UploadForm:
    if not request.headers.get("content-type", "").lower().startswith("multipart/form-data"):
        raise UnsupportedFileType(
            "Send the files as multipart/form-data (a 'file' field per file).",
            param="file",
            code="not_multipart",
        )
    # Starlette answers a missing boundary, too many parts, oversized fields and malformed
    # multipart with a 400 (its HTTPException, rendered in OpenAI's shape).
    async with request.form(
        max_files=config.max_files, max_fields=MAX_FIELDS, max_part_size=MAX_FIELD_BYTES
    ) as form:
        files = [f for f in form.getlist("file") if isinstance(f, UploadFile)]
        if not files:
            raise InvalidRequest("No 'file' field with a file in the upload.", param="file")
        purpose = _text_field(form, "purpose") or "assistants"
        if len(purpose) > 64:
            raise InvalidRequest("'purpose' is at most 64 characters.", param="purpose")
        document_id = _text_field(form, "document_id")
        if document_id == "":
            raise InvalidRequest(
                "'document_id' is empty: leave it out to use the file's name.",
                param="document_id",
            )
        if document_id is not None and len(files) > 1:
            raise InvalidRequest(
                "'document_id' names one document: upload one file with it.", param="document_id"
            )
        metadata = _checked_metadata(_json_field(form, "metadata"))
        try:
            access = parse_access(_json_field(form, "access"))
        except DocumentError as exc:
            raise InvalidRequest(str(exc), param="access") from None
        uploads = [await _read(f, config.max_file_bytes) for f in files]
    return UploadForm(uploads, purpose, document_id, metadata, access)


async def _convert(
    converter: ConverterPool, uploads: list[Upload], tenant: str, budget_s: float
) -> None:
    """Convert every file not refused yet, at once (the pool bounds how many run, and how many
    of the tenant's), within the upload's time budget: a file not converted by then is refused
    with ``upload_timeout`` while the others go in."""
    deadline = time.monotonic() + budget_s

    async def one(upload: Upload) -> None:
        try:
            upload.converted = await converter.convert(
                upload.filename, upload.data, tenant=tenant, deadline=deadline
            )
        except FileRejected as exc:
            upload.error = _file_error(upload.filename, exc)
        upload.data = b""

    await asyncio.gather(*(one(u) for u in uploads if u.error is None))


def _make_documents(form: UploadForm, max_chars: int) -> None:
    """Each converted file's document, or its error (too long a text, an id already used by
    another file of the upload)."""
    seen: set[str] = set()
    for upload in form.uploads:
        if upload.converted is None:
            continue
        doc_id = form.document_id or _document_id(upload.filename)
        try:
            if doc_id in seen:
                raise DocumentError(f"another file of this upload has the document id {doc_id!r}")
            upload.document = _document(upload.converted, doc_id, upload.filename, form, max_chars)
            seen.add(doc_id)
        except DocumentError as exc:
            error = PayloadTooLarge if exc.too_large else InvalidRequest
            upload.error = error(f"{upload.filename}: {exc}", param="file", code="invalid_file")


def _none_accepted(uploads: list[Upload]) -> PipelineError:
    """One error for an upload whose every file was refused: each file and its reason, with the
    files' status when they share one."""
    errors = [u.error for u in uploads if u.error is not None]
    if len(errors) == 1:
        return errors[0]
    statuses = Counter(type(e).status_code for e in errors)
    kind = type(errors[0]) if len(statuses) == 1 else InvalidRequest
    message = "No file was accepted: " + "; ".join(e.message for e in errors)
    return kind(message, param="file", code=errors[0].code)


@router.post(
    PATH,
    response_model=None,
    openapi_extra=_MULTIPART_BODY,
    operation_id="uploadFiles",
    responses=declared(200, FileUpload, 400, 403, 413, 415, 507),
)
async def upload_files(
    request: Request, services: ServicesDep, principal: IngestPrincipal
) -> dict[str, Any]:
    search, converter = services.retrieval, services.converter
    if search is None or converter is None:
        raise ServiceUnavailable("Retrieval is switched off on this server.", code="disabled")
    # Admitted before the body is read: a refused upload never holds its files in memory.
    try:
        admitted = converter.admit()
    except PoolBusy as exc:
        raise ConverterBusy(retry_after_s=exc.retry_after_s) from None
    with admitted:
        return await _upload(request, services, principal, search, converter)


async def _upload(
    request: Request,
    services: ServicesDep,
    principal: IngestPrincipal,
    search: PassageSearch,
    converter: ConverterPool,
) -> dict[str, Any]:
    config = services.settings.files
    form = await _read_form(request, config)
    await _convert(converter, form.uploads, principal.tenant, config.upload_timeout_seconds)
    passages = services.settings.retrieval
    _make_documents(form, passages.max_document_chars)
    accepted = [u for u in form.uploads if u.document is not None]
    if not accepted:
        raise _none_accepted(form.uploads)
    documents = [u.document for u in accepted if u.document is not None]
    try:
        result = await search.ingest(principal.tenant, documents)
    except DocumentError as exc:
        error = PayloadTooLarge if exc.too_large else InvalidRequest
        raise error(str(exc), param="file") from exc
    counts = await converter.call(
        _passage_counts, documents, passages.chunk_words, passages.overlap_words
    )
    data = [
        _file_object(u, form.purpose, result.version, count)
        for u, count in zip(accepted, counts, strict=True)
    ]
    if len(form.uploads) == 1:
        return data[0]
    return {
        "object": "list",
        "data": data,
        "errors": [
            {"filename": u.filename, "status": u.error.status_code, **u.error.to_dict()}
            for u in form.uploads
            if u.error is not None
        ],
    }


def _document(
    converted: Converted, doc_id: str, filename: str, form: UploadForm, max_chars: int
) -> Document:
    text = converted.text
    if len(text) > max_chars:
        raise DocumentError(
            f"its text has {len(text)} characters; the limit is {max_chars}", too_large=True
        )
    return Document(
        id=doc_id,
        text=text,
        title=converted.title,
        metadata={**form.metadata, "filename": filename, "format": converted.kind},
        access=form.access,
        blocks=converted.blocks,
    )


def _passage_counts(documents: list[Document], words: int, overlap: int) -> list[int]:
    return [len(chunk_document(d, max_words=words, overlap_words=overlap)) for d in documents]


def _file_object(upload: Upload, purpose: str, version: str, chunks: int) -> dict[str, Any]:
    document, converted = upload.document, upload.converted
    assert document is not None and converted is not None
    return {
        "id": document.id,
        "object": "file",
        "bytes": upload.size,
        "created_at": int(time.time()),
        "filename": upload.filename,
        "purpose": purpose,
        "status": "processed",
        "document_id": document.id,
        "kind": converted.kind,
        "title": converted.title,
        "chunks": chunks,
        "index_version": version,
    }
