"""bench.memo_memory measures what it says: its texts are ones a caller can really send, and
each memo's row says what it kept."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from bench.memo_memory import (
    ADDRESSES,
    MEMOS,
    astral_text,
    dense_passage,
    injection_blob,
    letters,
)
from pipeline.guards.injection import InjectionDetector
from pipeline.guards.pii import find_pii
from pipeline.model.tokens import ApproximateTokenCounter
from retrieval.documents import Document, chunk_document


def test_the_hostile_texts_pass_the_limits_a_caller_meets() -> None:
    counter = ApproximateTokenCounter()
    passage = dense_passage(7)
    assert len(passage) <= 8192, "as long as a passage whose analysis is kept"
    chunks = chunk_document(Document(id="d", text=passage))
    assert [chunk.text for chunk in chunks] == [passage], "the chunker stores it as one chunk"
    text = " ".join(f"{letters(3)}{letters(i)}@x.io" for i in range(ADDRESSES))
    assert counter.count(text) <= 4096, "within the default input tokens"
    assert len(find_pii(text)) == ADDRESSES
    blob = injection_blob()
    assert counter.count(blob) <= 4096 and len(InjectionDetector().check(blob).signals) > 100
    astral = astral_text(1)
    assert len(astral) == 65_536 and len(set(astral.split())) == 1024, "all distinct words"


@pytest.mark.parametrize("memo", list(MEMOS))
def test_each_memo_keeps_within_its_budget_and_without_it_keeps_everything(memo: str) -> None:
    rows = {}
    for which in ("none", "budget"):
        child = ["--child", f"{memo}:{which}", "--entries", "6"]
        done = subprocess.run(
            [sys.executable, "-m", "bench.memo_memory", *child],
            capture_output=True,
            text=True,
            check=True,
            timeout=300,
        )
        rows[which] = json.loads(done.stdout.splitlines()[-1])
    assert rows["none"]["budget"] is None and rows["budget"]["budget"] is not None
    assert rows["budget"]["kept_weight"] <= rows["budget"]["budget"]
    assert rows["none"]["held_mb"] > 0, (memo, rows)
    if memo == "patterns":  # RE2's programs: ~4 MB each kept before, none now
        assert rows["none"]["held_mb"] > 10 > rows["budget"]["held_mb"], rows
