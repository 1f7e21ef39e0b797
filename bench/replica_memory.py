"""Resident memory of one API replica per embedding backend: at start, with the SciFact tenant
loaded, and after a small tenant's ingest.

    .venv/bin/python -m bench.replica_memory [--backend torch onnx-int8] [--rounds 1]
        [--llm-url http://127.0.0.1:8001]

Each backend runs `rag serve` (tests.support.process.ServiceProcess, its own Redis) over the same
index directory, which holds SciFact (5,183 abstracts, one chunk each) as tenant ``scifact``,
built once with random unit vectors (their values do not change the memory, and no model has to
embed the corpus for it). VmRSS of the server process is read from /proc after:

1. start: /readyz answered (the query embedder loaded and warmed by the lifespan);
2. SciFact loaded: 30 /v1/retrieve calls for tenant scifact (its snapshot loaded, queries
   embedded);
3. small ingest: 20 SciFact abstracts ingested as tenant ``small`` through /v1/documents (the
   ingest embedder loaded and used), then 10 retrieve calls on it.

Also printed: whether the server imported torch (from /proc/PID/maps: libtorch mapped).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

from bench.retrieval_data import build_scifact_index, load_corpus, load_qrels, load_queries
from retrieval.embeddings import BACKENDS, Backend, Embedder, FloatArray
from tests.support.process import ServiceProcess
from tests.support.servers import RedisServer, wait_for


class RandomEmbedder(Embedder):
    """Seeded random unit vectors: an index of the right size without a model."""

    def __init__(self) -> None:
        super().__init__()
        self._random = np.random.default_rng(18)

    def embed(self, texts: list[str]) -> FloatArray:
        vectors = self._random.standard_normal((len(texts), self.dimension)).astype(np.float32)
        return vectors / np.linalg.norm(vectors, axis=1, keepdims=True)


class SlowService(ServiceProcess):
    """ServiceProcess that waits up to 15 minutes for the start (a loaded machine loading torch
    takes longer than the tests' 3)."""

    def __enter__(self) -> SlowService:
        try:
            super().__enter__()
        except TimeoutError:
            try:
                wait_for(self._ready, 720, "the service process", step=0.5)
            except BaseException:
                self.__exit__(None, None, None)
                raise
        return self


def rss_mb(pid: int) -> float:
    status = Path(f"/proc/{pid}/status").read_text()
    kb = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS"))
    return kb / 1024


def torch_mapped(pid: int) -> bool:
    return "libtorch" in Path(f"/proc/{pid}/maps").read_text()


def measure(backend: Backend, redis: RedisServer, llm_url: str, workdir: Path) -> list[float]:
    """[start, SciFact loaded, small ingest] RSS in MB, and 1.0 if torch was mapped."""
    queries = [load_queries()[q] for q in sorted(load_qrels("test"), key=int)[:40]]
    small = load_corpus()[:20]
    env = {"RAG_RETRIEVAL__EMBEDDINGS": backend}
    with SlowService(redis.url, llm_url, workdir, **env) as service:
        assert service.process is not None
        pid = service.process.pid
        key = service.key("scifact", scopes="retrieve")
        small_key = service.key("small", scopes="retrieve,ingest")
        with httpx.Client(base_url=service.url, timeout=300) as client:
            assert client.get("/readyz").status_code == 200
            time.sleep(1)
            start = rss_mb(pid)
            auth = {"Authorization": f"Bearer {key}"}
            for query in queries[:30]:
                answer = client.post("/v1/retrieve", json={"query": query}, headers=auth)
                assert answer.status_code == 200, answer.text
            time.sleep(1)
            loaded = rss_mb(pid)
            auth = {"Authorization": f"Bearer {small_key}"}
            body = {"documents": [{"id": d.id, "text": d.text, "title": d.title} for d in small]}
            done = client.post("/v1/documents", json=body, headers=auth)
            assert done.status_code == 200, done.text
            for query in queries[30:40]:
                answer = client.post("/v1/retrieve", json={"query": query}, headers=auth)
                assert answer.status_code == 200, answer.text
            time.sleep(1)
            ingested = rss_mb(pid)
            torch = torch_mapped(pid)
    print(
        f"{backend}: start {start:.0f} MB, SciFact loaded {loaded:.0f} MB, after a small ingest "
        f"{ingested:.0f} MB; torch mapped: {torch}",
        flush=True,
    )
    return [start, loaded, ingested, float(torch)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", nargs="+", choices=BACKENDS, default=["torch", "onnx-int8"])
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument(
        "--llm-url", default=os.environ.get("RAG_TEST_VLLM_URL", "http://127.0.0.1:8001")
    )
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="rag-bench-memory-"))
    build_scifact_index(root / "indexes", RandomEmbedder())
    redis = RedisServer()
    redis.start()
    results: dict[Backend, list[list[float]]] = {b: [] for b in args.backend}
    try:
        for r in range(args.rounds):
            for backend in args.backend:
                workdir = root / f"{backend}-{r}"
                # A copy each: the small tenant's ingest must embed in every run.
                shutil.copytree(root / "indexes", workdir / "indexes", symlinks=True)
                results[backend].append(measure(backend, redis, args.llm_url, workdir))
    finally:
        redis.stop()
    first = args.backend[0]
    base = [statistics.median(run[i] for run in results[first]) for i in range(3)]
    print(
        "| backend | RSS at start (MB) | SciFact loaded (MB) | after a small ingest (MB) "
        f"| each / {first}'s | torch imported |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    for backend in args.backend:
        mb = [statistics.median(run[i] for run in results[backend]) for i in range(3)]
        ratios = " / ".join(f"{m / b:.2f}" for m, b in zip(mb, base, strict=True))
        torch = "yes" if results[backend][0][3] else "no"
        print(f"| {backend} | {mb[0]:.0f} | {mb[1]:.0f} | {mb[2]:.0f} | {ratios} | {torch} |")


if __name__ == "__main__":
    main()
