"""What a delete's erasure of cached answers costs (``ResponseCache.erase``, which reads the
tenant's own entries) against a walk of the keyspace (how it found them before), what naming
each stored answer in its tenant's entries adds to a put, and what the names weigh, side by
side in one run.

    python -m bench.cache_erase [--entries 100 1000 10000] [--other-keys 200000] [--rounds 3]
                                [--puts 2000] [--out bench/results/cache_erase.json]

A private redis-server holds ``--other-keys`` cached answers of other tenants (200 bytes each)
and, before each arm, the tenant's ``--entries`` answers, stored by ``ResponseCache.put``, one in
ten with a fast-path copy. Each round runs both arms, in an order that rotates:

- ``walk``: the floor of any erasure that finds the tenant's names by walking the keyspace (the
  erasure before its index took 1.01x to 1.45x of it): one SCAN for them, 10,000 names a step,
  and their deletion, 500 a round trip, with no marks and no copies' sets read;
- ``erase``: ``ResponseCache.erase`` (the versions marked, then each entry named in the
  tenant's entries dropped with its copies).

Then ``--puts`` stored answers, alternating: ``ResponseCache.put`` against the put script as it
was before the index (the same checks and writes, no name recorded): the median time per put.
And the bytes Redis holds for the tenant's entries (``MEMORY USAGE``), per answer, against the
bytes of one stored answer. Medians over the rounds; each erasure's time over the walk's.
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

import orjson
from opentelemetry import trace

from pipeline.answer.completion import Completion
from pipeline.stages.cache import ResponseCache
from pipeline.store.kv import KeyValueStore
from tests.support.servers import RedisServer

TENANT = "acme"
ANSWER = Completion(model="smollm2", content="x" * 150, finish_reason="stop")
WALK_STEP = 10_000
# The cache's put script before the tenant's entries were recorded (pipeline.stages.cache).
PUT_BEFORE = """
local mark = tonumber(redis.call('GET', KEYS[3]) or '')
local made = tonumber(string.match(ARGV[3], '^%d+') or '')
if mark and made and made < mark then return -1 end
redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[2])
local copies = redis.call('SMEMBERS', KEYS[2])
for _, copy in ipairs(copies) do redis.call('DEL', copy) end
if #copies > 0 then redis.call('DEL', KEYS[2]) end
return #copies
"""


async def fill_others(cache: ResponseCache, tenant: str, count: int) -> None:
    """Other tenants' answers, written straight (they are what a walk steps over)."""
    client = cache.kv.client
    for start in range(0, count, 5000):
        pipe = client.pipeline(transaction=False)
        for n in range(start, min(count, start + 5000)):
            pipe.set(f"{cache.prefix}{tenant}:{n:064x}", b"x" * 200, ex=3600)
        await pipe.execute()


async def fill(cache: ResponseCache, tenant: str, count: int) -> None:
    """The tenant's answers as the service stores them, one in ten with a fast-path copy."""
    for start in range(0, count, 500):
        numbers = range(start, min(count, start + 500))
        await asyncio.gather(*(cache.put(f"{tenant}:{n:064x}", ANSWER) for n in numbers))
        await asyncio.gather(
            *(
                cache.copy(f"{tenant}:{n:064x}", f"{cache.alias_prefix}{tenant}:{n:064x}")
                for n in numbers
                if n % 10 == 0
            )
        )


async def walk(cache: ResponseCache, tenant: str) -> int:
    client = cache.kv.client
    pattern = f"{cache.prefix.removesuffix(':')}*:{tenant}:*"
    found = [n async for n in client.scan_iter(match=pattern, count=WALK_STEP)]
    for start in range(0, len(found), 500):
        await client.delete(*found[start : start + 500])
    return len(found)


async def left(cache: ResponseCache, tenant: str) -> int:
    client = cache.kv.client
    return len([n async for n in client.scan_iter(match=f"*:{tenant}:*", count=WALK_STEP)])


