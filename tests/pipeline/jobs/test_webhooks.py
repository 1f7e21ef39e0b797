"""Webhook delivery to a real HTTP receiver: signatures, retries, refusals, pinned addresses."""

from __future__ import annotations

import ipaddress
import ssl
import threading
import time
from pathlib import Path
from typing import Any

import orjson
import pytest
from opentelemetry import trace

from pipeline.jobs.model import SUCCEEDED, Job
from pipeline.jobs.signing import WebhookSecrets, verify
from pipeline.jobs.urls import Address, UrlPolicy
from pipeline.jobs.webhooks import WebhookSender, webhook_state
from pipeline.store.kv import KeyValueStore
from tests.pipeline.jobs.conftest import make_job
from tests.pipeline.jobs.receiver import DripReceiver, Receiver
from tests.support.tls import self_signed


@pytest.fixture
def secrets(kv: KeyValueStore, prefix: str) -> WebhookSecrets:
    return WebhookSecrets(kv, prefix=prefix, grace_seconds=3600)


def sender(secrets: WebhookSecrets, allow: list[str], **options: Any) -> WebhookSender:
    options.setdefault("backoff", 0.05)
    options.setdefault("timeout", 5.0)
    return WebhookSender(secrets, UrlPolicy(allow), trace.NoOpTracer(), **options)


def finished(url: str) -> Job:
    job = make_job("q", webhook_url=url)
    job.status, job.result, job.finished = SUCCEEDED, {"answer": "Paris"}, time.time()
    return job


class Recorder:
    def __init__(self) -> None:
        self.calls: list[list[dict[str, Any]]] = []

    async def __call__(self, deliveries: list[dict[str, Any]]) -> None:
        self.calls.append(list(deliveries))

    @property
    def outcomes(self) -> list[str]:
        return [d["outcome"] for d in self.calls[-1]] if self.calls else []


async def test_a_delivery_is_signed_and_the_receiver_verifies_it(secrets: WebhookSecrets) -> None:
    with Receiver() as receiver:
        job = finished(receiver.url)
        delivery = sender(secrets, ["127.0.0.1/32"])
        try:
            assert await delivery.deliver(job, Recorder())
        finally:
            await delivery.aclose()
    [got] = receiver.received
    secret = await secrets.current(job.tenant)
    assert secret.startswith("whsec_")
    header = got.headers["x-rag-signature"]
    assert verify(header, got.body, secret)
    assert orjson.loads(got.body) == job.public()
    assert (got.headers["x-rag-job-id"], got.headers["x-rag-event"]) == (job.id, "job.succeeded")
    assert not verify(header, got.body.replace(b"Paris", b"Rome!"), secret), "body is signed"
    assert not verify(header, got.body, "whsec_another"), "the secret matters"
    assert not verify(header, got.body, secret, now=time.time() + 600), "a replay is too old"


async def test_each_tenant_has_its_own_secret_and_a_rotation_has_a_grace_period(
    secrets: WebhookSecrets,
) -> None:
    acme, globex = await secrets.current("acme"), await secrets.current("globex")
    assert acme != globex
    assert await secrets.current("acme") == acme, "created once, then the same"
    rotated = await secrets.rotate("acme")
    assert rotated != acme
    assert await secrets.signing("acme") == [rotated, acme]
    with Receiver() as receiver:
        delivery = sender(secrets, ["127.0.0.1/32"])
        try:
            assert await delivery.deliver(finished(receiver.url), Recorder())
        finally:
            await delivery.aclose()
    header, body = receiver.received[0].headers["x-rag-signature"], receiver.received[0].body
    assert verify(header, body, rotated) and verify(header, body, acme)
    expired = WebhookSecrets(secrets.kv, prefix=secrets.prefix.removesuffix("webhook-secret:"))
    expired.grace_seconds = 0
    newest = await expired.rotate("acme")
    assert await expired.signing("acme") == [newest]


