"""``rag worker``, ``rag jobs submit`` and ``rag webhooks secret``.

rag worker [--workers N] [--concurrency N]       run jobs until SIGTERM (or Ctrl-C)
rag jobs submit FILE.jsonl --out RESULTS.jsonl [--url U] [--key K]
rag webhooks secret --tenant T [--rotate]        print (or replace) a tenant's signing secret
                                                 (needs RAG_JOBS__WEBHOOK_SECRET_KEY once set)
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
from pathlib import Path
from typing import Any

from opentelemetry import trace

from app.cli.batch import BatchOptions, run_batch
from app.jobs import start_job_workers, webhook_secrets
from app.path import build_paths
from app.services import Services
from app.settings import get_settings
from app.telemetry import build_tracer_provider, tracer_from
from pipeline.jobs.secret_box import SecretUnreadable
from pipeline.store.keys import validate_tenant
from pipeline.store.kv import KeyValueStore


async def _worker(args: argparse.Namespace) -> int:
    settings = get_settings()
    jobs = settings.jobs.model_copy(
        update={"concurrency": args.concurrency or settings.jobs.concurrency}
    )
    settings = settings.model_copy(update={"jobs": jobs})
    provider = build_tracer_provider(settings)
    services = Services.build(settings, tracer_from(provider))
    if services.retrieval is not None and settings.retrieval.warm_up:
        await asyncio.to_thread(services.retrieval.queries.embedder.warm_up)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    workers = await start_job_workers(
        services, build_paths(settings, services).chat, count=args.workers
    )
    print(
        f"rag worker: {args.workers} worker(s), {jobs.concurrency} jobs each; SIGTERM stops",
        file=sys.stderr,
        flush=True,
    )
    ended = asyncio.ensure_future(workers.wait())
    stopped = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({ended, stopped}, return_when=asyncio.FIRST_COMPLETED)
        if ended.done():
            ended.result()  # a worker that ended by itself failed: raise its error
    finally:
        stopped.cancel()
        await workers.stop()
        await services.aclose()
        provider.shutdown()
    print("rag worker: stopped", file=sys.stderr)
    return 0


def _submit(args: argparse.Namespace) -> int:
    key = args.key or os.environ.get("RAG_API_KEY")
    if not key:
        raise ValueError("an API key is needed: --key or RAG_API_KEY")
    source = Path(args.file)
    if not source.is_file():
        raise ValueError(f"{source} is not a file")
    settings = get_settings()
    options = BatchOptions(
        url=args.url or f"http://{settings.server.host}:{settings.server.port}",
        key=key,
        model=args.model,
        max_tokens=args.max_tokens,
        in_flight=args.in_flight,
        poll_seconds=args.poll,
        progress=not args.quiet,
    )
    try:
        return asyncio.run(run_batch(source, Path(args.out), options))
    except KeyboardInterrupt:
        print("rag jobs submit: interrupted; run it again to resume", file=sys.stderr)
        return 130


async def _secret(args: argparse.Namespace) -> int:
    settings = get_settings()
    validate_tenant(args.tenant)
    kv = KeyValueStore.from_url(
        settings.redis.url, trace.NoOpTracer(), timeout=max(settings.redis.timeout_seconds, 2.0)
    )
    try:
        secrets = webhook_secrets(settings, kv)
        secret = await (secrets.rotate if args.rotate else secrets.current)(args.tenant)
    except SecretUnreadable as exc:
        raise ValueError(str(exc)) from None  # a configuration error: `rag: ...`, status 2
    finally:
        await kv.aclose()
    print(secret)
    return 0


def add_commands(commands: Any) -> None:
    """Add the job commands to the ``rag`` parser's subcommands."""
    worker = commands.add_parser("worker", help="run queued jobs (a process of its own)")
    worker.add_argument("--workers", type=int, default=1, help="consumers in this process")
    worker.add_argument("--concurrency", type=int, help="jobs each consumer runs at once")
    worker.set_defaults(run=_worker)

    jobs = commands.add_parser("jobs", help="asynchronous jobs").add_subparsers(
        dest="action", required=True
    )
    submit = jobs.add_parser("submit", help="run a file of questions as jobs; resumable")
    submit.add_argument("file", help='JSONL: chat bodies, {"question": ...}, or plain lines')
    submit.add_argument("--out", required=True, help="results, one JSON line per input line")
    submit.add_argument("--url", help="the service (default: RAG_SERVER__HOST/PORT)")
    submit.add_argument("--key", help="API key (default: $RAG_API_KEY)")
    submit.add_argument("--model", default="smollm2")
    submit.add_argument("--max-tokens", type=int)
    submit.add_argument("--in-flight", type=int, default=32, help="jobs outstanding at once")
    submit.add_argument("--poll", type=float, default=1.0, help="seconds between status checks")
    submit.add_argument("--quiet", action="store_true", help="no progress bar")
    submit.set_defaults(run=_submit, sync=True)

    webhooks = commands.add_parser("webhooks", help="webhook signing").add_subparsers(
        dest="action", required=True
    )
    secret = webhooks.add_parser("secret", help="print a tenant's webhook signing secret")
    secret.add_argument("--tenant", required=True)
    secret.add_argument(
        "--rotate",
        action="store_true",
        help="replace it (the old one signs too during RAG_JOBS__WEBHOOK_SECRET_GRACE_SECONDS)",
    )
    secret.set_defaults(run=_secret)
