"""The ``rag`` command: keys, serving, ingestion.

rag keys create --tenant T --user U [--scopes chat,retrieve,ingest,admin] [--key VALUE]
              [--rpm N] [--tpm N] [--groups a,b]
rag keys groups KEY (--set a,b | --clear)   (the groups whose documents the key may retrieve)
rag keys revoke KEY         (its queued jobs fail with ``key_revoked``; they are never run)
rag keys limits KEY [--rpm N|default] [--tpm N|default]      (the key's own limits)
rag keys tenant-limits T [--rpm N|default] [--tpm N|default] [--key-rpm ..] [--key-tpm ..]
                            (per minute; 0: no limit; default: the settings' value)
rag serve [--host H] [--port P]
rag ingest PATH --tenant T [--batch N] [--quiet]   (--quiet: nothing printed but errors)
                            (PATH: a .jsonl, a PDF/DOCX/PPTX/HTML/Markdown/text file, or a
                            folder of them; each bad file is skipped with its reason)
rag delete --tenant T ID...   (an id the tenant does not have is reported; exit status 1)
rag backend show|move ...     (app.cli.backend: which backend holds a tenant; move it)

Ingest and delete go through the tenant's retrieval backend (retrieval.backends), as the app's
requests do.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from opentelemetry import trace

from app.cli.backend import add_commands as add_backend_commands
from app.cli.backend import backend_router
from app.cli.features import add_commands as add_feature_commands
from app.cli.ingest_files import FileReader, Skipped, read_documents
from app.cli.jobs import add_commands as add_job_commands
from app.jobs import job_queue
from app.services import build_converter, build_key_store
from app.settings import get_settings
from pipeline.errors import StoreUnavailable
from pipeline.store.keys import (
    DEFAULT_SCOPES,
    ApiKeyStore,
    validate_groups,
    validate_scopes,
    validate_tenant,
)
from pipeline.store.kv import KeyValueStore
from pipeline.store.limits import MAX_PER_MINUTE
from retrieval import Document, DocumentError
from retrieval.backends import BackendUnavailable, RetrievalBackend
from retrieval.backends.embedded import EmbeddedBackend
from retrieval.backends.moves import MoveUnderway, TenantMoving
from retrieval.snapshots import IndexUnreadable
from retrieval.store import IndexBusy, IngestResult


def _key_store() -> ApiKeyStore:
    settings = get_settings()
    kv = KeyValueStore.from_url(
        settings.redis.url, trace.NoOpTracer(), timeout=max(settings.redis.timeout_seconds, 2.0)
    )
    return build_key_store(settings, kv)


async def _create_key(args: argparse.Namespace) -> int:
    scopes = frozenset(s.strip() for s in args.scopes.split(",") if s.strip())
    validate_scopes(scopes)  # refused before anything is stored (an empty --scopes too)
    groups = _groups(args.groups)
    store = _key_store()
    try:
        raw = await store.create(
            args.tenant,
            args.user,
            scopes,
            raw_key=args.key,
            rpm=args.rpm,
            tpm=args.tpm,
            groups=groups,
        )
    finally:
        await store.kv.aclose()
    print(raw)
    return 0


def _groups(text: str | None) -> frozenset[str]:
    """``--groups a,b``: the names, checked before anything is stored (blank items dropped)."""
    return validate_groups(frozenset(g.strip() for g in (text or "").split(",") if g.strip()))


async def _key_groups(args: argparse.Namespace) -> int:
    """Replace a key's groups; every replica resolves the key afresh on its next request."""
    groups = frozenset() if args.clear else _groups(args.set)
    if not args.clear and not groups:
        # "--set ''" would clear them silently: clearing is said with --clear.
        print("--set names no group (to remove the key's groups, use --clear)", file=sys.stderr)
        return 2
    store = _key_store()
    try:
        principal = await store.set_groups(args.key, groups)
    finally:
        await store.kv.aclose()
    if principal is None:
        print("no such key", file=sys.stderr)
        return 1
    shown = ",".join(sorted(principal.groups)) or "none"
    print(f"key {principal.key_id}: groups {shown}")
    return 0


