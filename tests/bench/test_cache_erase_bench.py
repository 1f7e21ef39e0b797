"""bench.cache_erase measures what it says: each arm leaves none of the tenant's names and no
other tenant's is touched (the bench checks both), and its figures are written as read."""

from __future__ import annotations

from pathlib import Path

from bench.cache_erase import main


def test_both_arms_erase_the_tenant_alone_and_the_figures_are_written(tmp_path: Path) -> None:
    out = tmp_path / "erase.json"
    sizes = ["--entries", "30", "--other-keys", "800", "--rounds", "2", "--puts", "20"]
    results = main([*sizes, "--out", str(out)])
    assert out.read_text().startswith("{")
    (row,) = results["erase"]
    assert row["entries"] == 30 and len(row["rounds_ms"]["erase"]) == 2
    assert row["ms"]["erase"] > 0 and row["ms"]["walk"] > 0
    put = results["put"]
    assert put["puts"] == 40 and put["us"]["indexed"] > 0 and put["us"]["before"] > 0
    # 20 answers named (the before arm names none), and each name weighs less than its answer.
    assert 0 < put["index_bytes_per_answer"] < put["answer_bytes"]
