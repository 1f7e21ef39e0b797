"""A query's embedding time alone and while an ingest embeds, by torch threads per embedding thread.

    python -m bench.embed_threads_bench [--queries 60] [--threads 1 2]

Two model instances, as in the service (queries and ingestion each have their own), each in its
own thread (``retrieval.embeddings.embedding_executor``) with the given torch thread counts:
the query thread embeds one short SciFact claim at a time (10 ms apart), first alone, then while
the ingest thread embeds batches of 64 abstracts without pause. p50 and p95 in ms.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from bench.retrieval_data import load_corpus, load_queries
from retrieval.embeddings import Embedder, embedding_executor


def measure(queries: ThreadPoolExecutor, model: Embedder, claims: list[str]) -> tuple[float, float]:
    """p50 and p95 (ms) of one claim's embedding at a time, 10 ms apart."""
    times = []
    for claim in claims:
        started = time.perf_counter()
        queries.submit(model.embed, [claim]).result()
        times.append((time.perf_counter() - started) * 1000)
        time.sleep(0.01)
    times.sort()
    return statistics.median(times), times[int(len(times) * 0.95)]


def ingest(model: Embedder, passages: list[str], stop: threading.Event) -> None:
    for start in itertools.cycle(range(0, len(passages), 64)):
        if stop.is_set():
            return
        model.embed(passages[start : start + 64])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--queries", type=int, default=60)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    args = parser.parse_args()
    passages = [d.text for d in load_corpus()[:640]]
    claims = list(load_queries().values())[: args.queries]
    query_model, ingest_model = Embedder(), Embedder()
    query_model.warm_up()
    ingest_model.warm_up()
    print("| torch threads (query / ingest) | alone p50 / p95 ms | ingesting p50 / p95 ms |")
    print("|---|---|---|")
    for q_threads, i_threads in itertools.product(args.threads, repeat=2):
        queries = embedding_executor(1, q_threads, "query")
        ingests = embedding_executor(1, i_threads, "ingest")
        queries.submit(query_model.embed, ["warm up"]).result()
        ingests.submit(ingest_model.embed, ["warm up"]).result()
        alone = measure(queries, query_model, claims)
        stop = threading.Event()
        running = ingests.submit(ingest, ingest_model, passages, stop)
        time.sleep(0.5)
        during = measure(queries, query_model, claims)
        stop.set()
        running.result()
        queries.shutdown()
        ingests.shutdown()
        print(
            f"| {q_threads} / {i_threads} | {alone[0]:.1f} / {alone[1]:.1f} | "
            f"{during[0]:.1f} / {during[1]:.1f} |"
        )


if __name__ == "__main__":
    main()
