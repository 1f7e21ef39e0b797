"""``rag webhooks secret --tenant T [--rotate]``: print (or replace) a tenant's webhook signing
secret (needs RAG_JOBS__WEBHOOK_SECRET_KEY once set)."""

from __future__ import annotations

import argparse

from app.settings import get_settings
from app.stores import command_kv, webhook_secrets
from pipeline.jobs.secret_box import SecretUnreadable
from pipeline.store.keys import validate_tenant


async def secret(args: argparse.Namespace) -> int:
    settings = get_settings()
    validate_tenant(args.tenant)
    kv = command_kv(settings)
    try:
        secrets = webhook_secrets(settings, kv)
        secret = await (secrets.rotate if args.rotate else secrets.current)(args.tenant)
    except SecretUnreadable as exc:
        raise ValueError(str(exc)) from None  # a configuration error: `rag: ...`, status 2
    finally:
        await kv.aclose()
    print(secret)
    return 0
