"""Resident memory of one API replica as it serves more and more tenants, with the loaded
snapshots unbounded and under a budget (``RAG_RETRIEVAL__LOADED_INDEXES_MB``).

    .venv/bin/python -m bench.tenant_memory [--tenants 16] [--budgets 0 64] [--rounds 1]

The index directory holds SciFact (5,183 abstracts, one chunk each, random unit vectors: their
values do not change the memory) as ``--tenants`` tenants, one copy each. Per budget (0: no
bound) one ``rag serve`` (its own Redis) answers 3 ``/v1/retrieve`` calls for each tenant in
turn, and VmRSS is read after each tenant. Then the first tenant is searched again: under a
budget its snapshot was let go, so this search loads it from disk (the budget's price, printed
as that call's time against a search of a loaded tenant). The rows are medians over rounds.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from bench.replica_memory import RandomEmbedder, SlowService, rss_mb
from bench.retrieval_data import build_scifact_index, load_qrels, load_queries
from tests.support.servers import RedisServer


def snapshot_mb(tenant_dir: Path) -> float:
    version = (tenant_dir / "CURRENT").read_text().strip()
    return sum(path.stat().st_size for path in (tenant_dir / version).iterdir()) / 2**20


def measure(
    budget_mb: int, tenants: list[str], redis: RedisServer, workdir: Path
) -> tuple[list[float], float, float]:
    """RSS in MB at start and after each tenant; the first tenant's search again (ms), and a
    loaded tenant's (ms)."""
    queries = [load_queries()[q] for q in sorted(load_qrels("test"), key=int)[:3]]
    env = {"RAG_RETRIEVAL__LOADED_INDEXES_MB": str(budget_mb)}
    with SlowService(redis.url, "http://127.0.0.1:9", workdir, **env) as service:
        assert service.process is not None
        pid = service.process.pid
        keys = {t: service.key(t, scopes="retrieve") for t in tenants}
        with httpx.Client(base_url=service.url, timeout=300) as client:

            def retrieve(tenant: str, query: str) -> float:
                started = time.perf_counter()
                answer = client.post(
                    "/v1/retrieve",
                    json={"query": query},
                    headers={"Authorization": f"Bearer {keys[tenant]}"},
                )
                assert answer.status_code == 200, answer.text
                return (time.perf_counter() - started) * 1000

            retrieve(tenants[0], queries[0])  # the query embedder warm, before the first RSS
            time.sleep(1)
            rss = [rss_mb(pid)]
            for tenant in tenants:
                for query in queries:
                    retrieve(tenant, query)
                rss.append(rss_mb(pid))
            again = retrieve(tenants[0], "a question not asked before about the first tenant")
            loaded = retrieve(tenants[-1], "a question not asked before about the last tenant")
    return rss, again, loaded


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tenants", type=int, default=16)
    parser.add_argument("--budgets", type=int, nargs="+", default=[0, 64])
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="rag-bench-tenants-"))
    try:
        build_scifact_index(root / "indexes", RandomEmbedder())
        tenants = [f"t{n:02d}" for n in range(args.tenants)]
        for tenant in tenants:
            shutil.copytree(root / "indexes" / "scifact", root / "indexes" / tenant)
        print(f"SciFact's snapshot on disk: {snapshot_mb(root / 'indexes' / 'scifact'):.1f} MB")
        redis = RedisServer()
        redis.start()
        runs: dict[int, list[tuple[list[float], float, float]]] = {b: [] for b in args.budgets}
        try:
            for r in range(args.rounds):
                for budget in args.budgets:
                    workdir = root / f"run-{budget}-{r}"
                    workdir.mkdir()
                    (workdir / "indexes").symlink_to(root / "indexes")
                    runs[budget].append(measure(budget, tenants, redis, workdir))
                    print(f"budget {budget} MB, round {r}: RSS {runs[budget][-1][0]}", flush=True)
        finally:
            redis.stop()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    marks = sorted({1, 4, args.tenants // 2, args.tenants} - {0})
    head = " | ".join(f"after {m} tenants (MB)" for m in marks)
    print(f"| budget | RSS at start (MB) | {head} | first tenant again (ms) | a loaded one (ms) |")
    print("| --- " * (4 + len(marks)) + "|")
    for budget, results in runs.items():
        rss = [statistics.median(run[0][i] for run in results) for i in [0, *marks]]
        again = statistics.median(run[1] for run in results)
        loaded = statistics.median(run[2] for run in results)
        cells = " | ".join(f"{mb:.0f}" for mb in rss)
        label = "none" if budget == 0 else f"{budget} MB"
        print(f"| {label} | {cells} | {again:.0f} | {loaded:.0f} |")


if __name__ == "__main__":
    main()
