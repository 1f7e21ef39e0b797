"""Deleting many documents: one request for all of them (``POST /v1/documents/delete``)
against one request each (``DELETE /v1/documents/{id}``), side by side in one run.

    python -m bench.delete_batch [--deletes 10 100] [--other-keys 200000] [--rounds 3]
                                 [--out bench/results/delete_batch.json]

SciFact (5,183 documents, vectors from a random embedder: a delete never embeds) is indexed
once in a real ``IndexStore``; each arm works on a fresh copy of its directory, so both start
from the same index. A private redis-server holds ``--other-keys`` cached answers of other
tenants (an erasure walked past them before it read the tenant's own entries). What a delete
route does, without HTTP:

- ``one each``: for each id, ``IndexStore.delete`` of that id (a version written and
  published) and ``ResponseCache.erase`` (the tenant's cached answers);
- ``one for all``: one ``IndexStore.delete`` of every id and one erasure.

Per arm: wall time and versions published; medians over the rounds, the order alternating, and
the ratio of the two.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.cache_erase import filled_cache, run_and_save
from bench.replica_memory import RandomEmbedder
from bench.retrieval_data import load_corpus
from pipeline.stages.cache import ResponseCache
from retrieval.store import IndexStore

PRISTINE = "pristine"


async def one_arm(
    store: IndexStore, cache: ResponseCache, tenant: str, ids: list[str], batched: bool
) -> tuple[float, int]:
    """Seconds taken and versions published."""
    before = int(store.version(tenant)[:8])
    started = time.perf_counter()
    for part in [ids] if batched else [[i] for i in ids]:
        result = await asyncio.to_thread(store.delete, tenant, part)
        assert result.documents == len(part)
        await cache.erase(tenant, result.version)
    seconds = time.perf_counter() - started
    index = store.current(tenant)
    assert index is not None and not set(ids) & set(index.rows_by_document)
    return seconds, int(store.version(tenant)[:8]) - before


async def run(args: argparse.Namespace) -> dict[str, Any]:
    async with filled_cache(args.other_keys) as cache:
        with tempfile.TemporaryDirectory() as tmp:
            root = Path(tmp)
            store = IndexStore(root, RandomEmbedder())
            corpus = load_corpus()
            store.upsert(PRISTINE, corpus)
            every = [d.id for d in corpus]
            rows = []
            for count in args.deletes:
                times: dict[str, list[float]] = {"one each": [], "one for all": []}
                versions: dict[str, int] = {}
                for r in range(args.rounds):
                    ids = random.Random(r).sample(every, count)
                    order = ["one each", "one for all"]
                    for arm in order if r % 2 == 0 else order[::-1]:
                        tenant = f"t{count}-{r}-{arm.replace(' ', '')}"
                        shutil.copytree(root / PRISTINE, root / tenant)
                        seconds, published = await one_arm(
                            store, cache, tenant, ids, arm == "one for all"
                        )
                        times[arm].append(seconds * 1000)
                        versions[arm] = published
                        shutil.rmtree(root / tenant)
                medians = {arm: statistics.median(v) for arm, v in times.items()}
                rows.append(
                    {
                        "deletes": count,
                        "ms": {arm: round(m, 1) for arm, m in medians.items()},
                        "versions": versions,
                        "one_each_over_one_for_all": round(
                            medians["one each"] / medians["one for all"], 1
                        ),
                        "rounds_ms": {a: [round(v, 1) for v in t] for a, t in times.items()},
                    }
                )
        return {"documents": len(every), "other_keys": args.other_keys, "rows": rows}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--deletes", type=int, nargs="+", default=[10, 100])
    parser.add_argument("--other-keys", type=int, default=200_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("bench/results/delete_batch.json"))
    results = run_and_save(run, parser.parse_args(argv))
    print(f"{'deletes':>8} {'one each ms':>12} {'one for all ms':>15} {'ratio':>7} versions")
    for row in results["rows"]:
        ms = row["ms"]
        print(
            f"{row['deletes']:>8} {ms['one each']:>12.1f} {ms['one for all']:>15.1f} "
            f"{row['one_each_over_one_for_all']:>7.1f} {row['versions']}"
        )
    return results


if __name__ == "__main__":
    main()
