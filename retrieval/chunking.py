"""Structure-aware chunking: a converted file's blocks (headings, paragraphs, tables, each with
its page) into passages that follow the document's outline.

A heading ends the passage before it and starts the next; every passage keeps the path of
headings above it (``["Report", "Results"]``), which is also put before its text where it is
tokenised and embedded (`retrieval.documents.indexed_text`), so a passage that says "it rose by
a third" is still found for the section it belongs to. Paragraphs are packed whole while they
fit; a paragraph longer than a passage is cut between sentences (only a single sentence longer
than a passage is cut between words). A table that fits in a passage stays whole; a longer one is
cut between rows, each part repeating the header row when the header takes at most half a
passage (a longer one goes in once, as rows do; a row longer than a passage is cut between
words). Passages of structured documents do not overlap: they end on sentence boundaries
instead.

What a hostile file can make of this is bounded: a heading is cut to ``MAX_HEADING_CHARS`` and
levels below ``MAX_LEVEL`` count as that level, so a heading path holds at most six short
headings, and the headings never take more than half of a passage's words; with the header rule
above, a document's passages hold at most about twice its text.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Literal, TypeAlias

BlockKind: TypeAlias = Literal["heading", "text", "table"]

_WORD = re.compile(r"\S+")
# A sentence ends at . ! or ? (closing quotes or brackets allowed) followed by space and a
# capital, digit or opening quote. Linear: no nested quantifiers.
_SENTENCE_END = re.compile(r"[.!?][\"')\]]*\s+(?=[\"'(\[]?[A-Z0-9])")
_TABLE_RULE = re.compile(r"^\s*\|?\s*:?-{3,}")
_SLUG_DROP = re.compile(r"[^\w\- ]+")
MAX_LEVEL = 6
MAX_HEADING_CHARS = 200


@dataclass(frozen=True)
class Block:
    """One unit of a converted file: a heading (with its `level`, 1 = top), a paragraph or list
    (`text`), or a Markdown table; `page` is the 1-based PDF page (or slide) it is on."""

    kind: BlockKind
    text: str
    level: int = 0
    page: int | None = None


@dataclass(frozen=True)
class Piece:
    """A passage's text, the headings above it, its section anchor and its pages."""

    text: str
    heading_path: tuple[str, ...]
    anchor: str
    page: int | None
    page_end: int | None


def words(text: str) -> int:
    return sum(1 for _ in _WORD.finditer(text))


def slug(heading: str) -> str:
    """A heading's anchor as Markdown renderers make it: lower case, punctuation dropped,
    spaces to hyphens."""
    return _SLUG_DROP.sub("", heading.strip().lower()).replace(" ", "-")


def sentences(text: str) -> list[str]:
    parts, start = [], 0
    for match in _SENTENCE_END.finditer(text):
        parts.append(text[start : match.end()].strip())
        start = match.end()
    parts.append(text[start:].strip())
    return [p for p in parts if p]


def _word_windows(text: str, size: int) -> Iterator[str]:
    spans = [m.span() for m in _WORD.finditer(text)]
    for start in range(0, len(spans), size):
        window = spans[start : start + size]
        yield text[window[0][0] : window[-1][1]]


def _table_parts(table: str, size: int) -> Iterator[str]:
    """A table cut between rows into parts of at most `size` words, each with the header."""
    lines = table.splitlines()
    header = lines[:2] if len(lines) > 1 and _TABLE_RULE.match(lines[1]) else lines[:0]
    rows = lines[len(header) :]
    if words("\n".join(header)) > size // 2:
        header, rows = [], lines  # too long to repeat: it goes in once, as a row
    budget = size - words("\n".join(header))
    part: list[str] = []
    for row in (piece for line in rows for piece in _row_pieces(line, budget)):
        if part and words("\n".join([*part, row])) > budget:
            yield "\n".join(header + part)
            part = []
        part.append(row)
    if part:
        yield "\n".join(header + part)


def _row_pieces(row: str, size: int) -> Iterator[str]:
    yield from [row] if words(row) <= size else _word_windows(row, size)


def _units(block: Block, size: int) -> list[str]:
    """A block as the pieces it may be packed in: itself when it fits, else its sentences
    (table rows), an over-long sentence in word windows."""
    if words(block.text) <= size:
        return [block.text]
    if block.kind == "table":
        return list(_table_parts(block.text, size))
    units: list[str] = []
    for sentence in sentences(block.text):
        units.extend([sentence] if words(sentence) <= size else _word_windows(sentence, size))
    return units


class _Packer:
    def __init__(self, max_words: int) -> None:
        self.max_words = max_words
        self.pieces: list[Piece] = []
        self.path: list[tuple[int, str]] = []
        self.anchor = ""
        self.anchors: dict[str, int] = {}
        self.parts: list[str] = []
        self.pages: list[int] = []
        self.used = 0

    @property
    def budget(self) -> int:
        heading = " > ".join(h for _, h in self.path)
        return max(1, self.max_words // 2, self.max_words - words(heading))

    def heading(self, block: Block) -> None:
        self.flush()
        level = min(block.level, MAX_LEVEL)
        while self.path and self.path[-1][0] >= level:
            self.path.pop()
        title = " ".join(block.text[: MAX_HEADING_CHARS * 2].split())[:MAX_HEADING_CHARS]
        self.path.append((level, title))
        base = slug(title)
        seen = self.anchors.get(base, 0)
        self.anchors[base] = seen + 1
        self.anchor = base if not seen else f"{base}-{seen}"

    def add(self, block: Block) -> None:
        size = self.budget
        units = _units(block, size)
        for position, unit in enumerate(units):
            count = words(unit)
            if self.parts and self.used + count > size:
                self.flush()
            joiner = " " if position and block.kind == "text" and self.parts else "\n\n"
            self.parts.append(unit if not self.parts else joiner + unit)
            self.used += count
            if block.page is not None:
                self.pages.append(block.page)

    def flush(self) -> None:
        if not self.parts:
            return
        self.pieces.append(
            Piece(
                text="".join(self.parts),
                heading_path=tuple(h for _, h in self.path),
                anchor=self.anchor,
                page=min(self.pages) if self.pages else None,
                page_end=max(self.pages) if self.pages else None,
            )
        )
        self.parts, self.pages, self.used = [], [], 0


def split_blocks(blocks: Sequence[Block], *, max_words: int) -> list[Piece]:
    """The passages of a structured document, in reading order (none when it has no text
    outside its headings)."""
    packer = _Packer(max_words)
    for block in blocks:
        if block.kind == "heading":
            packer.heading(block)
        elif block.text.strip():
            packer.add(block)
    packer.flush()
    return packer.pieces
