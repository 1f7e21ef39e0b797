"""A file's bytes into structured text: headings, paragraphs and tables, with PDF pages.

One library per format, chosen by measured extraction quality (bench/convert_bench.py,
BENCHMARKS.md): pypdf for PDF (page by page, its layout mode keeps paragraph breaks, the
outline gives the headings), trafilatura for HTML (drops navigation, banners and footers that
markitdown keeps), markitdown for DOCX (through mammoth) and PPTX (through python-pptx).
Their Markdown is cut into blocks by markdown-it-py, a CommonMark parser; plain text is
paragraphs separated by blank lines.

`convert` is CPU-bound and parses untrusted bytes: call it through `ConverterPool`, which runs it
in a process of its own with a time limit.
"""

from __future__ import annotations

import dataclasses
import io
import math
import re
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import PurePath
from typing import TYPE_CHECKING

from retrieval.chunking import Block
from retrieval.files.kinds import FileRejected, Kind, ZipLimits, sniff

if TYPE_CHECKING:
    from markdown_it.token import Token
    from pypdf import PageObject, PdfReader

_SURROGATE = re.compile("[\ud800-\udfff]")

MAX_HEADING_CHARS = 200
_SLIDE = re.compile(r"<!--\s*Slide number:\s*(\d+)\s*-->")
_BLANK_LINES = re.compile(r"\n\s*\n")
_SPACES = re.compile(r"\s+")
# CommonMark's backslash escapes (converters write ``\<`` and ``\_``): the passage text a reader,
# BM25 and the embedder see is the text, not its Markdown spelling. Not applied to tables,
# where ``\|`` is structure, nor to code.
_ESCAPED = re.compile(r"\\([!-/:-@\[-`{-~])")
_PROSE = frozenset({"paragraph_open", "bullet_list_open", "ordered_list_open", "blockquote_open"})
_TITLE_LINES = 4  # an outline title may wrap over this many lines of its page
# Without an outline, text set this much larger than the body text is a heading (at most
# `_HEADING_WORDS` words; the largest size is level 1, and so on, `_LEVELS` levels at most).
_HEADING_SCALE = 1.15
_HEADING_WORDS = 25
_LEVELS = 6


@dataclass(frozen=True)
class Converted:
    """A converted file: its kind, a title (first top heading, else the file's stem), blocks."""

    kind: Kind
    title: str
    blocks: tuple[Block, ...]

    @property
    def text(self) -> str:
        return "\n\n".join(block.text for block in self.blocks)


def _one_line(text: str) -> str:
    return _SPACES.sub(" ", text).strip()[:MAX_HEADING_CHARS]


def markdown_blocks(markdown: str) -> Iterator[Block]:
    """Top-level blocks of a Markdown text, each as its source lines. A markitdown slide marker
    (``<!-- Slide number: 3 -->``) sets the page of the blocks after it."""
    from markdown_it import MarkdownIt

    parser = MarkdownIt("commonmark").enable("table")
    lines = markdown.splitlines()
    tokens = parser.parse(markdown)
    page: int | None = None
    for position, token in enumerate(tokens):
        if token.level != 0 or token.nesting == -1 or token.map is None:
            continue
        source = "\n".join(lines[token.map[0] : token.map[1]]).strip()
        if token.type == "heading_open":
            text = _one_line(tokens[position + 1].content)
            if text:
                yield Block("heading", text, level=int(token.tag[1:]), page=page)
        elif token.type == "html_block" and (slide := _SLIDE.fullmatch(source)):
            page = int(slide.group(1))
        elif token.type == "hr" or not source:
            continue
        elif token.type == "paragraph_open" and _only_images(tokens[position + 1]):
            continue  # a picture (converters write ``![](data:image/png;base64...)``): no text
        elif token.type == "table_open":
            yield Block("table", source, page=page)
        else:
            text = _ESCAPED.sub(r"\1", source) if token.type in _PROSE else source
            yield Block("text", text, page=page)


