"""Asynchronous jobs: chat requests queued in Redis Streams, run by workers, results by webhook.

    model      the job record and its statuses
    queue      Redis: submit (atomic), look up, list, cancel; hand runs to workers
    worker     the worker loop: bounded concurrency, heartbeats, reclaim, retries, graceful stop
    webhooks   signed delivery of finished jobs, with backoff and a deadline; urls: the SSRF rules
    signing    per-tenant webhook secrets and the signature scheme; secret_box: their sealing

Nothing here imports ``app``: the app gives the worker an ``execute(job) -> result`` callable.
Import from the modules; the package itself loads none of them, so that a light one
(``secret_box``, which the settings use) comes without the queue and Redis.
"""
