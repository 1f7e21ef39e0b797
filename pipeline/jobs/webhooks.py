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
Every attempt is recorded on the job.
"""

from __future__ import annotations

import asyncio
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
Record = Callable[[list[dict[str, Any]]], Awaitable[None]]


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
        back. ``record`` is given the list of attempts after each one."""
        deliveries = list(job.deliveries)
        body = orjson.dumps(job.public())
        while len(deliveries) < self.max_attempts:
            number = len(deliveries) + 1
            entry = await self._attempt(job, body, number)
            deliveries.append(entry)
            await record(deliveries)
            if entry["outcome"] != "retry" or number >= self.max_attempts:
                return bool(entry["outcome"] == "delivered")
            delay = min(self.max_backoff, self.backoff * 2 ** (number - 1))
            await asyncio.sleep(delay / 2 + random.uniform(0, delay / 2))
        return False

    async def _attempt(self, job: Job, body: bytes, number: int) -> dict[str, Any]:
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
            try:
                async with deadline:
                    target = self.policy.parse(job.webhook_url or "")
                    span.set_attribute(server_attributes.SERVER_ADDRESS, target.host)
                    addresses = await self.policy.resolve(target, self.resolver)
                    status, address = await self._post(job, target, addresses, body, number)
            except WebhookUrlRefused as exc:
                entry.update(outcome="refused", error=str(exc))
            except TimeoutError as exc:
                error = (
                    f"DeadlineExceeded: no answer within {self.deadline:g} s"
                    if deadline.expired()
                    else _describe(exc)
                )
                entry.update(outcome="retry", error=error)
            except (OSError, httpx.HTTPError, StoreUnavailable, SecretUnreadable) as exc:
                entry.update(outcome="retry", error=_describe(exc))
            else:
                span.set_attribute(http_attributes.HTTP_RESPONSE_STATUS_CODE, status)
                span.set_attribute(network_attributes.NETWORK_PEER_ADDRESS, str(address))
                entry.update(status_code=status, address=str(address))
                if 200 <= status < 300:
                    entry["outcome"] = "delivered"
                elif status >= 500 or status in RETRY_STATUSES:
                    entry["outcome"] = "retry"
                else:
                    entry["outcome"] = "rejected"
            if entry["outcome"] != "delivered":
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
    ) -> tuple[int, Address]:
        """POST to the first checked address that accepts a connection."""
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
            await response.aclose()  # the status is all we need; never read a large body
            return response.status_code, address
        assert last_error is not None
        raise last_error

    async def aclose(self) -> None:
        await self.client.aclose()


def _describe(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
