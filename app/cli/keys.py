"""``rag keys``: create, list, revoke and limit API keys, and set tenants' limits (in Redis,
which every replica reads)."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence

from app.settings import get_settings
from app.stores import build_key_store, command_kv, job_queue
from pipeline.context import Principal
from pipeline.store.keys import ApiKeyStore, validate_groups, validate_scopes, validate_tenant
from pipeline.store.limits import tenant_record


def _key_store() -> ApiKeyStore:
    settings = get_settings()
    kv = command_kv(settings)
    return build_key_store(settings, kv)


async def create(args: argparse.Namespace) -> int:
    scopes = frozenset(s.strip() for s in args.scopes.split(",") if s.strip())
    validate_scopes(scopes)  # refused before anything is stored (an empty --scopes too)
    groups = _group_names(args.groups)
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


def _group_names(text: str | None) -> frozenset[str]:
    """``--groups a,b``: the names, checked before anything is stored (blank items dropped)."""
    return validate_groups(frozenset(g.strip() for g in (text or "").split(",") if g.strip()))


async def groups(args: argparse.Namespace) -> int:
    """Replace a key's groups; every replica resolves the key afresh on its next request."""
    groups = frozenset() if args.clear else _group_names(args.set)
    if not args.clear and not groups:
        # "--set ''" would clear them silently: clearing is said with --clear.
        print("--set names no group (to remove the key's groups, use --clear)", file=sys.stderr)
        return 2
    store = _key_store()
    try:
        key, by_id = _which(args)
        principal = await store.set_groups(key, groups, by_id=by_id)
    finally:
        await store.kv.aclose()
    if principal is None:
        print("no such key", file=sys.stderr)
        return 1
    shown = ",".join(sorted(principal.groups)) or "none"
    print(f"{_named(principal)}: groups {shown}")
    return 0


def _shown(fields: dict[bytes, bytes], names: Sequence[str]) -> str:
    return ", ".join(
        f"{name} {fields[name.encode()].decode() if name.encode() in fields else 'default'}"
        for name in names
    )


async def limits(args: argparse.Namespace) -> int:
    store = _key_store()
    try:
        key, by_id = _which(args)
        principal = await store.set_limits(key, rpm=args.rpm, tpm=args.tpm, by_id=by_id)
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
    print(f"{_named(principal)}: {_shown(shown, ('rpm', 'tpm'))} per minute")
    return 0


TENANT_LIMITS = ("rpm", "tpm", "key_rpm", "key_tpm")


async def tenant_limits(args: argparse.Namespace) -> int:
    """The tenant record's limits, read by every replica's limiter on the next request."""
    validate_tenant(args.tenant)
    store = _key_store()
    record = tenant_record(store.kv, get_settings().redis.key_prefix, args.tenant)
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


async def revoke(args: argparse.Namespace) -> int:
    """Revoke the key, then settle the jobs it left queued (they fail with ``key_revoked``);
    a job a worker started meanwhile fails the worker's own check of the key."""
    store = _key_store()
    try:
        key, by_id = _which(args)
        revoked = await store.revoke(key, by_id=by_id)
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
    print(
        f"revoked {_named(revoked)}; {settled} queued job(s) of this key will not run",
        file=sys.stderr,
    )
    return 0


def _named(principal: Principal) -> str:
    """Which key a command acted on, so that the operator sees it was the one meant."""
    return f"key {principal.key_id} (tenant {principal.tenant}, user {principal.user})"


def _which(args: argparse.Namespace) -> tuple[str, bool]:
    """(the key or its id, whether it is the id), as ``ApiKeyStore``'s methods take them."""
    return (args.key_id, True) if args.key_id is not None else (args.key, False)


async def list_keys(args: argparse.Namespace) -> int:
    """The tenant's keys, one line each (tab-separated, with a header): never a key's value or
    hash, which are not stored or not shown."""
    store = _key_store()
    try:
        found = await store.keys_of(args.tenant, rescan=args.rescan)
    finally:
        await store.kv.aclose()
    print("key_id\tuser\tscopes\tgroups\trpm\ttpm\tcreated")
    for info in found:
        who = info.principal
        created = (
            time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(info.created))
            if info.created is not None
            else "-"
        )
        print(
            "\t".join(
                [
                    who.key_id or "-",
                    who.user,
                    ",".join(sorted(who.scopes)) or "-",
                    ",".join(sorted(who.groups)) or "-",
                    "default" if who.rpm is None else str(who.rpm),
                    "default" if who.tpm is None else str(who.tpm),
                    created,
                ]
            )
        )
    print(f"{len(found)} key(s) of tenant {args.tenant}", file=sys.stderr)
    return 0
