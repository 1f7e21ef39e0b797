"""Real document files made by real tools, for the converter's tests and bench/convert_bench.py.

Each builder takes a `Sample` (a title and sections of paragraphs, optionally a table) and
returns the bytes the tool wrote: a PDF from fpdf2 (with an outline, one section per page from
the second on), a DOCX from python-docx, a PPTX from python-pptx, an HTML page with navigation,
a cookie banner and a footer around the article, Markdown and plain text. What a converter
should recover is known: the paragraphs' sentences and the headings; what it should drop is
`BOILERPLATE` (HTML only).
"""

from __future__ import annotations

import html
import io
import random
from dataclasses import dataclass, field

BOILERPLATE = (
    "Home",
    "About us",
    "Contact sales",
    "Subscribe to our newsletter for weekly updates",
    "We use cookies to improve your experience",
    "Copyright 2026 Example Corp. All rights reserved.",
    "Privacy policy",
)


@dataclass(frozen=True)
class Section:
    heading: str
    paragraphs: tuple[str, ...]
    level: int = 2


@dataclass(frozen=True)
class Sample:
    title: str
    sections: tuple[Section, ...]
    table: tuple[tuple[str, ...], ...] = field(default=())
    table_after: int = 0  # the table follows this section's paragraphs

    @property
    def headings(self) -> list[str]:
        return [self.title, *(s.heading for s in self.sections)]


def coastal_sample() -> Sample:
    """The sample the tests assert on: two sections and a small table."""
    return Sample(
        title="Field report on coastal erosion",
        sections=(
            Section(
                "Methods",
                (
                    "We surveyed twelve beaches along the northern coast in the spring. "
                    "Each beach was measured at low tide with a laser rangefinder.",
                    "Sediment samples were taken every fifty metres. "
                    "The samples were dried and sieved in the laboratory.",
                ),
            ),
            Section(
                "Results",
                (
                    "Nine of the twelve beaches lost more than a metre of dune front. "
                    "The largest loss was recorded at Saltmarsh Point.",
                    "Beaches protected by sea walls lost sand faster than open beaches.",
                ),
            ),
        ),
        table=(("Beach", "Loss (m)"), ("Saltmarsh Point", "3.4"), ("Gull Bay", "1.2")),
        table_after=1,
    )


def pdf_bytes(
    sample: Sample,
    *,
    password: str | None = None,
    image_only: bool = False,
    outline: bool = True,
) -> bytes:
    """A PDF from fpdf2: the title on page 1 with the first section, each later section on a
    new page; headings in a larger bold font and (unless not `outline`) in the PDF outline.
    `image_only` draws a picture and no text (a scan); `password` encrypts it with pypdf."""
    from fpdf import FPDF

    pdf = FPDF()
    pdf.set_auto_page_break(True, margin=15)
    pdf.add_page()
    if image_only:
        from PIL import Image

        picture = io.BytesIO()
        Image.new("RGB", (200, 100), (200, 200, 200)).save(picture, format="PNG")
        pdf.image(picture, x=10, y=10, w=180)
        return bytes(pdf.output())
    pdf.set_font("Helvetica", "B", 20)
    if outline:
        pdf.start_section(sample.title, level=0)
    pdf.multi_cell(0, 10, sample.title, new_x="LMARGIN", new_y="NEXT")
    for number, section in enumerate(sample.sections):
        if number:
            pdf.add_page()
        pdf.set_font("Helvetica", "B", 15)
        if outline:
            pdf.start_section(section.heading, level=section.level - 1)
        pdf.multi_cell(0, 9, section.heading, new_x="LMARGIN", new_y="NEXT")
        pdf.set_font("Helvetica", "", 11)
        for paragraph in section.paragraphs:
            pdf.multi_cell(0, 6, paragraph, new_x="LMARGIN", new_y="NEXT")
            pdf.ln(4)
    data = bytes(pdf.output())
    return data if password is None else _encrypted(data, password)


def _encrypted(data: bytes, password: str) -> bytes:
    from pypdf import PdfReader, PdfWriter

    writer = PdfWriter(clone_from=PdfReader(io.BytesIO(data)))
    writer.encrypt(password, algorithm="AES-128")
    out = io.BytesIO()
    writer.write(out)
    return out.getvalue()


def docx_bytes(sample: Sample) -> bytes:
    from docx import Document

    document = Document()
    document.add_heading(sample.title, level=1)
    for number, section in enumerate(sample.sections):
        document.add_heading(section.heading, level=section.level)
        for paragraph in section.paragraphs:
            document.add_paragraph(paragraph)
        if sample.table and number == sample.table_after:
            table = document.add_table(rows=len(sample.table), cols=len(sample.table[0]))
            for r, row in enumerate(sample.table):
                for c, cell in enumerate(row):
                    table.cell(r, c).text = cell
    out = io.BytesIO()
    document.save(out)
    return out.getvalue()