async def test_a_receiver_down_then_up_gets_the_delivery_after_retries(
    secrets: WebhookSecrets,
) -> None:
    receiver = Receiver()
    threading.Timer(0.5, receiver.start).start()
    record = Recorder()
    delivery = sender(secrets, ["127.0.0.1/32"], backoff=0.2, max_attempts=8)
    try:
        assert await delivery.deliver(finished(receiver.url), record)
    finally:
        await delivery.aclose()
        receiver.stop()
    outcomes = record.outcomes
    assert outcomes[-1] == "delivered" and len(outcomes) >= 2
    assert set(outcomes[:-1]) == {"retry"}
    assert all("ConnectError" in d["error"] for d in record.calls[-1][:-1])
    assert [d["attempt"] for d in record.calls[-1]] == list(range(1, len(outcomes) + 1))
    assert len(receiver.received) == 1


async def test_5xx_is_retried_and_4xx_is_not(secrets: WebhookSecrets) -> None:
    delivery = sender(secrets, ["127.0.0.1/32"])
    try:
        with Receiver(statuses=[503, 502]) as flaky:
            record = Recorder()
            assert await delivery.deliver(finished(flaky.url), record)
            assert [d.get("status_code") for d in record.calls[-1]] == [503, 502, 200]
        with Receiver(statuses=[400, 200]) as refusing:
            record = Recorder()
            assert not await delivery.deliver(finished(refusing.url), record)
            assert record.outcomes == ["rejected"]
            assert len(refusing.received) == 1, "a 4xx is not retried"
    finally:
        await delivery.aclose()


async def test_a_receiver_that_drips_a_byte_a_second_is_cut_off_at_the_deadline(
    secrets: WebhookSecrets,
) -> None:
    # httpx's timeout is per read (2 s here), and a byte comes every second: only an overall
    # deadline on the attempt ends it.
    delivery = sender(secrets, ["127.0.0.1/32"], timeout=2.0, max_attempts=2)
    record = Recorder()
    try:
        with DripReceiver() as drip:
            started = time.monotonic()
            assert not await delivery.deliver(finished(drip.url), record)
            elapsed = time.monotonic() - started
    finally:
        await delivery.aclose()
    attempts = record.calls[-1]
    assert [a["outcome"] for a in attempts] == ["retry", "failed"], attempts
    assert all(a["error"] == "DeadlineExceeded: no answer within 2 s" for a in attempts)
    assert all(2000 <= a["duration_ms"] < 20_000 for a in attempts)
    assert drip.connections == 2
    assert elapsed < 40, "two attempts of 2 s each, with a wide margin"


async def test_retries_stop_after_the_configured_attempts_and_the_last_says_failed(
    secrets: WebhookSecrets,
) -> None:
    delivery = sender(secrets, ["127.0.0.1/32"], max_attempts=3)
    try:
        with Receiver(statuses=[500] * 10) as failing:
            record = Recorder()
            assert not await delivery.deliver(finished(failing.url), record)
    finally:
        await delivery.aclose()
    # No retry follows the third attempt: its record says the delivery failed, as its state will.
    assert record.outcomes == ["retry", "retry", "failed"]
    assert [d["status_code"] for d in record.calls[-1]] == [500] * 3
    assert webhook_state(record.calls[-1]) == "failed"
    assert len(failing.received) == 3


def attempt(number: int, outcome: str, **fields: Any) -> dict[str, Any]:
    return {"attempt": number, "at": int(time.time()), "outcome": outcome, **fields}


async def test_a_resumed_delivery_that_had_ended_sends_nothing_again(
    secrets: WebhookSecrets,
) -> None:
    # A worker recorded its last attempt, then died before settling the state; the worker that
    # takes over must settle what the record says, not send again (nor call a success failed).
    delivery = sender(secrets, ["127.0.0.1/32"], max_attempts=3)
    try:
        with Receiver() as receiver:
            results = []
            for ended in (
                [attempt(1, "retry"), attempt(2, "delivered", status_code=200)],
                [attempt(1, "rejected", status_code=410)],
                [attempt(1, "retry"), attempt(2, "retry"), attempt(3, "failed")],
            ):
                job = finished(receiver.url)
                job.deliveries = ended
                record = Recorder()
                results.append((await delivery.deliver(job, record), record.calls))
    finally:
        await delivery.aclose()
    assert results == [(True, []), (False, []), (False, [])]
    assert receiver.received == []


