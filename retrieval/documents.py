"""Documents as the caller gives them, and the chunks (passages) that are indexed.

A `Document` is validated when it is built, so a bad one never reaches an index: an empty text, an
id that is empty, too long or holds whitespace, control characters or `#` (the chunk-id separator),
a text with nothing visible in it (only whitespace, controls, invisible format characters),
or a metadata value that is not a string, a finite number, a bool or a list of strings all raise
`DocumentError`, as do a title over 1,000 characters and metadata over 8 KB as JSON (both are
copied onto every chunk), as does an access list that is not valid (retrieval.access); the ways
in check the finer limits of `/v1/documents` too (`check_metadata_limits`). A
document too large to index raises `DocumentError` with
`too_large=True`, which the HTTP layer answers with 413.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import TypeAlias

from retrieval.access import AccessError, AccessList
from retrieval.chunking import Block, split_blocks

MetadataValue: TypeAlias = str | int | float | bool | list[str]
Metadata: TypeAlias = dict[str, MetadataValue]

_ID = re.compile(r"[^\s#\x00-\x1f\x7f]{1,256}")
_KEY = re.compile(r"[A-Za-z0-9_.:-]{1,64}")
_WORD = re.compile(r"\S+")
_SURROGATE = re.compile("[\ud800-\udfff]")
# Python's whitespace (``str.isspace``), spelled out for JSON Schema too (whose ``\\s`` is
# ECMAScript's, which differs: U+0085, U+FEFF); then what else shows nothing: controls (C0,
# DEL, C1), the soft hyphen, joiners and fillers, variation selectors, zero-width space to RLM,
# line/paragraph separators, bidi controls and isolates, word joiner to the deprecated format
# characters, BOM, interlinear annotation. A text needs one character outside them (searched
# for, so its first visible character ends the search). Tag characters (U+E0000 on) are not
# here: JSON Schema's patterns cannot name a character past U+FFFF.
SPACE = r"\t\n\v\f\r\x1c-\x20\x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000"
INVISIBLE = SPACE + (
    r"\x00-\x1f\x7f-\x9f\xad\u034f\u061c\u115f\u1160\u17b4\u17b5\u180b-\u180f"
    r"\u200b-\u200f\u2028-\u202e\u2060-\u206f\u3164\ufe00-\ufe0f\ufeff\uffa0\ufff0-\ufffb"
)
_VISIBLE = re.compile(f"[^{INVISIBLE}]")

DEFAULT_MAX_WORDS = 180
DEFAULT_OVERLAP_WORDS = 30
# Title and metadata are copied onto every chunk of a document (a 400 KB text is ~450 chunks):
# bounded, so one request cannot grow the index hundreds of times its own size.
MAX_TITLE_CHARS = 1000
MAX_METADATA_BYTES = 8192
MAX_METADATA_KEYS = 64
MAX_METADATA_TEXT_CHARS = 1024  # a string value, or one string of a list
MAX_METADATA_LIST_ITEMS = 64
# What a signed or unsigned 64-bit integer holds: no JSON body (app.http.bodies) and no
# document's metadata takes an integer past them.
INT64_MIN = -(2**63)
UINT64_MAX = 2**64 - 1


class DocumentError(ValueError):
    """A document that cannot be indexed; `too_large` marks the size failure (HTTP 413)."""

    def __init__(self, message: str, *, too_large: bool = False) -> None:
        super().__init__(message)
        self.too_large = too_large


def _check_metadata(metadata: object) -> Metadata:
    if not isinstance(metadata, dict):
        raise DocumentError("metadata must be an object of key -> value")
    checked: Metadata = {}
    for key, value in metadata.items():
        if not isinstance(key, str) or not _KEY.fullmatch(key):
            raise DocumentError(f"metadata key {key!r} must match {_KEY.pattern}")
        if isinstance(value, float) and not math.isfinite(value):
            raise DocumentError(f"metadata {key!r}: numbers must be finite")
        if isinstance(value, str | int | float | bool):
            checked[key] = value
        elif isinstance(value, list) and all(isinstance(v, str) for v in value):
            checked[key] = list(value)
        else:
            raise DocumentError(
                f"metadata {key!r}: value must be a string, number, bool or list of strings, "
                f"not {type(value).__name__}"
            )
    size = len(json.dumps(checked, ensure_ascii=False).encode("utf-8", "replace"))
    if size > MAX_METADATA_BYTES:
        raise DocumentError(
            f"metadata is {size} bytes as JSON; at most {MAX_METADATA_BYTES} are accepted "
            "(it is copied onto every chunk)"
        )
    return checked


def check_metadata_limits(metadata: Metadata) -> None:
    """DocumentError unless ``metadata`` (a document's, checked) keeps to the limits that
    ``/v1/documents`` declares in its schema: at most 64 keys, strings of 1,024 characters,
    lists of 64, integers that fit in 64 bits, no lone surrogate. Every other way in (uploaded
    files, ``rag ingest``) calls it, so none stores what the API refuses."""
    if len(metadata) > MAX_METADATA_KEYS:
        raise DocumentError(
            f"metadata has {len(metadata)} keys; at most {MAX_METADATA_KEYS} are accepted"
        )
    for key, value in metadata.items():
        if isinstance(value, bool):
            continue
        if isinstance(value, int) and not INT64_MIN <= value <= UINT64_MAX:
            raise DocumentError(f"metadata {key!r}: integers must fit in 64 bits")
        if isinstance(value, list):
            if len(value) > MAX_METADATA_LIST_ITEMS:
                raise DocumentError(
                    f"metadata {key!r}: a list of {len(value)} strings; at most "
                    f"{MAX_METADATA_LIST_ITEMS} are accepted"
                )
            for item in value:
                _check_metadata_text(key, item)
        elif isinstance(value, str):
            _check_metadata_text(key, value)


def _check_metadata_text(key: str, value: str) -> None:
    if len(value) > MAX_METADATA_TEXT_CHARS:
        raise DocumentError(
            f"metadata {key!r}: a string of {len(value)} characters; at most "
            f"{MAX_METADATA_TEXT_CHARS} are accepted"
        )
    if _SURROGATE.search(value):
        raise DocumentError(f"metadata {key!r}: a string holds a lone surrogate")


@dataclass(frozen=True)
class Document:
    """A document to index: `id` unique within a tenant, `text` non-empty.

    Metadata values are strings, finite numbers, bools or lists of strings; they are copied onto
    every chunk and are what filters match.
    """

    id: str
    text: str
    title: str = ""
    metadata: Metadata = field(default_factory=dict)
    # Who may see it (retrieval.access); None: the whole tenant. JSON goes through parse_access.
    access: AccessList | None = None
    # A converted file's structure (retrieval.files): when given, the document is chunked by
    # its headings (retrieval.chunking) and `text` is the blocks' text, kept for the size check.
    blocks: tuple[Block, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.id, str) or not _ID.fullmatch(self.id):
            raise DocumentError(
                f"document id {self.id!r} must be 1-256 characters without whitespace or '#'"
            )
        if not isinstance(self.text, str) or not _VISIBLE.search(self.text):
            raise DocumentError(
                f"document {self.id!r} has empty text (nothing in it shows: only whitespace, "
                "control or invisible characters)"
            )
        if not isinstance(self.title, str):
            raise DocumentError(f"document {self.id!r}: title must be a string")
        # A lone surrogate (JSON allows "\ud800") is not text and cannot be stored as UTF-8.
        if (
            _SURROGATE.search(self.id)
            or _SURROGATE.search(self.text)
            or _SURROGATE.search(self.title)
        ):
            raise DocumentError(f"document {self.id!r}: the text holds a lone surrogate")
        if len(self.title) > MAX_TITLE_CHARS:
            raise DocumentError(
                f"document {self.id!r}: the title has {len(self.title)} characters; at most "
                f"{MAX_TITLE_CHARS} are accepted"
            )
        # Frozen, but the dict would still be shared with the caller: keep a private copy.
        object.__setattr__(self, "metadata", _check_metadata(self.metadata))
        if not isinstance(self.access, AccessList | None):
            raise DocumentError(f"document {self.id!r}: access must be an AccessList or None")
        if not all(isinstance(b, Block) for b in self.blocks):
            raise DocumentError(f"document {self.id!r}: blocks must be retrieval.chunking.Block")
        object.__setattr__(self, "blocks", tuple(self.blocks))


def parse_access(value: object) -> AccessList | None:
    """A document's access list from JSON (`{"groups": [...], "users": [...]}` or null), or
    DocumentError saying what is wrong with it."""
    try:
        return AccessList.parse(value)
    except AccessError as exc:
        raise DocumentError(f"access: {exc}") from None


@dataclass(frozen=True)
class Chunk:
    """One indexed passage of a document; `chunk_id` is `f"{document_id}#{n}"`."""

    chunk_id: str
    document_id: str
    text: str
    title: str
    metadata: Metadata
    access: AccessList | None = None

    @property
    def indexed_text(self) -> str:
        """The text that is tokenised for BM25 and embedded."""
        return indexed_text(self.title, self.text, self.metadata)


def indexed_text(title: str, text: str, metadata: Metadata | None = None) -> str:
    """A passage as it is tokenised and embedded: the title leads every passage of a document,
    then, for a passage of a converted file, the path of headings above it (``heading_path``)."""
    path = (metadata or {}).get("heading_path")
    if isinstance(path, list) and path and path[0] == title:
        path = path[1:]  # the top heading is usually the title, already leading
    heading = " > ".join(path) if isinstance(path, list) else ""
    lead = "\n".join(part for part in (title, heading) if part)
    return f"{lead}\n{text}" if lead else text


def chunk_document(
    doc: Document,
    *,
    max_words: int = DEFAULT_MAX_WORDS,
    overlap_words: int = DEFAULT_OVERLAP_WORDS,
    max_chars: int | None = None,
) -> list[Chunk]:
    """Split a document into passages of at most `max_words` words, `overlap_words` shared.

    Passages are slices of the original text (its line breaks kept). 180 words keeps a passage
    with its title inside MiniLM's 256-wordpiece window, so nothing embedded is truncated.
    """
    if max_words < 1 or not 0 <= overlap_words < max_words:
        raise ValueError("need max_words >= 1 and 0 <= overlap_words < max_words")
    if max_chars is not None and len(doc.text) > max_chars:
        raise DocumentError(
            f"document {doc.id!r} has {len(doc.text)} characters; the limit is {max_chars}",
            too_large=True,
        )
    structured = _structured_chunks(doc, max_words) if doc.blocks else []
    if structured:
        return structured
    spans = [m.span() for m in _WORD.finditer(doc.text)]
    step = max_words - overlap_words
    chunks: list[Chunk] = []
    start = 0
    while True:
        window = spans[start : start + max_words]
        text = doc.text[window[0][0] : window[-1][1]]
        chunks.append(
            Chunk(
                chunk_id=f"{doc.id}#{len(chunks)}",
                document_id=doc.id,
                text=text,
                title=doc.title,
                metadata=doc.metadata,
                access=doc.access,
            )
        )
        if start + max_words >= len(spans):
            return chunks
        start += step


def _structured_chunks(doc: Document, max_words: int) -> list[Chunk]:
    """A converted file's passages (retrieval.chunking), each with its ``heading_path``,
    section ``anchor`` and, for a PDF or slides, ``page`` (and ``page_end`` when it spans
    more) in its metadata beside the document's own."""
    chunks = []
    for number, piece in enumerate(split_blocks(doc.blocks, max_words=max_words)):
        metadata: Metadata = dict(doc.metadata)
        if piece.heading_path:
            metadata["heading_path"] = list(piece.heading_path)
            metadata["anchor"] = piece.anchor
        if piece.page is not None and piece.page_end is not None:
            metadata["page"] = piece.page
            metadata["page_end"] = piece.page_end
        chunks.append(
            Chunk(
                chunk_id=f"{doc.id}#{number}",
                document_id=doc.id,
                text=piece.text,
                title=doc.title,
                metadata=metadata,
                access=doc.access,
            )
        )
    return chunks
