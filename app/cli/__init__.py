"""The ``rag`` command: keys, serving, ingestion.

rag keys create --tenant T --user U [--scopes chat,retrieve,ingest,admin] [--key VALUE]
rag keys revoke KEY         (its queued jobs fail with ``key_revoked``; they are never run)
rag serve [--host H] [--port P]
rag ingest PATH --tenant T [--batch N] [--quiet]   (--quiet: nothing printed but errors)
rag delete --tenant T ID...   (an id the tenant does not have is reported; exit status 1)
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from opentelemetry import trace

from app.cli.features import add_commands as add_feature_commands
from app.cli.ingest_files import Skipped, read_documents
from app.cli.jobs import add_commands as add_job_commands
from app.jobs import job_queue
from app.services import build_index_store, build_key_store
from app.settings import get_settings
from pipeline.errors import StoreUnavailable
from pipeline.store.keys import DEFAULT_SCOPES, ApiKeyStore, validate_scopes
from pipeline.store.kv import KeyValueStore
from retrieval import Document, DocumentError, Embedder, IndexStore


def _key_store() -> ApiKeyStore:
    settings = get_settings()
    kv = KeyValueStore.from_url(
        settings.redis.url, trace.NoOpTracer(), timeout=max(settings.redis.timeout_seconds, 2.0)
    )
    return build_key_store(settings, kv)


async def _create_key(args: argparse.Namespace) -> int:
    scopes = frozenset(s.strip() for s in args.scopes.split(",") if s.strip())
    validate_scopes(scopes)  # refused before anything is stored (an empty --scopes too)
    store = _key_store()
    try:
        raw = await store.create(args.tenant, args.user, scopes, raw_key=args.key)
    finally:
        await store.kv.aclose()
    print(raw)
    return 0


async def _revoke_key(args: argparse.Namespace) -> int:
    """Revoke the key, then settle the jobs it left queued (they fail with ``key_revoked``);
    a job a worker started meanwhile fails the worker's own check of the key."""
    store = _key_store()
    try:
        revoked = await store.revoke(args.key)
        settled = (
            await job_queue(get_settings(), store.kv).settle_revoked(revoked.tenant, revoked.key_id)
            if revoked is not None
            else 0
        )
    finally:
        await store.kv.aclose()
    if revoked is None:
        print("no such key", file=sys.stderr)
        return 1
    print(f"revoked; {settled} queued job(s) of this key will not run", file=sys.stderr)
    return 0


def _serve(args: argparse.Namespace) -> int:
    import uvicorn

    from app.http.server import BoundedHttpToolsProtocol

    settings = get_settings()
    uvicorn.run(
        "app.main:create_app",
        factory=True,
        http=BoundedHttpToolsProtocol,
        host=args.host or settings.server.host,
        port=args.port or settings.server.port,
        log_level=args.log_level,
        timeout_graceful_shutdown=args.timeout_graceful_shutdown,
    )
    return 0


def _index_store() -> IndexStore:
    return build_index_store(get_settings().retrieval, Embedder())


def _quiet() -> None:
    """``--quiet``: no warning-level logs (the development settings' notes) and no library
    progress bars (the model's "Loading weights"); errors still reach stderr."""
    logging.disable(logging.WARNING)
    from huggingface_hub.utils.tqdm import disable_progress_bars

    # transformers reads this setting when it is imported, which is when the model first loads.
    disable_progress_bars()


