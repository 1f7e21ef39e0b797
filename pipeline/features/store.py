"""The online feature store: per (tenant, user) a Redis hash of batch features, read with the
real-time ones in one round trip.

Keys (``prefix`` is the service's Redis key prefix):

- ``{prefix}features:{tenant}:{user}``: a hash of the batch features, stored as text, plus
  ``_version`` (the feature-set version it was written under) and ``_updated`` (unix time).
- ``{prefix}features-rt:{tenant}:{user}:{hour}``: the user's requests in one clock hour (INCR,
  expiring after two hours). Requests in the last hour are estimated as a sliding window: this
  hour's count plus last hour's, weighted by the part of last hour still inside the window
  (``current + previous * (1 - seconds into this hour / 3600)``). Two counters per user, exact
  when requests are spread evenly, never off by more than last hour's count.
- ``{prefix}features-log:{tenant}``: a capped stream (``MAXLEN ~``) of the tenant's request-log
  records, what ``rag features compute`` derives batch features from. No prompt text is ever
  in it. One per tenant, each with its own cap: in one stream for all (before), one tenant's
  traffic pushed the others' records out before they were computed, and so decided their
  users' features (a hostile review, 2026-12-05: 400 requests of one tenant left only its own
  records at a cap of 100). ``read_log`` still reads the one stream of earlier versions.

On a Redis Cluster ``{tenant}:{user}`` in the first two is a hash tag (written with its braces),
so a user's lookup is one node's pipeline.

Tenant and user names cannot hold a colon (``pipeline.store.keys.validate_name``), so one user's key
can never be another's.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from pipeline.context import Features
from pipeline.features.spec import (
    FEATURE_SET_VERSION,
    SPECS,
    FeatureSpec,
    FeatureValueError,
    batch_specs,
    encode_value,
    parse_value,
)
from pipeline.store.kv import KeyValueStore, glob_escaped

log = logging.getLogger(__name__)

WINDOW_S = 3600

# Replace (or merge into) one user's hash atomically. A merge into a hash written under another
# feature-set version replaces it: old fields must not pass for the new version's.
WRITE_SCRIPT = """
if ARGV[1] == 'replace' or redis.call('HGET', KEYS[1], '_version') ~= ARGV[2] then
  redis.call('DEL', KEYS[1])
end
redis.call('HSET', KEYS[1], unpack(ARGV, 3))
return 1
"""


@dataclass(frozen=True)
class FeatureRow:
    """One user's batch features, typed and checked (what the loader writes)."""

    tenant: str
    user: str
    values: dict[str, Any]


@dataclass(frozen=True)
class Lookup:
    """What a load found: the features, and how the user's hash looked."""

    features: Features
    status: str  # hit, miss (no hash), stale (another feature-set version)
    age_s: float | None = None
    invalid: tuple[str, ...] = ()


