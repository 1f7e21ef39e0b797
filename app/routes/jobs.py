"""/v1/jobs: submit a chat request to run later, look it up, list, cancel.

A job body is a chat-completions body (not streamed) plus ``webhook_url`` and ``metadata``.
Everything that can be checked at submit is checked then (schema, model, context size, webhook
URL), so a job that is queued can only fail for reasons that arise when it runs. When Redis
cannot be reached the answer is a 503 with ``Retry-After``: a job is never acknowledged unless
it is stored.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Awaitable, Callable
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request
from fastapi.exceptions import RequestValidationError
from opentelemetry import trace
from opentelemetry.propagate import inject
from pydantic import Field, ValidationError, field_validator
from starlette.responses import Response

from app.auth import bearer_token
from app.jobs import job_queue
from app.path import guard_in_stage
from app.responses import JSONResponse
from app.schemas import ChatCompletionRequest
from app.services import Services, ServicesDep
from pipeline import attributes as attr
from pipeline.context import Principal, RequestContext
from pipeline.errors import InvalidRequest, NotFound, PayloadTooLarge, ServiceUnavailable
from pipeline.jobs.model import Job, is_job_id
from pipeline.jobs.queue import Conflict
from pipeline.jobs.urls import UrlPolicy, WebhookUrlRefused
from pipeline.kv import StoreUnavailable
from pipeline.stages.auth import Authenticate
from pipeline.stages.validate import ValidateRequest

router = APIRouter(tags=["jobs"])

MetadataKey = Annotated[str, Field(min_length=1, max_length=64)]
MetadataValue = Annotated[str, Field(max_length=512)]


class JobRequest(ChatCompletionRequest):
    """A chat-completions body plus the job's own fields; ``stream`` must be false."""

    webhook_url: str | None = Field(None, description="POSTed the job when it finishes.")
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
        return self.model_dump(mode="json", exclude_unset=True, exclude={"webhook_url", "metadata"})


Endpoint = Callable[..., Awaitable[Response]]


def retry_later_on_outage(endpoint: Endpoint) -> Endpoint:
    """Redis unreachable (the queue, or the key store behind auth): 503 with ``Retry-After``."""

    @functools.wraps(endpoint)
    async def wrapper(*args: Any, **kwargs: Any) -> Response:
        try:
            return await endpoint(*args, **kwargs)
        except (StoreUnavailable, ServiceUnavailable) as exc:
            services: Services = kwargs["services"]
            error = (
                exc
                if isinstance(exc, ServiceUnavailable)
                else ServiceUnavailable(
                    "The job queue cannot be reached right now; nothing was stored. Retry later.",
                    code="queue_unavailable",
                )
            )
            retry_after = max(1, math.ceil(services.settings.redis.retry_after_seconds))
            return JSONResponse(
                error.to_dict(), status_code=503, headers={"Retry-After": str(retry_after)}
            )

    return wrapper


async def _principal(request: Request, services: Services) -> Principal:
    return await Authenticate(services.keys, scope="chat").authenticate(bearer_token(request))


def _parse(raw: bytes) -> JobRequest:
    try:
        return JobRequest.model_validate_json(raw or b"null")
    except ValidationError as exc:
        raise RequestValidationError(exc.errors(include_url=False)) from None


async def _check(services: Services, body: JobRequest, principal: Principal) -> RequestContext:
    """The checks the path's validate and guard_in stages make, run now rather than when the
    job runs: a refused request is refused at submit, and personal data is redacted before
    the job is stored."""
    settings = services.settings
    ctx = RequestContext(
        params=body.to_params(settings.retrieval.top_k, settings.llm.default_max_tokens),
        credential=None,
        deadline=0.0,
        principal=principal,
    )
    await ValidateRequest(
        routes=services.routes,
        context_length=settings.llm.context_length,
        server_tools=services.server_tools,
    )(ctx)
    guard = guard_in_stage(services)
    if guard is not None:
        await guard(ctx)
    if body.webhook_url is not None:
        policy = UrlPolicy(settings.jobs.webhook_allow)
        try:
            target = policy.parse(body.webhook_url)
            await policy.resolve(target)
        except WebhookUrlRefused as exc:
            raise InvalidRequest(
                str(exc), param="webhook_url", code="invalid_webhook_url"
            ) from None
        except OSError:
            pass  # not resolvable now: checked again, and refused if need be, at delivery
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


