"""A clone runs anywhere: SciFact ships in data/scifact/ (xz), readable as it is, overridable."""

from __future__ import annotations

import hashlib
import lzma
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from bench.retrieval_data import load_corpus, load_qrels, load_queries
from tests.support import data
from tests.support.data import VENDORED, open_scifact, require_scifact, scifact_file

ROOT = Path(__file__).resolve().parents[2]


def _sha256(path: Path) -> str:
    opener = lzma.open if path.suffix == ".xz" else open
    with opener(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def test_vendored_files_are_the_ones_their_readme_describes() -> None:
    readme = (VENDORED / "README.md").read_text()
    rows = re.findall(r"^\| `([^`]+)` \|.*\| `([0-9a-f]{64})` \|$", readme, re.MULTILINE)
    assert {name for name, _ in rows} == {
        "corpus.jsonl.xz",
        "queries.jsonl.xz",
        "qrels/train.tsv",
        "qrels/test.tsv",
    }
    for name, digest in rows:
        assert _sha256(VENDORED / name) == digest, name


def test_the_benchmark_loaders_read_the_compressed_files() -> None:
    corpus = load_corpus()
    assert len(corpus) == 5183
    assert len({d.id for d in corpus}) == 5183
    assert len(load_queries()) == 1109
    assert len(load_qrels("test")) == 300
    assert len(load_qrels("train")) == 809


def test_plain_and_compressed_copies_read_the_same(tmp_path: Path) -> None:
    with open_scifact("queries.jsonl") as f:
        text = f.read()
    (tmp_path / "queries.jsonl").write_text(text, encoding="utf-8")
    assert scifact_file("queries.jsonl", tmp_path).suffix == ".jsonl"
    assert load_queries(tmp_path) == load_queries(VENDORED)


def test_files_opened_by_path_are_unpacked_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(data, "UNPACKED", tmp_path / "unpacked")
    folder = require_scifact(VENDORED)
    assert folder.parent == tmp_path / "unpacked"
    assert _sha256(folder / "corpus.jsonl") == _sha256(VENDORED / "corpus.jsonl.xz")
    written = (folder / "corpus.jsonl").stat().st_mtime_ns
    assert require_scifact(VENDORED) == folder
    assert (folder / "corpus.jsonl").stat().st_mtime_ns == written
    # A folder of plain files is used as it is.
    assert require_scifact(folder) == folder


def test_a_missing_file_says_where_scifact_comes_from(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"data/scifact/.*RAG_SCIFACT_DIR"):
        scifact_file("corpus.jsonl", tmp_path)


def test_rag_scifact_dir_overrides_the_vendored_copy(tmp_path: Path) -> None:
    code = "from tests.support.data import SCIFACT; print(SCIFACT)"
    env = {**os.environ, "RAG_SCIFACT_DIR": str(tmp_path)}
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == str(tmp_path)


def test_nothing_reads_a_folder_beside_the_repository() -> None:
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    code = [
        p
        for p in listed
        if p.endswith((".py", ".sh", ".toml", ".yaml", ".yml")) or p in ("Makefile", "README.md")
    ]
    assert "tests/support/data.py" in code
    needle = "shared/" + "data"  # spelled apart so this file does not find itself
    offenders = [p for p in code if (ROOT / p).is_file() and needle in (ROOT / p).read_text()]
    assert offenders == []
