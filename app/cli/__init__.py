"""The ``rag`` command: keys, serving, ingestion.

rag keys create --tenant T --user U [--scopes chat,retrieve,ingest,admin] [--key VALUE]
              [--rpm N] [--tpm N] [--groups a,b]
rag keys list --tenant T [--rescan]   (ids, users, scopes, groups, limits, created; never a key)
rag keys groups KEY (--set a,b | --clear)   (the groups whose documents the key may retrieve)
rag keys revoke KEY         (its queued jobs fail with ``key_revoked``; they are never run)
rag keys limits KEY [--rpm N|default] [--tpm N|default]      (the key's own limits)
                            (groups, revoke, limits: KEY, or --id KEY_ID for a lost key)
rag keys tenant-limits T [--rpm N|default] [--tpm N|default] [--key-rpm ..] [--key-tpm ..]
                            (per minute; 0: no limit; default: the settings' value)
rag serve [--host H] [--port P]
rag ingest PATH --tenant T [--batch N] [--quiet]   (--quiet: nothing printed but errors)
                            (PATH: a .jsonl, a PDF/DOCX/PPTX/HTML/Markdown/text file, or a
                            folder of them; each bad file is skipped with its reason)
rag delete --tenant T ID...   (an id the tenant does not have is reported; exit status 1)
rag restore --tenant T [--version V]   (the published index cannot be read: publish the
                            newest kept version that can; exit status 1 when none can; V: that
                            kept version, over a readable one too)
rag backend show|move ...     (app.cli.backend: which backend holds a tenant; move it)

rag features load|compute ... (app.cli.features: the online feature store)
rag worker | jobs submit | webhooks secret ...   (app.cli.jobs, app.cli.batch, app.cli.webhooks)
rag redis copy --to URL [--to-cluster] ...   (app.cli.redis_copy: the service's keys to
                            another Redis or a Redis Cluster, renamed for it)

This module is only the parser. Each command's code is in a module of its own (keys, documents,
serve, backend, features, jobs, batch, webhooks, redis_copy), imported when that command runs:
`rag keys`, `rag webhooks` and `rag redis` load Redis and the settings but not the web
framework, the request path (app.services), FAISS or scipy, and `rag --help` does not read the
settings.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import inspect
import sys
from collections.abc import Sequence
from typing import Any

from pipeline.errors import StoreUnavailable
from pipeline.store.keys import DEFAULT_SCOPES
from pipeline.store.limits import MAX_PER_MINUTE


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


def _which_key(parser: argparse.ArgumentParser) -> None:
    """The key a command acts on: its value, or its id (the value is shown only once)."""
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("key", nargs="?", help="the key itself")
    which.add_argument(
        "--id",
        dest="key_id",
        help="the key's id instead (key_...: `rag keys list` shows them), for a key whose value "
        "is lost",
    )


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
    create.set_defaults(run="keys:create")
    listed = keys.add_parser("list", help="a tenant's keys: ids, users, scopes, groups, limits")
    listed.add_argument("--tenant", required=True)
    listed.add_argument(
        "--rescan",
        action="store_true",
        help="scan every key name first, for keys an older version of rag created meanwhile",
    )
    listed.set_defaults(run="keys:list_keys")
    groups = keys.add_parser("groups", help="set a key's groups (every replica at once)")
    _which_key(groups)
    change = groups.add_mutually_exclusive_group(required=True)
    change.add_argument("--set", help="comma-separated groups, replacing the key's")
    change.add_argument("--clear", action="store_true", help="the key belongs to no group")
    groups.set_defaults(run="keys:groups")
    revoke = keys.add_parser("revoke", help="revoke a key (its queued jobs will not run)")
    _which_key(revoke)
    revoke.set_defaults(run="keys:revoke")
    limits = keys.add_parser("limits", help="set a key's own rate limits (every replica at once)")
    _which_key(limits)
    limits.add_argument("--rpm", type=_limit, help="requests per minute; 0: none; default")
    limits.add_argument("--tpm", type=_limit, help="tokens per minute; 0: none; default")
    limits.set_defaults(run="keys:limits")
    tenant = keys.add_parser("tenant-limits", help="set a tenant's rate limits and key defaults")
    tenant.add_argument("tenant")
    tenant.add_argument("--rpm", type=_limit, help="the tenant's requests per minute")
    tenant.add_argument("--tpm", type=_limit, help="the tenant's tokens per minute")
    tenant.add_argument("--key-rpm", type=_limit, help="each key's requests per minute")
    tenant.add_argument("--key-tpm", type=_limit, help="each key's tokens per minute")
    tenant.set_defaults(run="keys:tenant_limits")

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
    serve.set_defaults(run="serve:serve")

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
    ingest.set_defaults(run="documents:ingest")

    delete = commands.add_parser("delete", help="remove documents from a tenant's index")
    delete.add_argument("--tenant", required=True)
    delete.add_argument("document_ids", nargs="+")
    delete.set_defaults(run="documents:delete")

    restore = commands.add_parser(
        "restore",
        help="when a tenant's published index cannot be read, publish its newest readable "
        "kept version again",
    )
    restore.add_argument("--tenant", required=True)
    restore.add_argument(
        "--version",
        help="publish this kept version instead, even over a readable one (an ingest to take "
        "back); the one it replaces is deleted by the next write",
    )
    restore.set_defaults(run="documents:restore")
    _add_backend_commands(commands)
    _add_feature_commands(commands)
    _add_job_commands(commands)
    _add_redis_commands(commands)
    return parser


def _add_redis_commands(commands: Any) -> None:
    actions = commands.add_parser(
        "redis", help="the service's Redis: copy its keys to another"
    ).add_subparsers(dest="action", required=True)
    copy = actions.add_parser(
        "copy",
        help="copy the service's keys to another Redis or Redis Cluster, renamed for it (move "
        "a deployment from one Redis to a cluster; app.cli.redis_copy)",
    )
    copy.add_argument("--to", required=True, help="the target: a redis:// URL (a node's)")
    copy.add_argument("--to-cluster", action="store_true", help="the target is a Redis Cluster")
    copy.add_argument("--from", dest="source", help="the source (default: RAG_REDIS__URL)")
    copy.add_argument(
        "--from-cluster",
        action=argparse.BooleanOptionalAction,
        help="the source is a Redis Cluster (default: RAG_REDIS__CLUSTER)",
    )
    copy.add_argument(
        "--to-prefix", help="the target's key prefix (default: RAG_REDIS__KEY_PREFIX)"
    )
    into = copy.add_mutually_exclusive_group()
    into.add_argument(
        "--merge",
        action="store_true",
        help="copy into a target that holds names under the prefix already, leaving them as "
        "they are (a copy that stopped part way; what was deleted there comes back)",
    )
    into.add_argument(
        "--replace", action="store_true", help="as --merge, but overwrite the names there"
    )
    copy.add_argument(
        "--skip-prefix",
        action="append",
        metavar="PREFIX",
        help="another deployment's longer prefix on the source (rag:staging:): its names are "
        "counted, not copied, and not listed as unknown (may be given more than once)",
    )
    copy.add_argument(
        "--dry-run",
        action="store_true",
        help="count what would be copied and what the target holds already; write nothing",
    )
    copy.set_defaults(run="redis_copy:copy")


def _add_backend_commands(commands: Any) -> None:
    parser = commands.add_parser("backend", help="retrieval backends: show, move a tenant")
    actions = parser.add_subparsers(dest="action", required=True)
    show = actions.add_parser("show", help="the tenant's backend and index size")
    show.add_argument("--tenant", required=True)
    show.set_defaults(run="backend:show")
    move = actions.add_parser("move", help="move a tenant's index to another backend")
    move.add_argument("--tenant", required=True)
    move.add_argument("--to", required=True, choices=["embedded", "milvus"])
    move.add_argument("--batch", type=int, default=500, help="chunks copied per write")
    move.set_defaults(run="backend:move")


def _add_feature_commands(commands: Any) -> None:
    features = commands.add_parser("features", help="the online feature store").add_subparsers(
        dest="action", required=True
    )
    load = features.add_parser("load", help="bulk-load users' batch features (JSONL or CSV)")
    load.add_argument("file")
    load.add_argument("--quiet", action="store_true", help="no progress bar")
    load.set_defaults(run="features:load")
    compute = features.add_parser(
        "compute", help="derive batch features from the request log, as the nightly job would"
    )
    compute.add_argument("--log", help="a JSONL file of request-log records (default: Redis)")
    target = compute.add_mutually_exclusive_group(required=True)
    target.add_argument("--write", action="store_true", help="merge into the users' hashes")
    target.add_argument("--out", help="write a JSONL file that `rag features load` reads")
    compute.add_argument("--quiet", action="store_true", help="no progress bar")
    compute.set_defaults(run="features:compute")


def _add_job_commands(commands: Any) -> None:
    worker = commands.add_parser("worker", help="run queued jobs (a process of its own)")
    worker.add_argument("--workers", type=int, default=1, help="consumers in this process")
    worker.add_argument("--concurrency", type=int, help="jobs each consumer runs at once")
    worker.set_defaults(run="jobs:worker")

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
    submit.set_defaults(run="batch:submit")

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
    secret.set_defaults(run="webhooks:secret")


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    module, _, name = args.run.partition(":")
    handler = getattr(importlib.import_module(f"app.cli.{module}"), name)
    try:
        if inspect.iscoroutinefunction(handler):
            return int(asyncio.run(handler(args)))
        return int(handler(args))
    except (ValueError, StoreUnavailable) as exc:
        print(f"rag: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # the disk or the machine: full, read-only, no permission, no files
        print(f"rag: {exc}", file=sys.stderr)
        return 1
    except Exception as exc:
        said = _index_refusal(exc)
        if said is None:
            raise
        print(said, file=sys.stderr)
        return 1


def _index_refusal(exc: Exception) -> str | None:
    """What to tell the user when a retrieval backend refused the command; None for anything
    else. Its classes are imported only now, so that commands that never touch an index (keys,
    jobs) do not load the index code for their error handling."""
    if not type(exc).__module__.startswith("retrieval."):
        return None  # none of them: and nothing to import
    from retrieval.backends import BackendUnavailable
    from retrieval.backends.moves import MoveUnderway, TenantMoving
    from retrieval.snapshots import IndexUnreadable
    from retrieval.store import IndexBusy, IndexStorageFull

    if type(exc).__module__ == "retrieval.backends.milvus":
        from retrieval.backends.milvus import MilvusUnavailable

        if isinstance(exc, MilvusUnavailable):  # not installed: no retry mends it
            return f"rag: {exc}"
    if isinstance(exc, IndexUnreadable):
        return (
            f"rag: the index of tenant '{exc.tenant}' (version {exc.version!r}) cannot be read: "
            f"the log says why. `rag restore --tenant {exc.tenant}` publishes the last version "
            "that can be read (RELIABILITY.md section 8)."
        )
    if isinstance(exc, TenantMoving | MoveUnderway | BackendUnavailable | IndexBusy):
        return f"rag: {exc} Run it again later."
    if isinstance(exc, IndexStorageFull):
        return f"rag: {exc}"
    return None
