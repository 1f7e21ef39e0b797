"""The service under load: 32, 128 and 512 connections, then ingestion beside search.

    python -m bench.load_bench [--levels 32 128 512] [--duration 20] [--client-procs 2]
                               [--llm-url http://127.0.0.1:8001] [--ingest-rounds 2]

The service runs as its own process (`rag serve`, default settings: retrieval, guards, routing,
metrics, rate limits checked) against a private redis-server and the real vLLM (``--llm-url``,
else ``RAG_TEST_VLLM_URL``, else port 8001). The client is ``bench.loadclient``: hand-built
HTTP/1.1 over keep-alive connections in ``--client-procs`` uvloop processes, whose CPU time is
printed beside the server's.

1. Load, for ``--duration`` seconds at each level: every connection sends its next request as
   soon as it has the whole answer. The mix: mostly cache hits of a few questions answered
   before the run (the real vLLM answered them), with misses (new questions, a few tokens each,
   a bounded number in flight: the CPU vLLM serves a few tokens a second per stream), half of
   each streamed. Per level: requests, req/s, p50/p99 latency, time to first token of streams,
   answers shed by design (429/503 with Retry-After) apart from unexpected errors, the event
   loop's worst lag (``rag_event_loop_lag_max_seconds``, polled), and the app's RSS and open
   file descriptors before, right after, and once settled, the sockets among them split by
   peer (load clients, Redis, vLLM): the Redis pool keeps its connections open (up to 256),
   nothing else may stay.
2. Ingestion beside search: tenant ``reader`` (200 SciFact abstracts) is searched over
   ``/v1/retrieve`` by 4 connections, alone and while tenant ``writer`` ingests batches of 8
   new abstracts without pause (``POST /v1/documents``), alternating, ``--ingest-rounds`` times;
   the ratio of the p99s is the figure (target 1.5x). With ``--torch-threads`` the phase runs
   again on a service with other torch thread counts (0: torch's default, one per core).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import statistics
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import orjson

from bench.loadclient import (
    LoadResult,
    LoadSpec,
    Mix,
    Workload,
    chat_body,
    chat_workload,
    percentile,
    ready,
    run_load,
)
from tests.support.process import ServiceProcess
from tests.support.servers import RedisServer

HIT_QUESTIONS = [
    f"In one short sentence, what is the capital of {country}?"
    for country in ("France", "Spain", "Italy", "Peru", "Japan", "Kenya", "Chile", "Egypt")
]


@dataclass(frozen=True)
class Census:
    """The app process's resident memory and open file descriptors, sockets split by peer."""

    rss_mb: float
    fds: int
    clients: int  # accepted connections of load clients
    redis: int
    upstream: int  # to vLLM

    @property
    def other(self) -> int:
        return self.fds - self.clients - self.redis - self.upstream

    def cell(self) -> str:
        return (
            f"{self.rss_mb:.0f} MB, {self.fds} fds ({self.clients} clients, {self.redis} redis, "
            f"{self.upstream} vllm, {self.other} other)"
        )


def _tcp_ports() -> dict[str, tuple[int, int]]:
    """Socket inode -> (local port, remote port), for the TCP sockets of this machine."""
    ports = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            next(f)
            for line in f:
                fields = line.split()
                local, remote, inode = fields[1], fields[2], fields[9]
                ports[inode] = (int(local.rsplit(":", 1)[1], 16), int(remote.rsplit(":", 1)[1], 16))
    return ports


def census(pid: int, app_port: int, redis_port: int, llm_port: int) -> Census:
    status = Path(f"/proc/{pid}/status").read_text()
    rss_kb = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS"))
    ports = _tcp_ports()
    fds = clients = redis = upstream = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except FileNotFoundError:
            continue  # closed while we looked
        fds += 1
        if not target.startswith("socket:["):
            continue
        local, remote = ports.get(target[8:-1], (0, 0))
        if local == app_port and remote != 0:
            clients += 1
        elif remote == redis_port:
            redis += 1
        elif remote == llm_port:
            upstream += 1
    return Census(rss_kb / 1024, fds, clients, redis, upstream)


