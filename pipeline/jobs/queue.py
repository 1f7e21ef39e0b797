"""The job queue in Redis: records in hashes, work in one stream read by a consumer group.

Keys (all under one hash tag, so they live in one slot of a Redis Cluster):

    {prefix}{jobs}:stream              the work: one entry per queued run, ``id`` = job id
    {prefix}{jobs}:job:{id}            the job's record (a hash); finished ones expire
    {prefix}{jobs}:tenant:{tenant}     the tenant's jobs, a sorted set scored by creation (µs)
    {prefix}{jobs}:idem:{tenant}:{h}   idempotency key (hashed) -> job id, with a TTL

Submitting is one script (stream entry, record, index and idempotency key together, or nothing).
Writes made by workers (finish, requeue, webhook settled) are retried with backoff, since losing
one would run a job again; unlike the response cache, the queue never fails open.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

import orjson

from pipeline.errors import PipelineError
from pipeline.jobs import scripts
from pipeline.jobs.model import Job
from pipeline.kv import KeyValueStore, ScriptArg, StoreUnavailable

GROUP: Final = "workers"
LIST_SCAN_BUDGET: Final = 1000


class Conflict(PipelineError):
    """409: the request clashes with the job's state (or with an earlier use of its key)."""

    status_code = 409
    error_type = "invalid_request_error"


@dataclass(frozen=True)
class Delivery:
    """One stream entry handed to a worker: which job to look at."""

    entry: str
    job_id: str


