"""How many examples a property test draws: its own number in `make test`, `RAG_FUZZ_FACTOR`
times as many under `make fuzz` (which also draws them from random seeds: tests/conftest.py)."""

from __future__ import annotations

import os


def examples(count: int) -> int:
    return count * max(1, int(os.environ.get("RAG_FUZZ_FACTOR", "1")))
