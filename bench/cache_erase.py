"""What a delete's erasure of cached answers costs (``ResponseCache.erase``), against a floor,
and what the erased-version check adds to each stored answer, side by side in one run.

    python -m bench.cache_erase [--entries 100 1000 10000] [--other-keys 200000] [--rounds 3]
                                [--puts 2000] [--out bench/results/cache_erase.json]

A private redis-server holds ``--other-keys`` cached answers of other tenants (200 bytes each)
and, before each arm, the tenant's ``--entries`` answers, one in ten with a fast-path copy.
Each round runs both arms, in an order that rotates:

- ``floor``: what any erasure must do: one SCAN of the keyspace for the tenant's names (the
  erasure's pattern and step) and delete them, 500 a round trip, with no marks and no
  copies' sets read;
- ``erase``: ``ResponseCache.erase`` (the versions marked, then each entry with its copies).

Then ``--puts`` stored answers, alternating, with no version (the check is skipped) and with a
version at or above the tenant's erasure mark (the check runs): the median time per put.
Medians over the rounds; each erasure's time over the floor's.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

from opentelemetry import trace

from pipeline.answer.completion import Completion
from pipeline.stages.cache import SCAN_STEP, ResponseCache
from pipeline.store.kv import KeyValueStore
from tests.support.servers import RedisServer

TENANT = "acme"
ANSWER = Completion(model="smollm2", content="x" * 150, finish_reason="stop")


async def fill(cache: ResponseCache, tenant: str, count: int, *, copies: bool) -> None:
    client = cache.kv.client
    for start in range(0, count, 5000):
        pipe = client.pipeline(transaction=False)
        for n in range(start, min(count, start + 5000)):
            entry = f"{cache.prefix}{tenant}:{n:064x}"
            pipe.set(entry, b"x" * 200, ex=3600)
            if copies and n % 10 == 0:
                alias = f"{cache.alias_prefix}{tenant}:{n:064x}"
                pipe.set(alias, b"x" * 200, ex=3600)
                pipe.sadd(entry + ":copies", alias)
        await pipe.execute()


async def floor(cache: ResponseCache, tenant: str) -> int:
    client = cache.kv.client
    pattern = f"{cache.prefix.removesuffix(':')}*:{tenant}:*"  # the erasure's one walk
    found = [n async for n in client.scan_iter(match=pattern, count=SCAN_STEP)]
    for start in range(0, len(found), 500):
        await client.delete(*found[start : start + 500])
    return len(found)


async def left(cache: ResponseCache, tenant: str) -> int:
    client = cache.kv.client
    return len([n async for n in client.scan_iter(match=f"*:{tenant}:*", count=1000)])


async def erasures(cache: ResponseCache, entries: int, rounds: int) -> dict[str, Any]:
    times: dict[str, list[float]] = {"floor": [], "erase": []}
    for r in range(rounds):
        order = ["floor", "erase"] if r % 2 == 0 else ["erase", "floor"]
        for arm in order:
            await fill(cache, TENANT, entries, copies=True)
            started = time.perf_counter()
            if arm == "floor":
                await floor(cache, TENANT)
            else:
                assert await cache.erase(TENANT, str(r + 1)) == entries
            times[arm].append((time.perf_counter() - started) * 1000)
            assert await left(cache, TENANT) == 0, f"{arm} left names behind"
    medians = {arm: statistics.median(values) for arm, values in times.items()}
    return {
        "entries": entries,
        "ms": {arm: round(m, 2) for arm, m in medians.items()},
        "erase_over_floor": round(medians["erase"] / medians["floor"], 2),
        "rounds_ms": {arm: [round(v, 2) for v in values] for arm, values in times.items()},
    }


async def puts(cache: ResponseCache, count: int, rounds: int) -> dict[str, Any]:
    await cache.erase("puts", "5")
    times: dict[str, list[float]] = {"unchecked": [], "checked": []}
    for r in range(rounds):
        for n in range(count):
            arm = "unchecked" if (n + r) % 2 == 0 else "checked"
            version = "" if arm == "unchecked" else "7"
            started = time.perf_counter()
            assert await cache.put(f"puts:{n:064x}", ANSWER, version=version)
            times[arm].append((time.perf_counter() - started) * 1e6)
    medians = {arm: statistics.median(values) for arm, values in times.items()}
    return {
        "puts": count * rounds,
        "us": {arm: round(m, 1) for arm, m in medians.items()},
        "checked_over_unchecked": round(medians["checked"] / medians["unchecked"], 3),
    }


@contextlib.asynccontextmanager
async def filled_cache(other_keys: int) -> AsyncIterator[ResponseCache]:
    """A response cache on a private redis-server holding ``other_keys`` answers of other
    tenants (the keyspace an erasure walks)."""
    server = RedisServer()
    server.start()
    kv = KeyValueStore.from_url(server.url, trace.NoOpTracer(), timeout=30.0)
    try:
        cache = ResponseCache(kv, ttl=3600)
        for n in range(8):
            await fill(cache, f"other{n}", other_keys // 8, copies=False)
        yield cache
        assert await kv.client.dbsize() >= other_keys, "an erasure touched other tenants"
    finally:
        await kv.aclose()
        server.stop()


async def run(args: argparse.Namespace) -> dict[str, Any]:
    async with filled_cache(args.other_keys) as cache:
        return {
            "other_keys": args.other_keys,
            "rounds": args.rounds,
            "erase": [await erasures(cache, n, args.rounds) for n in args.entries],
            "put": await puts(cache, args.puts, args.rounds),
        }


def run_and_save(
    run: Callable[[argparse.Namespace], Awaitable[dict[str, Any]]], args: argparse.Namespace
) -> dict[str, Any]:
    """A benchmark's results, written to ``args.out`` as JSON."""
    results = asyncio.run(run(args))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))
    return results


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--entries", type=int, nargs="+", default=[100, 1000, 10000])
    parser.add_argument("--other-keys", type=int, default=200_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--puts", type=int, default=2000)
    parser.add_argument("--out", type=Path, default=Path("bench/results/cache_erase.json"))
    args = parser.parse_args(argv)
    results = run_and_save(run, args)
    print(f"{'entries':>8} {'floor ms':>9} {'erase ms':>9} {'erase/floor':>12}")
    for row in results["erase"]:
        ms = row["ms"]
        print(
            f"{row['entries']:>8} {ms['floor']:>9.1f} {ms['erase']:>9.1f} "
            f"{row['erase_over_floor']:>12.2f}"
        )
    put = results["put"]
    print(
        f"put: {put['us']['unchecked']:.1f} us unchecked, {put['us']['checked']:.1f} us checked "
        f"({put['checked_over_unchecked']:.3f}x), {put['puts']} puts"
    )
    return results


if __name__ == "__main__":
    main()
