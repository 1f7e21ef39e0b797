"""Reading documents from disk for ``rag ingest``: JSONL (BEIR ``corpus.jsonl`` included, plain
or ``.xz``-compressed), a folder of document files (PDF, DOCX, PPTX, HTML, Markdown, text:
converted as ``POST /v1/files`` converts them, by ``retrieval.files``), or one such file.

Problems are reported per line or per file and skipped, so one bad file never stops the rest:
``read_documents`` yields documents and collects the problems in ``skipped``, one entry per
line or file left out.
"""

from __future__ import annotations

import lzma
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import pydantic_core

from retrieval import Document, DocumentError
from retrieval.documents import check_metadata_limits, parse_access
from retrieval.files import EXTENSIONS, ConverterPool, FileRejected


@dataclass
class Skipped:
    items: list[str] = field(default_factory=list)

    def add(self, where: str, why: str) -> None:
        self.items.append(f"{where}: {why}")


def _from_json(data: object) -> Document:
    if not isinstance(data, dict):
        raise DocumentError("each line must be a JSON object")
    doc_id = data.get("_id", data.get("id"))
    if doc_id is None:
        raise DocumentError("missing 'id' (or BEIR '_id')")
    text, title = data.get("text", ""), data.get("title") or ""
    # A number where text belongs is no text (1e400 became "inf"); an id may be a number.
    if isinstance(doc_id, bool) or not isinstance(doc_id, str | int):
        raise DocumentError("'id' must be a string or an integer")
    if not isinstance(text, str) or not isinstance(title, str):
        raise DocumentError("'text' and 'title' must be strings")
    metadata = data.get("metadata") or {}
    document = Document(
        id=str(doc_id),
        text=text,
        title=title,
        metadata=metadata,
        access=parse_access(data.get("access")),  # who may see it; absent: the whole tenant
    )
    check_metadata_limits(document.metadata)  # as /v1/documents would
    return document


def _open(path: Path) -> IO[bytes]:
    # A compressed corpus (the vendored SciFact is .jsonl.xz) is read as it is.
    return lzma.open(path, "rb") if path.suffix.lower() == ".xz" else path.open("rb")


def _is_jsonl(path: Path) -> bool:
    return path.name.lower().endswith((".jsonl", ".jsonl.xz"))


def read_jsonl(path: Path, skipped: Skipped) -> Iterator[Document]:
    with _open(path) as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                # Integers keep their exact value (``check_metadata_limits`` refuses those past
                # 64 bits; orjson made them floats), no NaN, no lone surrogates.
                data = pydantic_core.from_json(line, allow_inf_nan=False)
            except ValueError as exc:
                skipped.add(f"{path}:{number}", f"not JSON ({exc})")
                continue
            try:
                yield _from_json(data)
            except DocumentError as exc:
                skipped.add(f"{path}:{number}", str(exc))


@dataclass
class FileReader:
    """Document files through the converter pool, `workers` at a time, each file's problem
    reported by its path: larger than `max_file_bytes`, refused by the converter (with its
    reason), or with more than `max_chars` characters of text (the index's limit: checked here,
    so that one file never fails the batch it would have been upserted with)."""

    converter: ConverterPool
    max_file_bytes: int
    max_chars: int
    workers: int = 2

    def read(self, path: Path, doc_id: str) -> Document | str:
        """The file's document, or why it is skipped."""
        try:
            size = path.stat().st_size
            if size > self.max_file_bytes:
                return f"{size} bytes; the limit is {self.max_file_bytes} (too_large)"
            data = path.read_bytes()
        except OSError as exc:
            return f"unreadable ({exc.strerror})"
        try:
            converted = self.converter.convert_now(path.name, data)
        except FileRejected as exc:
            return f"{exc} ({exc.reason})"
        text = converted.text
        if len(text) > self.max_chars:
            return f"{len(text)} characters of text; the limit is {self.max_chars}"
        try:
            return Document(
                id=doc_id,
                text=text,
                title=converted.title,
                metadata={"path": doc_id, "format": converted.kind},
                blocks=converted.blocks,
            )
        except DocumentError as exc:
            return str(exc)

    def read_all(self, files: list[tuple[Path, str]], skipped: Skipped) -> Iterator[Document]:
        """`read` for each (path, document id), in order, `workers` conversions at once and at
        most a few windows of documents held before they are consumed."""
        window = self.workers * 4
        with ThreadPoolExecutor(self.workers, thread_name_prefix="read") as threads:
            for start in range(0, len(files), window):
                part = files[start : start + window]
                for (path, _), outcome in zip(
                    part, threads.map(lambda item: self.read(*item), part), strict=True
                ):
                    if isinstance(outcome, Document):
                        yield outcome
                    else:
                        skipped.add(str(path), outcome)


def read_documents(path: Path, skipped: Skipped, files: FileReader) -> Iterator[Document]:
    """The documents under `path`. In a folder, a file of a type no reader takes is reported
    too (hidden files aside), so the summary accounts for every file left out."""
    if path.is_dir():
        convertible: list[tuple[Path, str]] = []
        for file in sorted(p for p in path.rglob("*") if p.is_file()):
            relative = file.relative_to(path)
            if _is_jsonl(file):
                yield from read_jsonl(file, skipped)
            elif file.suffix.lower() in EXTENSIONS:
                convertible.append((file, relative.as_posix().replace("#", "_")))
            elif not any(part.startswith(".") for part in relative.parts):
                skipped.add(
                    str(file), f"not a file type rag ingest reads ({file.suffix or 'none'})"
                )
        yield from files.read_all(convertible, skipped)
    elif _is_jsonl(path):
        yield from read_jsonl(path, skipped)
    elif path.suffix.lower() in EXTENSIONS:
        yield from files.read_all([(path, path.name.replace("#", "_"))], skipped)
    else:
        known = ", ".join(sorted(EXTENSIONS))
        raise ValueError(
            f"{path}: expected a .jsonl (or .jsonl.xz) file, a folder or one of {known}"
        )
