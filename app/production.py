"""What ``RAG_ENVIRONMENT=production`` refuses to start with, one sentence per problem.

The deployment must expose nothing by default: a Redis that anyone on its network can read (keys,
cached answers, jobs), a ``/metrics`` that anyone who reaches the API can read, a uvicorn that
takes ``X-Forwarded-For`` from any peer (so any client picks the address the logs and limits
see), webhook signing secrets stored in plaintext, a development key, prompt text on spans.
Each is fine on a laptop and is refused here, all at once, so one failed start names every fix.
The settings model calls this from its validator; development logs the same sentences as
warnings. A sentence holds no "; " (the refusal joins them with it) and never a value.
"""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from pydantic import SecretStr
from redis.connection import parse_url

from pipeline.jobs.secret_box import parse_keys

if TYPE_CHECKING:
    from app.settings import Settings

# How the Redis client itself reads a URL (user info, or `?password=`); redis-py leaves it
# untyped.
redis_url_options: Callable[[str], dict[str, Any]] = parse_url

# A secret shorter than this is guessable online (Redis answers ~100k AUTH attempts a second);
# the placeholders are what .env.example ships, so a copied file cannot reach production.
MIN_SECRET_CHARS = 16
PLACEHOLDERS = ("change-me", "changeme", "change_me")


def unsafe_for_production(
    settings: Settings, environ: Mapping[str, str] | None = None
) -> list[str]:
    """Every problem of ``settings`` (and of uvicorn's ``FORWARDED_ALLOW_IPS`` in ``environ``,
    the process environment by default) that production refuses."""
    environ = os.environ if environ is None else environ
    problems = []
    if settings.dev_api_key:
        problems.append("a development key is configured (RAG_DEV_API_KEY)")
    telemetry = settings.telemetry
    if telemetry.capture_content and not telemetry.allow_content_capture_in_production:
        problems.append(
            "content capture is on (RAG_TELEMETRY__CAPTURE_CONTENT) without "
            "RAG_TELEMETRY__ALLOW_CONTENT_CAPTURE_IN_PRODUCTION"
        )
    problems += redis_problems(settings.redis.url)
    problems += metrics_problems(telemetry.metrics, telemetry.metrics_token)
    problems += proxy_problems(environ.get("FORWARDED_ALLOW_IPS"))
    # Webhook signing secrets sealed at rest (the jobs' group says what it needs).
    problems += settings.jobs.production_problems()
    problems += sealing_key_problems(settings.jobs.webhook_secret_key)
    problems += salt_secret_problems(settings.llm.prefix_cache_secret)
    return problems


def salt_secret_problems(secret: SecretStr | None) -> list[str]:
    """The prefix cache's salts are HMACs of tenant names: a weak secret lets whoever reaches
    the model server compute another tenant's salt (unset is allowed: the model server is not
    on a network anyone else reaches, and salts still keep the service's callers apart)."""
    if secret is None:
        return []
    weak = weak_secret(secret.get_secret_value())
    return [f"the prefix cache secret (RAG_LLM__PREFIX_CACHE_SECRET) {weak}"] if weak else []


def weak_secret(value: str) -> str | None:
    """Why ``value`` is too weak to guard anything, or None."""
    if any(placeholder in value.lower() for placeholder in PLACEHOLDERS):
        return "is the placeholder of .env.example"
    if len(value) < MIN_SECRET_CHARS:
        return f"is shorter than {MIN_SECRET_CHARS} characters"
    return None


def redis_problems(url: str) -> list[str]:
    """Redis must ask for a password: it holds the keys, the cache and the jobs."""
    try:
        # The parser the client itself uses: user info, or `?password=` in the query.
        password = redis_url_options(url).get("password")
    except ValueError:
        return ["RAG_REDIS__URL is not a redis://, rediss:// or unix:// URL"]
    if not password:
        return ["Redis is reached without a password (RAG_REDIS__URL has none)"]
    weak = weak_secret(str(password))
    return [f"the Redis password in RAG_REDIS__URL {weak}"] if weak else []


def metrics_problems(enabled: bool, token: SecretStr | None) -> list[str]:
    """``/metrics`` is on the API's port: without a token, whoever reaches the API reads it."""
    if not enabled:
        return []
    if token is None:
        return [
            "/metrics is served without a token (set RAG_TELEMETRY__METRICS_TOKEN, "
            "or RAG_TELEMETRY__METRICS=false)"
        ]
    weak = weak_secret(token.get_secret_value())
    return [f"the metrics token (RAG_TELEMETRY__METRICS_TOKEN) {weak}"] if weak else []


def sealing_key_problems(key: SecretStr | None) -> list[str]:
    """.env.example's webhook key is valid base64 of 32 bytes (compose needs a value), and
    public: a key that seals with it seals nothing."""
    if key is None:
        return []  # JobSettings.production_problems names a missing key
    if any(
        placeholder.encode() in raw
        for raw in parse_keys(key.get_secret_value())
        for placeholder in PLACEHOLDERS
    ):
        return [
            "the webhook secret key (RAG_JOBS__WEBHOOK_SECRET_KEY) is the placeholder of "
            ".env.example"
        ]
    return []


def proxy_problems(forwarded_allow_ips: str | None) -> list[str]:
    """uvicorn believes ``X-Forwarded-*`` only from these peers; everyone is too many."""
    for item in (forwarded_allow_ips or "").split(","):
        item = item.strip()
        if item == "*" or _whole_internet(item):
            return [
                f"uvicorn trusts X-Forwarded-* from any address (FORWARDED_ALLOW_IPS={item}: "
                "name the proxy's addresses or network instead)"
            ]
    return []


def _whole_internet(item: str) -> bool:
    try:
        return ipaddress.ip_network(item, strict=False).prefixlen == 0
    except ValueError:
        return False
