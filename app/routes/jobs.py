"""/v1/jobs: submit a chat request to run later, look it up, list, cancel.

A job body is a chat-completions body (not streamed) plus ``webhook_url`` and ``metadata``;
any other top-level field is refused (400 naming it), so nothing unknown is ever stored.
Everything that can be checked at submit is checked then (schema, model, context size, webhook
URL: its form, and that its host resolves, within seconds, to addresses a webhook may reach),
so a job that is queued can only fail for reasons that arise when it runs. When Redis cannot be
reached the answer is a 503 with ``Retry-After``: a job is never acknowledged unless
it is stored. A tenant that submits too fast, or has too many jobs queued, gets a 429 with
``Retry-After``; a full queue is a 503 with it.

A job belongs to the user who submitted it: another user of the tenant gets a 404 for it, as for
a job that does not exist, unless their key has the ``admin`` scope (which also lists every
user's jobs with ``all_users=true``). Another tenant's job is a 404 for every key.

A job whose stored record this server cannot read (damaged, or written by another version
during a rolling upgrade) is a 503 ``job_unreadable`` for its owner (a 404 for anyone else, and
for a record that names no owner), and is left out of listings; it is logged.
"""

from __future__ import annotations

import asyncio
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request
from opentelemetry import trace
from opentelemetry.propagate import inject
from pydantic import ConfigDict, Field, StrictBool, field_validator
from starlette.responses import Response

from app.http import answers
from app.http.auth import PRINCIPAL, bearer_token
from app.http.bodies import BodyLimits, read_body, request_body
from app.http.errors import shown_name
from app.http.openapi import answers as declared
from app.http.openapi import link
from app.http.responses import JSONResponse
from app.http.schemas import ChatCompletionRequest
from app.path import Paths, PathsDep
from app.services import Services, ServicesDep
from app.stores import job_queue
from pipeline.context import Principal, RequestContext
from pipeline.errors import (
    AuthenticationFailed,
    InvalidRequest,
    NotFound,
    PayloadTooLarge,
    PermissionDenied,
)
from pipeline.jobs.model import Job, is_job_id
from pipeline.jobs.queue import Conflict, UnknownCursor
from pipeline.jobs.urls import UrlPolicy, WebhookUrlRefused
from pipeline.stages.auth import Authenticate
from pipeline.telemetry import attributes as attr

router = APIRouter(tags=["jobs"])

MetadataKey = Annotated[str, Field(min_length=1, max_length=64)]
MetadataValue = Annotated[str, Field(max_length=512)]
ADMIN = "admin"
LIMITS = BodyLimits()


class JobRequest(ChatCompletionRequest):
    """A chat-completions body plus the job's own fields; ``stream`` must be false. A field
    neither knows is refused, as in a chat request; ``metadata`` is the job's (returned as
    given), not OpenAI's ignored one."""

    model_config = ConfigDict(extra="forbid")
    ignored = ChatCompletionRequest.ignored - {"metadata"}  # the job's own, below

    # Streamed answers are refused (``_not_streamed``): the document says so.
    stream: StrictBool = Field(False, json_schema_extra={"const": False})
    webhook_url: str | None = Field(
        None,
        description="POSTed the job when it finishes: an https URL whose host resolves to "
        "public addresses (or is in RAG_JOBS__WEBHOOK_ALLOW).",
        json_schema_extra={
            "format": "uri",
            "pattern": "^https?://[^@/?#\\s]+(/\\S*)?$",
            "maxLength": 2048,
        },
    )
    metadata: dict[MetadataKey, MetadataValue] | None = Field(
        None, max_length=16, description="Up to 16 strings of the caller's, returned as given."
    )

    @field_validator("stream")
    @classmethod
    def _not_streamed(cls, stream: bool) -> bool:
        if stream:
            raise ValueError("a job cannot be streamed: leave stream out or set it to false")
        return stream

    def chat_body(self) -> dict[str, Any]:
        """The chat request the job runs, as stored: without the job's own fields, and without
        the ignored OpenAI ones (`user`, `prompt_cache_options`, ...), which change nothing
        and are not redacted, so they are not kept."""
        exclude = {"webhook_url", "metadata", *self.ignored}
        return self.model_dump(mode="json", exclude_unset=True, exclude=exclude)


