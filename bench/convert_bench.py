"""Document conversion: which library extracts real files best, what the chunker keeps whole,
and what converting in killable worker processes costs (retrieval/files/, retrieval/chunking.py).

    .venv/bin/python -m bench.convert_bench                # all parts, 20 documents per format
    .venv/bin/python -m bench.convert_bench --docs 5 --part pool

Documents are made by the real tools (fpdf2, python-docx, python-pptx, an HTML page with
navigation, a cookie banner, a sidebar and a footer; tests/support/sample_files.py) from SciFact
abstracts: each has a SciFact title, three sections ("Background", "Findings", "Context") of two
abstracts each, and a small table. What each candidate should recover is known:

- paragraphs: the share of source paragraphs that come out as exactly one output paragraph;
- sentence recall: the share of the source sentences found whole inside one output paragraph
  (blank-line separated; whitespace normalised), so a sentence broken by a false paragraph
  break (a PDF line wrap) counts as lost, as the chunker would lose it;
- heading recall: the share of the title and section headings that come out as headings
  (Markdown ``#`` lines, or heading blocks);
- boilerplate kept (HTML): the share of the page's navigation/banner/footer phrases in the output;
- ms/file: median conversion time in this process.
"""

from __future__ import annotations

import argparse
import functools
import io
import json
import multiprocessing
import re
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.context import BaseContext

from retrieval import Document, chunk_document
from retrieval.chunking import sentences
from retrieval.files import ConverterPool, convert
from tests.support.data import open_scifact
from tests.support.sample_files import (
    BOILERPLATE,
    BUILDERS,
    Sample,
    Section,
    docx_bytes,
    html_bytes,
    markdown_bytes,
    pdf_bytes,
    pptx_bytes,
)

SECTIONS = ("Background", "Findings", "Context")
_HEADING_LINE = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$", re.MULTILINE)


def samples(count: int) -> list[Sample]:
    """`count` documents of six SciFact abstracts each (Latin-1 ones: fpdf2's core fonts)."""
    rows = []
    with open_scifact("corpus.jsonl") as handle:
        for line in handle:
            row = json.loads(line)
            text, title = row["text"], row["title"].rstrip(".")
            try:
                (text + title).encode("latin-1")
            except UnicodeEncodeError:
                continue
            if 60 <= len(text.split()) <= 250 and len(title) < 120:
                rows.append((title, text))
            if len(rows) >= count * 7:
                break
    made = []
    for n in range(count):
        group = rows[n * 7 : n * 7 + 7]
        sections = tuple(
            Section(name, (group[1 + 2 * i][1], group[2 + 2 * i][1]))
            for i, name in enumerate(SECTIONS)
        )
        table = (("Measure", "Value"), ("Samples", str(12 + n)), ("Sites", str(3 + n % 5)))
        made.append(Sample(group[0][0], sections, table, table_after=1))
    return made


@dataclass
class Score:
    sentences: int = 0
    found: int = 0
    paragraphs: int = 0
    paragraphs_found: int = 0
    headings: int = 0
    headings_found: int = 0
    boilerplate: int = 0
    boilerplate_kept: int = 0
    ms: list[float] | None = None

    def add(self, sample: Sample, paragraphs: list[str], headings: list[str], ms: float) -> None:
        flat = [" ".join(p.split()) for p in paragraphs]
        joined = " ".join(flat)
        exact = set(flat)
        for section in sample.sections:
            for paragraph in section.paragraphs:
                self.paragraphs += 1
                self.paragraphs_found += " ".join(paragraph.split()) in exact
                for sentence in sentences(" ".join(paragraph.split())):
                    self.sentences += 1
                    self.found += any(sentence in p for p in flat)
        wanted = [sample.title, *(s.heading for s in sample.sections)]
        got = {" ".join(h.split()).casefold() for h in headings}
        self.headings += len(wanted)
        self.headings_found += sum(h.casefold() in got for h in wanted)
        self.boilerplate += len(BOILERPLATE)
        self.boilerplate_kept += sum(phrase in joined for phrase in BOILERPLATE)
        self.ms = [*(self.ms or []), ms]

    def row(self, fmt: str, name: str, html: bool) -> str:
        kept = f"{self.boilerplate_kept / self.boilerplate:.2f}" if html else "-"
        return (
            f"| {fmt} | {name} | {self.paragraphs_found / self.paragraphs:.2f} | "
            f"{self.found / self.sentences:.3f} | "
            f"{self.headings_found / self.headings:.2f} | {kept} | "
            f"{statistics.median(self.ms or [0]):.1f} |"
        )


