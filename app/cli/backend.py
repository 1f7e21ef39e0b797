"""``rag backend``: which retrieval backend holds a tenant, and moving a tenant between them.

rag backend show --tenant T
rag backend move --tenant T --to milvus|embedded [--batch N]

A move first fences the tenant's writes (retrieval.backends.moves: new writes are refused
with a 503 `index_moving` and Retry-After, and the move waits for the writes under way to
end), then copies the tenant's chunks with their vectors (no re-chunking, no re-embedding) into
the target, checks the target holds as many and that the source did not change meanwhile,
records the tenant's backend in Redis (every replica follows within a second:
retrieval.backends.router.RedisOverrides; writes follow at once), waits that second, and only
then deletes the tenant from the source and lifts the fence. Searches are served throughout.
Until the record is written the source keeps serving; a move that stopped before it can simply
be run again (the copy replaces the documents it copied; a killed move's fence lapses after
30 s).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time

import redis

from app.services import build_backends, build_index_store
from app.settings import RetrievalSettings, get_settings
from retrieval import HybridRetriever, make_embedder
from retrieval.backends import BackendUnavailable, RetrievalBackend
from retrieval.backends.moves import MOVE_TTL_S, MoveFence
from retrieval.backends.router import BackendRouter
from retrieval.backends.versions import Poller
from retrieval.embeddings import Backend
from retrieval.onnx_embeddings import native_bf16
from retrieval.tenants import check_tenant


def bulk_backend(config: RetrievalSettings) -> Backend:
    """The embedding runtime ``rag`` commands ingest with: ``ingest_embeddings`` when set; else
    openvino on a CPU that computes bfloat16 natively (about 2x onnx-int8's passages/s there);
    else the replicas' own."""
    if config.ingest_embeddings is not None:
        return config.ingest_embeddings
    return "openvino" if native_bf16() else config.embeddings


def backend_router() -> BackendRouter:
    """The backends as the app builds them from the same settings (so both agree on which
    backend holds a tenant and on its index version)."""
    settings = get_settings()
    config = settings.retrieval
    # A command, not a replica: no event loop shares the cores and its memory is given back
    # when it ends, so it takes the fastest runtime for bulk ingestion (`bulk_backend`), which
    # keeps its memory arena and lets its threads spin (BENCHMARKS.md, issue 18).
    embedder = make_embedder(bulk_backend(config), spinning=True)
    store = build_index_store(config, embedder)
    retriever = (
        HybridRetriever(store, candidates=config.candidates)
        if config.candidates
        else HybridRetriever(store)
    )
    # Milvus only once a tenant on it is touched: a command for an embedded tenant neither
    # starts Milvus Lite nor fails when a Milvus server cannot be reached.
    return build_backends(settings, store, retriever, embedder, connect_now=False)


def show(args: argparse.Namespace) -> int:
    check_tenant(args.tenant)
    router = backend_router()
    stats = router.for_tenant(args.tenant).stats(args.tenant)
    print(
        f"tenant {args.tenant}: {stats.backend}, version {stats.version}, "
        f"{stats.documents} documents, {stats.chunks} chunks"
    )
    return 0


# How long a move waits for the writes under way when it starts (a write's lease is renewed
# while it runs, so a long ingest batch is waited for; a killed writer's lease ends in 15 s).
# New writes are refused meanwhile, so this bounds how long a move can hold them off for
# nothing.
WRITES_WAIT_S = 120.0
# After the record, before the source is emptied: every replica's polled record has caught up
# (RedisOverrides reloads every second), so no search still reads the source.
SETTLE_S = 2.0


def move(args: argparse.Namespace) -> int:
    check_tenant(args.tenant)
    router = backend_router()
    if args.to not in router.backends:
        raise ValueError(
            f"no {args.to} backend is configured (for Milvus set RAG_RETRIEVAL__MILVUS_URI)"
        )
    if router.fence is None:
        raise ValueError(
            "a move needs both backends configured (set RAG_RETRIEVAL__MILVUS_URI): only "
            "then are run-time records and the write fence kept in Redis"
        )
    try:
        return _fenced_move(router, router.fence, args)
    except redis.RedisError as exc:
        print(
            f"rag backend move: Redis did not answer ({type(exc).__name__}: {exc}); run the "
            "move again",
            file=sys.stderr,
        )
        return 1


def _fenced_move(router: BackendRouter, fence: MoveFence, args: argparse.Namespace) -> int:
    token = fence.begin(args.tenant)
    keeper = Poller("move-fence", MOVE_TTL_S / 6, lambda: _keep(fence, args.tenant, token))
    keeper.start()
    try:
        if not _writes_ended(fence, args.tenant):
            return 1
        # Read now that writes are fenced (a move that ended meanwhile may have changed it);
        # no write can change it any more.
        router.reload()
        source, target = router.for_tenant(args.tenant), router.backends[args.to]
        if source.name == args.to:
            return _already_there(router, args.tenant, target)
        return _copy_and_switch(router, fence, token, args, source, target)
    finally:
        keeper.stop()
        try:
            fence.end(args.tenant, token)
        except redis.RedisError:
            print(
                f"rag backend move: could not lift the fence of tenant {args.tenant}; it "
                f"lapses by itself within {MOVE_TTL_S:.0f} s",
                file=sys.stderr,
            )


def _already_there(router: BackendRouter, tenant: str, target: RetrievalBackend) -> int:
    """`tenant` is on `target`: whatever another backend still holds of it (a move cut short
    after its record, before the source was emptied; writes only ever go to the recorded
    backend, so none of it is served) is removed, and the move is complete."""
    for backend in router.backends.values():
        if backend is target:
            continue
        try:
            left = backend.document_ids(tenant)
        except BackendUnavailable as exc:  # none of it is served: looked for on the next move
            print(f"could not look for documents of tenant {tenant} left on {backend.name}: {exc}")
            continue
        if left:
            backend.delete(tenant, sorted(left))
            print(f"removed {len(left)} documents of tenant {tenant} left on {backend.name}")
    print(f"tenant {tenant} is already on {target.name}")
    return 0


def _keep(fence: MoveFence, tenant: str, token: str) -> None:
    # A failed renewal is tried again next round; whether the fence held is checked before
    # the record is written.
    with contextlib.suppress(Exception):
        fence.holds(tenant, token)


def _writes_ended(fence: MoveFence, tenant: str) -> bool:
    deadline = time.monotonic() + WRITES_WAIT_S
    said = False
    while (left := fence.writes_in_flight(tenant)) > 0:
        if time.monotonic() > deadline:
            print(
                f"rag backend move: {left} writes of tenant {tenant} still under way after "
                f"{WRITES_WAIT_S:.0f} s; nothing was moved",
                file=sys.stderr,
            )
            return False
        if not said:
            print(f"waiting for {left} writes of tenant {tenant} to end", file=sys.stderr)
            said = True
        time.sleep(0.1)
    return True


def _copy_and_switch(
    router: BackendRouter,
    fence: MoveFence,
    token: str,
    args: argparse.Namespace,
    source: RetrievalBackend,
    target: RetrievalBackend,
) -> int:
    version = source.version(args.tenant)
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
    if source.version(args.tenant) != version or not fence.holds(args.tenant, token):
        print(
            f"rag backend move: tenant {args.tenant} changed during the copy (its fence "
            f"lapsed); it stays on {source.name}: run the move again",
            file=sys.stderr,
        )
        return 1
    router.record(args.tenant, args.to)
    time.sleep(SETTLE_S)
    documents = source.document_ids(args.tenant)
    source.delete(args.tenant, sorted(documents))
    print(
        f"moved tenant {args.tenant} from {source.name} to {args.to}: "
        f"{len(documents)} documents, {expected} chunks; version {target.version(args.tenant)}"
    )
    return 0
