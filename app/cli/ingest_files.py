"""Reading documents from disk for ``rag ingest``: JSONL (BEIR ``corpus.jsonl`` included, plain
or ``.xz``-compressed), a folder of ``.txt``/``.md`` files, or one such file.

Problems are reported per line or per file and skipped, so one bad file never stops the rest:
``read_documents`` yields documents and collects the problems in ``skipped``.
"""

from __future__ import annotations

import lzma
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import orjson

from retrieval import Document, DocumentError

TEXT_SUFFIXES = {".txt", ".md", ".markdown"}


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
    metadata = data.get("metadata") or {}
    return Document(
        id=str(doc_id),
        text=str(data.get("text", "")),
        title=str(data.get("title") or ""),
        metadata=metadata,
    )


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
                yield _from_json(orjson.loads(line))
            except orjson.JSONDecodeError as exc:
                skipped.add(f"{path}:{number}", f"not JSON ({exc})")
            except DocumentError as exc:
                skipped.add(f"{path}:{number}", str(exc))


def _title(text: str, fallback: str) -> str:
    for line in text.splitlines():
        if line.startswith("# "):
            return line[2:].strip()
        if line.strip():
            break
    return fallback


def read_text_file(path: Path, doc_id: str, skipped: Skipped) -> Document | None:
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        skipped.add(str(path), f"not UTF-8 (byte {exc.start})")
        return None
    except OSError as exc:
        skipped.add(str(path), f"unreadable ({exc.strerror})")
        return None
    try:
        return Document(
            id=doc_id,
            text=text,
            title=_title(text, path.stem),
            metadata={"path": doc_id, "format": path.suffix.lstrip(".").lower()},
        )
    except DocumentError as exc:
        skipped.add(str(path), str(exc))
        return None


def read_documents(path: Path, skipped: Skipped) -> Iterator[Document]:
    if path.is_dir():
        for file in sorted(p for p in path.rglob("*") if p.is_file()):
            if file.suffix.lower() in TEXT_SUFFIXES:
                doc_id = file.relative_to(path).as_posix().replace("#", "_")
                document = read_text_file(file, doc_id, skipped)
                if document is not None:
                    yield document
            elif _is_jsonl(file):
                yield from read_jsonl(file, skipped)
    elif _is_jsonl(path):
        yield from read_jsonl(path, skipped)
    elif path.suffix.lower() in TEXT_SUFFIXES:
        document = read_text_file(path, path.name.replace("#", "_"), skipped)
        if document is not None:
            yield document
    else:
        raise ValueError(
            f"{path}: expected a .jsonl (or .jsonl.xz) file, a .txt/.md file or a folder"
        )
