"""How long `rag` commands take, start to exit, beside another checkout's in the same run.

    python -m bench.cli_start [--rounds 15] [--code DIR] [--keys N] [--env NAME=VALUE]...

Each round runs every command once from this checkout and once from ``--code`` (a `git
worktree` of an earlier commit: its modules come first on PYTHONPATH), alternating which goes
first, against a private redis-server. A command's time is the wall time of the whole process
(`python -m app.cli ...`), which is what a user or a script waits for; the figures are medians
over the rounds, and the ratio is this checkout's median over the other's.

``--keys N`` first writes N key records of 1,000 tenants into Redis, as a version without the
tenants' key sets wrote them, so that ``rag keys list`` (50 keys of its own) runs among them:
the first listing of a version with key sets fills them (its time is printed apart).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import redis as redis_py

from tests.support.servers import RedisServer

ROOT = Path(__file__).resolve().parent.parent

COMMANDS: dict[str, list[str]] = {
    "rag --help": ["--help"],
    "rag keys create": ["keys", "create", "--tenant", "bench", "--user", "u"],
    "rag keys limits": ["keys", "tenant-limits", "bench", "--rpm", "60"],
    "rag webhooks secret": ["webhooks", "secret", "--tenant", "bench"],
    "rag keys list": ["keys", "list", "--tenant", "bench"],
    "rag features compute": ["features", "compute", "--out", os.devnull],
    "rag delete (no index)": ["delete", "--tenant", "bench", "nothing"],
}


def timed(code: Path, args: list[str], env: dict[str, str]) -> float:
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "app.cli", *args],
        cwd=code,
        env={**env, "PYTHONPATH": str(code)},
        capture_output=True,
        timeout=120,
    )
    took = time.perf_counter() - started
    if done.returncode not in (0, 1):  # delete of an id the tenant lacks: 1, by design
        raise RuntimeError(f"{args} from {code}: {done.stderr.decode()[-500:]}")
    return took


def write_keys(url: str, prefix: str, count: int) -> None:
    """``count`` key records of 1,000 tenants and 50 of the tenant "bench", without key sets."""
    client = redis_py.Redis.from_url(url)
    pipe = client.pipeline(transaction=False)
    for n in range(count + 50):
        tenant = "bench" if n < 50 else f"t{n % 1000}"
        digest = hashlib.sha256(f"bench-key-{n}".encode()).hexdigest()
        record: Any = {"hash": digest, "key_id": f"key_{n:024x}", "tenant": tenant, "user": n}
        pipe.hset(f"{prefix}apikey:{digest}", mapping={**record, "scopes": "chat", "created": n})
        if n % 5000 == 4999:
            pipe.execute()
    pipe.execute()
    client.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--code", help="the other checkout (e.g. a worktree of an older commit)")
    parser.add_argument("--keys", type=int, default=0, help="key records of other tenants")
    parser.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a setting for every command (e.g. RAG_RETRIEVAL__MILVUS_URI=/tmp/m.db)",
    )
    args = parser.parse_args(argv)
    codes = {"this": ROOT, **({"other": Path(args.code).resolve()} if args.code else {})}
    redis = RedisServer()
    redis.start()
    index = Path(os.environ.get("TMPDIR", "/tmp")) / f"rag-cli-bench-{os.getpid()}"
    env = {
        **os.environ,
        "RAG_REDIS__URL": redis.url,
        "RAG_RETRIEVAL__INDEX_DIR": str(index),
        "RAG_REDIS__KEY_PREFIX": "bench:",
        **dict(setting.split("=", 1) for setting in args.env),
    }
    times: dict[tuple[str, str], list[float]] = {}
    first: dict[str, float] = {}
    try:
        write_keys(redis.url, "bench:", args.keys)
        for name, command in COMMANDS.items():
            for label, code in codes.items():
                took = timed(code, command, env)  # warms the page cache and .pyc files
                first.setdefault(f"{name} ({label}, first run)", took)
            for round_ in range(args.rounds):
                order = list(codes.items())
                if round_ % 2:
                    order.reverse()
                for label, code in order:
                    times.setdefault((name, label), []).append(timed(code, command, env))
    finally:
        redis.stop()
    print(f"{'command':<24} " + " ".join(f"{label + ' p50 s':>14}" for label in codes), end="")
    print(f" {'ratio':>7}" if "other" in codes else "")
    for name in COMMANDS:
        p50 = {label: statistics.median(times[name, label]) for label in codes}
        row = f"{name:<24} " + " ".join(f"{p50[label]:>14.3f}" for label in codes)
        if "other" in codes:
            row += f" {p50['this'] / p50['other']:>6.2f}x"
        print(row)
    if args.keys:
        for label in codes:
            name = f"rag keys list ({label}, first run)"
            print(f"{name}: {first[name]:.3f} s, among {args.keys} other keys")


if __name__ == "__main__":
    main()
