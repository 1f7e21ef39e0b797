"""Settings: environment variables, and the README's configuration table kept complete."""

from __future__ import annotations

import base64
import os
import re
from pathlib import Path
from typing import Any

import pytest
from opentelemetry import trace
from pydantic import BaseModel, ValidationError

from app.main import create_app
from app.services import Services, build_policies
from app.settings import Settings, SettingsError

README = Path(__file__).resolve().parents[2] / "README.md"


def env_names(model: type[BaseModel], prefix: str = "RAG_") -> list[str]:
    names = []
    for name, field in model.model_fields.items():
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            names.extend(env_names(annotation, f"{prefix}{name.upper()}__"))
        else:
            names.append(f"{prefix}{name.upper()}")
    return names


def test_every_setting_is_in_the_readme_configuration_table() -> None:
    table = README.read_text()
    documented = set(re.findall(r"`(RAG_[A-Z_]+)`", table))
    # Rows may pair settings of one group: `RAG_X__A` / `__B`.
    for group, suffix in re.findall(r"`(RAG_[A-Z]+)__[A-Z_]+` / `__([A-Z_]+)`", table):
        documented.add(f"{group}__{suffix}")
    missing = [name for name in env_names(Settings) if name not in documented]
    assert missing == []


def test_nested_settings_come_from_prefixed_environment_variables(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("RAG_LLM__BASE_URL", "http://vllm:8000")
    monkeypatch.setenv("RAG_LLM__MODELS", "smollm2, qwen")
    monkeypatch.setenv("RAG_CACHE__TTL_SECONDS", "60")
    settings = Settings()
    assert settings.llm.base_url == "http://vllm:8000"
    assert settings.llm.models == ["smollm2", "qwen"]
    assert settings.cache.ttl_seconds == 60


def test_invalid_settings_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RAG_CACHE__TTL_SECONDS", "-5")
    with pytest.raises(ValueError, match="ttl_seconds"):
        Settings()


def field_names(model: type[BaseModel]) -> list[str]:
    return [name.lower() for name in env_names(model)]


def test_durations_have_one_unit_in_their_names() -> None:
    names = field_names(Settings)
    assert [n for n in names if re.search(r"_(ms|s|secs|millis|minutes)$", n)] == []
    assert "rag_routing__timeout_seconds" in names


@pytest.mark.parametrize(
    "old, value, group, field, seconds",
    [
        ("RAG_ROUTING__TIMEOUT_MS", "250", "routing", "timeout_seconds", 0.25),
        ("RAG_FEATURES__TIMEOUT_MS", "50", "features", "timeout_seconds", 0.05),
        (
            "RAG_RETRIEVAL__QUERY_BATCH_WINDOW_MS",
            "2.5",
            "retrieval",
            "query_batch_window_seconds",
            0.0025,
        ),
    ],
)
def test_a_duration_under_its_old_millisecond_name_still_means_the_same(
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    old: str,
    value: str,
    group: str,
    field: str,
    seconds: float,
) -> None:
    monkeypatch.setenv(old, value)
    with caplog.at_level("WARNING", logger="app.settings"):
        settings = Settings(_env_file=None)
    assert getattr(getattr(settings, group), field) == pytest.approx(seconds)
    assert any("deprecated" in r.getMessage() and field in r.getMessage() for r in caplog.records)
    monkeypatch.setenv(old.removesuffix("_MS") + "_SECONDS", "1")
    with pytest.raises(ValidationError, match="not both"):
        Settings(_env_file=None)
    monkeypatch.delenv(old.removesuffix("_MS") + "_SECONDS")
    monkeypatch.setenv(old, "soon")
    with pytest.raises(ValidationError, match="milliseconds"):
        Settings(_env_file=None)


@pytest.mark.parametrize(
    "variable, value, read",
    [
        ("RAG_LLM__MODELS", " a , b,,", lambda s: s.llm.models),
        ("RAG_LLM__MODELS", '["a", "b"]', lambda s: s.llm.models),
        ("RAG_JOBS__WEBHOOK_ALLOW", "a,b", lambda s: s.jobs.webhook_allow),
        ("RAG_ROUTING__CAPPED_TIERS", "a, b", lambda s: s.routing.capped_tiers),
        ("RAG_ROUTING__CAPPED_TIERS", '["a","b"]', lambda s: s.routing.capped_tiers),
    ],
)
def test_list_settings_take_commas_or_json(
    monkeypatch: pytest.MonkeyPatch, variable: str, value: str, read: Any
) -> None:
    monkeypatch.setenv(variable, value)
    assert read(Settings(_env_file=None)) == ["a", "b"]


@pytest.mark.parametrize("value", ["", " , ", "[]", '["a", 1]', "[oops"])
def test_a_bad_or_empty_model_list_is_refused(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv("RAG_LLM__MODELS", value)
    with pytest.raises(ValidationError, match="models"):
        Settings(_env_file=None)


@pytest.mark.parametrize(
    "policy, problem",
    [
        ("{oops", "not valid JSON"),
        ('{"acme": 3}', "map tenant names"),
        ('{"*": {"injection": "maybe"}}', "injection"),
    ],
)
def test_a_bad_guard_policy_stops_the_start_before_anything_is_built(
    policy: str, problem: str
) -> None:
    settings = Settings(_env_file=None, guard={"policy": policy})  # settings only hold it
    with pytest.raises(SettingsError, match=rf"RAG_GUARD__POLICY: .*{problem}"):
        build_policies(settings)
    # Services.build checks it first: before Redis is dialled or a model loaded (the URL below
    # would fail differently, and the embedder is never asked for).
    unreachable = settings.model_copy(
        update={"redis": settings.redis.model_copy(update={"url": "redis://nowhere.invalid:1"})}
    )
    with pytest.raises(SettingsError, match="RAG_GUARD__POLICY"):
        Services.build(unreachable, trace.get_tracer("test"))


# Production refuses what is fine in development. Values come from the environment, as in a
# container; `_env_file=None` keeps a developer's .env out of it. Each test starts from a
# production configuration that starts (`production`) and opens one thing.

REDIS_PASSWORD = "9c2e" * 8
METRICS_TOKEN = "51ad" * 8
WEBHOOK_SECRET_KEY = base64.b64encode(bytes(range(32))).decode()
PLACEHOLDER_KEY = base64.b64encode(b"change-me-change-me-change-me-!!").decode()


@pytest.fixture
def production(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in list(os.environ):
        if name.startswith("RAG_") or name == "FORWARDED_ALLOW_IPS":
            monkeypatch.delenv(name)
    monkeypatch.setenv("RAG_ENVIRONMENT", "production")
    monkeypatch.setenv("RAG_REDIS__URL", f"redis://:{REDIS_PASSWORD}@redis:6379/0")
    monkeypatch.setenv("RAG_TELEMETRY__METRICS_TOKEN", METRICS_TOKEN)
    monkeypatch.setenv("RAG_JOBS__WEBHOOK_SECRET_KEY", WEBHOOK_SECRET_KEY)
    return monkeypatch


def refusals(monkeypatch: pytest.MonkeyPatch, **env: str) -> list[str]:
    """The problems production names with `env` set on top (empty: it started)."""
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    try:
        Settings(_env_file=None)
    except ValidationError as exc:
        (error,) = exc.errors()
        message = str(error["msg"])
        assert message.startswith("Value error, refusing to start in production: "), message
        return message.split(": ", 1)[1].split("; ")
    return []


def test_production_starts_when_nothing_is_left_open(production: pytest.MonkeyPatch) -> None:
    production.setenv("RAG_DEV_API_KEY", "")  # an empty line in .env is no key
    production.setenv("FORWARDED_ALLOW_IPS", "172.28.0.0/16")
    settings = Settings(_env_file=None)
    assert settings.environment == "production"
    assert settings.dev_api_key is None
    assert settings.telemetry.metrics_token is not None
    # The password may also come as the client's `?password=` query parameter.
    assert refusals(production, RAG_REDIS__URL=f"redis://redis/0?password={REDIS_PASSWORD}") == []
    # Without /metrics there is nothing for a token to guard.
    assert (
        refusals(production, RAG_TELEMETRY__METRICS_TOKEN="", RAG_TELEMETRY__METRICS="false") == []
    )


def test_production_refuses_a_development_key_without_echoing_it(
    production: pytest.MonkeyPatch,
) -> None:
    found = refusals(production, RAG_DEV_API_KEY="rag-dev.s3cret-value")
    assert found == ["a development key is configured (RAG_DEV_API_KEY)"]


def test_production_refuses_content_capture_unless_explicitly_allowed(
    production: pytest.MonkeyPatch,
) -> None:
    assert refusals(production, RAG_TELEMETRY__CAPTURE_CONTENT="true") == [
        "content capture is on (RAG_TELEMETRY__CAPTURE_CONTENT) without "
        "RAG_TELEMETRY__ALLOW_CONTENT_CAPTURE_IN_PRODUCTION"
    ]
    production.setenv("RAG_TELEMETRY__ALLOW_CONTENT_CAPTURE_IN_PRODUCTION", "true")
    assert Settings(_env_file=None).telemetry.capture_content is True


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("redis://redis:6379/0", "Redis is reached without a password (RAG_REDIS__URL has none)"),
        ("redis://:@redis:6379/0", "Redis is reached without a password (RAG_REDIS__URL has none)"),
        (
            "redis://rag@redis:6379/0",
            "Redis is reached without a password (RAG_REDIS__URL has none)",
        ),
        # TLS hides the traffic; it does not stop a stranger from connecting.
        ("rediss://redis:6380/0", "Redis is reached without a password (RAG_REDIS__URL has none)"),
        (
            "redis://:0123456789abcde@redis/0",
            "the Redis password in RAG_REDIS__URL is shorter than 16 characters",
        ),
        (
            "redis://:change-me-redis-password@redis/0",
            "the Redis password in RAG_REDIS__URL is the placeholder of .env.example",
        ),
        ("http://redis:6379", "RAG_REDIS__URL is not a redis://, rediss:// or unix:// URL"),
    ],
)
def test_production_refuses_a_redis_anyone_can_read(
    production: pytest.MonkeyPatch, url: str, expected: str
) -> None:
    found = refusals(production, RAG_REDIS__URL=url)
    assert found == [expected]


@pytest.mark.parametrize(
    ("token", "expected"),
    [
        (
            "",
            "/metrics is served without a token (set RAG_TELEMETRY__METRICS_TOKEN, "
            "or RAG_TELEMETRY__METRICS=false)",
        ),
        (
            "short-token",
            "the metrics token (RAG_TELEMETRY__METRICS_TOKEN) is shorter than 16 characters",
        ),
        (
            "change-me-metrics-token",
            "the metrics token (RAG_TELEMETRY__METRICS_TOKEN) is the placeholder of .env.example",
        ),
    ],
)
def test_production_refuses_metrics_anyone_can_read(
    production: pytest.MonkeyPatch, token: str, expected: str
) -> None:
    assert refusals(production, RAG_TELEMETRY__METRICS_TOKEN=token) == [expected]


def test_production_refuses_webhook_secrets_in_plaintext_or_under_a_public_key(
    production: pytest.MonkeyPatch,
) -> None:
    assert refusals(production, RAG_JOBS__WEBHOOK_SECRET_KEY="") == [
        "webhook signing secrets would be stored in plaintext "
        "(RAG_JOBS__WEBHOOK_SECRET_KEY is not set)"
    ]
    assert refusals(production, RAG_JOBS__WEBHOOK_SECRET_KEY=PLACEHOLDER_KEY) == [
        "the webhook secret key (RAG_JOBS__WEBHOOK_SECRET_KEY) is the placeholder of .env.example"
    ]
    # Rotating away from the placeholder: it still opens old secrets, so it is still refused.
    rotating = f"{WEBHOOK_SECRET_KEY},{PLACEHOLDER_KEY}"
    assert len(refusals(production, RAG_JOBS__WEBHOOK_SECRET_KEY=rotating)) == 1


def test_production_refuses_a_weak_prefix_cache_secret_and_allows_none(
    production: pytest.MonkeyPatch,
) -> None:
    assert refusals(production, RAG_LLM__PREFIX_CACHE_SECRET="short") == [
        "the prefix cache secret (RAG_LLM__PREFIX_CACHE_SECRET) is shorter than 16 characters"
    ]
    assert refusals(production, RAG_LLM__PREFIX_CACHE_SECRET="change-me-prefix-cache") == [
        "the prefix cache secret (RAG_LLM__PREFIX_CACHE_SECRET) is the placeholder of .env.example"
    ]
    assert refusals(production, RAG_LLM__PREFIX_CACHE_SECRET="x9Vq2LmT7rB4kWz8Yd3N") == []
    production.delenv("RAG_LLM__PREFIX_CACHE_SECRET")
    assert refusals(production) == []  # unset: salts from the names alone


@pytest.mark.parametrize("trusted", ["*", "172.28.0.0/16, *", "0.0.0.0/0", "::/0"])
def test_production_refuses_forwarded_headers_from_anyone(
    production: pytest.MonkeyPatch, trusted: str
) -> None:
    item = trusted.split(",")[-1].strip()
    assert refusals(production, FORWARDED_ALLOW_IPS=trusted) == [
        f"uvicorn trusts X-Forwarded-* from any address (FORWARDED_ALLOW_IPS={item}: "
        "name the proxy's addresses or network instead)"
    ]


def test_production_names_every_problem_in_one_refusal_and_echoes_no_secret(
    production: pytest.MonkeyPatch,
) -> None:
    found = refusals(
        production,
        RAG_DEV_API_KEY="rag-dev.s3cret-value",
        RAG_TELEMETRY__CAPTURE_CONTENT="true",
        RAG_REDIS__URL="redis://:s3cret-short@redis:6379/0",
        RAG_TELEMETRY__METRICS_TOKEN="s3cret-tok",
        FORWARDED_ALLOW_IPS="*",
        RAG_JOBS__WEBHOOK_SECRET_KEY="",
    )
    assert [problem.split(" (")[0].split(" is ")[0] for problem in found] == [
        "a development key",
        "content capture",
        "the Redis password in RAG_REDIS__URL",
        "the metrics token",
        "uvicorn trusts X-Forwarded-* from any address",
        "webhook signing secrets would be stored in plaintext",
    ]
    with pytest.raises(ValidationError) as err:
        Settings(_env_file=None)
    assert "s3cret" not in str(err.value)


def test_development_warns_about_what_production_would_refuse(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    for name in list(os.environ):
        if name.startswith("RAG_") or name == "FORWARDED_ALLOW_IPS":
            monkeypatch.delenv(name)
    monkeypatch.setenv("RAG_ENVIRONMENT", "development")
    monkeypatch.setenv("RAG_DEV_API_KEY", "rag-dev.s3cret-value")
    monkeypatch.setenv("RAG_TELEMETRY__CAPTURE_CONTENT", "true")
    with caplog.at_level("WARNING", logger="app.settings"):
        settings = Settings(_env_file=None)
        # Made, they say nothing (a `rag` command's); the app, made of them, says it once.
        assert not [r for r in caplog.records if r.name == "app.settings"]
        create_app(settings)
    assert settings.dev_api_key is not None
    assert settings.dev_api_key.get_secret_value() == "rag-dev.s3cret-value"
    warnings = [r.getMessage() for r in caplog.records if r.name == "app.settings"]
    # The key, content capture, and the defaults: Redis without a password, /metrics open,
    # webhook secrets unsealed.
    assert len(warnings) == 5
    assert all("refused in production" in w for w in warnings)
    assert "s3cret-value" not in " ".join(warnings)