async def erasures(cache: ResponseCache, entries: int, rounds: int) -> dict[str, Any]:
    times: dict[str, list[float]] = {"walk": [], "erase": []}
    for r in range(rounds):
        order = ["walk", "erase"] if r % 2 == 0 else ["erase", "walk"]
        for arm in order:
            await fill(cache, TENANT, entries)
            started = time.perf_counter()
            if arm == "walk":
                await walk(cache, TENANT)
            else:
                assert await cache.erase(TENANT, "") == entries
            times[arm].append((time.perf_counter() - started) * 1000)
            assert await left(cache, TENANT) == 0, f"{arm} left names behind"
            await cache.kv.client.delete(f"{cache.prefix.removesuffix(':')}-entries:{TENANT}")
    medians = {arm: statistics.median(values) for arm, values in times.items()}
    return {
        "entries": entries,
        "ms": {arm: round(m, 2) for arm, m in medians.items()},
        "erase_over_walk": round(medians["erase"] / medians["walk"], 4),
        "rounds_ms": {arm: [round(v, 2) for v in values] for arm, values in times.items()},
    }


async def puts(cache: ResponseCache, count: int, rounds: int) -> dict[str, Any]:
    before = cache.kv.script(PUT_BEFORE)
    base = cache.prefix.removesuffix(":")
    answer = orjson.dumps(ANSWER.to_dict())

    async def put_before(key: str) -> None:
        entry = cache.prefix + key
        keys = [entry, entry + ":copies", f"{base}-erased:puts"]
        assert await cache.kv.run_script("put", before, keys, [answer, cache.ttl, "7"]) != -1

    await cache.erase("puts", "5")
    times: dict[str, list[float]] = {"before": [], "indexed": []}
    for r in range(rounds):
        for n in range(count):
            arm = "before" if (n + r) % 2 == 0 else "indexed"
            started = time.perf_counter()
            if arm == "before":
                await put_before(f"puts:{r}{n:063x}")
            else:
                assert await cache.put(f"puts:{r}{n:063x}", ANSWER, version="7")
            times[arm].append((time.perf_counter() - started) * 1e6)
    medians = {arm: statistics.median(values) for arm, values in times.items()}
    client = cache.kv.client
    named = await client.zcard(f"{base}-entries:puts")
    index_bytes = await client.memory_usage(f"{base}-entries:puts")
    answer_bytes = await client.memory_usage(f"{cache.prefix}puts:0{0:063x}")
    return {
        "puts": count * rounds,
        "us": {arm: round(m, 1) for arm, m in medians.items()},
        "indexed_over_before": round(medians["indexed"] / medians["before"], 3),
        "index_bytes_per_answer": round(index_bytes / named, 1),
        "answer_bytes": answer_bytes,
    }


@contextlib.asynccontextmanager
async def filled_cache(other_keys: int) -> AsyncIterator[ResponseCache]:
    """A response cache on a private redis-server holding ``other_keys`` answers of other
    tenants (the keyspace a walk steps over)."""
    server = RedisServer()
    server.start()
    kv = KeyValueStore.from_url(server.url, trace.NoOpTracer(), timeout=30.0)
    try:
        cache = ResponseCache(kv, ttl=3600)
        for n in range(8):
            await fill_others(cache, f"other{n}", other_keys // 8)
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
    print(f"{'entries':>8} {'walk ms':>9} {'erase ms':>9} {'erase/walk':>11}")
    for row in results["erase"]:
        ms = row["ms"]
        print(
            f"{row['entries']:>8} {ms['walk']:>9.1f} {ms['erase']:>9.1f} "
            f"{row['erase_over_walk']:>11.4f}"
        )
    put = results["put"]
    print(
        f"put: {put['us']['before']:.1f} us before, {put['us']['indexed']:.1f} us indexed "
        f"({put['indexed_over_before']:.3f}x), {put['puts']} puts; the index holds "
        f"{put['index_bytes_per_answer']:.0f} bytes an answer (an answer: {put['answer_bytes']})"
    )
    return results


if __name__ == "__main__":
    main()