def _slide_paragraphs(blocks: list[Block]) -> Iterator[Block]:
    """markitdown writes a slide's paragraphs (bullets) on consecutive lines, which Markdown
    reads as one paragraph: each line is its own."""
    for block in blocks:
        if block.kind != "text":
            yield block
            continue
        for line in block.text.splitlines():
            if line.strip():
                yield Block("text", line.strip(), page=block.page)


def _only_images(inline: Token) -> bool:
    children = inline.children or []
    return any(c.type == "image" for c in children) and all(
        c.type in ("image", "softbreak") or (c.type == "text" and not c.content.strip())
        for c in children
    )


def _text_blocks(text: str) -> Iterator[Block]:
    for paragraph in _BLANK_LINES.split(text):
        if paragraph.strip():
            yield Block("text", paragraph.strip())


def _outline(reader: PdfReader) -> dict[int, list[tuple[str, int]]]:
    """Page index -> the outline's (title, level) entries that point into it."""
    found: dict[int, list[tuple[str, int]]] = {}

    def walk(items: Sequence[object], level: int) -> None:
        for item in items:
            if isinstance(item, list):
                walk(item, level + 1)
                continue
            try:
                page = reader.get_destination_page_number(item)  # type: ignore[arg-type]
            except Exception:  # a broken destination: no heading from it
                continue
            title = _one_line(str(getattr(item, "title", "") or ""))
            if page is not None and title:
                found.setdefault(page, []).append((title, level))

    try:
        walk(reader.outline, 1)
    except Exception:  # a broken outline is no reason to lose the text
        return {}
    return found


def _sized_runs(page: PageObject, sizes: Counter[float]) -> list[tuple[str, float]]:
    """A page's text runs with their effective font size (counted into `sizes` by characters)."""
    runs: list[tuple[str, float]] = []

    def visit(text: str, cm: list[float], tm: list[float], font: object, size: float) -> None:
        plain = _one_line(text)
        if plain:
            effective = round(size * math.hypot(tm[2], tm[3]) * math.hypot(cm[2], cm[3]), 1)
            runs.append((plain, effective))
            sizes[effective] += len(plain)

    page.extract_text(visitor_text=visit)
    return runs


def _font_headings(reader: PdfReader) -> dict[int, list[tuple[str, int]]]:
    """For a PDF without an outline: page index -> its (text, level) runs set in a font larger
    than the body's (the size most characters have), consecutive runs of one size joined."""
    sizes: Counter[float] = Counter()
    pages = [_sized_runs(page, sizes) for page in reader.pages]
    if not sizes:
        return {}
    body = sizes.most_common(1)[0][0]
    larger = sorted((s for s in sizes if s >= body * _HEADING_SCALE), reverse=True)[:_LEVELS]
    levels = {size: number for number, size in enumerate(larger, start=1)}
    found: dict[int, list[tuple[str, int]]] = {}
    for index, runs in enumerate(pages):
        joined: list[tuple[list[str], float]] = []
        for text, size in runs:
            if joined and joined[-1][1] == size:
                joined[-1][0].append(text)
            else:
                joined.append(([text], size))
        for texts, size in joined:
            title = _one_line(" ".join(texts))
            if size in levels and len(title.split()) <= _HEADING_WORDS:
                found.setdefault(index, []).append((title, levels[size]))
    return found


def _pdf_page_blocks(text: str, page: int, headings: list[tuple[str, int]]) -> Iterator[Block]:
    """A page's paragraphs (blank-line separated in pypdf's layout mode, wrapped lines joined);
    a line, or up to `_TITLE_LINES` lines, that spell one of the page's outline titles become a
    heading."""
    wanted = {title.casefold(): level for title, level in headings}
    for paragraph in _BLANK_LINES.split(text):
        lines = [plain for line in paragraph.splitlines() if (plain := _one_line(line))]
        kept: list[str] = []
        index = 0
        while index < len(lines):
            for span in range(min(_TITLE_LINES, len(lines) - index), 0, -1):
                title = " ".join(lines[index : index + span])
                level = wanted.get(title.casefold())
                if level is not None:
                    break
            if level is None:
                kept.append(lines[index])
                index += 1
                continue
            if kept:
                yield Block("text", " ".join(kept), page=page)
                kept = []
            yield Block("heading", title, level=level, page=page)
            index += span
        if kept:
            yield Block("text", " ".join(kept), page=page)


