"""``rag redis copy``: the service's keys from one Redis to another, each renamed for the
target's form (one Redis or a Redis Cluster, whose hash tags change some names:
docs/scaling.md).

rag redis copy --to URL [--to-cluster] [--from URL] [--from-cluster | --no-from-cluster]
               [--to-prefix P] [--merge | --replace] [--skip-prefix P ...] [--dry-run]

What it copies, group by group (pipeline.store.layout): API keys, features and their hourly
counts, request logs, tenant limits, webhook secrets, index versions, backend records and
jobs, each value exactly with its time to live (DUMP and RESTORE: a stream keeps its consumer
groups, a sealed webhook secret stays sealed). The cache, coalesced flights and rate-limit
windows are not copied: the service rebuilds them. A name under the prefix that the service
does not write is listed and not copied (exit status 1), except under a ``--skip-prefix``: a
longer prefix of another deployment on the same Redis ("rag:staging:" beside "rag:"), whose
names are counted and left alone.

Stop the old deployment first (at least its workers, and no keys created meanwhile), copy,
then start the new one on the target: what is written after its name was read is not copied.

The target must hold none of the service's names under the prefix: copying into a deployment
already running there would bring back what was deleted there since (a key revoked on the
target, a job it finished). ``--merge`` copies anyway, leaving the names already there as they
are (a copy that stopped part way is run again with it); ``--replace`` overwrites them. The
source itself, under any of its names, is refused as a target. ``--dry-run`` writes nothing and
asks the target which names it holds already, so its counts are the copy's.
"""

from __future__ import annotations

import argparse
import contextlib
import re
import sys
from collections import Counter
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlparse

import redis
from redis.exceptions import RedisClusterException

from app.settings import get_settings
from pipeline.store.kv import glob_escaped
from pipeline.store.layout import GROUPS, classify

BATCH = 500  # names read and written per round trip
SHOWN = 10  # names listed of each kind of problem


def _client(url: str, cluster: bool, flag: str) -> redis.Redis | redis.RedisCluster:
    """A client of the Redis at ``url``, its first answer read. A URL that says what it
    cannot mean, a password refused, a database that does not exist, or the wrong kind of
    Redis (a cluster's node without ``flag``: its client would be refused the other nodes'
    keys, name by name) is a ValueError; a Redis that does not answer, a RedisError."""
    found = urlparse(url)
    if found.scheme in ("redis", "rediss") and not re.fullmatch(r"/?[0-9]*", found.path):
        raise ValueError(f"{url}: the database is a number (redis://host:port/0)")
    if cluster and found.path.strip("/") not in ("", "0"):
        raise ValueError(f"{url}: a Redis Cluster has database 0 only")
    # An operator is waiting, nothing else is: patient bounds, but bounds.
    options: dict[str, Any] = {"socket_timeout": 10.0, "socket_connect_timeout": 5.0}
    try:
        if cluster:
            return redis.RedisCluster.from_url(url, **options)  # asks it for the nodes now
        client = redis.Redis.from_url(url, **options)
        try:
            if client.info("cluster").get("cluster_enabled"):
                raise ValueError(f"{url} is a node of a Redis Cluster: add {flag}")
        except BaseException:
            client.close()
            raise
        return client
    except RedisClusterException as exc:
        if "not enabled" in str(exc):
            raise ValueError(f"{url} is no Redis Cluster's node: drop {flag}") from None
        raise redis.ConnectionError(str(exc)) from None
    except redis.AuthenticationError as exc:
        raise ValueError(f"{url}: the password was refused ({exc})") from None
    except redis.ResponseError as exc:  # a database out of range; NOAUTH, WRONGPASS
        raise ValueError(f"{url}: {exc}") from None


def _servers(client: redis.Redis | redis.RedisCluster) -> set[tuple[str, int]]:
    """The servers (run ids) and database ``client`` writes to: two clients that share one
    write to the same keys, whatever their URLs say (a host's other name, a cluster's other
    node)."""
    if isinstance(client, redis.RedisCluster):
        replies = client.info("server", target_nodes=redis.RedisCluster.ALL_NODES)
        if "run_id" in replies:  # a cluster of one node: its reply alone
            replies = {"node": replies}
        return {(reply["run_id"], 0) for reply in replies.values()}
    db = int(client.connection_pool.connection_kwargs.get("db") or 0)
    return {(client.info("server")["run_id"], db)}


def _names(client: redis.Redis | redis.RedisCluster, pattern: str) -> Iterator[bytes]:
    """Every name matching ``pattern``, by SCAN; on a cluster every primary in turn."""
    nodes: list[Any] = [None]
    if isinstance(client, redis.RedisCluster):
        nodes = client.get_primaries()  # type: ignore[no-untyped-call]
    for node in nodes:
        on = {"target_nodes": node} if node is not None else {}
        cursor: Any = 0
        while True:
            cursor, found = client.scan(cursor, match=pattern, count=1000, **on)
            if isinstance(cursor, dict):  # a cluster's reply: {node: cursor}
                cursor = next(iter(cursor.values()), 0)
            yield from (name.encode() if isinstance(name, str) else name for name in found)
            if not cursor:
                break