async def test_a_retry_recorded_with_no_attempt_left_is_recorded_as_the_failure_it_was(
    secrets: WebhookSecrets,
) -> None:
    # Three attempts recorded as retries (an older release, or more attempts allowed then).
    delivery = sender(secrets, ["127.0.0.1/32"], max_attempts=3)
    try:
        with Receiver() as receiver:
            job = finished(receiver.url)
            job.deliveries = [attempt(n, "retry", status_code=503) for n in (1, 2, 3)]
            record = Recorder()
            assert not await delivery.deliver(job, record)
    finally:
        await delivery.aclose()
    assert record.outcomes == ["retry", "retry", "failed"]
    assert record.calls[-1][-1]["status_code"] == 503, "the attempt itself is kept"
    assert receiver.received == []


async def test_a_name_resolving_to_loopback_is_refused_at_delivery(
    secrets: WebhookSecrets,
) -> None:
    with Receiver() as receiver:
        record = Recorder()
        delivery = sender(secrets, [])  # nothing allow-listed
        try:
            url = f"https://localhost:{receiver.port}/hook"
            assert not await delivery.deliver(finished(url), record)
        finally:
            await delivery.aclose()
    assert record.outcomes == ["refused"], "refused, and not retried"
    assert "loopback" in record.calls[-1][0]["error"]
    assert receiver.received == [], "no connection was made"


@pytest.fixture
def tls(tmp_path: Path) -> tuple[ssl.SSLContext, ssl.SSLContext, list[str | None]]:
    """A certificate for hooks.test: the receiver's TLS, a client trusting it, the SNI names."""
    server, client = self_signed(tmp_path, "hooks.test")
    names: list[str | None] = []

    def remember(sock: Any, name: str | None, ctx: Any) -> None:
        names.append(name)

    server.sni_callback = remember
    return server, client, names


def resolving_to(*answers: str) -> tuple[Any, list[str]]:
    queue = iter(answers)
    lookups: list[str] = []

    async def resolve(host: str, port: int) -> list[Address]:
        lookups.append(host)
        return [ipaddress.ip_address(next(queue))]

    return resolve, lookups


async def test_delivery_connects_to_the_address_it_checked(
    secrets: WebhookSecrets, tls: tuple[ssl.SSLContext, ssl.SSLContext, list[str | None]]
) -> None:
    # DNS rebinding: the name answers differently on each lookup. Each attempt resolves once,
    # checks every address, and connects to the address it checked, not to a new lookup.
    server_tls, client_tls, _ = tls
    resolver, lookups = resolving_to("127.0.0.1", "10.0.0.9")
    with Receiver(statuses=[503], tls=server_tls) as receiver:
        record = Recorder()
        delivery = sender(secrets, ["127.0.0.1/32"], resolver=resolver, verify=client_tls)
        try:
            url = f"https://hooks.test:{receiver.port}/hook"
            assert not await delivery.deliver(finished(url), record)
        finally:
            await delivery.aclose()
    assert lookups == ["hooks.test", "hooks.test"]
    assert record.outcomes == ["retry", "refused"]
    assert "10.0.0.9" in record.calls[-1][1]["error"]
    assert record.calls[-1][0]["address"] == "127.0.0.1"
    [got] = receiver.received
    assert got.headers["host"] == f"hooks.test:{receiver.port}"


async def test_https_by_address_keeps_the_host_name_for_sni_and_the_certificate(
    secrets: WebhookSecrets, tls: tuple[ssl.SSLContext, ssl.SSLContext, list[str | None]]
) -> None:
    server_tls, client_tls, names = tls
    resolver, _ = resolving_to(*["127.0.0.1"] * 2)
    with Receiver(tls=server_tls) as receiver:
        delivery = sender(
            secrets, ["127.0.0.1/32"], resolver=resolver, verify=client_tls, max_attempts=1
        )
        try:
            good = finished(f"https://hooks.test:{receiver.port}/")
            assert await delivery.deliver(good, Recorder())
            record = Recorder()
            assert not await delivery.deliver(
                finished(f"https://wrong.test:{receiver.port}/"), record
            )
        finally:
            await delivery.aclose()
    assert names[0] == "hooks.test"
    assert len(receiver.received) == 1
    assert "certificate" in record.calls[-1][0]["error"].lower(), "verified against the name"
