"""What a file is, judged by its bytes, and the checks made before any library opens it.

A file's kind comes from its content (PDF magic bytes, the members of a zip, UTF-8 text that
opens like an HTML page); its extension must agree with it, so a ``.pdf`` that is really an HTML
page is refused by name rather than handed to a PDF parser. DOCX and PPTX are zips: their
directory is read (cheap, bounded by the file's size) and refused when the declared
uncompressed sizes or ratios are those of a zip bomb, before python-docx, mammoth or
python-pptx inflate anything.

Every refusal is a `FileRejected` carrying a `reason` (`Reason`); the HTTP layer maps each
reason to its status (413 for size, 415 for type, 422 for the rest).
"""

from __future__ import annotations

import io
import zipfile
from dataclasses import dataclass
from pathlib import PurePath
from typing import Final, Literal, TypeAlias

Kind: TypeAlias = Literal["pdf", "docx", "pptx", "html", "markdown", "text"]
Reason: TypeAlias = Literal[
    "too_large",
    "unsupported_type",
    "type_mismatch",
    "zip_bomb",
    "encrypted",
    "no_text",
    "empty",
    "conversion_failed",
    "timeout",
    "upload_timeout",
]

EXTENSIONS: Final[dict[str, Kind]] = {
    ".pdf": "pdf",
    ".docx": "docx",
    ".pptx": "pptx",
    ".html": "html",
    ".htm": "html",
    ".md": "markdown",
    ".markdown": "markdown",
    ".txt": "text",
    ".text": "text",
}
# Content sniffed as plain text may be any of these (an HTML fragment, Markdown, text).
_TEXT_LIKE: Final = frozenset({"html", "markdown", "text"})
_HTML_OPENINGS: Final = (b"<!doctype html", b"<html", b"<head", b"<body")


class FileRejected(ValueError):
    """A file that is not converted, and why (`reason`)."""

    def __init__(self, reason: Reason, message: str) -> None:
        super().__init__(message)
        self.reason: Reason = reason


@dataclass(frozen=True)
class ZipLimits:
    """What a DOCX/PPTX zip may declare: its members' total inflated size, each member's
    inflation ratio (above `ratio_floor_bytes`; tiny members compress oddly), the count."""

    max_total_bytes: int = 100_000_000
    max_ratio: float = 100.0
    ratio_floor_bytes: int = 1_000_000
    max_members: int = 10_000


def declared_kind(filename: str) -> Kind | None:
    return EXTENSIONS.get(PurePath(filename).suffix.lower())


def _zip_kind(data: bytes, limits: ZipLimits) -> Kind:
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            members = archive.infolist()
    except (zipfile.BadZipFile, OSError, ValueError, EOFError) as exc:
        raise FileRejected("unsupported_type", f"a damaged zip archive ({exc})") from exc
    if len(members) > limits.max_members:
        raise FileRejected("zip_bomb", f"the zip holds {len(members)} members")
    total = 0
    for member in members:
        total += member.file_size
        ratio = member.file_size / max(member.compress_size, 1)
        if member.file_size > limits.ratio_floor_bytes and ratio > limits.max_ratio:
            raise FileRejected(
                "zip_bomb",
                f"zip member {member.filename!r} inflates {ratio:.0f}x "
                f"(at most {limits.max_ratio:.0f}x is accepted)",
            )
    if total > limits.max_total_bytes:
        raise FileRejected(
            "zip_bomb",
            f"the zip inflates to {total} bytes (at most {limits.max_total_bytes})",
        )
    names = {m.filename for m in members}
    if "word/document.xml" in names:
        return "docx"
    if "ppt/presentation.xml" in names:
        return "pptx"
    raise FileRejected("unsupported_type", "a zip archive that is neither DOCX nor PPTX")


def _text_kind(data: bytes) -> Kind:
    """`html` or `text` for UTF-8 content; anything else is not a supported text."""
    if b"\x00" in data[:65536]:
        raise FileRejected("unsupported_type", "binary content of an unsupported type")
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise FileRejected(
            "unsupported_type", f"not UTF-8 text, nor a known binary format (byte {exc.start})"
        ) from exc
    opening = data[:1024].lstrip(b"\xef\xbb\xbf \t\r\n").lower()
    return "html" if opening.startswith(_HTML_OPENINGS) else "text"


def sniff(filename: str, data: bytes, limits: ZipLimits | None = None) -> Kind:
    """The file's kind, from its content, checked against its extension.

    Raises `FileRejected`: ``empty``, ``unsupported_type`` (an extension or content this
    service does not read), ``type_mismatch`` (content of one kind under another's extension),
    ``zip_bomb``.
    """
    declared = declared_kind(filename)
    if declared is None:
        suffix = PurePath(filename).suffix or "(none)"
        known = ", ".join(sorted(EXTENSIONS))
        raise FileRejected("unsupported_type", f"extension {suffix} is not one of {known}")
    if not data.strip():
        raise FileRejected("empty", "the file is empty")
    if data[:1024].find(b"%PDF-") != -1:
        content: Kind = "pdf"
    elif data.startswith(b"PK\x03\x04"):
        content = _zip_kind(data, limits or ZipLimits())
    else:
        content = _text_kind(data)
    if content == declared or (content == "text" and declared in _TEXT_LIKE):
        return declared
    raise FileRejected(
        "type_mismatch", f"the extension says {declared} but the content is {content}"
    )
