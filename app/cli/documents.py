"""``rag ingest``, ``rag delete`` and ``rag restore``: a tenant's documents, through its
retrieval backend (retrieval.backends), as the app's requests do."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from pathlib import Path

from app.cli.backend import backend_router
from app.cli.ingest_files import FileReader, Skipped, read_documents
from app.path import erase_cached_answers
from app.services import build_converter
from app.settings import get_settings
from app.stores import command_kv
from retrieval import Document, DocumentError
from retrieval.backends import RetrievalBackend
from retrieval.backends.embedded import EmbeddedBackend
from retrieval.backends.moves import TenantMoving
from retrieval.snapshots import IndexUnreadable
from retrieval.store import IndexBusy, IndexStorageFull, IngestResult
from retrieval.versions import NO_VERSION


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


def ingest(args: argparse.Namespace) -> int:
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
    except (IndexBusy, IndexStorageFull) as exc:
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


def delete(args: argparse.Namespace) -> int:
    """Like ``DELETE /v1/documents/{id}``: an id the tenant does not have is an error (exit 1),
    reported after the ids it does have are deleted."""
    wanted = list(dict.fromkeys(args.document_ids))
    with backend_router().writing(args.tenant) as store:
        present = store.document_ids(args.tenant)
        missing = [d for d in wanted if d not in present]
        result = store.delete(args.tenant, wanted) if len(missing) < len(wanted) else None
    if result is not None:
        erased = asyncio.run(_erase_cached_answers(args.tenant, result.version))
        print(
            f"deleted {result.documents} documents ({result.chunks} chunks); "
            f"version {result.version}; "
            + ("cached answers not erased" if erased is None else f"{erased} cached answers erased")
        )
        if erased is None:
            print(
                "rag delete: Redis could not be reached, so the tenant's cached answers were "
                "not erased; no request finds them (the index version is part of their keys), "
                "and they expire within RAG_CACHE__TTL_SECONDS",
                file=sys.stderr,
            )
    for document_id in missing:
        print(
            f"rag delete: document {document_id!r} not found for tenant {args.tenant!r}",
            file=sys.stderr,
        )
    return 1 if missing else 0


async def _erase_cached_answers(tenant: str, version: str) -> int | None:
    """As the API's delete does (``app.path.erase_cached_answers``)."""
    settings = get_settings()
    kv = command_kv(settings)
    try:
        return await erase_cached_answers(settings, kv, tenant, version)
    finally:
        await kv.aclose()


def restore(args: argparse.Namespace) -> int:
    """Publish the tenant's newest readable snapshot again when the published one cannot be
    read, or, with ``--version``, the kept version named (``IndexStore.restore``); every replica
    follows within its reload interval."""
    tenant, chosen = args.tenant, args.version
    with backend_router().writing(tenant) as backend:  # fenced against a move, as ingest is
        if not isinstance(backend, EmbeddedBackend):
            raise ValueError(
                f"tenant {tenant!r} is on the {backend.name} backend, which keeps no snapshots "
                "to restore"
            )
        try:
            restored = backend.store.restore(tenant, chosen)
        except IndexUnreadable as exc:
            print(
                f"rag restore: version {chosen!r} of tenant {tenant!r} cannot be read (the log "
                "says why); nothing was changed."
                if chosen is not None
                else f"rag restore: no kept version of tenant {tenant!r} can be read (the "
                f"published one is {exc.version!r}; the log says why). Move the tenant's "
                "directory aside and ingest its documents again.",
                file=sys.stderr,
            )
            return 1
    if restored is None:
        version = backend.version(tenant)
        print(
            f"tenant {tenant}: "
            + (f"version {version} can be read" if version != NO_VERSION else "no index")
            + ("" if chosen is None else " and is the one published")
            + "; nothing to restore"
        )
        return 0
    totals = f"({restored.documents} documents, {restored.chunks} chunks)"
    if chosen is not None:
        print(
            f"tenant {tenant}: version {restored.version} {totals} is published in place of "
            f"{restored.replaced}, which the next write deletes"
        )
        return 0
    lost = (
        f"version {restored.replaced!r} could not be read"
        if restored.replaced != NO_VERSION
        else "CURRENT named no version"
    )
    print(
        f"tenant {tenant}: {lost}; version {restored.version} is published again {totals}. "
        "What the unreadable version changed is not in it: run the ingest or delete that made "
        "it again."
    )
    return 0
