"""Document files made by real tools (fpdf2, python-docx, python-pptx, an HTML page with its
navigation and footer), converted and chunked: what text comes out, and which passage carries
which heading path, anchor and page."""

from __future__ import annotations

import asyncio
import io
import multiprocessing
import re
import threading
import time

import pytest

from retrieval import Chunk, Document, chunk_document
from retrieval.files import ConverterPool, FileRejected, convert
from tests.support.sample_files import (
    BOILERPLATE,
    BUILDERS,
    Sample,
    Section,
    coastal_sample,
    docx_bytes,
    html_bytes,
    long_pdf,
    markdown_bytes,
    pdf_bytes,
    pptx_bytes,
    text_bytes,
    wordy_docx,
    zip_bomb_docx,
)

SAMPLE = coastal_sample()
TITLE = SAMPLE.title


def passages(filename: str, data: bytes, max_words: int = 180) -> list[Chunk]:
    converted = convert(filename, data)
    document = Document(
        id=filename, text=converted.text, title=converted.title, blocks=converted.blocks
    )
    return chunk_document(document, max_words=max_words, overlap_words=0)


def flat(text: str) -> str:
    return " ".join(text.split())


def holding(chunks: list[Chunk], phrase: str) -> Chunk:
    found = [c for c in chunks if phrase in flat(c.text)]
    assert len(found) == 1, (phrase, [c.text for c in chunks])
    return found[0]


@pytest.mark.parametrize("extension", sorted(BUILDERS))
def test_every_sentence_of_every_format_comes_out_whole_in_one_passage(extension: str) -> None:
    chunks = passages(f"report.{extension}", BUILDERS[extension](SAMPLE), max_words=30)
    for section in SAMPLE.sections:
        for paragraph in section.paragraphs:
            for sentence in re.split(r"(?<=\.) ", paragraph):
                holding(chunks, sentence)


def test_a_pdf_keeps_its_outline_headings_and_the_page_of_each_passage() -> None:
    chunks = passages("report.pdf", pdf_bytes(SAMPLE))
    methods = holding(chunks, "with a laser rangefinder")
    results = holding(chunks, "recorded at Saltmarsh Point")
    assert methods.metadata["heading_path"] == [TITLE, "Methods"]
    assert (methods.metadata["page"], methods.metadata["page_end"]) == (1, 1)
    assert results.metadata["heading_path"] == [TITLE, "Results"]
    assert results.metadata["page"] == 2 and results.metadata["anchor"] == "results"
    assert "Results" not in results.text  # the heading is metadata, not passage text
    assert convert("report.pdf", pdf_bytes(SAMPLE)).title == TITLE


def test_a_pdf_without_an_outline_gets_its_headings_from_their_larger_font() -> None:
    converted = convert("report.pdf", pdf_bytes(SAMPLE, outline=False))
    headings = [(b.text, b.level, b.page) for b in converted.blocks if b.kind == "heading"]
    assert headings == [(TITLE, 1, 1), ("Methods", 2, 1), ("Results", 2, 2)]
    results = holding(passages("report.pdf", pdf_bytes(SAMPLE, outline=False)), "sea walls")
    assert results.metadata["heading_path"] == [TITLE, "Results"]


def test_the_heading_path_leads_the_text_that_is_embedded_but_not_the_title_twice() -> None:
    results = holding(passages("report.md", markdown_bytes(SAMPLE)), "sea walls")
    assert results.indexed_text.startswith(f"{TITLE}\nResults\n")
    plain = Document(id="p", text="Just text.", title="T")
    assert chunk_document(plain)[0].indexed_text == "T\nJust text."  # unchanged for JSON docs


def test_a_docx_keeps_its_headings_and_its_small_table_whole() -> None:
    chunks = passages("report.docx", docx_bytes(SAMPLE))
    table = holding(chunks, "Saltmarsh Point | 3.4")
    assert "Gull Bay | 1.2" in table.text and "Beach | Loss (m)" in table.text
    assert table.metadata["heading_path"] == [TITLE, "Results"]
    methods = holding(chunks, "Sediment samples were taken")
    assert methods.metadata["anchor"] == "methods" and "page" not in methods.metadata


def test_a_pptx_gives_each_slide_its_title_as_heading_and_its_number_as_page() -> None:
    chunks = passages("deck.pptx", pptx_bytes(SAMPLE))
    results = holding(chunks, "lost sand faster")
    assert results.metadata["heading_path"] == ["Results"]
    assert results.metadata["page"] == 3


def test_an_html_page_loses_its_navigation_banner_and_footer() -> None:
    converted = convert("page.html", html_bytes(SAMPLE))
    text = flat(converted.text)
    assert "Nine of the twelve beaches lost more than a metre of dune front." in text
    kept = [phrase for phrase in BOILERPLATE if phrase in text]
    assert kept == []
    headings = [b.text for b in converted.blocks if b.kind == "heading"]
    assert headings == [TITLE, "Methods", "Results"]


