"""The job queue in Redis: records in hashes, work in one stream read by a consumer group.

Keys (all under one hash tag, so they live in one slot of a Redis Cluster):

    {prefix}{jobs}:stream                 the work: one entry per queued run, ``id`` = job id
    {prefix}{jobs}:job:{id}               the job's record (a hash); finished ones expire
    {prefix}{jobs}:tenant:{tenant}        the tenant's jobs, a sorted set scored by creation (µs)
    {prefix}{jobs}:user:{tenant}:{user}   one user's jobs, the same way
    {prefix}{jobs}:queued                 queued jobs, scored by when they expire (the sweep)
    {prefix}{jobs}:queued:{tenant}        the tenant's queued jobs, the same way (its limit)
    {prefix}{jobs}:rate:{tenant}          the tenant's submit token bucket
    {prefix}{jobs}:idem:{tenant}:{user}:{h}   idempotency key (hashed) -> job id, with a TTL
    {prefix}{jobs}:waiting:{line}         jobs deferred for room in their key's token window,
                                          scored by creation (``scripts``: waiting lines)
    {prefix}{jobs}:waiting-lines          the lines, scored by when their head is let out
    {prefix}{jobs}:parked                 the jobs in waiting lines, scored by when they expire

Submitting is one script (stream entry, record, indexes and idempotency key together, or
nothing), which also enforces the stream's cap and the tenant's limit on queued jobs, so every
API replica shares them. Writes made by workers (finish, requeue, webhook settled) are retried
with backoff, since losing one would run a job again; unlike the response cache, the queue never
fails open.

Lifetime: a queued job that no worker starts within ``queued_ttl`` seconds fails (``job_expired``)
and is never run, whether a worker finds it late (``start``) or the sweep does. The stream is
capped: submit refuses new work at the cap, and no other XADD trims (a requeue, a webhook's
fresh entry, a job let out of a waiting line: each replaces its own job's entry), so nothing
accepted is dropped; a queued job whose entry is gone anyway (an older version's trim, a hand
deletion) fails (``job_dropped``) at the next sweep. Redis losing the consumer group (a
restart without persistence, a flush) is repaired on the spot: a read that meets ``NOGROUP``
creates the group again.

What another version (or damage) left in Redis that this code cannot read is logged and treated
as absent, never allowed to stop a worker or fail a whole listing: a stream entry without a
readable job id is acknowledged and deleted, a job record that does not parse is left out of
listings (and is a 503 ``job_unreadable`` when asked for by id), and a job key of another type
is dropped from the sweep's and listings' view.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal, TypeVar

import orjson
from redis.exceptions import ResponseError

from pipeline.errors import PipelineError, ServiceUnavailable, StoreUnavailable, error_body
from pipeline.errors import retry_after as retry_after_header
from pipeline.jobs import scripts
from pipeline.jobs.model import Job, JobUnreadable
from pipeline.store.kv import KeyValueStore, ScriptArg

log = logging.getLogger("rag.jobs")
T = TypeVar("T")

GROUP: Final = "workers"
LIST_SCAN_BUDGET: Final = 1000
SWEEP_BATCH: Final = 100
# When the queue is full nothing says when room will free up; a client polling every 10 s costs
# the service little and loses little time.
FULL_RETRY_AFTER: Final = 10.0


class UnknownCursor(KeyError):
    """A listing's ``after`` that is not one of the listed jobs."""


class Conflict(PipelineError):
    """409: the request clashes with the job's state (or with an earlier use of its key)."""

    status_code = 409
    error_type = "invalid_request_error"


class TooManyJobs(PipelineError):
    """429: the tenant submits too fast, or has as many queued jobs as it may; retry later."""

    status_code = 429
    error_type = "rate_limit_error"

    def __init__(self, message: str, *, code: str, retry_after: float) -> None:
        super().__init__(message, code=code, headers=retry_after_header(retry_after))
        self.retry_after = retry_after


class QueueFull(ServiceUnavailable):
    """503: the stream is at its cap (all tenants together); retry later."""

    def __init__(self, message: str, *, retry_after: float = FULL_RETRY_AFTER) -> None:
        super().__init__(message, code="queue_full", headers=retry_after_header(retry_after))
        self.retry_after = retry_after


