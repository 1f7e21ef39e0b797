"""bench.snapshot_memory measures what it says: its dense metadata is what an ingest key may
really send, and its rows compare what is counted with what is held."""

from __future__ import annotations

import json
import subprocess
import sys

from bench.snapshot_memory import corpus
from retrieval.documents import MAX_METADATA_BYTES, MAX_METADATA_KEYS, Document


def test_the_dense_metadata_is_as_much_as_an_ingest_key_may_send() -> None:
    for document in corpus("metadata", 20):
        size = len(json.dumps(document.metadata, separators=(",", ":")))
        assert MAX_METADATA_BYTES * 0.75 < size <= MAX_METADATA_BYTES
        assert len(document.metadata) == MAX_METADATA_KEYS
        # Accepted as it would be from a request (the checks run when a Document is made).
        assert Document(document.id, document.text, metadata=document.metadata).metadata


def test_its_rows_say_what_is_counted_against_what_is_held() -> None:
    command = ["-m", "bench.snapshot_memory", "--kinds", "access", "unicode", "--rounds", "1"]
    done = subprocess.run(
        [sys.executable, *command],
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    )
    rows = [line.split("|") for line in done.stdout.splitlines() if line.startswith("| ")]
    found = {row[1].strip(): row for row in rows[2:]}
    assert set(found) == {"access", "unicode"}, done.stdout
    for row in found.values():
        assert 0.95 <= float(row[8]) <= 1.05, row  # counted / held, once searched
        assert float(row[7]) < 0.5, row  # on disk / held: what the disk rule missed