class JobQueue:
    """Submit, look up, list and cancel jobs; hand their runs to workers exactly once at a time.

    ``poll_kv`` carries the blocking reads of workers (a client whose socket timeout is longer
    than a read blocks, and whose commands are not traced: an idle worker would otherwise emit
    a trace every second).
    """

    def __init__(
        self,
        kv: KeyValueStore,
        *,
        prefix: str = "rag:",
        max_attempts: int = 3,
        result_ttl: int = 86_400,
        idempotency_ttl: int = 86_400,
        poll_kv: KeyValueStore | None = None,
        write_attempts: int = 6,
        write_backoff: float = 0.5,
    ) -> None:
        self.kv = kv
        self.poll_kv = poll_kv or kv
        self.max_attempts = max_attempts
        self.result_ttl = result_ttl
        self.idempotency_ttl = idempotency_ttl
        self.write_attempts = write_attempts
        self.write_backoff = write_backoff
        base = f"{prefix}{{jobs}}:"
        self.stream = base + "stream"
        self.job_prefix = base + "job:"
        self._tenant_prefix = base + "tenant:"
        self._idem_prefix = base + "idem:"
        self._scripts = {
            name: kv.script(getattr(scripts, name))
            for name in ("SUBMIT", "START", "FINISH", "SETTLE_WEBHOOK", "REQUEUE", "CANCEL", "LIST")
        }

    # --- the API side ---

    async def submit(self, job: Job, idempotency_key: str | None = None) -> tuple[Job, bool]:
        """Store and enqueue ``job``; returns it and True, or, for a repeated idempotency key,
        the job first submitted with it and False. Raises ``StoreUnavailable``."""
        idem = self._idem_key(job.tenant, idempotency_key)
        fields = [item for pair in job.to_hash().items() for item in pair]
        cutoff = int((time.time() - 2 * self.result_ttl) * 1_000_000)
        created, job_id = await self._run(
            "SUBMIT",
            [self.job_prefix + job.id, self.stream, self._tenant_prefix + job.tenant, idem],
            [
                job.id,
                int(job.created * 1_000_000),
                self.idempotency_ttl,
                "1" if idempotency_key else "0",
                self.job_prefix,
                cutoff,
                *fields,
            ],
        )
        if created:
            return job, True
        existing = await self.get(job_id.decode())
        if existing is None:  # expired between the two calls: submit it anew
            return await self.submit(job, idempotency_key)
        if existing.digest != job.digest:
            raise Conflict(
                "This Idempotency-Key was already used with a different request body.",
                param="Idempotency-Key",
                code="idempotency_key_reused",
            )
        return existing, False

    async def get(self, job_id: str) -> Job | None:
        fields = await self.kv.hgetall(self.job_prefix + job_id)
        return Job.from_hash(fields) if fields else None

    async def get_for(self, tenant: str, job_id: str) -> Job | None:
        """The job if it exists and belongs to ``tenant``; another tenant's job is None."""
        job = await self.get(job_id)
        return job if job is not None and job.tenant == tenant else None

    async def page(self, tenant: str, *, limit: int, after: str | None) -> tuple[list[Job], bool]:
        """The tenant's jobs, newest first, after the job ``after``; and whether more follow.
        Raises ``KeyError`` for an ``after`` that is not one of the tenant's jobs."""
        reply = await self._run(
            "LIST",
            [self._tenant_prefix + tenant],
            [self.job_prefix, after or "", limit, LIST_SCAN_BUDGET],
        )
        if reply[0] == 0:
            raise KeyError(after)
        jobs = [Job.from_hash(_pairs(flat)) for flat in reply[2:]]
        return jobs, bool(reply[1])

    async def cancel(self, tenant: str, job_id: str) -> str:
        """Cancel a queued job: 'cancelled', 'missing', or the status that prevents it."""
        reply = await self._run(
            "CANCEL", [self.job_prefix + job_id], [tenant, repr(time.time()), self.result_ttl]
        )
        return reply.decode() if isinstance(reply, bytes) else str(reply)

    # --- the worker side ---

    async def ensure_group(self) -> None:
        await self.kv.xgroup_create(self.stream, GROUP)

    async def read(self, consumer: str, *, count: int, block_ms: int) -> list[Delivery]:
        entries = await self.poll_kv.xreadgroup(
            self.stream, GROUP, consumer, count=count, block_ms=block_ms
        )
        return _deliveries(entries)

    async def reclaim(self, consumer: str, *, min_idle_ms: int, count: int) -> list[Delivery]:
        """Entries another worker took and then left silent for ``min_idle_ms`` (it died)."""
        entries = await self.poll_kv.xautoclaim(
            self.stream, GROUP, consumer, min_idle_ms=min_idle_ms, count=count
        )
        return _deliveries(entries)

    async def touch(self, consumer: str, entries: list[str]) -> None:
        """Heartbeat: the entries this worker still works on are not idle."""
        await self.poll_kv.xclaim_touch(self.stream, GROUP, consumer, entries)

    async def start(self, delivery: Delivery, lease: str) -> tuple[str, int]:
        """Take the job of ``delivery`` under ``lease``: ('run', attempt) and the others that
        ``scripts.START`` describes."""
        kind, attempts = await self._persist(
            "START", delivery, [GROUP, delivery.entry, lease, repr(time.time())]
        )
        return kind.decode(), int(attempts)

    async def finish(
        self, delivery: Delivery, lease: str, status: str, payload: dict[str, Any]
    ) -> int:
        """Write the result (succeeded) or the error (failed); 0 if the lease was lost, 2 if a
        webhook is now owed."""
        field = "result" if status == "succeeded" else "error"
        body = orjson.dumps(payload).decode()
        args: list[ScriptArg] = [GROUP, delivery.entry, lease, status, repr(time.time())]
        done: int = await self._persist("FINISH", delivery, [*args, self.result_ttl, field, body])
        return done

    async def requeue(
        self, delivery: Delivery, lease: str, last_error: dict[str, Any] | None, *, refund: bool
    ) -> bool:
        """Queue the job again (a transient failure, or a worker stopping mid-job: refund)."""
        error = orjson.dumps(last_error).decode() if last_error else ""
        done = await self._persist(
            "REQUEUE", delivery, [GROUP, delivery.entry, lease, error, "1" if refund else "0"]
        )
        return bool(done)

    async def settle_webhook(self, delivery: Delivery, lease: str, state: str) -> bool:
        done = await self._persist(
            "SETTLE_WEBHOOK", delivery, [GROUP, delivery.entry, lease, state, self.result_ttl]
        )
        return bool(done)

    async def record_deliveries(self, job_id: str, deliveries: list[dict[str, Any]]) -> None:
        await self.kv.hset(
            self.job_prefix + job_id, {"deliveries": orjson.dumps(deliveries).decode()}
        )

    async def backlog(self) -> int:
        """Entries in the stream (queued plus running)."""
        return await self.kv.xlen(self.stream)

    # --- plumbing ---

    def _idem_key(self, tenant: str, key: str | None) -> str:
        digest = hashlib.sha256((key or "").encode()).hexdigest()
        return f"{self._idem_prefix}{tenant}:{digest}"

    async def _run(self, name: str, keys: Sequence[str], args: Sequence[ScriptArg]) -> Any:
        return await self.kv.run_script(name.lower(), self._scripts[name], keys, args)

    async def _persist(self, name: str, delivery: Delivery, args: Sequence[ScriptArg]) -> Any:
        """A worker's write, retried with exponential backoff while Redis is unreachable."""
        keys = [self.job_prefix + delivery.job_id, self.stream]
        delay = self.write_backoff
        for attempt in range(self.write_attempts):
            try:
                return await self._run(name, keys, args)
            except StoreUnavailable:
                if attempt == self.write_attempts - 1:
                    raise
                await asyncio.sleep(delay)
                delay *= 2
        raise AssertionError("unreachable")


def _pairs(flat: list[bytes]) -> dict[bytes, bytes]:
    return dict(zip(flat[::2], flat[1::2], strict=True))


def _deliveries(entries: list[tuple[bytes, dict[bytes, bytes]]]) -> list[Delivery]:
    return [
        Delivery(entry=entry_id.decode(), job_id=fields.get(b"id", b"").decode())
        for entry_id, fields in entries
    ]
