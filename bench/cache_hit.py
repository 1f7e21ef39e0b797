"""Cache-hit latency through the service, beside a floor measured in the same run.

    python -m bench.cache_hit [--requests 2000] [--concurrency 1 32] [--variants ...] [--cluster]

Every server runs as its own uvicorn process on loopback, against a private redis-server: the
floor (a bare FastAPI route doing one Redis GET, ``bench/floor_app.py``) and the service
answering from the cache, in variants (``--variants``; see ``SERVICE_VARIANTS``) so that before
and after are measured in one run:

- the fast path (``app.http.fastpath``, the default) and the full path
  (``RAG_CACHE__FAST_PATH=false``: routing, the body's validation, auth, validate, guard_in and
  the cache lookup), each with observability
- all off: no metrics, no request log, no exporter, ``OTEL_TRACES_SAMPLER=always_off``;
- on, not sampled: metrics, the JSON request log (to a file), an OTLP/gRPC exporter configured
  and ``OTEL_TRACES_SAMPLER=always_off`` (the cost for requests that are not sampled);
- and, by name, on, sampled + exported (every trace exported in batches over gRPC to a receiver
  process, ``tests/support/otlp.py``, that counts what it gets) and the full path with spans
  recorded and no exporter (the service as it was before it had metrics and logs).

The same client measures each, interleaved by round, and prints p50/p99 latency, requests/s and
the CPU time each server process spent per request (from ``/proc``: on shared, loaded cores the
steadiest of the figures), their ratios to the floor, and the difference of each variant to
the full path with everything off. The client is `bench.rawclient` (pre-encoded requests over
keep-alive sockets), so it costs less than the servers; ``--client httpx`` measures with httpx
instead, to see what a heavier client hides. ``--before DIR`` serves each variant from another
checkout too (a ``git worktree`` of the code before a change), in the same rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import httpx
import orjson
import redis.asyncio as aioredis
from opentelemetry import trace

from app.http.schemas import ChatCompletionRequest
from app.path import build_paths
from app.services import Services
from app.settings import Settings
from bench.rawclient import measure_raw, summarise
from pipeline.answer.completion import Completion
from pipeline.context import RequestContext
from pipeline.runner import Concurrent
from pipeline.stages.cache import CacheLookup
from tests.support.process import process_cpu_seconds
from tests.support.servers import RedisClusterServers, RedisServer, free_port, wait_for

ROOT = Path(__file__).resolve().parents[1]
JSON = {"content-type": "application/json"}
BODY = {
    "model": "smollm2",
    "messages": [{"role": "user", "content": "What is the capital of France?"}],
    "max_tokens": 16,
    "temperature": 0,
    "rag": {"enabled": False},
}


def serve_module(
    args: list[str], env: dict[str, str], log: Path, cwd: Path = ROOT
) -> subprocess.Popen[bytes]:
    """``python -m ARGS`` in the repository (or the checkout ``cwd``), its output in ``log``."""
    with log.open("wb") as out:  # the child keeps its own handle
        return subprocess.Popen(
            [sys.executable, "-m", *args],
            cwd=cwd,
            env={**os.environ, **env},
            stdout=out,
            stderr=subprocess.STDOUT,
        )


def serve(
    target: str, port: int, env: dict[str, str], log: Path, cwd: Path = ROOT
) -> subprocess.Popen[bytes]:
    factory = ["--factory"] if target.endswith("create_app") else []
    args = ["uvicorn", target, "--port", str(port), "--log-level", "warning", "--no-access-log"]
    return serve_module([*args, *factory], env, log, cwd)


def up(url: str) -> bool:
    try:
        return httpx.get(url, timeout=0.5).status_code < 500
    except httpx.HTTPError:
        return False


def service_settings(redis_url: str, prefix: str, cluster: bool = False) -> Settings:
    """The settings every service variant runs with (as environment variables in ``env``)."""
    return Settings(
        redis={"url": redis_url, "key_prefix": prefix, "cluster": cluster},
        llm={"base_url": "http://127.0.0.1:9"},
        retrieval={"enabled": False},
    )


def settings_env(settings: Settings) -> dict[str, str]:
    return {
        "RAG_REDIS__URL": settings.redis.url,
        "RAG_REDIS__KEY_PREFIX": settings.redis.key_prefix,
        "RAG_REDIS__CLUSTER": str(settings.redis.cluster).lower(),
        "RAG_LLM__BASE_URL": settings.llm.base_url,
        "RAG_RETRIEVAL__ENABLED": "false",
    }


async def prefill(settings: Settings) -> str:
    """Create a key and store the answer the benchmark request will hit, under the key the
    service computes: the path's own stages run up to and including the cache lookup (its
    versions, personalisation and what earlier stages add to the key)."""
    services = Services.build(settings, trace.NoOpTracer())
    raw: str = await services.keys.create("bench", "bench")
    params = ChatCompletionRequest.model_validate(BODY).to_params(
        settings.retrieval.top_k, settings.llm.default_max_tokens
    )
    ctx = RequestContext(
        params=params, credential=raw, deadline=asyncio.get_running_loop().time() + 30
    )
    lookup = None
    for step in build_paths(settings, services).chat.steps:
        assert not isinstance(step, Concurrent), "no concurrent group before the cache lookup"
        await step(ctx)
        if isinstance(step, CacheLookup):
            lookup = step
            break
    assert lookup is not None and ctx.cache_key is not None and ctx.cache_status == "miss"
    completion = Completion(
        content="The capital of France is Paris.",
        finish_reason="stop",
        model="smollm2",
        prompt_tokens=20,
        completion_tokens=8,
    )
    await lookup.cache.put(ctx.cache_key, completion)
    await services.aclose()
    floor = (aioredis.RedisCluster if settings.redis.cluster else aioredis.Redis).from_url(
        settings.redis.url
    )
    await floor.set("bench:floor", orjson.dumps(completion.to_dict()))
    await floor.aclose()
    return raw


async def measure(
    url: str, headers: dict[str, str], requests: int, concurrency: int
) -> dict[str, float]:
    latencies: list[float] = []
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(limits=limits, timeout=30) as client:
        for _ in range(min(50, requests)):  # warm connections and code paths
            await client.post(url, json=BODY, headers=headers)
        queue = iter(range(requests))

        async def worker() -> None:
            for _ in queue:
                started = time.perf_counter()
                try:
                    response = await client.post(url, json=BODY, headers=headers)
                except httpx.TransportError as exc:
                    # A pooled connection the server closed as it was reused: counted, and
                    # the request is not measured.
                    print(f"# {url}: {type(exc).__name__}, request dropped", file=sys.stderr)
                    continue
                latencies.append(time.perf_counter() - started)
                if response.status_code != 200:
                    raise RuntimeError(f"{url}: {response.status_code} {response.text[:200]}")

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - started
    return summarise(latencies, wall)


# The fast path (``app.http.fastpath``) and the full path (``RAG_CACHE__FAST_PATH=false``: auth,
# limits, routing, validation, the stages up to the cache lookup) side by side, each with
# observability all off (no metrics, no request log, nothing sampled) and on but not sampled
# (metrics, the JSON request log, an OTLP/gRPC exporter, ``OTEL_TRACES_SAMPLER=always_off``).
# More variants by name: the full path with spans recorded and no exporter (the service as it
# was before metrics and logs), and each path with every trace sampled and exported.
ALL_OFF = {
    "OTEL_TRACES_SAMPLER": "always_off",
    "RAG_TELEMETRY__METRICS": "false",
    "RAG_LOG__REQUESTS": "false",
}
NOT_SAMPLED = {"OTEL_TRACES_SAMPLER": "always_off", "RAG_LOG__FORMAT": "json"}
FULL_PATH = {"RAG_CACHE__FAST_PATH": "false"}
BEFORE = "service, full path, all off"
SERVICE_VARIANTS: dict[str, dict[str, str]] = {
    "service, fast path, all off": ALL_OFF,
    BEFORE: {**ALL_OFF, **FULL_PATH},
    "service, fast path, on, not sampled": NOT_SAMPLED,
    "service, full path, on, not sampled": {**NOT_SAMPLED, **FULL_PATH},
    "service, full path, spans recorded, no export": {
        "RAG_TELEMETRY__METRICS": "false",
        "RAG_LOG__REQUESTS": "false",
        **FULL_PATH,
    },
    "service, fast path, on, sampled + exported": {"RAG_LOG__FORMAT": "json"},
    "service, full path, on, sampled + exported": {"RAG_LOG__FORMAT": "json", **FULL_PATH},
}
DEFAULT_VARIANTS = list(SERVICE_VARIANTS)[:4]
EXPORTING = tuple(name for name in SERVICE_VARIANTS if ", on, " in name)


def start_servers(
    settings: Settings, variants: list[str], logs: Path, before: Path | None = None
) -> tuple[dict[str, str], list[subprocess.Popen[bytes]]]:
    """Each variant of the service (and, with ``before``, each served from that checkout
    too, named "before: VARIANT"), the floor and the OTLP receiver: name -> base URL (and, in
    ``PIDS``, name -> the server's process id)."""
    receiver_port = free_port()
    procs = [serve_module(["tests.support.otlp", str(receiver_port)], {}, logs / "receiver.log")]
    common = {
        **settings_env(settings),
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{receiver_port}",
        "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
    }
    urls = {}
    served = [(name, name, ROOT) for name in variants]
    if before is not None:
        served += [(f"before: {name}", name, before) for name in variants]
    for number, (label, name, checkout) in enumerate(served):
        env = {**common, **SERVICE_VARIANTS[name]}
        if name not in EXPORTING:
            env = {k: v for k, v in env.items() if not k.startswith("OTEL_EXPORTER")}
        port = free_port()
        log = logs / f"service-{number}.log"
        procs.append(serve("app.main:create_app", port, env, log, checkout))
        urls[label] = f"http://127.0.0.1:{port}"
        PIDS[label] = procs[-1].pid
    port = free_port()
    floor_env = {
        "BENCH_REDIS_URL": settings.redis.url,
        "BENCH_REDIS_CLUSTER": "1" if settings.redis.cluster else "",
    }
    procs.append(serve("bench.floor_app:app", port, floor_env, logs / "floor.log"))
    urls["floor"] = f"http://127.0.0.1:{port}"
    PIDS["floor"] = procs[-1].pid
    return urls, procs


PIDS: dict[str, int] = {}


def lag_buckets(url: str) -> dict[str, float]:
    """The service's event-loop lag histogram (``app.lag``): upper bound -> samples so far."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    buckets = {}
    for line in text.splitlines():
        if line.startswith('rag_event_loop_lag_seconds_bucket{le="'):
            bound = line.split('"')[1]
            buckets[bound] = float(line.rsplit(" ", 1)[1])
    return buckets


def print_lag(concurrency: int, name: str, before: dict[str, float], after: dict[str, float]):
    """How late the service's event loop ran during the load: samples over 10 ms and 50 ms."""
    total = after["+Inf"] - before["+Inf"]
    over_10 = total - (after["0.01"] - before["0.01"])
    over_50 = total - (after["0.05"] - before["0.05"])
    print(
        f"| {concurrency} | {name}: event-loop lag | {total:.0f} samples | "
        f"{over_10:.0f} over 10 ms | {over_50:.0f} over 50 ms | |"
    )


def print_rows(concurrency: int, summary: dict[str, dict[str, float]]) -> None:
    floor = summary["floor"]
    for name, s in summary.items():
        cells = [
            f"{s['p50_ms']:.2f}",
            f"{s['p99_ms']:.2f}",
            f"{s['rps']:.0f}",
            f"{s['cpu_us']:.0f}",
        ]
        ratios = (
            ["", "", ""]
            if name == "floor"
            else [
                f"{s['p50_ms'] / floor['p50_ms']:.2f}x",
                f"{s['rps'] / floor['rps']:.2f}x",
                f"{s['cpu_us'] / floor['cpu_us']:.2f}x",
            ]
        )
        print(f"| {concurrency} | {name} | " + " | ".join(cells + ratios) + " |")
    base = summary.get(BEFORE)
    if base is not None:
        for name, s in summary.items():
            if name not in ("floor", BEFORE):
                extra = s["p50_ms"] - base["p50_ms"]
                print(
                    f"| {concurrency} | {name} vs {BEFORE} | {extra:+.3f} ms p50 "
                    f"({s['p50_ms'] / base['p50_ms'] - 1:+.1%}) | | "
                    f"{s['rps'] / base['rps'] - 1:+.1%} req/s | | | | |"
                )


async def ready_targets(urls: dict[str, str], key: str) -> dict[str, tuple[str, dict[str, str]]]:
    """Wait for every server; check that each service variant answers from the cache."""
    for name, url in urls.items():
        health = f"{url}/docs" if name == "floor" else f"{url}/healthz"
        wait_for(partial(up, health), 240, name)  # slow to start on loaded cores
    targets = {
        name: (f"{url}/v1/chat/completions", {"Authorization": f"Bearer {key}"})
        for name, url in urls.items()
        if name != "floor"
    }
    async with httpx.AsyncClient() as client:
        for url, headers in targets.values():
            # The bytes the benchmark sends: the full path's hit leaves the fast path's alias.
            check = await client.post(url, content=orjson.dumps(BODY), headers={**headers, **JSON})
            assert check.headers.get("x-cache") == "hit", f"{check.status_code} {check.text}"
    return {"floor": (f"{urls['floor']}/floor", {}), **targets}


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--client", choices=["raw", "httpx"], default="raw")
    parser.add_argument(
        "--variants",
        nargs="+",
        choices=list(SERVICE_VARIANTS),
        default=DEFAULT_VARIANTS,
        help="service variants to run beside the floor",
    )
    parser.add_argument(
        "--before",
        metavar="DIR",
        type=Path,
        help="another checkout (a git worktree): each variant served from it too, in the same "
        "rounds, so a change is measured against the code before it",
    )
    parser.add_argument(
        "--cluster",
        action="store_true",
        help="a Redis Cluster of three primaries instead of one Redis, under the service "
        "(RAG_REDIS__CLUSTER) and the floor alike",
    )
    args = parser.parse_args()

    redis_server: RedisServer | RedisClusterServers = (
        RedisClusterServers() if args.cluster else RedisServer()
    )
    redis_server.start()
    settings = service_settings(redis_server.url, "bench:", cluster=args.cluster)
    key = await prefill(settings)
    logs = Path(tempfile.mkdtemp(prefix="rag-bench-logs-"))
    urls, procs = start_servers(settings, args.variants, logs, args.before)
    try:
        targets = await ready_targets(urls, key)
        print(
            f"# cache-hit benchmark, {args.client} client, "
            f"{args.requests} requests x {args.rounds} rounds, "
            f"{os.cpu_count()} cores, {time.strftime('%Y-%m-%d')}; server logs in {logs}"
        )
        print(
            "| concurrency | target | p50 ms | p99 ms | req/s | server CPU µs/req "
            "| p50 / floor | req/s / floor | CPU / floor |"
        )
        print("|---|---|---|---|---|---|---|---|---|")
        body = orjson.dumps(BODY)
        for concurrency in args.concurrency:
            runs: dict[str, list[dict[str, float]]] = {name: [] for name in targets}
            # The variants with /metrics.
            probed = [n for n in targets if n.removeprefix("before: ") in EXPORTING]
            lags = {name: lag_buckets(urls[name]) for name in probed}
            for _ in range(args.rounds):
                for name, (url, headers) in targets.items():
                    cpu = process_cpu_seconds(PIDS[name])
                    if args.client == "raw":
                        result = await measure_raw(url, body, headers, args.requests, concurrency)
                    else:
                        result = await measure(url, headers, args.requests, concurrency)
                    sent = args.requests + min(50, args.requests)  # with the warm-up
                    result["cpu_us"] = (process_cpu_seconds(PIDS[name]) - cpu) / sent * 1e6
                    runs[name].append(result)
            summary = {
                name: {k: statistics.median(r[k] for r in results) for k in results[0]}
                for name, results in runs.items()
            }
            print_rows(concurrency, summary)
            for name in probed:
                print_lag(concurrency, name, lags[name], lag_buckets(urls[name]))
    finally:
        for proc in reversed(procs):  # the receiver last: the services flush to it on exit
            proc.terminate()
            proc.wait(10)
        redis_server.stop()
        print((logs / "receiver.log").read_text().strip().splitlines()[-1])


if __name__ == "__main__":
    asyncio.run(main())