async def _principal(request: Request, services: Services, *scopes: str) -> Principal:
    """The caller (resolved by the auth middleware when it runs, else here), which must carry
    one of ``scopes``."""
    principal: Principal | None = getattr(request.state, PRINCIPAL, None)
    if principal is None:
        principal = await Authenticate(services.keys).resolve(bearer_token(request))
    if not any(principal.can(scope) for scope in scopes):
        raise PermissionDenied(f"This API key lacks the '{scopes[0]}' scope.")
    return principal


def _owner(principal: Principal) -> str | None:
    """Whose jobs the caller may see: its own user's, or (admin) every user's of its tenant."""
    return None if principal.can(ADMIN) else principal.user


async def _parse(raw: bytes) -> JobRequest:
    """``app.http.bodies`` refuses what nothing downstream can use (integers past 64 bits, which
    the job record's JSON encoder cannot write; non-finite numbers; deep nesting), naming the
    field, inline when small and in a worker thread when large; then the job's schema, where an
    unknown top-level field is refused by name."""
    return await read_body(raw or b"null", JobRequest, LIMITS, refine=_refine)


def _refine(errors: list[Any]) -> Exception | None:
    for error in errors:
        loc = error.get("loc", ())
        if error.get("type") == "extra_forbidden" and len(loc) == 1:
            return _unknown_field(str(loc[0]))
    return None


def _unknown_field(name: str) -> InvalidRequest:
    shown = shown_name(name)
    return InvalidRequest(
        f"Unrecognized request argument supplied: {shown!r}. A job takes the chat-completions "
        "fields (docs/openai-compatibility.md), plus webhook_url and metadata. Nothing was "
        "stored.",
        param=shown,
        code="unknown_parameter",
    )


async def _check(
    services: Services, paths: Paths, body: JobRequest, principal: Principal
) -> RequestContext:
    """The submit path (``app.path``: the chat path's validate and guard_in stages), run now
    rather than when the job runs: a refused request is refused at submit, and personal data is
    redacted before the job is stored."""
    settings = services.settings
    ctx = RequestContext(
        params=body.to_params(settings.retrieval.top_k, settings.llm.default_max_tokens),
        credential=None,
        deadline=asyncio.get_running_loop().time() + settings.server.request_timeout_seconds,
        principal=principal,
    )
    if services.retrieval is not None:  # its stages read the index on the loop: loaded off it
        await services.retrieval.ready(principal.tenant)
    await paths.submit.run(ctx)
    if body.webhook_url is not None:
        policy = UrlPolicy(settings.jobs.webhook_allow)
        try:
            # Checked again at every delivery attempt, on the addresses it then connects to.
            await policy.check_at_submit(policy.parse(body.webhook_url))
        except WebhookUrlRefused as exc:
            raise InvalidRequest(
                str(exc), param="webhook_url", code="invalid_webhook_url"
            ) from None
    return ctx


def _idempotency_key(request: Request) -> str | None:
    key = request.headers.get("idempotency-key")
    if key is None:
        return None
    if not 1 <= len(key) <= 255 or not key.isprintable():
        raise InvalidRequest(
            "Idempotency-Key must be 1 to 255 printable characters.",
            param="Idempotency-Key",
            code="invalid_idempotency_key",
        )
    return key


CREATED_LINKS = {
    "GetJob": link("getJob", "The job just submitted.", job_id="$response.body#/id"),
    "CancelJob": link("cancelJob", "Cancel the job just submitted.", job_id="$response.body#/id"),
    "ListJobsAfter": link("listJobs", "The jobs after this one.", after="$response.body#/id"),
}


@router.post(
    "/v1/jobs",
    status_code=202,
    response_model=None,
    openapi_extra=request_body(JobRequest),
    operation_id="createJob",
    responses=declared(
        202, answers.JobCreated, 400, 403, 404, 413, links=CREATED_LINKS, description="Queued."
    ),
)
async def create_job(request: Request, services: ServicesDep, paths: PathsDep) -> Response:
    principal = await _principal(request, services, "chat")
    queue = job_queue(services.settings, services.kv)
    await queue.take_submit_token(principal.tenant)  # before any work that grows with the body
    if not await services.keys.is_active(principal.key_id):
        # Resolved keys are cached for seconds; a job outlives that, so it asks Redis itself:
        # a key revoked a moment ago queues nothing (its queued jobs were settled then).
        raise AuthenticationFailed("The API key of this request has been revoked.")
    limit = services.settings.jobs.max_body_bytes
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(
            f"A job body may be at most {limit} bytes; this one has {declared}.",
            code="request_too_large",
        )
    raw = await request.body()
    if len(raw) > limit:
        raise PayloadTooLarge(
            f"A job body may be at most {limit} bytes; this one has {len(raw)}.",
            code="request_too_large",
        )
    body = await _parse(raw)
    checked = await _check(services, paths, body, principal)
    key = _idempotency_key(request)
    carrier: dict[str, str] = {}
    inject(carrier)  # the submitting request's trace: the job's trace links to it
    job = Job.create(
        principal,
        stored_body(body, checked),
        max_attempts=services.settings.jobs.max_attempts,
        webhook_url=body.webhook_url,
        metadata=body.metadata,
        traceparent=carrier.get("traceparent"),
    )
    job, created = await queue.submit(job, key)
    trace.get_current_span().set_attribute(attr.JOB_ID, job.id)
    headers = {"Location": f"/v1/jobs/{job.id}"}
    if not created:
        headers["Idempotent-Replayed"] = "true"
    content = {"id": job.id, "object": "job", "status": job.status, "created_at": int(job.created)}
    return JSONResponse(content, status_code=202, headers=headers)


