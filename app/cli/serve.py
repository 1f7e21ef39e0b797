"""``rag serve``: the API under uvicorn."""

from __future__ import annotations

import argparse
import functools

import uvicorn

from app.http.server import BoundedHttpToolsProtocol
from app.http.shutdown import DrainingServer, Shutdown
from app.main import create_app
from app.settings import get_settings


def serve(args: argparse.Namespace) -> int:
    """uvicorn, draining on SIGTERM (``app.http.shutdown``): in-flight requests finish within
    the grace period or end cleanly, new ones get a 503."""
    settings = get_settings()
    shutdown = Shutdown()
    config = uvicorn.Config(
        functools.partial(create_app, shutdown=shutdown),
        factory=True,
        http=BoundedHttpToolsProtocol,
        host=args.host or settings.server.host,
        port=args.port or settings.server.port,
        log_level=args.log_level,
        timeout_graceful_shutdown=args.timeout_graceful_shutdown,
    )
    server = DrainingServer(config, shutdown)
    server.run()
    return 0 if server.started else 3  # 3: uvicorn's status when the app failed to start