class App:
    """The service process and the ports that tell its sockets apart."""

    def __init__(self, service: ServiceProcess, redis: RedisServer, llm_url: str) -> None:
        self.service = service
        self.ports = (service.port, redis.port, urlsplit(llm_url).port or 80)

    def census(self) -> Census:
        assert self.service.process is not None
        return census(self.service.process.pid, *self.ports)

    async def settle(self, baseline: Census, within_s: float = 15.0) -> Census:
        """The census once no client connection is left and the other fds are back to
        ``baseline``'s, or as it is after ``within_s``."""
        deadline = time.monotonic() + within_s
        while True:
            now = self.census()
            if (now.clients == 0 and now.other <= baseline.other) or time.monotonic() > deadline:
                return now
            await asyncio.sleep(0.5)


async def lag_max_ms(client: httpx.AsyncClient, url: str) -> float:
    text = (await client.get(f"{url}/metrics", timeout=10)).text
    for line in text.splitlines():
        if line.startswith("rag_event_loop_lag_max_seconds "):
            return float(line.rsplit(" ", 1)[1]) * 1000
    raise RuntimeError("rag_event_loop_lag_max_seconds not in /metrics")


async def run_clients(
    pool: ProcessPoolExecutor,
    url: str,
    parts: list[tuple[Workload, int]],
    duration: float,
    seed: int,
) -> tuple[LoadResult, float]:
    """Each (workload, connections) in its own client process, all starting together; the
    merged result and the worst loop lag seen while they ran (ms)."""
    loop = asyncio.get_running_loop()
    start_at = time.monotonic() + 1.0
    futures = [
        loop.run_in_executor(
            pool,
            run_load,
            LoadSpec(url, workload, n, start_at, duration, seed=seed * 100 + i),
        )
        for i, (workload, n) in enumerate(parts)
    ]
    worst = 0.0
    async with httpx.AsyncClient() as client:
        await lag_max_ms(client, url)
        while not all(f.done() for f in futures):
            await asyncio.wait(futures, timeout=1.5)  # the gauge's window is 2 s
            worst = max(worst, await lag_max_ms(client, url))
    merged = LoadResult()
    for future in futures:
        merged.merge(await future)
    return merged, worst


def split(workload: Workload, connections: int, procs: int) -> list[tuple[Workload, int]]:
    per = math.ceil(connections / procs)
    counts = [min(per, connections - i * per) for i in range(procs) if connections > i * per]
    return [(workload, n) for n in counts]


def ms(value: float) -> str:
    return "-" if math.isnan(value) else f"{value * 1000:.1f}"


def print_level(
    connections: int,
    result: LoadResult,
    lag_ms: float,
    server_cpu: float,
    cells: tuple[Census, Census, Census],
) -> None:
    oks = [x for t in result.kinds.values() for x in t.latencies]
    ttfts = [x for t in result.kinds.values() for x in t.ttfts]
    before, after, settled = cells
    print(
        f"| {connections} | {result.answered} | {len(oks) / result.wall_s:.0f} | "
        f"{ms(percentile(oks, 0.5))} / {ms(percentile(oks, 0.99))} | "
        f"{ms(percentile(ttfts, 0.5))} / {ms(percentile(ttfts, 0.99))} | {result.shed} | "
        f"{result.unexpected} | {lag_ms:.0f} | {server_cpu:.1f} / {result.client_cpu_s:.1f} | "
        f"{before.rss_mb:.0f} / {after.rss_mb:.0f} / {settled.rss_mb:.0f} | "
        f"{before.fds} / {after.fds} / {settled.fds} (clients {settled.clients}, "
        f"redis {settled.redis}, vllm {settled.upstream}, other {before.other}->{settled.other}) |"
    )


def print_kinds(connections: int, result: LoadResult) -> None:
    for kind, t in sorted(result.kinds.items()):
        cache = ", ".join(f"{k} {v}" for k, v in sorted(t.cache.items()))
        shed = ", ".join(f"{k}: {v}" for k, v in sorted(t.shed.items())) or "0"
        wrong = ", ".join(f"{k}: {v}" for k, v in t.unexpected.items()) or "0"
        print(
            f"| {connections} | {kind} | {len(t.latencies)} | {ms(percentile(t.latencies, 0.5))}"
            f" | {ms(percentile(t.latencies, 0.99))} | {ms(percentile(t.ttfts, 0.5))} | "
            f"{ms(percentile(t.ttfts, 0.99))} | {cache} | {shed} | {wrong} |"
        )
        for example in t.examples:
            print(f"|  | unexpected: {example!r} | | | | | | | | |")


