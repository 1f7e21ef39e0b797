"""`rag ingest` over a folder of document files: each bad file skipped with its reason, the rest
ingested with their structure, and a summary that counts every file left out."""

from __future__ import annotations

import json
from pathlib import Path

from retrieval import HybridRetriever, IndexStore
from tests.support.cli import rag
from tests.support.sample_files import (
    coastal_sample,
    docx_bytes,
    html_bytes,
    markdown_bytes,
    pdf_bytes,
    pptx_bytes,
    zip_bomb_docx,
)

SAMPLE = coastal_sample()


def test_ingest_takes_every_good_file_of_a_folder_and_skips_each_bad_one(
    tmp_path: Path, shared_embedder
) -> None:
    docs = tmp_path / "docs"
    (docs / "deck").mkdir(parents=True)
    (docs / "report.pdf").write_bytes(pdf_bytes(SAMPLE))
    (docs / "report.docx").write_bytes(docx_bytes(SAMPLE))
    (docs / "deck" / "slides.pptx").write_bytes(pptx_bytes(SAMPLE))
    (docs / "page.html").write_bytes(html_bytes(SAMPLE))
    (docs / "notes.md").write_bytes(markdown_bytes(SAMPLE))
    (docs / "locked.pdf").write_bytes(pdf_bytes(SAMPLE, password="pw"))
    (docs / "bomb.docx").write_bytes(zip_bomb_docx(docx_bytes(SAMPLE)))
    (docs / "fake.pdf").write_bytes(html_bytes(SAMPLE))
    (docs / "huge.txt").write_bytes(b"word " * 100_000)
    (docs / "photo.png").write_bytes(b"\x89PNG\r\n")
    (docs / ".hidden").write_bytes(b"editor state")
    index_dir = tmp_path / "index"
    env = {"RAG_RETRIEVAL__INDEX_DIR": str(index_dir), "RAG_FILES__MAX_FILE_BYTES": "300000"}

    done = rag("ingest", str(docs), "--tenant", "files", env=env)
    assert done.returncode == 0, done.stderr
    assert "ingested 5 documents" in done.stdout and "skipped 5;" in done.stdout
    skipped = [line for line in done.stderr.splitlines() if line.startswith("skipped ")]
    reasons = {Path(line.split(": ", 1)[0].removeprefix("skipped ")).name: line for line in skipped}
    assert set(reasons) == {"locked.pdf", "bomb.docx", "fake.pdf", "huge.txt", "photo.png"}
    assert "(encrypted)" in reasons["locked.pdf"] and "(zip_bomb)" in reasons["bomb.docx"]
    assert "(type_mismatch)" in reasons["fake.pdf"] and "(too_large)" in reasons["huge.txt"]

    store = IndexStore(index_dir, shared_embedder)
    vector = shared_embedder.embed(["largest loss of dune front"])[0]
    hits = (
        HybridRetriever(store).search("files", "largest loss of dune front", vector, top_k=10).hits
    )
    pdf = next(h for h in hits if h.document_id == "report.pdf")
    assert pdf.metadata["heading_path"] == [SAMPLE.title, "Results"] and pdf.metadata["page"] == 2
    slides = next(h for h in hits if h.document_id == "deck/slides.pptx")
    assert slides.metadata["page"] == 3 and slides.metadata["format"] == "pptx"


def test_one_document_over_the_size_limit_no_longer_drops_its_batch(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus.jsonl"
    rows = [
        {"_id": "a", "title": "A", "text": "Aspirin thins blood."},
        {"_id": "big", "title": "Big", "text": "word " * 200},
        {"_id": "c", "title": "C", "text": "Statins lower LDL."},
    ]
    corpus.write_text("\n".join(json.dumps(r) for r in rows))
    env = {
        "RAG_RETRIEVAL__INDEX_DIR": str(tmp_path / "index"),
        "RAG_RETRIEVAL__MAX_DOCUMENT_CHARS": "500",
    }
    done = rag("ingest", str(corpus), "--tenant", "t", "--batch", "10", env=env)
    assert done.returncode == 0, done.stderr
    assert "ingested 2 documents" in done.stdout and "skipped 1;" in done.stdout
    assert "skipped big: document 'big' has 1000 characters" in done.stderr
