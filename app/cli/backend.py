"""``rag backend``: which retrieval backend holds a tenant, and moving a tenant between them.

rag backend show --tenant T
rag backend move --tenant T --to milvus|embedded [--batch N]

A move copies the tenant's chunks with their vectors (no re-chunking, no re-embedding) into
the target, checks the target holds as many, records the tenant's backend in Redis (every
replica follows within a second: retrieval.backends.router.RedisOverrides) and only then deletes
the tenant from the source. Until the record is written the source keeps serving; a move that
stopped before it can simply be run again (the copy replaces the documents it copied).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from app.services import build_backends, build_index_store
from app.settings import get_settings
from retrieval import HybridRetriever, make_embedder
from retrieval.backends.router import BackendRouter
from retrieval.store import check_tenant


def backend_router() -> BackendRouter:
    """The backends as the app builds them from the same settings (so both agree on which
    backend holds a tenant and on its index version)."""
    settings = get_settings()
    config = settings.retrieval
    embedder = make_embedder(config.embeddings)
    store = build_index_store(config, embedder)
    retriever = (
        HybridRetriever(store, candidates=config.candidates)
        if config.candidates
        else HybridRetriever(store)
    )
    return build_backends(settings, store, retriever, embedder)


def _show(args: argparse.Namespace) -> int:
    check_tenant(args.tenant)
    router = backend_router()
    stats = router.for_tenant(args.tenant).stats(args.tenant)
    print(
        f"tenant {args.tenant}: {stats.backend}, version {stats.version}, "
        f"{stats.documents} documents, {stats.chunks} chunks"
    )
    return 0


def _move(args: argparse.Namespace) -> int:
    check_tenant(args.tenant)
    router = backend_router()
    if args.to not in router.backends:
        raise ValueError(
            f"no {args.to} backend is configured (for Milvus set RAG_RETRIEVAL__MILVUS_URI)"
        )
    source = router.for_tenant(args.tenant)
    if source.name == args.to:
        print(f"tenant {args.tenant} is already on {args.to}")
        return 0
    target = router.backends[args.to]
    # What an earlier move cut short left in the target, of documents the source has deleted
    # since, would never match the source's count: the copy starts from the source's documents.
    stale = target.document_ids(args.tenant) - source.document_ids(args.tenant)
    if stale:
        target.delete(args.tenant, sorted(stale))
    expected = source.stats(args.tenant).chunks
    copied = 0
    for batch in source.export(args.tenant, batch=args.batch):
        copied += target.import_chunks(args.tenant, batch).chunks
    held = target.stats(args.tenant).chunks
    if held != expected or copied != expected:
        print(
            f"rag backend move: {args.to} holds {held} chunks of {expected} (copied {copied}); "
            f"tenant {args.tenant} stays on {source.name}",
            file=sys.stderr,
        )
        return 1
    router.record(args.tenant, args.to)
    documents = source.document_ids(args.tenant)
    source.delete(args.tenant, sorted(documents))
    print(
        f"moved tenant {args.tenant} from {source.name} to {args.to}: "
        f"{len(documents)} documents, {expected} chunks; version {target.version(args.tenant)}"
    )
    return 0


def add_commands(commands: Any) -> None:
    parser = commands.add_parser("backend", help="retrieval backends: show, move a tenant")
    actions = parser.add_subparsers(dest="action", required=True)
    show = actions.add_parser("show", help="the tenant's backend and index size")
    show.add_argument("--tenant", required=True)
    show.set_defaults(run=_show, sync=True)
    move = actions.add_parser("move", help="move a tenant's index to another backend")
    move.add_argument("--tenant", required=True)
    move.add_argument("--to", required=True, choices=["embedded", "milvus"])
    move.add_argument("--batch", type=int, default=500, help="chunks copied per write")
    move.set_defaults(run=_move, sync=True)
