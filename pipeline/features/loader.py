"""The bulk loader behind ``rag features load`` (and ``compute --write``): feature files in,
users' hashes out, bad rows reported by line number and skipped.

A file is JSONL (one object per line) or CSV (a header row naming the columns), one row per
user: ``tenant``, ``user`` and any of the declared batch features. An empty cell (or a JSON
``null``) leaves the feature out, so the request path uses its default. A row is bad, and
skipped, when it lacks a tenant or user, names one that is not a valid name, has a column that
is no batch feature, or a value of the wrong type.
"""

from __future__ import annotations

import csv
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from pipeline.features.spec import SPECS, FeatureSpec, FeatureValueError, parse_value
from pipeline.features.store import FeatureRow, FeatureStore
from pipeline.store.keys import validate_name

IDENTITY = ("tenant", "user")


class RowError(ValueError):
    """A row that cannot be loaded; the message says why."""


@dataclass
class LoadReport:
    """What a load did: users written, and each bad row's line number and reason."""

    written: int = 0
    bad: list[tuple[int, str]] = field(default_factory=list)


def parse_row(raw: Any, *, text: bool, specs: Mapping[str, FeatureSpec] = SPECS) -> FeatureRow:
    """One row, checked against the declared features (``text``: values are strings, CSV)."""
    if not isinstance(raw, Mapping):
        raise RowError("expected an object with tenant, user and feature columns")
    names: dict[str, str] = {}
    for column in IDENTITY:
        value = raw.get(column)
        if value in (None, ""):
            raise RowError(f"missing {column}")
        if not isinstance(value, str):
            raise RowError(f"{column} must be a string")
        try:
            names[column] = validate_name(column, value)
        except ValueError as exc:
            raise RowError(str(exc)) from None
    values: dict[str, Any] = {}
    for column, value in raw.items():
        if column in IDENTITY:
            continue
        spec = specs.get(str(column))
        if spec is None:
            raise RowError(f"unknown column {str(column)[:40]!r}")
        if spec.source != "batch":
            raise RowError(f"{column} is computed per request, not loaded")
        if value is None or (text and value == ""):
            continue
        try:
            values[spec.name] = parse_value(spec, value, text=text)
        except FeatureValueError as exc:
            raise RowError(str(exc)) from None
    return FeatureRow(names["tenant"], names["user"], values)


def read_rows(path: Path, report: LoadReport) -> Iterator[FeatureRow]:
    """The good rows of a JSONL or CSV file; bad ones go into ``report.bad``."""
    if path.suffix.lower() == ".csv":
        yield from _read_csv(path, report)
    else:
        yield from _read_jsonl(path, report)


def _read_jsonl(path: Path, report: LoadReport) -> Iterator[FeatureRow]:
    with path.open("rb") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                yield parse_row(orjson.loads(line), text=False)
            except orjson.JSONDecodeError:
                report.bad.append((number, "not a JSON object"))
            except RowError as exc:
                report.bad.append((number, str(exc)))


def _read_csv(path: Path, report: LoadReport) -> Iterator[FeatureRow]:
    with path.open(newline="", encoding="utf-8-sig") as handle:
        reader = csv.DictReader(handle, restkey="\x00extra")
        for raw in reader:
            number = reader.line_num
            if "\x00extra" in raw or None in raw.values():
                report.bad.append((number, "the row's cell count differs from the header's"))
                continue
            try:
                yield parse_row(raw, text=True)
            except RowError as exc:
                report.bad.append((number, str(exc)))


def count_lines(path: Path) -> int:
    with path.open("rb") as handle:
        return sum(1 for line in handle if line.strip())


async def write_rows(
    store: FeatureStore,
    rows: Iterable[FeatureRow],
    report: LoadReport,
    *,
    batch_size: int = 500,
    merge: bool = False,
    progress: Any = None,
) -> LoadReport:
    """Write the rows in pipelined batches (each user atomically); ``progress``: a tqdm bar."""
    for batch in _batches(rows, batch_size):
        report.written += await store.write_many(batch, merge=merge)
        if progress is not None:
            progress.update(len(batch))
    return report


def _batches(rows: Iterable[FeatureRow], size: int) -> Iterator[list[FeatureRow]]:
    batch: list[FeatureRow] = []
    for row in rows:
        batch.append(row)
        if len(batch) >= size:
            yield batch
            batch = []
    if batch:
        yield batch
