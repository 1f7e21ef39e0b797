"""``rag redis copy`` (a deployment moved from one Redis to a Redis Cluster): names per second
against a floor, side by side in one run.

    python -m bench.redis_copy_bench [--users 20000] [--tenants 100] [--rounds 3]
                                     [--out bench/results/redis_copy.json]

A private redis-server is filled with a deployment's names, per user: an API key's record (a
hash), its id and its tenant's set, a features hash, this hour's count (with a TTL), a cached
answer of about 1 KB and its fast-path alias (with TTLs: not copied). Each round runs, in an
order that rotates:

- ``floor``: what any copy must do, without the naming work: SCAN every name, DUMP and PTTL
  each but the cache's, RESTORE each under the same name, up to 500 names a pipelined round
  trip, into a second private redis-server;
- ``copy to one Redis``: ``rag redis copy`` into that second server;
- ``copy to a cluster``: ``rag redis copy --to-cluster`` into a private three-primary cluster.

The command runs in this process (``app.cli.main``: its start, ~0.5 s, is not counted), and
the targets are emptied between arms. Per arm: wall time and names read per second; medians
over the rounds, and each copy's time over the floor's.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import redis

from app.cli import main as rag
from app.cli.redis_copy import BATCH, _batches, _names
from app.settings import get_settings
from tests.support.servers import RedisClusterServers, RedisServer

PREFIX = "rag:"
SKIPPED = f"{PREFIX}cache".encode()  # the cache and its aliases: rebuilt, not copied


def fill(url: str, users: int, tenants: int) -> int:
    """The deployment's names; how many there are."""
    hour = int(time.time() // 3600)
    answer = b"x" * 1000
    with redis.Redis.from_url(url) as client:
        pipe = client.pipeline(transaction=False)
        for n in range(users):
            tenant, user, digest = f"t{n % tenants}", f"u{n}", f"{n:064x}"
            pipe.hset(
                f"{PREFIX}apikey:{digest}",
                mapping={"tenant": tenant, "user": user, "scopes": "chat", "id": f"key_{n}"},
            )
            pipe.set(f"{PREFIX}apikey:id:key_{n}", digest)
            pipe.sadd(f"{PREFIX}apikey:tenant:{tenant}", digest)
            pipe.hset(
                f"{PREFIX}features:{tenant}:{user}", mapping={"request_count": n, "lang": "en"}
            )
            pipe.set(f"{PREFIX}features-rt:{tenant}:{user}:{hour}", 3, ex=7200)
            pipe.set(f"{PREFIX}cache:{tenant}:{digest}", answer, ex=3600)
            pipe.set(f"{PREFIX}cache-alias:{tenant}:{digest}", answer, ex=3600)
            if n % 1000 == 999:
                pipe.execute()
        pipe.execute()
        return int(client.dbsize())


def floor(source: str, target: str) -> int:
    """SCAN, DUMP and PTTL, RESTORE under the same names: the copy without its naming work
    (the names it skips, the cache's, skipped by their start)."""
    copied = 0
    with redis.Redis.from_url(source) as src, redis.Redis.from_url(target) as dst:
        for listed in _batches(_names(src, f"{PREFIX}*")):
            batch = [name for name in listed if not name.startswith(SKIPPED)]
            reading = src.pipeline(transaction=False)
            for name in batch:
                reading.dump(name)
                reading.pttl(name)
            read = reading.execute()
            writing = dst.pipeline(transaction=False)
            for name, payload, ttl in zip(batch, read[::2], read[1::2], strict=True):
                writing.restore(name, 0 if ttl == -1 else ttl, payload)
            copied += len(writing.execute())
    return copied


def command(source: str, *args: str) -> int:
    os.environ["RAG_REDIS__URL"] = source
    os.environ["RAG_REDIS__KEY_PREFIX"] = PREFIX
    get_settings.cache_clear()
    with contextlib.redirect_stdout(io.StringIO()):
        status = rag(["redis", "copy", *args])
    if status != 0:
        raise SystemExit(f"rag redis copy {' '.join(args)}: exit status {status}")
    return 0


def empty(target: RedisServer, cluster: RedisClusterServers) -> None:
    with redis.Redis.from_url(target.url) as client:
        client.flushall()
    for node in cluster.nodes:
        with redis.Redis(port=node.port) as client:
            if client.info("replication")["role"] == "master":
                client.flushall()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--users", type=int, default=20_000)
    parser.add_argument("--tenants", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default="bench/results/redis_copy.json")
    args = parser.parse_args()

    source, target = RedisServer(), RedisServer()
    cluster = RedisClusterServers(nodes=3)
    for server in (source, target):
        server.start()
    cluster.start()
    try:
        names = fill(source.url, args.users, args.tenants)
        print(f"{names} names ({args.users} users, {args.tenants} tenants), batch {BATCH}")
        arms: dict[str, Any] = {
            "floor": lambda: floor(source.url, target.url),
            "copy to one Redis": lambda: command(source.url, "--to", target.url),
            "copy to a cluster": lambda: command(source.url, "--to", cluster.url, "--to-cluster"),
        }
        walls: dict[str, list[float]] = {arm: [] for arm in arms}
        order = list(arms)
        for round_no in range(args.rounds):
            for arm in order[round_no % len(order) :] + order[: round_no % len(order)]:
                empty(target, cluster)
                started = time.perf_counter()
                arms[arm]()
                walls[arm].append(time.perf_counter() - started)
        results = {
            arm: {
                "wall_s_median": statistics.median(w),
                "names_per_s": names / statistics.median(w),
                "walls_s": w,
            }
            for arm, w in walls.items()
        }
        base = results["floor"]["wall_s_median"]
        for arm, result in results.items():
            result["over_floor"] = result["wall_s_median"] / base
            print(
                f"{arm:<18} wall {result['wall_s_median']:.2f} s  "
                f"{result['names_per_s']:,.0f} names/s  {result['over_floor']:.2f}x the floor"
            )
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(
            json.dumps(
                {"names": names, "users": args.users, "rounds": args.rounds, "arms": results},
                indent=2,
            )
        )
    finally:
        cluster.stop()
        for server in (source, target):
            server.stop()


if __name__ == "__main__":
    main()
