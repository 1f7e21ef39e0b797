"""What a loaded index snapshot holds in memory, against what the loaded-snapshot budget
(``RAG_RETRIEVAL__LOADED_INDEXES_MB``) counts: its size on disk (before) and its
``resident_bytes`` (now).

    .venv/bin/python -m bench.snapshot_memory [--rounds 3] [--tenants 6] [--budget-mb 768]

Four kinds of tenant, each indexed once by a real ``IndexStore`` (random unit vectors: their
values do not change the memory):

- ``scifact``: SciFact's 5,183 abstracts, one chunk each;
- ``words``: 2,000 documents of 180 random words (one chunk each at the default chunking);
- ``metadata``: 2,000 short documents whose metadata is as many two-letter strings as the
  8 KB limit allows (64 keys of 19), what an ingest key can send;
- ``access``: 2,000 short documents, each readable by 8 of 64 groups and 8 of 512 users;
- ``unicode``: 2,000 documents of words, a title and metadata beyond ASCII (emoji too).

Per kind, in a fresh process each: the snapshot is loaded (``read_snapshot``) under
tracemalloc, then searched as a filtered search would (its filter columns) or as a viewer
would (a view), and every chunk served once (written by orjson, as a response is: a string
beyond ASCII then holds a UTF-8 copy). "held" is what tracemalloc sees plus the vectors the
snapshot maps from its file (tracemalloc does not see a mapped file; they are resident once
searched). The counting's cost: loading a snapshot, then counting it, medians over
``--rounds`` (no tracemalloc).

Then a replica: ``--tenants`` copies of the ``metadata`` tenant, each searched with a filter,
in a fresh process each arm, resident memory (VmRSS after ``malloc_trim``) growth over the
process before any snapshot. Before: the snapshots as many as the disk rule kept (the budget
over their size on disk); now: the store under the budget, counting ``resident_bytes``.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import random
import shutil
import statistics
import string
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from bench.replica_memory import RandomEmbedder, rss_mb
from retrieval.access import AccessList, Viewer
from retrieval.documents import Document
from retrieval.filters import parse_filters
from retrieval.hybrid import HybridRetriever
from retrieval.snapshots import read_snapshot
from retrieval.store import IndexStore

MB = 2**20
DOCUMENTS = 2000


def _words(rng: random.Random, n: int) -> str:
    return " ".join(
        "".join(rng.choices(string.ascii_lowercase, k=rng.randint(3, 9))) for _ in range(n)
    )


def corpus(kind: str, documents: int = DOCUMENTS) -> list[Document]:
    """The documents of one kind of tenant (SciFact: all of them)."""
    rng = random.Random(18)
    if kind == "scifact":
        from bench.retrieval_data import load_corpus

        return load_corpus()
    if kind == "words":
        return [Document(f"d{n}", _words(rng, 180)) for n in range(documents)]
    if kind == "metadata":
        letters = string.ascii_letters
        return [
            Document(
                f"d{n}",
                _words(rng, 8),
                metadata={
                    f"k{k:02d}": ["".join(rng.choices(letters, k=2)) for _ in range(19)]
                    for k in range(64)
                },
            )
            for n in range(documents)
        ]
    if kind == "unicode":
        letters = "éßжλ字語😀𝔘"
        return [
            Document(
                f"d{n}",
                " ".join("".join(rng.choices(letters, k=5)) for _ in range(40)),
                title="".join(rng.choices(letters, k=12)),
                metadata={
                    f"k{k:02d}": ["".join(rng.choices(letters, k=2)) for _ in range(8)]
                    for k in range(16)
                },
            )
            for n in range(documents)
        ]
    if kind == "access":
        return [
            Document(
                f"d{n}",
                _words(rng, 8),
                access=AccessList(
                    frozenset(f"group-{g}" for g in rng.sample(range(64), 8)),
                    frozenset(f"user-{u}" for u in rng.sample(range(512), 8)),
                ),
            )
            for n in range(documents)
        ]
    raise ValueError(kind)


KINDS = ("scifact", "words", "metadata", "access", "unicode")


def build(root: Path, kind: str, tenants: int = 1) -> list[str]:
    """Index ``kind`` as ``tenants`` tenants (copies of the first one's directory)."""
    store = IndexStore(root, RandomEmbedder())
    first = f"{kind}0"
    store.upsert(first, corpus(kind))
    for n in range(1, tenants):
        shutil.copytree(root / first, root / f"{kind}{n}")
    return [f"{kind}{n}" for n in range(tenants)]


def resident_mb() -> float:
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    return rss_mb(os.getpid())


def snapshot_dir(root: Path, tenant: str) -> Path:
    return root / tenant / (root / tenant / "CURRENT").read_text().strip()


def disk_bytes(directory: Path) -> int:
    return sum(path.stat().st_size for path in directory.iterdir())


def search(index: Any, kind: str) -> Any:
    """What searches of this kind build on the snapshot: a filter's columns, or a view; and
    every chunk served once, written as a response writes it (orjson keeps a UTF-8 copy in
    each string beyond ASCII it writes)."""
    records = index.records
    for row in range(len(records)):
        orjson.dumps([records.chunk_id[row], records.title[row], records.text[row]])
        orjson.dumps(records.metadata[row])
    if kind == "access":
        return index.visible_to(Viewer("user-1", frozenset({"group-1", "group-2"})))
    index.visible_to(None)
    return index.columns if kind == "metadata" else None


def held(kind: str, directory: Path) -> dict[str, float]:
    """One snapshot loaded, then searched: disk, counted and held (MB)."""
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    index = read_snapshot(directory)
    mapped = index.vectors.nbytes if isinstance(index.vectors, np.memmap) else 0
    loaded = tracemalloc.get_traced_memory()[0] - before + mapped
    counted_loaded = index.resident_bytes
    kept = search(index, kind)
    gc.collect()
    searched = tracemalloc.get_traced_memory()[0] - before + mapped
    del kept
    return {
        "disk": disk_bytes(directory) / MB,
        "held_loaded": loaded / MB,
        "counted_loaded": counted_loaded / MB,
        "held_searched": searched / MB,
        "counted_searched": index.resident_bytes / MB,
    }


def cost(directory: Path, rounds: int) -> dict[str, float]:
    """Loading the snapshot, then counting it (ms), medians."""
    loads, counts = [], []
    for _ in range(rounds):
        gc.collect()
        started = time.perf_counter()
        index = read_snapshot(directory)
        loaded = time.perf_counter()
        assert index.resident_bytes > 0
        loads.append((loaded - started) * 1000)
        counts.append((time.perf_counter() - loaded) * 1000)
        del index
    return {"load_ms": statistics.median(loads), "count_ms": statistics.median(counts)}


def replica(root: Path, tenants: list[str], budget_mb: int, arm: str) -> dict[str, float]:
    """Resident growth of a process that searches each tenant with a filter."""
    start = resident_mb()
    if arm == "before":
        # The disk rule kept as many as fit the budget by their size on disk.
        keep = max(1, int(budget_mb * MB // disk_bytes(snapshot_dir(root, tenants[0]))))
        store = IndexStore(root, RandomEmbedder())
        tenants = tenants[-min(keep, len(tenants)) :]
    else:
        store = IndexStore(root, RandomEmbedder(), loaded_bytes=budget_mb * MB)
    retriever = HybridRetriever(store)
    only = parse_filters({"k00": "ab"})
    for tenant in tenants:
        retriever.search(tenant, "a question", None, top_k=5, filters=only)
    loaded = sum(1 for entry in store._loaded.values() if entry.index is not None)
    return {"grew": resident_mb() - start, "loaded": loaded, "counted": store.loaded_bytes / MB}


def child(args: argparse.Namespace) -> None:
    what, *rest = args.child.split(":")
    root = Path(args.root)
    if what == "held":
        result = held(rest[0], snapshot_dir(root, f"{rest[0]}0"))
    elif what == "cost":
        result = cost(snapshot_dir(root, f"{rest[0]}0"), args.rounds)
    else:
        tenants = [f"metadata{n}" for n in range(args.tenants)]
        result = replica(root, tenants, args.budget_mb, rest[0])
    print(json.dumps(result))


def run_child(root: Path, what: str, args: argparse.Namespace) -> dict[str, float]:
    command = [sys.executable, "-m", "bench.snapshot_memory", "--child", what]
    command += ["--root", str(root), "--rounds", str(args.rounds), "--tenants", str(args.tenants)]
    command += ["--budget-mb", str(args.budget_mb)]
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    result: dict[str, float] = json.loads(done.stdout.splitlines()[-1])
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tenants", type=int, default=6)
    parser.add_argument("--budget-mb", type=int, default=768)
    parser.add_argument("--kinds", nargs="+", default=list(KINDS))
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--root", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    root = Path(tempfile.mkdtemp(prefix="rag-bench-snapshots-"))
    try:
        for kind in args.kinds:
            build(root, kind, args.tenants if kind == "metadata" else 1)
        print(
            "| tenant | on disk | held, loaded | counted | held, searched | counted | "
            "disk / held | counted / held | load | count |"
        )
        print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
        for kind in args.kinds:
            h = run_child(root, f"held:{kind}", args)
            c = run_child(root, f"cost:{kind}", args)
            print(
                f"| {kind} | {h['disk']:.1f} MB | {h['held_loaded']:.1f} MB | "
                f"{h['counted_loaded']:.1f} MB | {h['held_searched']:.1f} MB | "
                f"{h['counted_searched']:.1f} MB | {h['disk'] / h['held_searched']:.3f} | "
                f"{h['counted_searched'] / h['held_searched']:.2f} | {c['load_ms']:.0f} ms | "
                f"{c['count_ms']:.1f} ms |"
            )
        if "metadata" in args.kinds:
            rows: dict[str, list[dict[str, float]]] = {"before": [], "now": []}
            for _ in range(args.rounds):
                for arm in ("before", "now"):
                    rows[arm].append(run_child(root, f"replica:{arm}", args))
            print(
                f"\n{args.tenants} metadata tenants, searched with a filter, under "
                f"{args.budget_mb} MB:"
            )
            for arm, found in rows.items():
                grew = statistics.median(r["grew"] for r in found)
                print(
                    f"- {arm}: {found[0]['loaded']:.0f} snapshots kept, counted "
                    f"{found[0]['counted']:.0f} MB; resident grew {grew:.0f} MB (median of "
                    f"{len(found)})"
                )
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