def _batches(names: Iterator[bytes]) -> Iterator[list[bytes]]:
    batch: list[bytes] = []
    for name in names:
        batch.append(name)
        if len(batch) == BATCH:
            yield batch
            batch = []
    if batch:
        yield batch


class Copy:
    """One copy's plan and its tally, batch by batch."""

    def __init__(self, args: argparse.Namespace, from_cluster: bool, prefix: str) -> None:
        self.args = args
        self.from_cluster = from_cluster
        self.prefix = prefix
        self.to_prefix = prefix if args.to_prefix is None else args.to_prefix
        self.tally: dict[str, Counter[str]] = {group.name: Counter() for group in GROUPS}
        self.unknown: list[str] = []
        self.failed: list[str] = []
        self.seen = 0  # names read under the prefix, but for those skipped
        self.skip = tuple(prefix.encode() for prefix in args.skip_prefix or ())
        self.skipped = 0  # names under a --skip-prefix

    def plan(self, batch: list[bytes]) -> list[tuple[bytes, str, str]]:
        """(source name, target name, group) for the names of ``batch`` that are copied."""
        planned = []
        for raw in batch:
            if raw.startswith(self.skip):
                self.skipped += 1
                continue
            self.seen += 1
            try:
                name = raw.decode("utf-8")
            except UnicodeDecodeError:
                self.unknown.append(repr(raw))
                continue
            found = classify(name[len(self.prefix) :], cluster=self.from_cluster)
            if found is None:
                self.unknown.append(repr(name))  # as text: no control character reaches a tty
                continue
            group, parts = found
            if not group.copied:
                self.tally[group.name]["not copied"] += 1
                continue
            target = self.to_prefix + group.build(parts, cluster=self.args.to_cluster)
            planned.append((raw, target, group.name))
        return planned

    def run(
        self,
        source: redis.Redis | redis.RedisCluster,
        target: redis.Redis | redis.RedisCluster,
        planned: list[tuple[bytes, str, str]],
    ) -> None:
        if self.args.dry_run:
            self._look(target, planned)
            return
        reading = source.pipeline(transaction=False)
        for name, _, _ in planned:
            reading.dump(name)
            reading.pttl(name)
        read = reading.execute()
        writing = target.pipeline(transaction=False)
        written = []
        for (name, to, group), payload, ttl in zip(planned, read[::2], read[1::2], strict=True):
            # Expired or deleted since it was listed; 0: it expires within this millisecond
            # (RESTORE would read 0 as "never").
            if payload is None or ttl == -2 or ttl == 0:
                self.tally[group]["gone"] += 1
                continue
            writing.restore(to, 0 if ttl == -1 else int(ttl), payload, replace=self.args.replace)
            written.append((name, to, group))
        if not written:
            return
        for (name, to, group), reply in zip(
            written, writing.execute(raise_on_error=False), strict=True
        ):
            if not isinstance(reply, Exception):
                self.tally[group]["copied"] += 1
            elif "BUSYKEY" in str(reply):
                self.tally[group]["already there"] += 1
            else:
                self.tally[group]["failed"] += 1
                self.failed.append(f"{name!r} -> {to!r}: {reply}")

    def _look(
        self, target: redis.Redis | redis.RedisCluster, planned: list[tuple[bytes, str, str]]
    ) -> None:
        """A dry run's counts: what the copy would find on the target already is "already
        there" (left as it is), unless ``--replace`` would overwrite it."""
        held: list[Any] = [0] * len(planned)
        if not self.args.replace and planned:
            asking = target.pipeline(transaction=False)
            for _, to, _ in planned:
                asking.exists(to)
            held = asking.execute()
        for (_, _, group), there in zip(planned, held, strict=True):
            self.tally[group]["already there" if there else "to copy"] += 1

    @property
    def copied(self) -> int:
        return sum(counts["copied"] for counts in self.tally.values())

    def report(self) -> int:
        columns: tuple[str, ...] = ("to copy", "already there")
        if not self.args.dry_run:
            columns = ("copied", "already there", "gone")
        columns += ("not copied",) + (() if self.args.dry_run else ("failed",))
        width = max(len(group.name) for group in GROUPS)
        print(f"{'group':<{width}}  " + "  ".join(f"{c:>13}" for c in columns))
        for group in GROUPS:
            counts = self.tally[group.name]
            print(f"{group.name:<{width}}  " + "  ".join(f"{counts[c]:>13}" for c in columns))
        status = 0
        if self.skipped:
            shown = ", ".join(repr(prefix.decode()) for prefix in self.skip)
            print(f"{self.skipped} names under {shown} skipped (--skip-prefix)", file=sys.stderr)
        if not self.seen:
            status = 1
            print(
                f"no names under {self.prefix!r} on the source: is RAG_REDIS__KEY_PREFIX (or "
                "the URL's database) the old deployment's?",
                file=sys.stderr,
            )
        if self.unknown:
            status = 1
            print(
                f"{len(self.unknown)} names under {self.prefix!r} are none the service writes "
                "(pipeline/store/layout.py): not copied",
                file=sys.stderr,
            )
            for name in self.unknown[:SHOWN]:
                print(f"  {name}", file=sys.stderr)
        if self.failed:
            status = 1
            print(f"{len(self.failed)} names were not copied:", file=sys.stderr)
            for line in self.failed[:SHOWN]:
                print(f"  {line}", file=sys.stderr)
        return status


