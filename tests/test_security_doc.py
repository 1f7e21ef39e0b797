"""SECURITY.md's threat table names, for every threat, the tests that show what the service does;
each name must be a test that exists, so the table cannot drift from the suite."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# `path.py::name`, or `::name` continuing the last path named in the same cell.
REFERENCE = re.compile(r"(tests/[\w/]+\.py)?::(\w+)")


def _tests_in(path: Path) -> set[str]:
    tree = ast.parse(path.read_text("utf-8"))
    return {
        node.name
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name.startswith("test")
    }


def test_every_test_security_md_names_exists() -> None:
    rows = [
        line
        for line in (ROOT / "SECURITY.md").read_text("utf-8").splitlines()
        if line.startswith("| ") and not line.startswith("| ---") and "threat" not in line
    ]
    assert len(rows) >= 30
    missing = []
    for row in rows:
        cell = row.rstrip(" |").rsplit(" | ", 1)[-1]
        assert "tests/" in cell, f"no test named for: {row[:80]}"
        current = None
        for path, name in REFERENCE.findall(cell):
            current = path or current
            assert current is not None, row
            if name not in _tests_in(ROOT / current):
                missing.append(f"{current}::{name}")
        for path in re.findall(r"tests/[\w/]+\.py", cell):
            if not (ROOT / path).exists():
                missing.append(path)
    assert not missing, f"SECURITY.md names tests that do not exist: {missing}"
