"""A job: one chat request run later, with the principal that submitted it and what became of it.

A job is kept in Redis as a hash of strings; ``Job.from_hash`` and ``Job.to_hash`` are the only
places that know the field names. The raw API key is never part of a job: the resolved principal
(tenant, user, scopes, key id, groups) is, and the key id lets a worker check that the key is
still active before it runs the job. The groups are the key's at submission: the job retrieves
what its submitter could see then (a job stored before groups existed has none, and sees only
the documents without an access list).
"""

from __future__ import annotations

import hashlib
import secrets
import time
from dataclasses import dataclass, field
from typing import Any, Final

import orjson

from pipeline.context import Principal

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


def _text(fields: dict[bytes, bytes], name: str) -> str | None:
    value = fields.get(name.encode())
    return value.decode() if value else None


def _json(fields: dict[bytes, bytes], name: str) -> Any:
    value = fields.get(name.encode())
    return orjson.loads(value) if value else None


def _time(fields: dict[bytes, bytes], name: str) -> float | None:
    value = fields.get(name.encode())
    return float(value) if value else None


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
        )

    def principal(self) -> Principal:
        return Principal(
            tenant=self.tenant,
            user=self.user,
            scopes=self.scopes,
            key_id=self.key_id,
            groups=self.groups,
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
        if self.webhook_url:
            fields["webhook_url"] = self.webhook_url
        if self.metadata is not None:
            fields["metadata"] = orjson.dumps(self.metadata).decode()
        if self.traceparent:
            fields["traceparent"] = self.traceparent
        return fields

    @classmethod
    def from_hash(cls, fields: dict[bytes, bytes]) -> Job:
        return cls(
            id=fields[b"id"].decode(),
            tenant=fields[b"tenant"].decode(),
            user=fields[b"user"].decode(),
            key_id=fields.get(b"key_id", b"").decode(),
            scopes=frozenset(s for s in fields.get(b"scopes", b"").decode().split(",") if s),
            request=_json(fields, "request") or {},
            max_attempts=int(fields.get(b"max_attempts", b"1")),
            status=fields[b"status"].decode(),
            created=float(fields[b"created"]),
            started=_time(fields, "started"),
            finished=_time(fields, "finished"),
            attempts=int(fields.get(b"attempts", b"0")),
            webhook_url=_text(fields, "webhook_url"),
            metadata=_json(fields, "metadata"),
            result=_json(fields, "result"),
            error=_json(fields, "error"),
            last_error=_json(fields, "last_error"),
            webhook_state=_text(fields, "webhook_state"),
            deliveries=_json(fields, "deliveries") or [],
            traceparent=_text(fields, "traceparent"),
            digest=fields.get(b"digest", b"").decode(),
            expires=_time(fields, "expires"),
            groups=frozenset(g for g in fields.get(b"groups", b"").decode().split(",") if g),
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