def job_error(message: str, error_type: str, code: str) -> dict[str, Any]:
    error: dict[str, Any] = error_body(message, error_type, code=code)["error"]
    return error


KEY_REVOKED: Final = job_error(
    "The API key that submitted this job was revoked before the job ran; it was not run.",
    "authentication_error",
    "key_revoked",
)


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
        queued_ttl: float = 86_400,
        max_stream_length: int = 100_000,
        max_queued_per_tenant: int = 1_000,
        submit_rate: float = 10.0,
        submit_burst: int = 60,
    ) -> None:
        self.kv = kv
        self.poll_kv = poll_kv or kv
        self.max_attempts = max_attempts
        self.result_ttl = result_ttl
        self.idempotency_ttl = idempotency_ttl
        self.write_attempts = write_attempts
        self.write_backoff = write_backoff
        self.queued_ttl = queued_ttl
        self.max_stream_length = max_stream_length
        self.max_queued_per_tenant = max_queued_per_tenant
        self.submit_rate = submit_rate
        self.submit_burst = submit_burst
        self.base = base = f"{prefix}{{jobs}}:"
        self.stream = base + "stream"
        self.job_prefix = base + "job:"
        self.queued = base + "queued"
        self._tenant_prefix = base + "tenant:"
        self._user_prefix = base + "user:"
        self._idem_prefix = base + "idem:"
        # Redis out of memory (kv.KeyValueStore.script): a job's start is refused (its answer
        # could not be stored, and each start counts an attempt); what records a job's
        # outcome, already paid for, runs all the same.
        self._scripts = {
            name: kv.script(getattr(scripts, name), when_full=WHEN_FULL.get(name, "as redis"))
            for name in (
                "SUBMIT",
                "TAKE",
                "START",
                "FINISH",
                "SETTLE_WEBHOOK",
                "RECORD_DELIVERIES",
                "REQUEUE",
                "PARK",
                "NEXT",
                "CANCEL",
                "SETTLE_KEY",
                "LIST",
                "DROP_ENTRIES",
            )
        }
        self._sweep_script = self.poll_kv.script(scripts.SWEEP)
        self._promote_script = self.poll_kv.script(scripts.PROMOTE)

    # --- the API side ---

    async def take_submit_token(self, tenant: str) -> None:
        """Count one submit against the tenant's rate (a token bucket in Redis, shared by every
        API replica); raises ``TooManyJobs`` when it has none left, ``StoreUnavailable``."""
        taken, wait = await self._run(
            "TAKE", [f"{self.base}rate:{tenant}"], [self.submit_rate, self.submit_burst]
        )
        if not int(taken):
            raise TooManyJobs(
                f"Too many job submissions: at most {self.submit_rate * 60:g} a minute per "
                f"tenant (bursts of {self.submit_burst}). Retry after the time in Retry-After.",
                code="rate_limit_exceeded",
                retry_after=float(wait),
            )

    async def submit(self, job: Job, idempotency_key: str | None = None) -> tuple[Job, bool]:
        """Store and enqueue ``job``; returns it and True, or, for a repeated idempotency key,
        the job first submitted with it and False. Raises ``QueueFull`` (the stream is at its
        cap), ``TooManyJobs`` (the tenant has its most queued jobs), ``StoreUnavailable``."""
        idem = self._idem_key(job.tenant, job.user, idempotency_key)
        now = time.time()
        job.expires = now + self.queued_ttl
        fields = [item for pair in job.to_hash().items() for item in pair]
        cutoff = int((now - 2 * self.result_ttl) * 1_000_000)
        kind, value = await self._run(
            "SUBMIT",
            [
                self.job_prefix + job.id,
                self.stream,
                self._tenant_prefix + job.tenant,
                idem,
                self._user_index(job.tenant, job.user),
                self.queued,
                self._tenant_queued(job.tenant),
            ],
            [
                job.id,
                int(job.created * 1_000_000),
                self.idempotency_ttl,
                "1" if idempotency_key else "0",
                self.job_prefix,
                cutoff,
                self.max_stream_length,
                self.max_queued_per_tenant,
                repr(job.expires),
                repr(now),
                *fields,
            ],
        )
        if kind == 2:
            raise QueueFull(
                f"The job queue is full ({self.max_stream_length} jobs queued or running); "
                "nothing was stored. Retry later."
            )
        if kind == 3:
            raise TooManyJobs(
                f"This tenant has {self.max_queued_per_tenant} jobs queued, the most it may "
                "have; nothing was stored. Retry when some have run (or cancel some).",
                code="too_many_queued_jobs",
                retry_after=FULL_RETRY_AFTER,
            )
        if kind == 1:
            return job, True
        job_id = value
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
        """The job, or None; raises ``JobUnreadable`` for a record this code cannot read."""
        return _parsed(job_id, await self.kv.hgetall(self.job_prefix + job_id))

    async def get_for(self, tenant: str, job_id: str, user: str | None = None) -> Job | None:
        """The job if it exists and belongs to ``tenant`` (and to ``user``, unless None: a
        tenant-wide view); anyone else's job is None. Ownership is checked on the raw record
        first, so only its owner learns that an unreadable record (``JobUnreadable``) exists;
        a key that holds another type than a hash names no owner, so it is nobody's job."""
        try:
            fields = await self.kv.hgetall(self.job_prefix + job_id)
        except StoreUnavailable as exc:
            if not _redis_refused(exc, "WRONGTYPE"):
                raise
            log.error("job %s: its key holds another type than a hash", job_id)
            return None
        if fields.get(b"tenant") != tenant.encode():
            return None
        if user is not None and fields.get(b"user") != user.encode():
            return None
        return _parsed(job_id, fields)

    async def page(
        self, tenant: str, *, limit: int, after: str | None, user: str | None = None
    ) -> tuple[list[Job], bool, str | None]:
        """The jobs of ``user`` of ``tenant`` (of every user of it when None), newest first,
        after the job ``after``; whether more follow; and the id to continue after (the last
        listed, None when none was). Raises ``UnknownCursor`` for an ``after`` that is not one
        of those jobs. A record that cannot be read is left out (and logged): one damaged job
        must not hide all the others, nor stop a client paging past it (the id to continue
        after may be a record left out)."""
        index = self._tenant_prefix + tenant if user is None else self._user_index(tenant, user)
        reply = await self._run(
            "LIST",
            [index],
            [self.job_prefix, after or "", limit, LIST_SCAN_BUDGET],
        )
        if reply[0] == 0:
            raise UnknownCursor(after)
        jobs = [job for flat in reply[2:] if (job := _listed(flat)) is not None]
        last = _pairs(reply[-1]).get(b"id") if len(reply) > 2 else None
        cursor = last.decode(errors="replace") if isinstance(last, bytes) else None
        return jobs, bool(reply[1]), cursor

    async def cancel(self, tenant: str, job_id: str, user: str | None = None) -> str:
        """Cancel a queued job of ``tenant`` (of ``user`` unless None): 'cancelled', 'missing',
        or the status that prevents it."""
        reply = await self._run(
            "CANCEL",
            [self.job_prefix + job_id],
            [tenant, repr(time.time()), self.result_ttl, user or "", self.base],
        )
        return reply.decode() if isinstance(reply, bytes) else str(reply)

    async def settle_revoked(self, tenant: str, key_id: str) -> int:
        """Fail the queued jobs that the key ``key_id`` submitted (it was revoked): they are
        never run. Returns how many. (A job a worker started meanwhile fails its auth check.)"""
        settled: int = await self._run(
            "SETTLE_KEY",
            [self._tenant_queued(tenant)],
            [*self._settling(), key_id, orjson.dumps(KEY_REVOKED).decode()],
        )
        return settled

    async def sweep(self) -> tuple[int, int]:
        """Fail queued jobs past their expiry, and queued jobs whose stream entry is gone;
        (expired, dropped). Any worker may run it at any time: each job is settled once."""
        expired, dropped, *rest = await self.poll_kv.run_script(  # untraced: every 10 s
            "sweep",
            self._sweep_script,
            [self.queued],
            [
                *self._settling(),
                SWEEP_BATCH,
                orjson.dumps(self.expired_error()).decode(),
                orjson.dumps(DROPPED).decode(),
            ],
        )
        if rest and int(rest[0]):
            log.error("job sweep: dropped %d queued ids whose job key is not a hash", int(rest[0]))
        return int(expired), int(dropped)

    def expired_error(self) -> dict[str, Any]:
        return job_error(
            f"The job was not started within {self.queued_ttl:g} s of being queued; it expired "
            "and was not run. Submit it again.",
            "timeout",
            "job_expired",
        )

    def _settling(self) -> list[ScriptArg]:
        return [self.base, GROUP, repr(time.time()), self.result_ttl]

    # --- the worker side ---

    async def ensure_group(self) -> None:
        await self.kv.xgroup_create(self.stream, GROUP)

    async def read(self, consumer: str, *, count: int, block_ms: int) -> list[Delivery]:
        entries = await self._regrouping(
            self.poll_kv.xreadgroup(self.stream, GROUP, consumer, count=count, block_ms=block_ms)
        )
        return await self._deliveries(entries or [])

    async def reclaim(self, consumer: str, *, min_idle_ms: int, count: int) -> list[Delivery]:
        """Entries another worker took and then left silent for ``min_idle_ms`` (it died)."""
        entries = await self._regrouping(
            self.poll_kv.xautoclaim(
                self.stream, GROUP, consumer, min_idle_ms=min_idle_ms, count=count
            )
        )
        return await self._deliveries(entries or [])

    async def _deliveries(self, entries: list[tuple[bytes, dict[bytes, bytes]]]) -> list[Delivery]:
        """The entries as deliveries. One whose job id cannot be read names no job any worker
        could run: it is acknowledged and deleted here (else every worker that takes it over
        after the visibility timeout meets it again), and the rest of the batch goes on."""
        deliveries, unreadable = [], []
        for entry_id, fields in entries:
            entry = entry_id.decode()  # stream ids are ASCII: Redis writes them
            try:
                deliveries.append(Delivery(entry=entry, job_id=fields.get(b"id", b"").decode()))
            except UnicodeDecodeError:
                log.error("job stream entry %s has no readable job id; dropping it", entry)
                unreadable.append(entry)
        if unreadable:
            await self._run("DROP_ENTRIES", [self.stream], [GROUP, *unreadable])
        return deliveries

    async def touch(self, consumer: str, entries: list[str]) -> None:
        """Heartbeat: the entries this worker still works on are not idle."""
        await self._regrouping(self.poll_kv.xclaim_touch(self.stream, GROUP, consumer, entries))

    async def _regrouping(self, call: Awaitable[T]) -> T | None:
        """``call``; if Redis lost the consumer group (a restart without persistence, a flush),
        the group is created again and the call's answer is None: nothing was read."""
        try:
            return await call
        except StoreUnavailable as exc:
            if not _redis_refused(exc, "NOGROUP"):
                raise
        log.warning("the job stream's consumer group is gone (Redis lost its data?); recreating")
        await self.ensure_group()
        return None

    async def start(self, delivery: Delivery, lease: str) -> tuple[str, int, str]:
        """Take the job of ``delivery`` under ``lease``: ('run', attempt, line) and the others
        that ``scripts.START`` describes (an expired job is failed and acknowledged there);
        ``line`` names the waiting line a run was let out of ('' for none)."""
        kind, attempts, *line = await self._persist(
            "START",
            delivery,
            [
                GROUP,
                delivery.entry,
                lease,
                repr(time.time()),
                self.base,
                self.result_ttl,
                orjson.dumps(self.expired_error()).decode(),
            ],
        )
        return kind.decode(), int(attempts), line[0].decode() if line else ""

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
        expires = repr(time.time() + self.queued_ttl)
        done = await self._persist(
            "REQUEUE",
            delivery,
            [
                GROUP,
                delivery.entry,
                lease,
                error,
                "1" if refund else "0",
                self.base,
                expires,
            ],
        )
        return bool(done)

    async def park(self, delivery: Delivery, lease: str, wait: float) -> bool:
        """Queue the job again as it was before ``start``, without running it (its key's token
        window is full): out of the stream, at its place in its key's waiting line, whose head
        is tried again in ``wait`` seconds (``scripts.PARK``). False when the lease was lost."""
        done = await self._persist(
            "PARK",
            delivery,
            [
                GROUP,
                delivery.entry,
                lease,
                self.base,
                repr(max(0.0, wait)),
                repr(time.time()),
                self.queued_ttl,
            ],
        )
        return bool(done)

    async def promote(self, lines: int, fallback: float) -> int:
        """Let the heads of up to ``lines`` waiting lines that are due out into the stream
        (``scripts.PROMOTE``); a line whose head went out is due again in ``fallback`` seconds
        should its worker never say how it went. How many went out."""
        out: int = await self.poll_kv.run_script(  # untraced: every pass of every worker
            "promote",
            self._promote_script,
            [self.base + "waiting-lines"],
            [self.base, max(1, lines), repr(fallback)],
        )
        return out

    async def next_in_line(self, line: str, fallback: float) -> int:
        """The job let out of ``line`` holds its tokens, or has ended: let the next two out now
        (``scripts.NEXT``). How many went out."""
        out: int = await self._run(
            "NEXT", [self.base + "waiting-lines"], [self.base, line, repr(fallback)]
        )
        return out

    async def settle_webhook(
        self, delivery: Delivery, lease: str, state: str, deliveries: list[dict[str, Any]]
    ) -> bool:
        """The delivery's final state, written with its attempts; False if the lease is lost."""
        record = orjson.dumps(deliveries).decode()
        done = await self._persist(
            "SETTLE_WEBHOOK",
            delivery,
            [GROUP, delivery.entry, lease, state, self.result_ttl, record],
        )
        return bool(done)

    async def record_deliveries(
        self, delivery: Delivery, lease: str, deliveries: list[dict[str, Any]]
    ) -> bool:
        """The attempts so far (not retried: ``settle_webhook`` writes them all again); False
        if the lease is lost."""
        done = await self._run(
            "RECORD_DELIVERIES",
            [self.job_prefix + delivery.job_id],
            [lease, orjson.dumps(deliveries).decode()],
        )
        return bool(done)

    async def backlog(self) -> int:
        """Entries in the stream (queued plus running)."""
        return await self.kv.xlen(self.stream)

    # --- plumbing ---

    def _user_index(self, tenant: str, user: str) -> str:
        return f"{self._user_prefix}{tenant}:{user}"

    def _tenant_queued(self, tenant: str) -> str:
        return f"{self.queued}:{tenant}"

    def _idem_key(self, tenant: str, user: str, key: str | None) -> str:
        """Per user: another user's key must not hand back (and so reveal) someone's job."""
        digest = hashlib.sha256((key or "").encode()).hexdigest()
        return f"{self._idem_prefix}{tenant}:{user}:{digest}"

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


