"""SciFact for tests, benchmarks and the demo tenant: vendored in ``data/scifact/`` (xz).

``RAG_SCIFACT_DIR`` points at another copy. Either place may hold each file plain
(``corpus.jsonl``) or compressed (``corpus.jsonl.xz``); `open_scifact` reads both, so nothing
needs unpacking first.
"""

from __future__ import annotations

import hashlib
import lzma
import os
import shutil
import tempfile
from pathlib import Path
from typing import TextIO

ROOT = Path(__file__).resolve().parents[2]
VENDORED = ROOT / "data" / "scifact"
SCIFACT = Path(os.environ.get("RAG_SCIFACT_DIR") or VENDORED)
UNPACKED = Path.home() / ".cache" / "rag" / "scifact"


def scifact_file(name: str, root: Path = SCIFACT) -> Path:
    """The file `name` (e.g. ``qrels/test.tsv``) under `root`: plain if there, else its ``.xz``."""
    for candidate in (root / name, root / f"{name}.xz"):
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(
        f"SciFact's {name} (or {name}.xz) is not in {root}: the repository ships it in "
        f"{VENDORED.relative_to(ROOT)}/ (restore it with git), or set RAG_SCIFACT_DIR to a copy"
    )


def open_scifact(name: str, root: Path = SCIFACT) -> TextIO:
    """Open a SciFact file as UTF-8 text, decompressing ``.xz`` on the fly."""
    path = scifact_file(name, root)
    if path.suffix == ".xz":
        return lzma.open(path, "rt", encoding="utf-8")
    return path.open(encoding="utf-8")


def require_scifact(root: Path = SCIFACT) -> Path:
    """A folder holding ``corpus.jsonl`` and ``queries.jsonl`` as plain files.

    For callers that open the files by path: `root` itself when they are plain there, else a
    copy unpacked once under ~/.cache/rag/scifact/, keyed by the compressed files' contents.
    """
    names = ("corpus.jsonl", "queries.jsonl")
    sources = [scifact_file(name, root) for name in names]
    if all(path.suffix != ".xz" for path in sources):
        return root
    digest = hashlib.sha256()
    for path in sources:
        digest.update(path.read_bytes())
    target = UNPACKED / digest.hexdigest()[:16]
    if not all((target / name).is_file() for name in names):
        _unpack(root, names, target)
    return target


def _unpack(root: Path, names: tuple[str, ...], target: Path) -> None:
    # Unpack beside the target and rename into place, so a concurrent or interrupted run never
    # leaves a half-written file where another process will read it.
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=".unpack-"))
    try:
        for name in names:
            source = scifact_file(name, root)
            opener = lzma.open if source.suffix == ".xz" else open
            with opener(source, "rb") as src, (staging / name).open("wb") as dst:
                shutil.copyfileobj(src, dst)
        try:
            staging.rename(target)
        except OSError:
            if not all((target / name).is_file() for name in names):
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
