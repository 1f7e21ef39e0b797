"""``rag features``: the precompute job's two commands.

rag features load FILE                 JSONL or CSV, one row per user (tenant, user, features)
rag features compute [--log FILE.jsonl] [--write | --out FILE.jsonl]

``load`` replaces each listed user's hash atomically; bad rows are reported by line number
and skipped (exit code 1 when there were any). ``compute`` derives ``request_count``,
``language`` and ``top_filter`` from the request log (the Redis stream the features stage
appends to, or a JSONL file of the same records) and merges them into the users' hashes
through the same writer (``--write``), or writes a file ``load`` can read (``--out``).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import orjson
from tqdm import tqdm

from app.settings import get_settings
from app.stores import build_feature_store, command_kv
from pipeline.features.loader import LoadReport, count_lines, read_rows, write_rows
from pipeline.features.requestlog import derive_rows
from pipeline.features.store import FeatureRow, FeatureStore

SHOWN_PROBLEMS = 100


def _feature_store() -> FeatureStore:
    settings = get_settings()
    kv = command_kv(settings, min_timeout_s=5.0)  # bulk writes
    return build_feature_store(settings, kv)


def load(args: argparse.Namespace) -> int:
    path = Path(args.file)
    if not path.is_file():
        raise ValueError(f"{path} is not a file")
    total = max(count_lines(path) - (1 if path.suffix.lower() == ".csv" else 0), 0)
    report = asyncio.run(_load_rows(path, total, quiet=args.quiet))
    for number, why in report.bad[:SHOWN_PROBLEMS]:
        print(f"{path}:{number}: skipped: {why}", file=sys.stderr)
    if len(report.bad) > SHOWN_PROBLEMS:
        print(f"... and {len(report.bad) - SHOWN_PROBLEMS} more bad rows", file=sys.stderr)
    print(f"loaded features of {report.written} users; skipped {len(report.bad)} bad rows")
    return 1 if report.bad else 0


async def _load_rows(path: Path, total: int, *, quiet: bool) -> LoadReport:
    store = _feature_store()
    report = LoadReport()
    try:
        with tqdm(total=total, unit="row", desc="features", disable=quiet) as bar:
            await write_rows(store, _counted(read_rows(path, report), bar, report), report)
            _advance(bar, report)
    finally:
        await store.kv.aclose()
    return report


def _counted(rows: Iterable[FeatureRow], bar: Any, report: LoadReport) -> Iterator[FeatureRow]:
    # The bar counts rows read, bad ones included; the writer counts users written.
    for read, row in enumerate(rows, start=1):
        _advance(bar, report, read)
        yield row


def _advance(bar: Any, report: LoadReport, good: int | None = None) -> None:
    done = (report.written if good is None else good) + len(report.bad)
    bar.update(max(done - bar.n, 0))


async def compute(args: argparse.Namespace) -> int:
    store = _feature_store()
    try:
        records = _read_log(Path(args.log)) if args.log else await store.read_log()
        rows, skipped = derive_rows(records)
        if args.out:
            _write_jsonl(Path(args.out), rows)
        report = LoadReport()
        if args.write:
            with tqdm(total=len(rows), unit="user", desc="features", disable=args.quiet) as bar:
                await write_rows(store, rows, report, merge=True, progress=bar)
    finally:
        await store.kv.aclose()
    where = "written" if args.write else f"in {args.out}" if args.out else "not written"
    print(
        f"derived features of {len(rows)} users from {len(records)} records "
        f"({skipped} malformed); {where}"
    )
    return 0


def _read_log(path: Path) -> list[dict[str, Any]]:
    records = []
    with path.open("rb") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                record = orjson.loads(line)
            except orjson.JSONDecodeError:
                print(f"{path}:{number}: skipped: not JSON", file=sys.stderr)
                continue
            if isinstance(record, dict):
                records.append(record)
    return records


def _write_jsonl(path: Path, rows: list[FeatureRow]) -> None:
    with path.open("wb") as handle:
        for row in rows:
            handle.write(orjson.dumps({"tenant": row.tenant, "user": row.user, **row.values}))
            handle.write(b"\n")
