"""bench.memo_timing runs and measures what it says: one round, each table with its arms."""

from __future__ import annotations

import subprocess
import sys


def test_one_round_prints_each_table_with_another_tenants_arm() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "bench.memo_timing", "--rounds", "1", "--passages", "2"],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    out = done.stdout
    for heading in (
        "2 passages a request",
        "finding 2 kept analyses",
        "one word",
        "a scope's first count",
        "PyStemmer",
    ):
        assert heading in out, out
    vocabulary = [line for line in out.splitlines() if line.startswith("| with the vocabulary |")]
    assert len(vocabulary) == 1 and float(vocabulary[0].split("|")[2]) > 0
    assert "| kept by another tenant |" in out and "seen by another tenant us" in out
    rows = [line for line in out.splitlines() if line.startswith("| first seen |")]
    assert len(rows) == 1 and float(rows[0].split("|")[2].replace(",", "")) > 0
