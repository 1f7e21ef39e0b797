"""bench.delete_batch measures what it says: both arms start from the same index and delete
the same ids (the bench checks they are gone), one version each against one for all."""

from __future__ import annotations

from pathlib import Path

from bench.delete_batch import main


def test_one_request_each_publishes_a_version_each_and_one_for_all_publishes_one(
    tmp_path: Path,
) -> None:
    out = tmp_path / "delete.json"
    sizes = ["--deletes", "3", "--rounds", "1", "--other-keys", "80"]
    results = main([*sizes, "--out", str(out)])
    (row,) = results["rows"]
    assert row["versions"] == {"one each": 3, "one for all": 1}
    assert row["ms"]["one each"] > 0 and row["ms"]["one for all"] > 0
    assert results["documents"] > 5000 and out.read_text().startswith("{")
