"""``rag worker`` (``rag jobs submit`` is app.cli.batch, ``rag webhooks secret`` app.cli.webhooks).

rag worker [--workers N] [--concurrency N]       run jobs until SIGTERM (or Ctrl-C)
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys

from app.jobs import start_job_workers
from app.path import build_paths
from app.services import Services
from app.settings import get_settings
from app.telemetry import build_tracer_provider, tracer_from


async def worker(args: argparse.Namespace) -> int:
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