def stored_body(body: JobRequest, checked: RequestContext) -> dict[str, Any]:
    """The chat body a job keeps: its messages and tools as guard_in left them (PII redacted)."""
    stored = {**body.chat_body(), "messages": checked.params.messages}
    if "tools" in stored:
        stored["tools"] = checked.params.tools
    return stored


def _shown(job_id: str) -> str:
    """A job id as an error message repeats it: never more than a real id's length."""
    return job_id if len(job_id) <= 40 else job_id[:40] + "…"


async def _owned(services: Services, principal: Principal, job_id: str) -> Job:
    queue = job_queue(services.settings, services.kv)
    job = (
        await queue.get_for(principal.tenant, job_id, _owner(principal))
        if is_job_id(job_id)
        else None
    )
    if job is None:  # another tenant's (or user's) job is as absent as one that never existed
        raise NotFound(f"No job with id '{_shown(job_id)}'.", param="job_id", code="job_not_found")
    return job


@router.get(
    "/v1/jobs/{job_id}",
    response_model=None,
    operation_id="getJob",
    responses=declared(200, answers.Job, 403, 404),
)
async def get_job(job_id: str, request: Request, services: ServicesDep) -> Response:
    principal = await _principal(request, services, "chat", ADMIN)
    return JSONResponse((await _owned(services, principal, job_id)).public(principal))


@router.delete(
    "/v1/jobs/{job_id}",
    response_model=None,
    operation_id="cancelJob",
    responses=declared(200, answers.Job, 403, 404, 409),
)
async def cancel_job(job_id: str, request: Request, services: ServicesDep) -> Response:
    principal = await _principal(request, services, "chat", ADMIN)
    job = await _owned(services, principal, job_id)
    outcome = await job_queue(services.settings, services.kv).cancel(
        principal.tenant, job.id, _owner(principal)
    )
    if outcome == "missing":
        raise NotFound(f"No job with id '{_shown(job_id)}'.", param="job_id", code="job_not_found")
    if outcome != "cancelled":
        raise Conflict(
            f"Only a queued job can be cancelled; this one is {outcome}.",
            code="job_not_cancellable",
        )
    return JSONResponse((await _owned(services, principal, job_id)).public(principal))


@router.get(
    "/v1/jobs",
    response_model=None,
    operation_id="listJobs",
    responses=declared(200, answers.JobList, 400, 403),
)
async def list_jobs(
    request: Request,
    services: ServicesDep,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    after: Annotated[str | None, Query(max_length=64)] = None,
    all_users: bool = False,
) -> Response:
    principal = await _principal(request, services, "chat", ADMIN)
    if all_users and not principal.can(ADMIN):
        raise PermissionDenied(
            "Listing the jobs of every user of the tenant needs a key with the 'admin' scope.",
            param="all_users",
        )
    queue = job_queue(services.settings, services.kv)
    user = None if all_users else principal.user
    try:
        jobs, more, cursor = await queue.page(principal.tenant, limit=limit, after=after, user=user)
    except UnknownCursor:
        raise InvalidRequest(
            f"after: no job with id '{_shown(after or '')}' to continue from.", param="after"
        ) from None
    data = [job.public(principal) for job in jobs]
    return JSONResponse(
        {
            "object": "list",
            "data": data,
            "first_id": data[0]["id"] if data else None,
            # The last listed: a record left out (unreadable) may be it, so a page of only
            # such records still says where to go on from.
            "last_id": cursor if more else data[-1]["id"] if data else None,
            "has_more": more,
        }
    )
