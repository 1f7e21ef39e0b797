"""A job: one chat request run later, with the principal that submitted it and what became of it.

A job is kept in Redis as a hash of strings; ``Job.from_hash`` and ``Job.to_hash`` are the only
places that know the field names. The raw API key is never part of a job: the resolved principal
(tenant, user, scopes, key id, groups) is, and the key id lets a worker check that the key is
still active before it runs the job. The groups are the key's at submission: the job retrieves
what its submitter could see then (a job stored before groups existed has none, and sees only
the documents without an access list).

Replicas of different versions share one Redis, and a record may be damaged: a record this code
cannot read raises ``JobUnreadable`` (never a bare ``KeyError`` or ``ValueError``), so each
caller can skip it, fail it or answer for it instead of dying on it.
"""

from __future__ import annotations

import hashlib
import math
import secrets
import time
from dataclasses import dataclass, field
from typing import Any, Final

import orjson

from pipeline.context import Principal
from pipeline.errors import ServiceUnavailable
from pipeline.store.keys import read_limit

QUEUED: Final = "queued"
RUNNING: Final = "running"
SUCCEEDED: Final = "succeeded"
FAILED: Final = "failed"
CANCELLED: Final = "cancelled"
STATUSES: Final = (QUEUED, RUNNING, SUCCEEDED, FAILED, CANCELLED)
FINISHED: Final = frozenset({SUCCEEDED, FAILED, CANCELLED})

JOB_ID_PREFIX: Final = "job_"


def new_job_id() -> str:
    return JOB_ID_PREFIX + secrets.token_hex(12)


def is_job_id(value: str) -> bool:
    body = value.removeprefix(JOB_ID_PREFIX)
    return (
        value.startswith(JOB_ID_PREFIX)
        and len(body) == 24
        and all(c in "0123456789abcdef" for c in body)
    )


def body_digest(request: dict[str, Any], webhook_url: str | None, metadata: Any) -> str:
    """What an idempotent retry must repeat: the same key with another body is a conflict."""
    canonical = orjson.dumps(
        {"request": request, "webhook_url": webhook_url, "metadata": metadata},
        option=orjson.OPT_SORT_KEYS,
    )
    return hashlib.sha256(canonical).hexdigest()


class JobUnreadable(ServiceUnavailable):
    """A stored job record that this code cannot read: damaged, or written by a version that
    stores it otherwise. A 503 for a caller: during a rolling upgrade another replica may read
    it, and the record is not the caller's fault. The message names no field of it (``detail``
    does, for the log)."""

    def __init__(self, job_id: str, detail: str) -> None:
        super().__init__(
            f"The stored job '{job_id}' cannot be read by this server; retry later.",
            code="job_unreadable",
        )
        self.job_id = job_id
        self.detail = detail


def _raw(fields: dict[bytes, bytes], name: str) -> str | None:
    value = fields.get(name.encode())
    return value.decode() if value else None


def _text(fields: dict[bytes, bytes], name: str) -> str:
    value = fields.get(name.encode())
    if value is None:
        raise ValueError(f"{name} is missing")
    return value.decode()


def _json(fields: dict[bytes, bytes], name: str, kind: type) -> Any:
    """The field's JSON, which must be a ``kind`` (or absent: None)."""
    value = fields.get(name.encode())
    if not value:
        return None
    decoded = orjson.loads(value)
    if not isinstance(decoded, kind):
        raise ValueError(f"{name} is not a JSON {kind.__name__}")
    return decoded


def _number(fields: dict[bytes, bytes], name: str) -> float | None:
    value = fields.get(name.encode())
    if not value:
        return None
    number = float(value)
    if not math.isfinite(number):  # the API shows it as an integer
        raise ValueError(f"{name} is not a finite number")
    return number


def _count(fields: dict[bytes, bytes], name: str, default: int) -> int:
    value = fields.get(name.encode())
    return int(value) if value else default


def _names(fields: dict[bytes, bytes], name: str) -> frozenset[str]:
    return frozenset(item for item in (_raw(fields, name) or "").split(",") if item)


