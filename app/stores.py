"""The Redis-backed stores that the settings describe: API keys, users' features, the job queue
and the webhook signing secrets.

They are built here, apart from the request path (``app.services``), so that the ``rag keys``
and ``rag webhooks`` commands need not import it: ``app.services`` brings FastAPI, the guards,
the model client and the index code, a second or more before any command runs.
The app's composition root and its routes build the same stores with these functions.
"""

from __future__ import annotations

from opentelemetry import trace

from app.settings import Settings
from pipeline.features.store import FeatureStore
from pipeline.jobs.queue import JobQueue
from pipeline.jobs.secret_box import SecretBox
from pipeline.jobs.signing import WebhookSecrets
from pipeline.store.keys import ApiKeyStore
from pipeline.store.kv import KeyValueStore


def build_key_store(settings: Settings, kv: KeyValueStore) -> ApiKeyStore:
    return ApiKeyStore(
        kv,
        prefix=f"{settings.redis.key_prefix}apikey:",
        cache_ttl=settings.auth.key_cache_seconds,
        stale_ttl=settings.auth.key_stale_seconds,
        # Jobs queued under an old-style key id still pass the worker's check until they expire.
        legacy_id_grace=int(settings.jobs.queued_ttl_seconds),
    )


def build_feature_store(settings: Settings, kv: KeyValueStore) -> FeatureStore:
    return FeatureStore(
        kv, prefix=settings.redis.key_prefix, log_max_entries=settings.features.log_max_entries
    )


def job_queue(
    settings: Settings, kv: KeyValueStore, poll_kv: KeyValueStore | None = None
) -> JobQueue:
    jobs = settings.jobs
    return JobQueue(
        kv,
        prefix=settings.redis.key_prefix,
        max_attempts=jobs.max_attempts,
        result_ttl=jobs.result_ttl_seconds,
        idempotency_ttl=jobs.idempotency_ttl_seconds,
        poll_kv=poll_kv,
        queued_ttl=jobs.queued_ttl_seconds,
        max_stream_length=jobs.max_stream_length,
        max_queued_per_tenant=jobs.max_queued_per_tenant,
        submit_rate=jobs.submit_rate_per_minute / 60,
        submit_burst=jobs.submit_burst,
    )


def webhook_secrets(settings: Settings, kv: KeyValueStore) -> WebhookSecrets:
    key = settings.jobs.webhook_secret_key
    return WebhookSecrets(
        kv,
        prefix=settings.redis.key_prefix,
        grace_seconds=settings.jobs.webhook_secret_grace_seconds,
        box=SecretBox.from_setting(key.get_secret_value() if key is not None else None),
    )


def command_kv(settings: Settings, *, min_timeout_s: float = 2.0) -> KeyValueStore:
    """Redis for a ``rag`` command: untraced, and more patient than a request (at least
    ``min_timeout_s`` per call), since an operator is waiting and nothing else is."""
    return KeyValueStore.from_url(
        settings.redis.url,
        trace.NoOpTracer(),
        timeout=max(settings.redis.timeout_seconds, min_timeout_s),
        cluster=settings.redis.cluster,
    )