@router.post("/v1/jobs", status_code=202, response_model=None)
@retry_later_on_outage
async def create_job(request: Request, services: ServicesDep) -> Response:
    principal = await _principal(request, services)
    raw = await request.body()
    limit = services.settings.jobs.max_body_bytes
    if len(raw) > limit:
        raise PayloadTooLarge(
            f"A job body may be at most {limit} bytes; this one has {len(raw)}.",
            code="request_too_large",
        )
    body = _parse(raw)
    checked = await _check(services, body, principal)
    key = _idempotency_key(request)
    carrier: dict[str, str] = {}
    inject(carrier)  # the submitting request's trace: the job's trace links to it
    job = Job.create(
        principal,
        {**body.chat_body(), "messages": checked.params.messages},
        max_attempts=services.settings.jobs.max_attempts,
        webhook_url=body.webhook_url,
        metadata=body.metadata,
        traceparent=carrier.get("traceparent"),
    )
    job, created = await job_queue(services.settings, services.kv).submit(job, key)
    trace.get_current_span().set_attribute(attr.JOB_ID, job.id)
    headers = {"Location": f"/v1/jobs/{job.id}"}
    if not created:
        headers["Idempotent-Replayed"] = "true"
    content = {"id": job.id, "object": "job", "status": job.status, "created_at": int(job.created)}
    return JSONResponse(content, status_code=202, headers=headers)


async def _owned(services: Services, principal: Principal, job_id: str) -> Job:
    job = (
        await job_queue(services.settings, services.kv).get_for(principal.tenant, job_id)
        if is_job_id(job_id)
        else None
    )
    if job is None:  # another tenant's job is as absent as one that never existed
        raise NotFound(f"No job with id '{job_id}'.", param="job_id", code="job_not_found")
    return job


@router.get("/v1/jobs/{job_id}", response_model=None)
@retry_later_on_outage
async def get_job(job_id: str, request: Request, services: ServicesDep) -> Response:
    principal = await _principal(request, services)
    return JSONResponse((await _owned(services, principal, job_id)).public())


@router.delete("/v1/jobs/{job_id}", response_model=None)
@retry_later_on_outage
async def cancel_job(job_id: str, request: Request, services: ServicesDep) -> Response:
    principal = await _principal(request, services)
    job = await _owned(services, principal, job_id)
    outcome = await job_queue(services.settings, services.kv).cancel(principal.tenant, job.id)
    if outcome == "missing":
        raise NotFound(f"No job with id '{job_id}'.", param="job_id", code="job_not_found")
    if outcome != "cancelled":
        raise Conflict(
            f"Only a queued job can be cancelled; this one is {outcome}.",
            code="job_not_cancellable",
        )
    return JSONResponse((await _owned(services, principal, job_id)).public())


@router.get("/v1/jobs", response_model=None)
@retry_later_on_outage
async def list_jobs(
    request: Request,
    services: ServicesDep,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    after: Annotated[str | None, Query(max_length=64)] = None,
) -> Response:
    principal = await _principal(request, services)
    queue = job_queue(services.settings, services.kv)
    try:
        jobs, more = await queue.page(principal.tenant, limit=limit, after=after)
    except KeyError:
        raise InvalidRequest(
            f"after: no job with id '{after}' to continue from.", param="after"
        ) from None
    data = [job.public() for job in jobs]
    return JSONResponse(
        {
            "object": "list",
            "data": data,
            "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None,
            "has_more": more,
        }
    )