@dataclass
class Job:
    """One job, as stored. ``request`` is the chat-completions body without the job's fields."""

    id: str
    tenant: str
    user: str
    key_id: str
    scopes: frozenset[str]
    request: dict[str, Any]
    max_attempts: int
    status: str = QUEUED
    created: float = field(default_factory=time.time)
    started: float | None = None
    finished: float | None = None
    attempts: int = 0
    webhook_url: str | None = None
    metadata: dict[str, str] | None = None
    result: dict[str, Any] | None = None
    error: dict[str, Any] | None = None
    last_error: dict[str, Any] | None = None
    webhook_state: str | None = None  # pending, delivered, failed
    deliveries: list[dict[str, Any]] = field(default_factory=list)
    traceparent: str | None = None
    digest: str = ""
    expires: float | None = None  # a queued job not started by then fails (set by the queue)
    groups: frozenset[str] = frozenset()  # the submitting key's, for access lists
    # The submitting key's own limits per minute, which its answer's tokens are charged to
    # (None: the tenant's); a job made before they were kept is charged as the tenant's.
    rpm: int | None = None
    tpm: int | None = None

    @classmethod
    def create(
        cls,
        principal: Principal,
        request: dict[str, Any],
        *,
        max_attempts: int,
        webhook_url: str | None = None,
        metadata: dict[str, str] | None = None,
        traceparent: str | None = None,
    ) -> Job:
        return cls(
            id=new_job_id(),
            tenant=principal.tenant,
            user=principal.user,
            key_id=principal.key_id,
            scopes=principal.scopes,
            request=request,
            max_attempts=max_attempts,
            webhook_url=webhook_url,
            metadata=metadata,
            traceparent=traceparent,
            digest=body_digest(request, webhook_url, metadata),
            groups=principal.groups,
            rpm=principal.rpm,
            tpm=principal.tpm,
        )

    def principal(self) -> Principal:
        return Principal(
            tenant=self.tenant,
            user=self.user,
            scopes=self.scopes,
            key_id=self.key_id,
            groups=self.groups,
            rpm=self.rpm,
            tpm=self.tpm,
        )

    def to_hash(self) -> dict[str, str]:
        """The fields written at submit (the rest are written by workers as the job runs)."""
        fields = {
            "id": self.id,
            "tenant": self.tenant,
            "user": self.user,
            "key_id": self.key_id,
            "scopes": ",".join(sorted(self.scopes)),
            "request": orjson.dumps(self.request).decode(),
            "max_attempts": str(self.max_attempts),
            "status": self.status,
            "created": repr(self.created),
            "attempts": str(self.attempts),
            "digest": self.digest,
        }
        if self.groups:
            fields["groups"] = ",".join(sorted(self.groups))
        for name, limit in (("rpm", self.rpm), ("tpm", self.tpm)):
            if limit is not None:
                fields[name] = str(limit)
        if self.webhook_url:
            fields["webhook_url"] = self.webhook_url
        if self.metadata is not None:
            fields["metadata"] = orjson.dumps(self.metadata).decode()
        if self.traceparent:
            fields["traceparent"] = self.traceparent
        return fields

    @classmethod
    def from_hash(cls, fields: dict[bytes, bytes]) -> Job:
        """The job stored as ``fields``; raises ``JobUnreadable`` when they cannot be read."""
        try:
            return cls._from_fields(fields)
        except (ValueError, TypeError) as exc:  # UnicodeDecodeError and JSON errors among them
            raw_id = fields.get(b"id", b"")
            shown = raw_id.decode(errors="replace")[:40] if isinstance(raw_id, bytes) else "?"
            raise JobUnreadable(shown, f"{type(exc).__name__}: {exc}") from exc

    @classmethod
    def _from_fields(cls, fields: dict[bytes, bytes]) -> Job:
        created = _number(fields, "created")
        if created is None:
            raise ValueError("created is missing")
        return cls(
            id=_text(fields, "id"),
            tenant=_text(fields, "tenant"),
            user=_text(fields, "user"),
            key_id=_raw(fields, "key_id") or "",
            scopes=_names(fields, "scopes"),
            request=_json(fields, "request", dict) or {},
            max_attempts=_count(fields, "max_attempts", 1),
            status=_text(fields, "status"),
            created=created,
            started=_number(fields, "started"),
            finished=_number(fields, "finished"),
            attempts=_count(fields, "attempts", 0),
            webhook_url=_raw(fields, "webhook_url"),
            metadata=_json(fields, "metadata", dict),
            result=_json(fields, "result", dict),
            error=_json(fields, "error", dict),
            last_error=_json(fields, "last_error", dict),
            webhook_state=_raw(fields, "webhook_state"),
            deliveries=_json(fields, "deliveries", list) or [],
            traceparent=_raw(fields, "traceparent"),
            digest=_raw(fields, "digest") or "",
            expires=_number(fields, "expires"),
            groups=_names(fields, "groups"),
            rpm=read_limit(fields.get(b"rpm")),
            tpm=read_limit(fields.get(b"tpm")),
        )

    def readable_by(self, reader: Principal) -> bool:
        """Whether ``reader`` may read the job's answer: it was built from what the submitting
        key could see (its user, its groups), so only a reader of the same user in at least
        those groups may (an admin of the tenant, or the same user's key with fewer groups, sees
        the job's status but not its answer)."""
        return (
            reader.tenant == self.tenant
            and reader.user == self.user
            and reader.groups >= self.groups
        )

    def public(self, reader: Principal | None = None) -> dict[str, Any]:
        """The job as the API shows it (and as a webhook delivers it); no prompt text. For a
        ``reader`` that may not read the answer (``readable_by``), ``result`` is null and
        ``result_withheld`` true."""
        withheld = reader is not None and self.result is not None and not self.readable_by(reader)
        body: dict[str, Any] = {
            "id": self.id,
            "object": "job",
            "status": self.status,
            "model": self.request.get("model"),
            "created_at": int(self.created),
            "started_at": int(self.started) if self.started else None,
            "finished_at": int(self.finished) if self.finished else None,
            "attempts": self.attempts,
            "max_attempts": self.max_attempts,
            "expires_at": int(self.expires) if self.expires and self.status == QUEUED else None,
            "metadata": self.metadata,
            "result": None if withheld else self.result,
            "error": self.error,
            "last_error": self.last_error,
        }
        if withheld:
            body["result_withheld"] = True
        if self.webhook_url:
            body["webhook"] = {
                "url": self.webhook_url,
                "state": self.webhook_state,
                "deliveries": self.deliveries,
            }
        return body