def _limit(text: str) -> int:
    """A limit on the command line: a count per minute (0: no limit), or ``default`` (-1:
    remove the setting, so the next level's applies)."""
    if text == "default":
        return -1
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"not a count: {text!r} (a number >= 0, or default)"
        ) from None
    if not 0 <= value <= MAX_PER_MINUTE:
        raise argparse.ArgumentTypeError(f"a limit is 0 (no limit) to {MAX_PER_MINUTE}, or default")
    return value


def _shown(fields: dict[bytes, bytes], names: Sequence[str]) -> str:
    return ", ".join(
        f"{name} {fields[name.encode()].decode() if name.encode() in fields else 'default'}"
        for name in names
    )


async def _key_limits(args: argparse.Namespace) -> int:
    store = _key_store()
    try:
        principal = await store.set_limits(args.key, rpm=args.rpm, tpm=args.tpm)
    finally:
        await store.kv.aclose()
    if principal is None:
        print("no such key", file=sys.stderr)
        return 1
    shown = {
        name.encode(): str(value).encode()
        for name, value in (("rpm", principal.rpm), ("tpm", principal.tpm))
        if value is not None
    }
    print(f"key {principal.key_id}: {_shown(shown, ('rpm', 'tpm'))} per minute")
    return 0


TENANT_LIMITS = ("rpm", "tpm", "key_rpm", "key_tpm")


async def _tenant_limits(args: argparse.Namespace) -> int:
    """The tenant record's limits, read by every replica's limiter on the next request."""
    validate_tenant(args.tenant)
    store = _key_store()
    record = f"{get_settings().redis.key_prefix}limits:tenant:{args.tenant}"
    try:
        wanted = {name: getattr(args, name) for name in TENANT_LIMITS}
        changes: dict[str, str | int] = {
            n: v for n, v in wanted.items() if v is not None and v >= 0
        }
        if changes:
            await store.kv.hset(record, changes)
        removed = [n for n, v in wanted.items() if v is not None and v < 0]
        if removed:
            await store.kv.hdel(record, *removed)
        fields = await store.kv.hgetall(record)
    finally:
        await store.kv.aclose()
    print(f"tenant {args.tenant}: {_shown(fields, TENANT_LIMITS)} per minute")
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
    """uvicorn, draining on SIGTERM (``app.http.shutdown``): in-flight requests finish within
    the grace period or end cleanly, new ones get a 503."""
    import functools

    import uvicorn

    from app.http.server import BoundedHttpToolsProtocol
    from app.http.shutdown import DrainingServer, Shutdown
    from app.main import create_app

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


def _upsert(
    backend: RetrievalBackend, tenant: str, docs: list[Document], progress: bool
) -> IngestResult:
    if isinstance(backend, EmbeddedBackend):
        return backend.store.upsert(tenant, docs, progress=progress)  # with its progress bar
    return backend.upsert(tenant, docs)


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
    router = backend_router()
    skipped = Skipped()
    documents = chunks = 0
    batch: list[Document] = []

    def upsert(docs: list[Document]) -> None:
        """Upsert `docs`; when the index refuses the batch, each document alone, so only the
        bad one is skipped (with its own reason) and the rest go in."""
        nonlocal documents, chunks
        try:
            with router.writing(args.tenant) as backend:  # fenced against a move, as the app
                result = _upsert(backend, args.tenant, docs, progress=not args.quiet)
        except DocumentError as exc:
            if len(docs) == 1:
                skipped.add(docs[0].id, str(exc))
                return
            for document in docs:
                upsert([document])
            return
        documents += result.documents
        chunks += result.chunks
        if not args.quiet:
            print(
                f"version {result.version}: +{result.documents} documents "
                f"({result.total_documents} in all, {result.total_chunks} chunks)",
                file=sys.stderr,
            )

    def flush() -> None:
        if batch:
            upsert(list(batch))
            batch.clear()

    settings = get_settings()
    files = FileReader(
        build_converter(settings),
        max_file_bytes=settings.files.max_file_bytes,
        max_chars=settings.retrieval.max_document_chars,
        workers=settings.files.convert_workers,
    )
    try:
        for document in read_documents(path, skipped, files):
            batch.append(document)
            if len(batch) >= args.batch:
                flush()
        flush()
    except TenantMoving as exc:
        print(
            f"rag ingest: {exc} {documents} documents were ingested before that; run the same "
            "command again when the move ends (it replaces what it ingested).",
            file=sys.stderr,
        )
        return 1
    except IndexBusy as exc:
        print(
            f"rag ingest: {exc} (that batch); {documents} documents were ingested before it. "
            "Run the same command again later (it replaces what it ingested).",
            file=sys.stderr,
        )
        return 1
    for problem in skipped.items:
        print(f"skipped {problem}", file=sys.stderr)
    if not args.quiet:
        print(
            f"ingested {documents} documents ({chunks} chunks) for tenant {args.tenant}; "
            f"skipped {len(skipped.items)}; "
            f"index version {router.for_tenant(args.tenant).version(args.tenant)}"
        )
    return 0 if documents or not skipped.items else 1