async def warm_hits(url: str, key: str, questions: list[str]) -> None:
    """Answer each question once (the real vLLM), then check both shapes are cache hits."""
    headers = {"Authorization": f"Bearer {key}"}
    async with httpx.AsyncClient(timeout=120) as client:
        for question in questions:
            for stream in (False, False, True):
                body = chat_body(question, stream=stream)
                answer = await client.post(f"{url}/v1/chat/completions", json=body, headers=headers)
                assert answer.status_code == 200, answer.text[:300]
            assert answer.headers.get("x-cache") == "hit", f"{question}: not cached"


async def load_phase(app: App, args: argparse.Namespace, pool: ProcessPoolExecutor) -> None:
    service = app.service
    key = service.key("load", "bench", "chat")
    await warm_hits(service.url, key, HIT_QUESTIONS)
    mix = Mix(args.miss_share, args.stream_share, args.miss_slots, args.miss_max_tokens)
    workload = chat_workload(key, HIT_QUESTIONS, mix)
    print(
        f"\n## Load: {args.duration:g} s per level, {args.client_procs} client processes; mix: "
        f"{len(HIT_QUESTIONS)} cached questions, {mix.describe()}\n"
    )
    print(
        "| connections | answers | ok req/s | p50 / p99 ms | TTFT p50 / p99 ms (streams) | "
        "shed (429/503) | unexpected | worst loop lag ms | CPU s server / clients | "
        "RSS MB before / after / settled | fds before / after / settled |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    baseline = await app.settle(app.census())
    details = []
    for level in args.levels:
        before = baseline
        cpu = service.cpu_seconds()
        parts = split(workload, level, args.client_procs)
        result, lag = await run_clients(pool, service.url, parts, args.duration, level)
        server_cpu = service.cpu_seconds() - cpu
        after = app.census()
        settled = await app.settle(baseline, args.settle)
        print_level(level, result, lag, server_cpu, (before, after, settled))
        details.append((level, result))
        baseline = settled
    print(
        "\n| connections | kind | ok | p50 ms | p99 ms | TTFT p50 ms | TTFT p99 ms | x-cache | "
        "shed | unexpected |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for level, result in details:
        print_kinds(level, result)
        unanswered = result.sent - result.answered
        print(
            f"|  | {level}: {result.connections_answered}/{result.connections} connections "
            f"answered, {result.sent} sent, {unanswered} unanswered, "
            f"{result.reconnects} reconnects | | | | | | | | |"
        )


def ingest_bodies(docs: list[dict[str, str]], batches: int, size: int) -> list[bytes]:
    """Bodies of ``size`` documents each whose texts differ from the last time their ids were
    sent (ids cycle over 64): every batch is embedded, the writer's index stays small."""
    bodies = []
    for b in range(batches):
        batch = [
            {**docs[(b * size + i) % len(docs)], "id": f"w-{(b * size + i) % 64}"}
            for i in range(size)
        ]
        bodies.append(orjson.dumps({"documents": batch}))
    return bodies


async def ingest_phase(app: App, args: argparse.Namespace, pool: ProcessPoolExecutor) -> None:
    from bench.retrieval_data import load_corpus, load_queries

    service = app.service
    reader = service.key("reader", "bench", "retrieve,ingest")
    writer = service.key("writer", "bench", "ingest")
    corpus = [{"id": d.id, "title": d.title, "text": d.text} for d in load_corpus()]
    async with httpx.AsyncClient(timeout=600) as client:
        for start in range(0, 200, 50):
            answer = await client.post(
                f"{service.url}/v1/documents",
                json={"documents": corpus[start : start + 50]},
                headers={"Authorization": f"Bearer {reader}"},
            )
            assert answer.status_code == 200, answer.text[:300]
    queries = [orjson.dumps({"query": q, "top_k": 5}) for q in list(load_queries().values())[:300]]
    search = Workload("/v1/retrieve", reader, kind="retrieve", bodies=tuple(queries))
    ingest = Workload(
        "/v1/documents",
        writer,
        kind="ingest",
        bodies=tuple(ingest_bodies(corpus[1000:], 40, args.ingest_batch)),
    )
    rows = []
    for round_ in range(args.ingest_rounds):
        alone, lag_alone = await run_clients(
            pool, service.url, [(search, 4)], args.ingest_duration, 1000 + round_
        )
        during, lag_during = await run_clients(
            pool, service.url, [(search, 4), (ingest, 2)], args.ingest_duration, 2000 + round_
        )
        rows.append((alone, lag_alone, during, lag_during))
    p99_alone = statistics.median(percentile(r[0].kinds["retrieve"].latencies, 0.99) for r in rows)
    p99_during = statistics.median(percentile(r[2].kinds["retrieve"].latencies, 0.99) for r in rows)
    print("| round | phase | retrieves | p50 ms | p99 ms | ingests (docs) | unexpected | lag ms |")
    print("|---|---|---|---|---|---|---|---|")
    for number, (alone, lag_alone, during, lag_during) in enumerate(rows, 1):
        for name, result, lag in (("alone", alone, lag_alone), ("ingesting", during, lag_during)):
            s = result.kinds["retrieve"].latencies
            ingested = len(result.kinds["ingest"].latencies) if "ingest" in result.kinds else 0
            print(
                f"| {number} | {name} | {len(s)} | {ms(percentile(s, 0.5))} | "
                f"{ms(percentile(s, 0.99))} | {ingested} ({ingested * args.ingest_batch}) | "
                f"{result.unexpected} | {lag:.0f} |"
            )
    print(
        f"\nretrieve p99 of tenant reader: alone {ms(p99_alone)} ms, while writer ingests "
        f"{ms(p99_during)} ms: **{p99_during / p99_alone:.2f}x** (target <= 1.5x; median of "
        f"{len(rows)} rounds)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--levels", type=int, nargs="+", default=[32, 128, 512])
    parser.add_argument("--duration", type=float, default=20.0)
    parser.add_argument("--settle", type=float, default=15.0)
    parser.add_argument("--client-procs", type=int, default=2)
    parser.add_argument("--miss-share", type=float, default=0.05)
    parser.add_argument("--stream-share", type=float, default=0.5)
    parser.add_argument("--miss-slots", type=int, default=2, help="per client process")
    parser.add_argument("--miss-max-tokens", type=int, default=8)
    parser.add_argument("--ingest-rounds", type=int, default=2)
    parser.add_argument("--ingest-duration", type=float, default=10.0)
    parser.add_argument("--ingest-batch", type=int, default=8)
    parser.add_argument(
        "--torch-threads",
        type=int,
        nargs="*",
        default=[0],
        help="also run the ingest phase with these torch thread counts (0: torch's default)",
    )
    parser.add_argument("--skip", choices=["load", "ingest"], action="append", default=[])
    parser.add_argument(
        "--llm-url", default=os.environ.get("RAG_TEST_VLLM_URL", "http://127.0.0.1:8001")
    )
    args = parser.parse_args()
    asyncio.run(bench(args))


async def bench(args: argparse.Namespace) -> None:
    try:
        async with httpx.AsyncClient() as client:
            (await client.get(f"{args.llm_url}/health", timeout=5)).raise_for_status()
    except httpx.HTTPError as exc:
        raise SystemExit(f"no vLLM at {args.llm_url} ({exc}): `make run` or --llm-url") from None
    redis = RedisServer()
    redis.start()
    workdir = Path(tempfile.mkdtemp(prefix="rag-bench-load-"))
    print(
        f"# load benchmark, {os.cpu_count()} cores, {time.strftime('%Y-%m-%d %H:%M')}, "
        f"load average before {os.getloadavg()[0]:.1f}; vLLM {args.llm_url}; logs in {workdir}"
    )
    procs = max(args.client_procs, 2)
    pool = ProcessPoolExecutor(procs, mp_context=get_context("spawn"))
    try:
        # Every client process started and its modules imported before any level's clock runs.
        assert len(set(pool.map(ready, [1.0] * procs))) == procs
        variants = [None, *args.torch_threads] if "ingest" not in args.skip else [None]
        for threads in variants:
            env = {"RAG_LOG__REQUESTS": "true"}  # the default, which ServiceProcess turns off
            if threads is not None:
                env["RAG_RETRIEVAL__QUERY_TORCH_THREADS"] = str(threads)
                env["RAG_RETRIEVAL__INGEST_TORCH_THREADS"] = str(threads)
            (workdir / str(threads)).mkdir()
            with ServiceProcess(redis.url, args.llm_url, workdir / str(threads), **env) as service:
                app = App(service, redis, args.llm_url)
                if threads is None and "load" not in args.skip:
                    await load_phase(app, args, pool)
                if "ingest" not in args.skip:
                    setting = "settings' defaults" if threads is None else f"{threads}"
                    print(f"\n## Ingestion beside search (torch threads: {setting})\n")
                    await ingest_phase(app, args, pool)
    finally:
        pool.shutdown()
        redis.stop()


if __name__ == "__main__":
    main()