def copy(args: argparse.Namespace) -> int:
    settings = get_settings().redis
    prefix = settings.key_prefix
    source_url = args.source or settings.url
    from_cluster = settings.cluster if args.from_cluster is None else args.from_cluster
    to_prefix = prefix if args.to_prefix is None else args.to_prefix
    if source_url == args.to:
        raise ValueError("--to names the Redis copied from: copy to another one")
    for cluster, named in ((from_cluster, prefix), (args.to_cluster, to_prefix)):
        if cluster and ("{" in named or "}" in named):
            raise ValueError(f"a key prefix on a Redis Cluster holds no {{ or }}: {named!r}")
    for skipped in args.skip_prefix or ():
        if not skipped.startswith(prefix) or skipped == prefix:
            raise ValueError(
                f"--skip-prefix {skipped!r}: another deployment's prefix starts with this "
                f"one's ({prefix!r}) and is longer"
            )
        mine = _groups_under(skipped[len(prefix) :])
        if mine:
            raise ValueError(
                f"--skip-prefix {skipped!r} would skip this deployment's own names too "
                f"({', '.join(mine)}): name another deployment's whole prefix"
            )
    plan = Copy(args, from_cluster, prefix)
    with contextlib.ExitStack() as clients:
        try:
            source = clients.enter_context(_client(source_url, from_cluster, "--from-cluster"))
            target = clients.enter_context(_client(args.to, args.to_cluster, "--to-cluster"))
            same = _servers(source) & _servers(target)
        except (redis.RedisError, RedisClusterException) as exc:
            print(
                f"rag redis copy: Redis did not answer ({type(exc).__name__}: {exc}); nothing "
                "was copied",
                file=sys.stderr,
            )
            return 1
        if same:
            raise ValueError(
                "--to names the Redis copied from (the same server and database, by another "
                "name): copy to another one"
            )
        try:
            return _copy(plan, source, target)
        except (redis.RedisError, RedisClusterException) as exc:
            plan.report()
            then = (
                "what was copied stays, and running it again with --merge copies the rest"
                if plan.copied
                else "nothing was copied"
            )
            print(
                f"rag redis copy: Redis did not answer ({type(exc).__name__}: {exc}); {then}",
                file=sys.stderr,
            )
            return 1


def _copy(
    plan: Copy, source: redis.Redis | redis.RedisCluster, target: redis.Redis | redis.RedisCluster
) -> int:
    args, to_prefix = plan.args, plan.to_prefix
    # Only names of the service's own groups count: a deployment under a longer prefix
    # ("rag:staging:") on the same Redis is not this one's.
    held = next(
        (
            name
            for name in _names(target, glob_escaped(to_prefix) + "*")
            if _ours(name, len(to_prefix), args.to_cluster)
        ),
        None,
    )
    if held is not None and not (args.merge or args.replace):
        print(
            f"rag redis copy: the target already holds names under {to_prefix!r} (such as "
            f"{held!r}). A copy into a deployment running there would bring back what was "
            "deleted there since (a revoked key); --merge copies anyway, leaving those names "
            "as they are (a copy that stopped part way), --replace overwrites them. Nothing "
            "was copied.",
            file=sys.stderr,
        )
        return 1
    for batch in _batches(_names(source, glob_escaped(plan.prefix) + "*")):
        plan.run(source, target, plan.plan(batch))
    return plan.report()


def _groups_under(rest: str) -> list[str]:
    """The groups some of whose names (after the prefix, in either form) start with ``rest``,
    or under which ``rest`` itself could be a name's start."""
    found = []
    for group in GROUPS:
        for template in (group.single, group.cluster):
            head = template.split("<", 1)[0]  # the literal start, before any part
            if head.startswith(rest) or (rest.startswith(head) and "<" in template):
                found.append(group.name)
                break
    return found


def _ours(name: bytes, after: int, cluster: bool) -> bool:
    try:
        return classify(name.decode("utf-8")[after:], cluster=cluster) is not None
    except UnicodeDecodeError:
        return False
