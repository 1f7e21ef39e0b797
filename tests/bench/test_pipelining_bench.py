"""``bench.pipelining_bench``: a pipelined flood's memory and the parser's CPU per request,
measured in fresh processes per side, each running its own checkout's protocol."""

from __future__ import annotations

from pathlib import Path

import pytest

from app.http.server import MAX_PIPELINED, PIECE_BYTES
from bench.pipelining_bench import HERE, SMALLEST, measure


def test_each_side_runs_its_own_checkout_and_the_flood_waits_within_the_bound() -> None:
    result = measure({"this": HERE, "same": HERE}, rounds=1, connections=2, serial=50)
    for row in result["sides"].values():
        assert len(row["rounds"]) == 1
        assert row["waiting_per_connection"] >= MAX_PIPELINED
        assert row["waiting_per_connection"] <= MAX_PIPELINED + PIECE_BYTES // len(SMALLEST)
        assert row["chat_us"] > 0 and row["body_1mib_us"] > row["chat_us"]
        assert row["serial_us"] > row["chat_us"], "the whole request costs more than its parsing"
    this, same = result["sides"]["this"], result["sides"]["same"]
    assert result["ratios"]["chat_us"] == this["chat_us"] / same["chat_us"]


def test_a_side_that_cannot_run_the_measure_fails_the_bench_with_its_error(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="failed"):
        measure({"empty": str(tmp_path), "this": HERE}, rounds=1, connections=1, serial=1)