def _markdown(text: str) -> tuple[list[str], list[str]]:
    """Paragraphs and heading lines of a candidate's Markdown (or plain text) output."""
    return re.split(r"\n\s*\n", text), _HEADING_LINE.findall(text)


def _markitdown(converter_name: str, extension: str) -> Callable[[bytes], tuple[list, list]]:
    import markitdown.converters as converters
    from markitdown import StreamInfo

    converter = getattr(converters, converter_name)()

    def run(data: bytes) -> tuple[list[str], list[str]]:
        result = converter.convert(io.BytesIO(data), StreamInfo(extension=extension))
        return _markdown(result.markdown)

    return run


def _pypdf_plain(data: bytes) -> tuple[list[str], list[str]]:
    from pypdf import PdfReader

    reader = PdfReader(io.BytesIO(data))
    return _markdown("\n\n".join(page.extract_text() for page in reader.pages))


def _trafilatura_default(data: bytes) -> tuple[list[str], list[str]]:
    import trafilatura

    return _markdown(trafilatura.extract(data.decode(), output_format="markdown") or "")


def _ours(extension: str) -> Callable[[bytes], tuple[list[str], list[str]]]:
    def run(data: bytes) -> tuple[list[str], list[str]]:
        converted = convert(f"file.{extension}", data)
        return (
            [b.text for b in converted.blocks if b.kind != "heading"],
            [b.text for b in converted.blocks if b.kind == "heading"],
        )

    return run


BUILDS: dict[str, Callable[[Sample], bytes]] = {
    **BUILDERS,
    "pdf, no outline": lambda sample: pdf_bytes(sample, outline=False),
}
CANDIDATES: dict[str, list[tuple[str, Callable[[bytes], tuple[list[str], list[str]]]]]] = {
    "pdf": [
        ("markitdown (pdfminer/pdfplumber)", _markitdown("PdfConverter", ".pdf")),
        ("pypdf extract_text", _pypdf_plain),
        ("pypdf layout + outline (chosen)", _ours("pdf")),
    ],
    "pdf, no outline": [
        ("markitdown (pdfminer/pdfplumber)", _markitdown("PdfConverter", ".pdf")),
        ("pypdf layout + font sizes (chosen)", _ours("pdf")),
    ],
    "html": [
        ("markitdown (BeautifulSoup + markdownify)", _markitdown("HtmlConverter", ".html")),
        ("trafilatura defaults", _trafilatura_default),
        ("trafilatura, recall + formatting + tables (chosen)", _ours("html")),
    ],
    "docx": [("markitdown (mammoth) (chosen)", _ours("docx"))],
    "pptx": [("markitdown (python-pptx) (chosen)", _ours("pptx"))],
    "md": [("markdown-it-py blocks (chosen)", _ours("md"))],
}


