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
    assert row["ms"]["erase"] > 0 and row["ms"]["floor"] > 0
    assert results["put"]["puts"] == 40 and results["put"]["us"]["checked"] > 0