def test_a_picture_in_a_docx_leaves_no_data_uri_in_the_text() -> None:
    from docx import Document as WordDocument
    from docx.shared import Inches
    from PIL import Image

    picture = io.BytesIO()
    Image.new("RGB", (40, 40), (200, 0, 0)).save(picture, format="PNG")
    document = WordDocument()
    document.add_paragraph("Before the picture.")
    document.add_picture(picture, width=Inches(1))
    document.add_paragraph("After the picture.")
    out = io.BytesIO()
    document.save(out)
    converted = convert("pictures.docx", out.getvalue())
    assert [b.text for b in converted.blocks] == ["Before the picture.", "After the picture."]


def test_plain_text_is_paragraphs_without_headings() -> None:
    chunks = passages("notes.txt", text_bytes(SAMPLE))
    assert all("heading_path" not in c.metadata for c in chunks)
    assert "Saltmarsh Point" in chunks[0].text


def test_a_long_paragraph_is_cut_between_sentences_and_a_long_table_between_rows() -> None:
    sentences = [f"Sentence number {n} says something about the beach survey." for n in range(40)]
    rows = tuple((f"Beach {n}", str(n)) for n in range(60))
    sample = Sample(
        "Long", (Section("Only", (" ".join(sentences),)),), (("Beach", "Loss"), *rows), 0
    )
    chunks = passages("long.md", markdown_bytes(sample), max_words=50)
    prose = [c for c in chunks if "Sentence" in c.text]
    assert len(prose) > 1
    for chunk in prose:
        assert chunk.text.startswith("Sentence number ") and chunk.text.endswith("survey.")
    tables = [c for c in chunks if "| Beach" in c.text]
    assert len(tables) > 1
    assert all(c.text.startswith("| Beach | Loss |\n| --- | --- |") for c in tables)
    assert sum(c.text.count("| Beach ") for c in tables) == 60 + len(tables)


@pytest.mark.parametrize(
    ("filename", "data", "reason"),
    [
        ("locked.pdf", pdf_bytes(SAMPLE, password="secret"), "encrypted"),
        ("scan.pdf", pdf_bytes(SAMPLE, image_only=True), "no_text"),
        ("bomb.docx", zip_bomb_docx(docx_bytes(SAMPLE)), "zip_bomb"),
        ("page.pdf", html_bytes(SAMPLE), "type_mismatch"),
        ("report.pptx", docx_bytes(SAMPLE), "type_mismatch"),
        ("report.docx", pdf_bytes(SAMPLE), "type_mismatch"),
        ("program.exe", b"MZ\x90\x00", "unsupported_type"),
        ("image.txt", b"\x89PNG\r\n\x1a\n\x00\x00", "unsupported_type"),
        ("latin1.txt", "Caf\xe9".encode("latin-1"), "unsupported_type"),
        ("empty.md", b"  \n", "empty"),
        ("broken.docx", b"PK\x03\x04not really a zip", "unsupported_type"),
    ],
)
def test_bad_files_are_refused_with_their_reason(filename: str, data: bytes, reason: str) -> None:
    with pytest.raises(FileRejected) as refused:
        convert(filename, data)
    assert refused.value.reason == reason


def test_a_pdf_with_only_an_owner_password_is_read() -> None:
    from pypdf import PdfReader, PdfWriter

    writer = PdfWriter(clone_from=PdfReader(io.BytesIO(pdf_bytes(SAMPLE))))
    writer.encrypt(user_password="", owner_password="owner", algorithm="AES-128")
    out = io.BytesIO()
    writer.write(out)
    assert "Saltmarsh Point" in convert("open.pdf", out.getvalue()).text


def test_the_pool_reuses_its_worker_and_kills_one_past_the_time_limit() -> None:
    pool = ConverterPool(workers=1, timeout_seconds=30, memory_bytes=2_000_000_000)
    try:
        converted = pool.convert_now("report.docx", docx_bytes(SAMPLE))
        assert converted.title == TITLE
        (worker,) = multiprocessing.active_children()
        with pytest.raises(FileRejected) as refused:
            pool.convert_now("locked.pdf", pdf_bytes(SAMPLE, password="secret"))
        assert refused.value.reason == "encrypted"
        assert multiprocessing.active_children() == [worker]  # a refusal keeps the worker
        pool.timeout_seconds = 0.01
        with pytest.raises(FileRejected) as slow:
            pool.convert_now("report.docx", docx_bytes(SAMPLE))
        assert slow.value.reason == "timeout"
        assert multiprocessing.active_children() == []  # killed and reaped, not left running
        assert not worker.is_alive()
        pool.timeout_seconds = 30
        assert pool.convert_now("notes.md", markdown_bytes(SAMPLE)).title == TITLE  # a new one
    finally:
        pool.close()
    assert multiprocessing.active_children() == []