class FeatureStore:
    """Reads and writes users' features in Redis through ``KeyValueStore`` (spans, errors
    converted to ``StoreUnavailable``, the circuit breaker)."""

    def __init__(
        self,
        kv: KeyValueStore,
        *,
        prefix: str = "rag:",
        specs: Mapping[str, FeatureSpec] = SPECS,
        log_max_entries: int = 100_000,
        version: str = FEATURE_SET_VERSION,
    ) -> None:
        self.kv = kv
        self.prefix = prefix
        self.specs = dict(specs)
        self.batch = batch_specs(self.specs)
        self.log_max_entries = log_max_entries
        self.version = version
        self._write = kv.script(WRITE_SCRIPT)

    def key(self, tenant: str, user: str) -> str:
        # On a cluster a user's keys share a slot: the lookup's pipeline is one node's.
        return f"{self.prefix}features:{self.kv.tag(f'{tenant}:{user}')}"

    def rate_key(self, tenant: str, user: str, hour: int) -> str:
        return f"{self.prefix}features-rt:{self.kv.tag(f'{tenant}:{user}')}:{hour}"

    def log_stream(self, tenant: str) -> str:
        return f"{self.prefix}features-log:{tenant}"

    @property
    def shared_log_stream(self) -> str:
        """The one stream of every tenant's records that earlier versions appended to."""
        return f"{self.prefix}features-log"

    async def load(self, tenant: str, user: str, *, log: dict[str, Any] | None = None) -> Lookup:
        """The user's features in one round trip; ``log``: a request-log record to append."""
        now = time.time()
        hour = int(now // WINDOW_S)
        names = list(self.batch)
        current = self.rate_key(tenant, user, hour)

        async def queue(pipe: Any) -> None:
            pipe.hmget(self.key(tenant, user), [*names, "_version", "_updated"])
            pipe.incr(current)
            pipe.expire(current, 2 * WINDOW_S)
            pipe.get(self.rate_key(tenant, user, hour - 1))
            if log is not None:
                record = {"tenant": tenant, "user": user, "ts": round(now, 3), **log}
                pipe.xadd(
                    self.log_stream(tenant),
                    {"record": orjson.dumps(record)},
                    maxlen=self.log_max_entries,
                    approximate=True,
                )

        replies = await self.kv.pipeline("PIPELINE features", queue)
        stored, count, previous = replies[0], int(replies[1]), _count(replies[3])
        into_hour = (now % WINDOW_S) / WINDOW_S
        realtime = {"requests_last_hour": round(count + previous * (1.0 - into_hour))}
        return self._typed(names, stored, realtime, now)

    def _typed(
        self, names: list[str], stored: list[Any], realtime: dict[str, Any], now: float
    ) -> Lookup:
        *raw, version_raw, updated_raw = stored
        found = dict(zip(names, raw, strict=True))
        version = _text(version_raw)
        status = "miss" if version is None else "hit" if version == self.version else "stale"
        values: dict[str, Any] = {}
        defaulted: set[str] = set()
        invalid: list[str] = []
        for name, spec in self.specs.items():
            if spec.source == "realtime" and name in realtime:
                values[name] = realtime[name]
                continue
            text = _text(found.get(name))
            if status != "hit" or text is None:
                values[name] = spec.default
                defaulted.add(name)
                continue
            try:
                values[name] = parse_value(spec, text, text=True)
            except FeatureValueError:
                values[name] = spec.default
                defaulted.add(name)
                invalid.append(name)
        updated = _number(updated_raw)
        age = round(now - updated, 3) if updated is not None else None
        features = Features(values, frozenset(defaulted), version)
        return Lookup(features, status, age, tuple(invalid))

    def defaults(self) -> Features:
        """Every declared feature at its default (what a failed lookup leaves)."""
        values = {name: spec.default for name, spec in self.specs.items()}
        return Features(values, frozenset(values), None)

    async def write_many(self, rows: Iterable[FeatureRow], *, merge: bool = False) -> int:
        """Write users' batch features, one pipelined round trip per call; each user's hash is
        replaced atomically (``merge``: only the given fields change, unless the hash is of
        another feature-set version). Returns the number of users written."""
        batch = list(rows)
        if not batch:
            return 0
        updated = str(round(time.time(), 3))
        mode = "merge" if merge else "replace"

        async def queue(pipe: Any) -> None:
            for row in batch:
                fields = [
                    item
                    for name, value in sorted(row.values.items())
                    for item in (name, encode_value(self.batch[name], value))
                ]
                args = [mode, self.version, *fields, "_version", self.version]
                await self._write(
                    keys=[self.key(row.tenant, row.user)],
                    args=[*args, "_updated", updated],
                    client=pipe,
                )

        await self.kv.pipeline("PIPELINE features.write", queue)
        return len(batch)

    async def read_log(self, *, batch: int = 1000) -> list[dict[str, Any]]:
        """Every record in the request-log streams (every tenant's, and the shared one of
        earlier versions), oldest first."""
        # Streams only: a key of another type under the name (another version's, an
        # operator's) made every compute fail as if Redis were down.
        pattern = glob_escaped(self.shared_log_stream) + "*"
        found = [key.decode(errors="replace") for key in await self.kv.scan(pattern, kind="stream")]
        tenants = self.log_stream("")
        streams = sorted(k for k in found if k == self.shared_log_stream or k.startswith(tenants))
        stamped: list[tuple[tuple[int, ...], dict[str, Any]]] = []
        for stream in streams:
            stamped.extend(await self._read_stream(stream, batch))
        stamped.sort(key=lambda item: item[0])
        return [record for _, record in stamped]

    async def _read_stream(
        self, stream: str, batch: int
    ) -> list[tuple[tuple[int, ...], dict[str, Any]]]:
        """A stream's readable records, each with its entry id as numbers (time, sequence)."""
        records: list[tuple[tuple[int, ...], dict[str, Any]]] = []
        start = "-"
        while True:
            entries = await self.kv.xrange(stream, start=start, count=batch)
            for entry_id, fields in entries:
                raw = fields.get(b"record")
                try:
                    record = orjson.loads(raw) if raw is not None else None
                except orjson.JSONDecodeError:
                    record = None
                if isinstance(record, dict):
                    stamp = tuple(int(part) for part in entry_id.split(b"-"))
                    records.append((stamp, record))
                else:  # another version's, or damaged: as a file's bad line is, skipped
                    log.warning("request log entry %s cannot be read: skipped", _text(entry_id))
            if len(entries) < batch:
                return records
            start = "(" + entries[-1][0].decode()


def _text(value: Any) -> str | None:
    """A stored value as text (bytes that are not UTF-8, another version's or damaged, with
    their characters replaced: a value that then fails to parse takes its default)."""
    if value is None:
        return None
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def _number(value: Any) -> float | None:
    text = _text(value)
    try:
        return float(text) if text is not None else None
    except ValueError:
        return None


def _count(value: Any) -> int:
    number = _number(value)
    return int(number) if number is not None and math.isfinite(number) else 0
