"""SECURITY.md's threat table names, for every threat, the tests that show what the service does,
and RELIABILITY.md's scenario tables the command that reproduces each; each test named must
exist, so the tables cannot drift from the suite."""

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


def _table_rows(document: str) -> list[str]:
    return [
        line
        for line in (ROOT / document).read_text("utf-8").splitlines()
        if line.startswith("| ") and not line.startswith("| ---") and "threat" not in line
    ]


def _missing(cell: str) -> list[str]:
    """The tests (``path::name``, or ``::name`` after a path) and test files that ``cell``
    names but the suite does not have."""
    missing = []
    current = None
    for path, name in REFERENCE.findall(cell):
        current = path or current
        assert current is not None, cell
        if name not in _tests_in(ROOT / current):
            missing.append(f"{current}::{name}")
    for path in re.findall(r"tests/[\w/]+\.py", cell):
        if not (ROOT / path).exists():
            missing.append(path)
    return missing


def test_every_test_security_md_names_exists() -> None:
    rows = _table_rows("SECURITY.md")
    assert len(rows) >= 30
    missing = []
    for row in rows:
        cell = row.rstrip(" |").rsplit(" | ", 1)[-1]
        assert "tests/" in cell, f"no test named for: {row[:80]}"
        missing += _missing(cell)
    assert not missing, f"SECURITY.md names tests that do not exist: {missing}"


def test_every_reliability_scenario_says_how_to_reproduce_it() -> None:
    """RELIABILITY.md: each scenario row has its five cells (scenario, injected, seen, lost,
    command); the command names a test that exists, or a make target or bench module."""
    scenarios, in_scenarios = [], False
    for line in (ROOT / "RELIABILITY.md").read_text("utf-8").splitlines():
        if not line.startswith("|"):
            in_scenarios = False
        elif line.startswith("| scenario | what was injected"):
            in_scenarios = True
        elif in_scenarios and not line.startswith("| ---"):
            scenarios.append(line)
    assert len(scenarios) >= 30
    missing = []
    for row in scenarios:
        cells = [cell.strip() for cell in row.strip().strip("|").split(" | ")]
        assert len(cells) == 5, f"not five cells: {row[:100]}"
        command = cells[-1]
        assert (
            "tests/" in command or "::" in command or "make " in command or "bench." in command
        ), f"no command for: {row[:80]}"
        missing += _missing(command)
    assert not missing, f"RELIABILITY.md names tests that do not exist: {missing}"