def quality(docs: list[Sample]) -> None:
    print(
        "| format | converter | paragraphs | sentence recall | heading recall "
        "| boilerplate kept | ms/file |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for fmt, candidates in CANDIDATES.items():
        files = [BUILDS[fmt](sample) for sample in docs]
        for name, run in candidates:
            score = Score()
            for sample, data in zip(docs, files, strict=True):
                started = time.perf_counter()
                paragraphs, headings = run(data)
                score.add(sample, paragraphs, headings, (time.perf_counter() - started) * 1000)
            print(score.row(fmt, name, fmt == "html"))


def chunking(docs: list[Sample], max_words: int) -> None:
    """Source sentences cut by a passage boundary (found whole in no passage), and tables split,
    with the structure-aware chunker against the word windows of plain documents."""
    print(f"\nchunking at {max_words} words (overlap 30 for word windows):")
    for fmt in ("pdf", "docx", "md"):
        cut = {"structure": 0, "windows": 0}
        tables_whole = {"structure": 0, "windows": 0}
        total = 0
        for sample in docs:
            converted = convert(f"f.{fmt}", BUILDERS[fmt](sample))
            structured = Document("d", converted.text, converted.title, blocks=converted.blocks)
            plain = Document("d", converted.text, converted.title)
            for name, document in (("structure", structured), ("windows", plain)):
                texts = [
                    " ".join(c.text.split())
                    for c in chunk_document(document, max_words=max_words, overlap_words=30)
                ]
                for section in sample.sections:
                    for paragraph in section.paragraphs:
                        for sentence in sentences(" ".join(paragraph.split())):
                            cut[name] += not any(sentence in t for t in texts)
                table_rows = [" | ".join(row) for row in sample.table[1:]]
                tables_whole[name] += any(all(r in t for r in table_rows) for t in texts)
            total += sum(len(sentences(p)) for s in sample.sections for p in s.paragraphs)
        tables = (
            f"; tables whole {tables_whole['structure']}/{len(docs)} vs "
            f"{tables_whole['windows']}/{len(docs)}"
            if fmt != "pdf"  # the PDFs have no table
            else ""
        )
        print(
            f"  {fmt}: sentences cut {cut['structure']}/{total} (structure) vs "
            f"{cut['windows']}/{total} (word windows){tables}"
        )


def _per_file_child(conn: Connection, filename: str, data: bytes) -> None:
    conn.send(convert(filename, data))
    conn.close()


def _process_per_file(context: BaseContext, filename: str, data: bytes) -> None:
    """The design not taken: a fresh child per file (forkserver or spawn), killed at its limit."""
    receive, send = context.Pipe(duplex=False)
    child = context.Process(target=_per_file_child, args=(send, filename, data))
    child.start()
    send.close()
    receive.recv()
    child.join()


def pool(docs: list[Sample], rounds: int) -> None:
    """Per-file cost of conversion in the pool's worker processes (chosen), against converting
    in this process, and against a new child process per file (forked from a forkserver that
    has imported the converters, or a freshly spawned interpreter)."""
    files = {
        "md": markdown_bytes(docs[0]),
        "html": html_bytes(docs[0]),
        "pdf": pdf_bytes(docs[0]),
        "docx": docx_bytes(docs[0]),
        "pptx": pptx_bytes(docs[0]),
    }
    converters = ConverterPool(workers=1, timeout_seconds=60)
    converters.convert_now("warm.md", b"# warm\n\nup")  # starts the forkserver and the worker
    forkserver = multiprocessing.get_context("forkserver")
    print(f"\nper-file cost (median ms of {rounds}):")
    print("| file | in process | pool worker (chosen) | process per file (forkserver) |")
    print("| --- | --- | --- | --- |")
    for ext, data in files.items():
        timings: dict[str, list[float]] = {"inline": [], "worker": [], "child": []}
        runs: dict[str, Callable[[], object]] = {
            "inline": functools.partial(convert, f"f.{ext}", data),
            "worker": functools.partial(converters.convert_now, f"f.{ext}", data),
            "child": functools.partial(_process_per_file, forkserver, f"f.{ext}", data),
        }
        for _ in range(rounds):
            for name, run in runs.items():
                started = time.perf_counter()
                run()
                timings[name].append((time.perf_counter() - started) * 1000)
        inline, worker, child = (statistics.median(timings[k]) for k in timings)
        print(f"| {ext} | {inline:.1f} | {worker:.1f} | {child:.1f} |")
    converters.close()
    spawn = multiprocessing.get_context("spawn")
    times = []
    for _ in range(3):
        started = time.perf_counter()
        _process_per_file(spawn, "f.md", files["md"])
        times.append((time.perf_counter() - started) * 1000)
    print(f"a spawned interpreter per file (md): {statistics.median(times):.0f} ms median of 3")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--docs", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--part", choices=["all", "quality", "chunking", "pool"], default="all")
    args = parser.parse_args()
    docs = samples(args.docs)
    if args.part in ("all", "quality"):
        quality(docs)
    if args.part in ("all", "chunking"):
        chunking(docs, 180)
        chunking(docs, 60)
    if args.part in ("all", "pool"):
        pool(docs, args.rounds)


if __name__ == "__main__":
    main()
