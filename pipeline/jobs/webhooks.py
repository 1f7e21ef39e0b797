"""Webhook delivery: POST the finished job, signed, to the URL the client gave, safely.

Each attempt resolves the host, checks every address it got (``urls.UrlPolicy``), and connects
to a checked address itself: the URL's host is replaced by the IP, with the ``Host`` header and
the TLS server name (SNI, and so certificate verification) set to the original host. The
connection therefore goes where the check looked, even if the name resolves elsewhere a moment
later (DNS rebinding). Redirects are not followed; connections are not kept alive.

Each attempt has one overall deadline (``timeout``): name resolution, connect, TLS, request and
the response's headers together, enforced with ``asyncio.timeout`` around the whole attempt.
httpx's own timeouts apply per read, so a receiver that drips a byte now and then would
otherwise hold the attempt (and a delivery slot) for as long as it likes.

Network errors, a missed deadline, 5xx, 408 and 429 are retried with exponential backoff and
jitter; other answers (2xx: delivered; 3xx and 4xx: the receiver refused) end the delivery.

Every attempt is recorded on the job with its outcome, and the record agrees with the delivery's
final state (``webhook_state``): every attempt but the last is ``retry``; the last is
``delivered`` (state ``delivered``), ``rejected`` (3xx, 4xx), ``refused`` (the URL policy) or
``failed`` (a retryable failure with no attempt left), all three state ``failed``. A delivery
resumed by another worker continues the record, and sends nothing when its last attempt had
already ended it.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Awaitable, Callable
from typing import Any, Final

import httpx
import orjson
from opentelemetry import trace
from opentelemetry.semconv.attributes import (
    http_attributes,
    network_attributes,
    server_attributes,
)
from opentelemetry.trace import SpanKind

from pipeline.errors import StoreUnavailable
from pipeline.jobs.model import Job
from pipeline.jobs.signing import (
    SIGNATURE_HEADER,
    SecretUnreadable,
    WebhookSecrets,
    signature_header,
)
from pipeline.jobs.urls import (
    Address,
    Resolver,
    UrlPolicy,
    WebhookTarget,
    WebhookUrlRefused,
    system_resolver,
)
from pipeline.telemetry import attributes as attr
from pipeline.telemetry.spans import mark_failed

RETRY_STATUSES: Final = frozenset({408, 429})
# An attempt's outcome; only RETRY is followed by another attempt.
DELIVERED: Final = "delivered"
RETRY: Final = "retry"
REJECTED: Final = "rejected"
REFUSED: Final = "refused"
FAILED: Final = "failed"
# A response's stream is closed after its status is known, outside the attempt's deadline.
CLOSE_SECONDS: Final = 1.0
Record = Callable[[list[dict[str, Any]]], Awaitable[None]]


def webhook_state(deliveries: list[dict[str, Any]]) -> str:
    """The final state of a delivery whose attempts are ``deliveries``: what its last says."""
    return "delivered" if deliveries and deliveries[-1].get("outcome") == DELIVERED else "failed"


def ended(deliveries: list[dict[str, Any]]) -> bool:
    """Whether the last attempt of ``deliveries`` ended the delivery (no retry follows it)."""
    return bool(deliveries) and deliveries[-1].get("outcome") != RETRY


def unsent(number: int, error: str) -> dict[str, Any]:
    """The record of an attempt that could not be made at all; it ends the delivery."""
    return {"attempt": number, "at": int(time.time()), "outcome": FAILED, "error": error}


class WebhookSender:
    """Delivers finished jobs to their ``webhook_url``; one per worker process."""

    def __init__(
        self,
        secrets: WebhookSecrets,
        policy: UrlPolicy,
        tracer: trace.Tracer,
        *,
        timeout: float = 10.0,
        connect_timeout: float = 3.0,
        max_attempts: int = 6,
        backoff: float = 1.0,
        max_backoff: float = 300.0,
        resolver: Resolver = system_resolver,
        verify: Any = True,
    ) -> None:
        self.secrets = secrets
        self.policy = policy
        self.tracer = tracer
        self.max_attempts = max_attempts
        self.backoff = backoff
        self.max_backoff = max_backoff
        self.resolver = resolver
        self.deadline = timeout
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(timeout, connect=connect_timeout),
            follow_redirects=False,
            limits=httpx.Limits(max_keepalive_connections=0),
            trust_env=False,  # never through a proxy: the proxy would resolve the name itself
            verify=verify,
        )

    async def deliver(self, job: Job, record: Record) -> bool:
        """Deliver ``job`` (continuing the attempts already recorded on it); True if a 2xx came
        back. ``record`` is given the list of attempts after each one, and whenever this call
        changes it; its last entry then says how the delivery ended."""
        deliveries = list(job.deliveries)
        if ended(deliveries):
            # Ended before, by a worker that stopped before settling it: nothing to send again.
            return webhook_state(deliveries) == "delivered"
        if len(deliveries) >= self.max_attempts:
            # Its last attempt said retry, but none is left (fewer are allowed now): it was last.
            deliveries[-1] = {**deliveries[-1], "outcome": FAILED}
            await record(deliveries)
            return False
        body = orjson.dumps(job.public())
        while True:
            number = len(deliveries) + 1
            entry = await self._attempt(job, body, number, last=number >= self.max_attempts)
            deliveries.append(entry)
            await record(deliveries)
            if entry["outcome"] != RETRY:
                return bool(entry["outcome"] == DELIVERED)
            delay = min(self.max_backoff, self.backoff * 2 ** (number - 1))
            await asyncio.sleep(delay / 2 + random.uniform(0, delay / 2))

    async def _attempt(self, job: Job, body: bytes, number: int, *, last: bool) -> dict[str, Any]:
        """One attempt; a failure worth retrying is ``retry``, or ``failed`` when ``last``."""
        retry = FAILED if last else RETRY
        entry: dict[str, Any] = {"attempt": number, "at": int(time.time())}
        started = time.perf_counter()
        with self.tracer.start_as_current_span(
            "POST",
            kind=SpanKind.CLIENT,
            attributes={
                http_attributes.HTTP_REQUEST_METHOD: "POST",
                attr.JOB_ID: job.id,
                attr.WEBHOOK_ATTEMPT: number,
            },
        ) as span:
            deadline = asyncio.timeout(self.deadline)
            response: httpx.Response | None = None
            try:
                async with deadline:
                    target = self.policy.parse(job.webhook_url or "")
                    span.set_attribute(server_attributes.SERVER_ADDRESS, target.host)
                    addresses = await self.policy.resolve(target, self.resolver)
                    response, address = await self._post(job, target, addresses, body, number)
            except WebhookUrlRefused as exc:
                entry.update(outcome=REFUSED, error=str(exc))
            except TimeoutError as exc:
                error = (
                    f"DeadlineExceeded: no answer within {self.deadline:g} s"
                    if deadline.expired()
                    else _describe(exc)
                )
                entry.update(outcome=retry, error=error)
            except (OSError, httpx.HTTPError, StoreUnavailable, SecretUnreadable) as exc:
                entry.update(outcome=retry, error=_describe(exc))
            else:
                assert response is not None
                status = response.status_code
                span.set_attribute(http_attributes.HTTP_RESPONSE_STATUS_CODE, status)
                span.set_attribute(network_attributes.NETWORK_PEER_ADDRESS, str(address))
                entry.update(
                    status_code=status, address=str(address), outcome=_answered(status, retry)
                )
            finally:
                if response is not None:
                    # The answer is in: closing the stream must not turn it into a timeout.
                    await _close(response)
            if entry["outcome"] != DELIVERED:
                mark_failed(span, kind=entry["outcome"])
        entry["duration_ms"] = round((time.perf_counter() - started) * 1000, 1)
        return entry

    async def _post(
        self,
        job: Job,
        target: WebhookTarget,
        addresses: list[Address],
        body: bytes,
        number: int,
    ) -> tuple[httpx.Response, Address]:
        """POST to the first checked address that accepts a connection; the response's stream
        is left open (its status is all we read; ``_close`` closes it)."""
        secrets = await self.secrets.signing(job.tenant)
        original = httpx.URL(target.url)
        headers = {
            "Host": original.netloc.decode("ascii"),
            "Content-Type": "application/json",
            "User-Agent": "rag-pipeline-webhooks/1",
            "X-RAG-Event": f"job.{job.status}",
            "X-RAG-Job-Id": job.id,
            "X-RAG-Delivery": f"{job.id}.{number}",
        }
        extensions = (
            {"sni_hostname": target.host}
            if target.scheme == "https" and target.literal is None
            else {}
        )
        last_error: httpx.ConnectError | None = None
        for address in addresses:
            timestamp = int(time.time())
            headers[SIGNATURE_HEADER] = signature_header(secrets, timestamp, body)
            request = self.client.build_request(
                "POST",
                original.copy_with(host=str(address)),
                content=body,
                headers=headers,
                extensions=extensions,
            )
            try:
                response = await self.client.send(request, stream=True)
            except httpx.ConnectError as exc:
                last_error = exc
                continue
            return response, address
        assert last_error is not None
        raise last_error

    async def aclose(self) -> None:
        await self.client.aclose()


def _answered(status: int, retry: str) -> str:
    """The outcome of an answer: 2xx delivered; 5xx, 408 and 429 ``retry``; others rejected."""
    if 200 <= status < 300:
        return DELIVERED
    if status >= 500 or status in RETRY_STATUSES:
        return retry
    return REJECTED


async def _close(response: httpx.Response) -> None:
    """Close without reading the body (never read a large one); bounded, and quiet: the
    connection is not kept alive, so a close that fails loses nothing."""
    with contextlib.suppress(httpx.HTTPError, OSError):  # OSError covers TimeoutError
        async with asyncio.timeout(CLOSE_SECONDS):
            await response.aclose()


def _describe(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