def _pdf(data: bytes) -> list[Block]:
    from pypdf import PasswordType, PdfReader
    from pypdf.errors import PdfReadError

    try:
        reader = PdfReader(io.BytesIO(data))
        if reader.is_encrypted and reader.decrypt("") == PasswordType.NOT_DECRYPTED:
            raise FileRejected("encrypted", "the PDF is encrypted with a password")
        outline = _outline(reader) or _font_headings(reader)
        blocks: list[Block] = []
        for index, page in enumerate(reader.pages):
            text = page.extract_text(extraction_mode="layout")
            blocks.extend(_pdf_page_blocks(text, index + 1, outline.get(index, [])))
    except FileRejected:
        raise
    except (PdfReadError, ValueError, KeyError, TypeError) as exc:
        raise FileRejected("conversion_failed", f"an unreadable PDF ({exc})") from exc
    if not any(b.kind == "text" for b in blocks):
        raise FileRejected(
            "no_text", "the PDF has no text layer (a scan?); run OCR on it before uploading"
        )
    return blocks


def _html(data: bytes) -> str:
    import trafilatura

    html = data.decode("utf-8-sig")
    markdown = trafilatura.extract(
        html,
        output_format="markdown",
        include_tables=True,
        include_formatting=True,
        include_links=False,
        include_images=False,
        include_comments=False,
        favor_recall=True,
        with_metadata=False,
    )
    if markdown and markdown.strip():
        return str(markdown)
    # A fragment with no page around it (``<p>..</p>``) can leave trafilatura nothing to pick.
    from markitdown.converters import HtmlConverter

    return _markitdown(HtmlConverter(), data, ".html")


def _markitdown(converter: object, data: bytes, extension: str) -> str:
    from markitdown import StreamInfo

    result = converter.convert(  # type: ignore[attr-defined]
        io.BytesIO(data), StreamInfo(extension=extension)
    )
    return str(result.markdown or "")


def _office(kind: Kind, data: bytes) -> str:
    from markitdown.converters import DocxConverter, PptxConverter

    converter = (
        DocxConverter()  # type: ignore[no-untyped-call]
        if kind == "docx"
        else PptxConverter()  # type: ignore[no-untyped-call]
    )
    try:
        return _markitdown(converter, data, f".{kind}")
    except Exception as exc:  # the libraries raise anything from KeyError to lxml errors
        raise FileRejected("conversion_failed", f"an unreadable {kind.upper()} ({exc})") from exc


def _title(blocks: list[Block], filename: str) -> str:
    top = min((b.level for b in blocks if b.kind == "heading"), default=None)
    for block in blocks:
        if block.kind == "heading" and block.level == top:
            return block.text
    return PurePath(filename).stem[:MAX_HEADING_CHARS]


def convert(filename: str, data: bytes, zip_limits: ZipLimits | None = None) -> Converted:
    """`data` (named `filename`) as structured text, or `FileRejected` saying why not."""
    kind = sniff(filename, data, zip_limits)
    if kind == "pdf":
        blocks = _pdf(data)
    elif kind == "text":
        blocks = list(_text_blocks(data.decode("utf-8-sig")))
    else:
        if kind == "html":
            markdown = _html(data)
        elif kind == "markdown":
            markdown = data.decode("utf-8-sig")
        else:
            markdown = _office(kind, data)
        blocks = list(markdown_blocks(markdown))
        if kind == "pptx":
            blocks = list(_slide_paragraphs(blocks))
    # A PDF's ToUnicode map may name a lone surrogate (pypdf decodes with surrogatepass): not
    # text, and not encodable as UTF-8 where the index is written. Replaced, as a decoder does.
    blocks = [
        dataclasses.replace(b, text=_SURROGATE.sub("\ufffd", b.text))
        if _SURROGATE.search(b.text)
        else b
        for b in blocks
    ]
    if not any(b.kind != "heading" for b in blocks):
        raise FileRejected("no_text", f"no text could be extracted from the {kind} file")
    return Converted(kind, _title(blocks, filename), tuple(blocks))