def pptx_bytes(sample: Sample) -> bytes:
    """A title slide, then one slide per section: its heading as the slide title and its
    paragraphs in the body placeholder."""
    from pptx import Presentation

    deck = Presentation()
    first = deck.slides.add_slide(deck.slide_layouts[0])
    first.shapes.title.text = sample.title
    for section in sample.sections:
        slide = deck.slides.add_slide(deck.slide_layouts[1])
        slide.shapes.title.text = section.heading
        body = slide.placeholders[1].text_frame
        body.text = section.paragraphs[0]
        for paragraph in section.paragraphs[1:]:
            body.add_paragraph().text = paragraph
    out = io.BytesIO()
    deck.save(out)
    return out.getvalue()


def _html_table(rows: tuple[tuple[str, ...], ...]) -> str:
    head = "".join(f"<th>{html.escape(c)}</th>" for c in rows[0])
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in rows[1:]
    )
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def html_bytes(sample: Sample) -> bytes:
    """An article page as sites publish them: navigation, a cookie banner, a sidebar and a
    footer around the `<article>`."""
    parts = [f"<h1>{html.escape(sample.title)}</h1>"]
    for number, section in enumerate(sample.sections):
        parts.append(f"<h{section.level}>{html.escape(section.heading)}</h{section.level}>")
        parts.extend(f"<p>{html.escape(p)}</p>" for p in section.paragraphs)
        if sample.table and number == sample.table_after:
            parts.append(_html_table(sample.table))
    nav = " | ".join(f'<a href="/{w.lower()}">{w}</a>' for w in BOILERPLATE[:3])
    page = f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{html.escape(sample.title)}</title></head>
<body>
<div class="cookie-banner">{BOILERPLATE[4]}. <button>Accept</button></div>
<header><nav class="menu">{nav}</nav></header>
<main><article>{"".join(parts)}</article>
<aside class="sidebar"><p>{BOILERPLATE[3]}.</p></aside></main>
<footer><p>{BOILERPLATE[5]}</p><a href="/privacy">{BOILERPLATE[6]}</a></footer>
</body></html>"""
    return page.encode()


def markdown_bytes(sample: Sample) -> bytes:
    lines = [f"# {sample.title}", ""]
    for number, section in enumerate(sample.sections):
        lines += ["#" * section.level + " " + section.heading, ""]
        for paragraph in section.paragraphs:
            lines += [paragraph, ""]
        if sample.table and number == sample.table_after:
            header, *rows = sample.table
            lines.append("| " + " | ".join(header) + " |")
            lines.append("|" + " --- |" * len(header))
            lines += ["| " + " | ".join(row) + " |" for row in rows]
            lines.append("")
    return "\n".join(lines).encode()


def text_bytes(sample: Sample) -> bytes:
    paragraphs = [p for s in sample.sections for p in s.paragraphs]
    return (sample.title + "\n\n" + "\n\n".join(paragraphs) + "\n").encode()


def zip_bomb_docx(real: bytes, *, inflated_bytes: int = 200_000_000) -> bytes:
    """A real DOCX with one more member that inflates to `inflated_bytes` of zeros (declared
    honestly in the zip directory, as a real bomb is: the ratio gives it away)."""
    import zipfile

    out = io.BytesIO(real)
    with (
        zipfile.ZipFile(out, "a", compression=zipfile.ZIP_DEFLATED) as archive,
        archive.open("word/media/padding.bin", "w", force_zip64=True) as member,
    ):
        block = bytes(1 << 20)
        for _ in range(inflated_bytes >> 20):
            member.write(block)
    return out.getvalue()


BUILDERS = {
    "pdf": pdf_bytes,
    "docx": docx_bytes,
    "pptx": pptx_bytes,
    "html": html_bytes,
    "md": markdown_bytes,
    "txt": text_bytes,
}


_FILLER_WORDS = (
    "shore",
    "marsh",
    "tide",
    "sand",
    "dune",
    "reef",
    "storm",
    "levee",
    "inlet",
    "spit",
)


def _filler_line(seed: int, words: int) -> str:
    """Words of `_FILLER_WORDS` in a seeded random order (a repeated line would compress like
    a zip bomb)."""
    pick = random.Random(seed).choice
    return " ".join(pick(_FILLER_WORDS) for _ in range(words))


def long_pdf(pages: int = 4000) -> bytes:
    """A PDF of `pages` pages of 25 lines each (~2 MB): seconds of pypdf's work per thousand
    pages, so its conversion outlasts a short time limit or upload budget by far."""
    from fpdf import FPDF

    pdf = FPDF()
    pdf.set_font("Helvetica", size=10)
    for page in range(pages):
        pdf.add_page()
        for line in range(25):
            pdf.cell(0, 5, _filler_line(page + line, 12), new_x="LMARGIN", new_y="NEXT")
    return bytes(pdf.output())


def wordy_docx(chars: int) -> bytes:
    """A DOCX whose text is more than `chars` characters, in paragraphs of ~1,000: a file a
    few times smaller than its text (a zip inflating about tenfold, not a zip bomb)."""
    from docx import Document

    document = Document()
    document.add_heading("A very long report", level=1)
    written, seed = 0, 0
    while written <= chars:
        paragraph = _filler_line(seed, 180)
        document.add_paragraph(paragraph)
        written += len(paragraph)
        seed += 1
    out = io.BytesIO()
    document.save(out)
    return out.getvalue()