def _delete(args: argparse.Namespace) -> int:
    """Like ``DELETE /v1/documents/{id}``: an id the tenant does not have is an error (exit 1),
    reported after the ids it does have are deleted."""
    wanted = list(dict.fromkeys(args.document_ids))
    with backend_router().writing(args.tenant) as store:
        present = store.document_ids(args.tenant)
        missing = [d for d in wanted if d not in present]
        result = store.delete(args.tenant, wanted) if len(missing) < len(wanted) else None
    if result is not None:
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
    create.add_argument("--rpm", type=_limit, help="the key's requests per minute (0: none)")
    create.add_argument("--tpm", type=_limit, help="the key's tokens per minute (0: none)")
    create.add_argument(
        "--groups", help="comma-separated groups: documents whose access list names one are seen"
    )
    create.set_defaults(run=_create_key)
    groups = keys.add_parser("groups", help="set a key's groups (every replica at once)")
    groups.add_argument("key")
    change = groups.add_mutually_exclusive_group(required=True)
    change.add_argument("--set", help="comma-separated groups, replacing the key's")
    change.add_argument("--clear", action="store_true", help="the key belongs to no group")
    groups.set_defaults(run=_key_groups)
    revoke = keys.add_parser("revoke", help="revoke a key (its queued jobs will not run)")
    revoke.add_argument("key")
    revoke.set_defaults(run=_revoke_key)
    limits = keys.add_parser("limits", help="set a key's own rate limits (every replica at once)")
    limits.add_argument("key")
    limits.add_argument("--rpm", type=_limit, help="requests per minute; 0: none; default")
    limits.add_argument("--tpm", type=_limit, help="tokens per minute; 0: none; default")
    limits.set_defaults(run=_key_limits)
    tenant = keys.add_parser("tenant-limits", help="set a tenant's rate limits and key defaults")
    tenant.add_argument("tenant")
    tenant.add_argument("--rpm", type=_limit, help="the tenant's requests per minute")
    tenant.add_argument("--tpm", type=_limit, help="the tenant's tokens per minute")
    tenant.add_argument("--key-rpm", type=_limit, help="each key's requests per minute")
    tenant.add_argument("--key-tpm", type=_limit, help="each key's tokens per minute")
    tenant.set_defaults(run=_tenant_limits)

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
        "ingest",
        help="index documents: JSONL (BEIR corpus.jsonl too), or PDF, DOCX, PPTX, HTML, "
        "Markdown and text files (one, or a folder of them)",
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
    add_backend_commands(commands)
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
    except (TenantMoving, MoveUnderway, BackendUnavailable, IndexBusy) as exc:
        print(f"rag: {exc} Run it again later.", file=sys.stderr)
        return 1
    except IndexUnreadable as exc:
        print(
            f"rag: the index of tenant '{exc.tenant}' (version {exc.version!r}) cannot be read: "
            "the log says why; RELIABILITY.md section 8 says how to recover it.",
            file=sys.stderr,
        )
        return 1