def test_a_table_with_a_huge_header_is_not_repeated_into_every_passage() -> None:
    """A header longer than half a passage would otherwise be copied onto each of thousands of
    one-row passages (a 39 KB file became 40 MB of passages)."""
    from retrieval.chunking import Block, split_blocks

    header = "| " + " ".join(["h"] * 5000) + " | " + " ".join(["g"] * 5000) + " |\n|---|---|\n"
    table = header + "\n".join(f"|b{i}|c|" for i in range(2000))
    pieces = split_blocks([Block("heading", "T", 1), Block("table", table)], max_words=180)
    # The header went in once: the passages hold the table's text and no more.
    assert sum(len(p.text) for p in pieces) <= len(table)
    assert all(len(p.text.split()) <= 180 for p in pieces)


def test_a_deep_outline_of_long_headings_keeps_a_short_path_and_full_passages() -> None:
    from retrieval.chunking import MAX_HEADING_CHARS, MAX_LEVEL, Block, split_blocks

    outline = [Block("heading", "x" * 500 + str(i), i + 1) for i in range(100)]
    pieces = split_blocks([*outline, Block("text", "word " * 500)], max_words=180)
    for piece in pieces:
        assert len(piece.heading_path) <= MAX_LEVEL
        assert all(len(h) <= MAX_HEADING_CHARS for h in piece.heading_path)
        assert len(piece.text.split()) >= 90  # the headings take at most half a passage


@pytest.fixture(scope="module")
def slow_pdf() -> bytes:
    return long_pdf()


def test_a_worker_refuses_a_text_over_the_limit_before_sending_it_back() -> None:
    """A DOCX of ~180 KB that inflates to over a million characters: refused in the worker
    (``too_large``), which is kept, as it is after any refusal."""
    wordy = wordy_docx(1_050_000)
    assert len(wordy) < 300_000 and len(convert("wordy.docx", wordy).text) > 1_000_000
    pool = ConverterPool(workers=1, timeout_seconds=30, max_chars=1_000_000)
    try:
        with pytest.raises(FileRejected) as refused:
            pool.convert_now("wordy.docx", wordy)
        assert refused.value.reason == "too_large"
        assert "1000000" in str(refused.value)
        (worker,) = multiprocessing.active_children()
        assert pool.convert_now("report.docx", docx_bytes(SAMPLE)).title == TITLE
        assert multiprocessing.active_children() == [worker]
    finally:
        pool.close()


def test_a_file_past_its_uploads_deadline_is_refused_waiting_or_converting(slow_pdf) -> None:
    pool = ConverterPool(workers=1, timeout_seconds=60)
    try:
        with pytest.raises(FileRejected) as late:
            pool.convert_now("notes.md", markdown_bytes(SAMPLE), deadline=time.monotonic())
        assert late.value.reason == "upload_timeout"
        assert multiprocessing.active_children() == []  # no worker started for it
        # Converting when the budget runs out (long before the file's own time limit): the
        # worker is killed, and the reason is the upload's budget, not the file's limit.
        with pytest.raises(FileRejected) as killed:
            pool.convert_now("long.pdf", slow_pdf, deadline=time.monotonic() + 1)
        assert killed.value.reason == "upload_timeout"
        assert multiprocessing.active_children() == []
        # Waiting for the only worker, busy with another upload's slow file.
        outcomes: list[str] = []

        def busy() -> None:
            try:
                pool.convert_now("long.pdf", slow_pdf, deadline=time.monotonic() + 4)
            except FileRejected as exc:
                outcomes.append(exc.reason)

        thread = threading.Thread(target=busy)
        thread.start()
        while not multiprocessing.active_children():  # the worker has the slow file
            thread.join(0.01)
        with pytest.raises(FileRejected) as waited:
            pool.convert_now("notes.md", markdown_bytes(SAMPLE), deadline=time.monotonic() + 0.5)
        assert waited.value.reason == "upload_timeout"
        thread.join()
        assert outcomes == ["upload_timeout"]
        assert pool.convert_now("notes.md", markdown_bytes(SAMPLE)).title == TITLE
    finally:
        pool.close()


async def test_a_tenant_over_its_share_of_workers_waits_while_another_goes_first(
    slow_pdf,
) -> None:
    """Two workers, one file at a time per tenant: tenant a's two slow files take one worker in
    turn (each killed at the 3 s limit), tenant b's file, sent after them, takes the other at
    once. Without the bound a's files would hold both workers and b's would finish last."""
    pool = ConverterPool(workers=2, timeout_seconds=3, per_tenant=1)
    finished: list[str] = []

    async def send(name: str, filename: str, data: bytes, tenant: str) -> None:
        try:
            await pool.convert(filename, data, tenant=tenant)
        except FileRejected as exc:
            assert exc.reason == "timeout"
        finished.append(name)

    try:
        await asyncio.gather(
            send("a1", "long.pdf", slow_pdf, "a"),
            send("a2", "long.pdf", slow_pdf, "a"),
            send("b", "notes.md", markdown_bytes(SAMPLE), "b"),
        )
    finally:
        pool.close()
    assert finished == ["b", "a1", "a2"]
    assert pool._tenants == {}  # nothing kept for tenants with no file left
