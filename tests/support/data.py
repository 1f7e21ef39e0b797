"""Where the shared SciFact data set is: ``RAG_SCIFACT_DIR``, else ``shared/`` beside the repo."""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCIFACT = Path(os.environ.get("RAG_SCIFACT_DIR") or ROOT.parent / "shared" / "data" / "scifact")


def require_scifact() -> Path:
    if not (SCIFACT / "corpus.jsonl").exists():
        raise FileNotFoundError(
            f"SciFact not found at {SCIFACT}: put the repository beside shared/ "
            "(as in the workspace and in CI) or set RAG_SCIFACT_DIR"
        )
    return SCIFACT