WHEN_FULL: Final[dict[str, Literal["refuse", "run"]]] = {
    "START": "refuse",
    "FINISH": "run",
    "REQUEUE": "run",
    "PARK": "run",
    "SETTLE_WEBHOOK": "run",
}

DROPPED: Final = job_error(
    "The job queue was over its cap and this job's entry was dropped before a worker took "
    "it; it was not run. Submit it again.",
    "api_error",
    "job_dropped",
)


def _redis_refused(exc: StoreUnavailable, error: str) -> bool:
    """Whether Redis answered the command with the error ``error`` (NOGROUP, WRONGTYPE)."""
    cause = exc.__cause__
    return isinstance(cause, ResponseError) and str(cause).startswith(error)


def _pairs(flat: list[bytes]) -> dict[bytes, bytes]:
    return dict(zip(flat[::2], flat[1::2], strict=True))


def _parsed(job_id: str, fields: dict[bytes, bytes]) -> Job | None:
    """The job stored as ``fields`` (None when there are none); ``JobUnreadable``, logged and
    naming ``job_id``, when they cannot be read."""
    if not fields:
        return None
    try:
        return Job.from_hash(fields)
    except JobUnreadable as exc:
        log.error("job %s: its record cannot be read (%s)", job_id, exc.detail)
        raise JobUnreadable(job_id, exc.detail) from exc.__cause__


def _listed(flat: list[bytes]) -> Job | None:
    """A job of a listing, or None (logged) for one whose record cannot be read."""
    try:
        return Job.from_hash(_pairs(flat))
    except JobUnreadable as exc:
        log.error(
            "job %s left out of a listing: its record cannot be read (%s)", exc.job_id, exc.detail
        )
        return None