def _ingest(args: argparse.Namespace) -> int:
    path = Path(args.path)
    if not path.exists():
        raise ValueError(f"{path} does not exist")
    if args.quiet:
        _quiet()
    store = _index_store()
    skipped = Skipped()
    documents = chunks = 0
    batch: list[Document] = []

    def flush() -> None:
        nonlocal documents, chunks
        if batch:
            try:
                result = store.upsert(args.tenant, batch, progress=not args.quiet)
            except DocumentError as exc:
                skipped.add(f"batch ending {batch[-1].id}", str(exc))
            else:
                documents += result.documents
                chunks += result.chunks
                if not args.quiet:
                    print(
                        f"version {result.version}: +{result.documents} documents "
                        f"({result.total_documents} in all, {result.total_chunks} chunks)",
                        file=sys.stderr,
                    )
            batch.clear()

    for document in read_documents(path, skipped):
        batch.append(document)
        if len(batch) >= args.batch:
            flush()
    flush()
    for problem in skipped.items:
        print(f"skipped {problem}", file=sys.stderr)
    if not args.quiet:
        print(
            f"ingested {documents} documents ({chunks} chunks) for tenant {args.tenant}; "
            f"skipped {len(skipped.items)}; index version {store.version(args.tenant)}"
        )
    return 0 if documents or not skipped.items else 1


def _delete(args: argparse.Namespace) -> int:
    """Like ``DELETE /v1/documents/{id}``: an id the tenant does not have is an error (exit 1),
    reported after the ids it does have are deleted."""
    store = _index_store()
    wanted = list(dict.fromkeys(args.document_ids))
    index = store.current(args.tenant)
    missing = [d for d in wanted if index is None or d not in index.rows_by_document]
    if len(missing) < len(wanted):
        result = store.delete(args.tenant, wanted)
        print(
            f"deleted {result.documents} documents ({result.chunks} chunks); "
            f"version {result.version}"
        )
    for document_id in missing:
        print(
            f"rag delete: document {document_id!r} not found for tenant {args.tenant!r}",
            file=sys.stderr,
        )
    return 1 if missing else 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rag", description="RAG pipeline service tools.")
    commands = parser.add_subparsers(dest="command", required=True)

    keys = commands.add_parser("keys", help="manage API keys").add_subparsers(
        dest="action", required=True
    )
    create = keys.add_parser("create", help="create a key and print it (shown only once)")
    create.add_argument("--tenant", required=True)
    create.add_argument("--user", required=True)
    create.add_argument(
        "--scopes",
        default=",".join(sorted(DEFAULT_SCOPES)),
        help="comma-separated: chat, retrieve, ingest, admin (admin: every user's jobs of the "
        "tenant); at least one",
    )
    create.add_argument(
        "--key",
        help="use this value instead of a generated one (at least 32 random-looking characters)",
    )
    create.set_defaults(run=_create_key)
    revoke = keys.add_parser("revoke", help="revoke a key (its queued jobs will not run)")
    revoke.add_argument("key")
    revoke.set_defaults(run=_revoke_key)

    serve = commands.add_parser("serve", help="serve the API with uvicorn")
    serve.add_argument("--host")
    serve.add_argument("--port", type=int)
    serve.add_argument("--log-level", default="info")
    serve.add_argument(
        "--timeout-graceful-shutdown",
        type=float,
        default=None,
        help="on SIGTERM, wait this many seconds for open requests (streams) before closing",
    )
    serve.set_defaults(run=_serve, sync=True)

    ingest = commands.add_parser(
        "ingest", help="index documents: JSONL (BEIR corpus.jsonl too) or a folder of .txt/.md"
    )
    ingest.add_argument("path")
    ingest.add_argument("--tenant", required=True)
    ingest.add_argument("--batch", type=int, default=5000, help="documents per index version")
    ingest.add_argument(
        "--quiet", action="store_true", help="no progress bar and no output but errors"
    )
    ingest.set_defaults(run=_ingest, sync=True)

    delete = commands.add_parser("delete", help="remove documents from a tenant's index")
    delete.add_argument("--tenant", required=True)
    delete.add_argument("document_ids", nargs="+")
    delete.set_defaults(run=_delete, sync=True)
    add_feature_commands(commands)
    add_job_commands(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if getattr(args, "sync", False):
            return int(args.run(args))
        return int(asyncio.run(args.run(args)))
    except (ValueError, StoreUnavailable) as exc:
        print(f"rag: {exc}", file=sys.stderr)
        return 2
