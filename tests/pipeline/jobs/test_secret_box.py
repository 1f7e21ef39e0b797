"""Webhook secrets at rest: sealed with a key from the environment, so what Redis holds signs
nothing; deliveries still verify; old plaintext secrets are sealed on first use; a wrong key,
a missing key or a secret moved to another tenant is a clear error, never a wrong signature."""

from __future__ import annotations

import base64
import logging
import secrets as random

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from app.settings import JobSettings, Settings
from pipeline.jobs.secret_box import SecretBox, SecretUnreadable, new_key, parse_keys
from pipeline.jobs.signing import WebhookSecrets, verify
from pipeline.store.kv import KeyValueStore
from tests.pipeline.jobs.receiver import Receiver
from tests.pipeline.jobs.test_webhooks import Recorder, finished, sender
from tests.support.fuzzing import examples

KEY = new_key()
OTHER_KEY = new_key()


def box(*keys: str) -> SecretBox:
    return SecretBox(parse_keys(",".join(keys)))


async def stored(kv: KeyValueStore, secrets: WebhookSecrets, tenant: str) -> dict[bytes, bytes]:
    return await kv.hgetall(secrets.prefix + tenant)


async def test_the_stored_secret_is_not_the_secret_and_deliveries_still_verify(
    kv: KeyValueStore, prefix: str
) -> None:
    sealed = WebhookSecrets(kv, prefix=prefix, box=box(KEY))
    secret = await sealed.current("acme")
    at_rest = (await stored(kv, sealed, "acme"))[b"current"]
    assert secret.startswith("whsec_")
    assert secret.encode() not in at_rest and at_rest.startswith(b"enc:v1:")
    assert secret.removeprefix("whsec_")[:16].encode() not in at_rest
    with Receiver() as receiver:
        delivery = sender(sealed, ["127.0.0.1/32"])
        try:
            assert await delivery.deliver(finished(receiver.url), Recorder())
        finally:
            await delivery.aclose()
    [got] = receiver.received
    assert verify(got.headers["x-rag-signature"], got.body, secret)
    rotated = await sealed.rotate("acme")
    fields = await stored(kv, sealed, "acme")
    assert fields[b"current"].startswith(b"enc:v1:") and fields[b"previous"] == at_rest
    assert rotated.encode() not in fields[b"current"]
    assert await sealed.signing("acme") == [rotated, secret]


async def test_a_plaintext_secret_from_before_the_key_is_sealed_on_first_use(
    kv: KeyValueStore, prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="rag.jobs"):
        plain = WebhookSecrets(kv, prefix=prefix)  # development: no key
    assert "plaintext" in caplog.text and "RAG_JOBS__WEBHOOK_SECRET_KEY" in caplog.text
    secret = await plain.current("acme")
    assert (await stored(kv, plain, "acme"))[b"current"] == secret.encode()
    sealed = WebhookSecrets(kv, prefix=prefix, box=box(KEY))
    assert await sealed.signing("acme") == [secret], "the same secret: receivers keep working"
    assert (await stored(kv, sealed, "acme"))[b"current"].startswith(b"enc:v1:")
    with pytest.raises(SecretUnreadable, match="set RAG_JOBS__WEBHOOK_SECRET_KEY"):
        await plain.signing("acme")


async def test_the_key_can_be_rotated_and_a_wrong_key_is_a_clear_error(
    kv: KeyValueStore, prefix: str
) -> None:
    secret = await WebhookSecrets(kv, prefix=prefix, box=box(OTHER_KEY)).current("acme")
    with pytest.raises(SecretUnreadable, match="which RAG_JOBS__WEBHOOK_SECRET_KEY does not"):
        await WebhookSecrets(kv, prefix=prefix, box=box(KEY)).signing("acme")
    rotated = WebhookSecrets(kv, prefix=prefix, box=box(KEY, OTHER_KEY))  # new key first
    assert await rotated.signing("acme") == [secret]
    assert await WebhookSecrets(kv, prefix=prefix, box=box(KEY)).current("globex")


async def test_a_sealed_secret_moved_to_another_tenant_does_not_open(
    kv: KeyValueStore, prefix: str
) -> None:
    sealed = WebhookSecrets(kv, prefix=prefix, box=box(KEY))
    await sealed.current("acme")
    acme = (await stored(kv, sealed, "acme"))[b"current"]
    await kv.hset(sealed.prefix + "globex", {"current": acme.decode()})
    with pytest.raises(SecretUnreadable, match="copied from another tenant"):
        await sealed.signing("globex")


async def test_a_delivery_whose_secret_cannot_be_opened_is_recorded_as_a_retry(
    kv: KeyValueStore, prefix: str
) -> None:
    await WebhookSecrets(kv, prefix=prefix, box=box(OTHER_KEY)).current("acme")
    with Receiver() as receiver:
        record = Recorder()
        delivery = sender(
            WebhookSecrets(kv, prefix=prefix, box=box(KEY)), ["127.0.0.1/32"], max_attempts=2
        )
        try:
            assert not await delivery.deliver(finished(receiver.url), record)
        finally:
            await delivery.aclose()
    assert record.outcomes == ["retry", "failed"], "the last attempt ends the delivery"
    assert all("SecretUnreadable" in d["error"] for d in record.calls[-1])
    assert receiver.received == [], "nothing is sent unsigned"


def test_the_setting_takes_base64_keys_and_never_echoes_a_bad_one() -> None:
    urlsafe = base64.urlsafe_b64encode(random.token_bytes(32)).decode().rstrip("=")
    jobs = JobSettings(webhook_secret_key=f"{KEY}, {urlsafe}")
    assert jobs.webhook_secret_key is not None and jobs.production_problems() == []
    assert JobSettings(webhook_secret_key="").webhook_secret_key is None
    assert "RAG_JOBS__WEBHOOK_SECRET_KEY" in JobSettings().production_problems()[0]
    for bad in ("not-base64!!", base64.b64encode(b"short").decode(), f"{KEY},tooshort-secret"):
        with pytest.raises(ValidationError) as refused:
            Settings(environment="test", jobs={"webhook_secret_key": bad})
        assert "base64 of 32 bytes" in str(refused.value)
        assert bad.split(",")[-1] not in str(refused.value)


@settings(max_examples=examples(200), deadline=None)
@given(
    text=st.text(max_size=120)
    | st.lists(st.binary(min_size=30, max_size=34)).map(
        lambda keys: ",".join(base64.b64encode(k).decode() for k in keys)
    )
)
@example(text=",,,")
@example(text=KEY + "=")
def test_any_key_setting_is_accepted_as_32_byte_keys_or_refused_with_a_value_error(
    text: str,
) -> None:
    try:
        keys = parse_keys(text)
    except ValueError as exc:
        assert all(len(part) < 4 or part not in str(exc) for part in text.split(","))
        return
    assert keys and all(len(key) == 32 for key in keys)
    sealed = SecretBox(keys).seal("acme", "whsec_x")
    assert SecretBox(keys).open("acme", sealed) == "whsec_x"
