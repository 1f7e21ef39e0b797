"""Settings: environment variables, and the README's configuration table kept complete."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from pydantic import BaseModel

from app.settings import Settings

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


# Production refuses what is fine in development. Values come from the environment, as in a
# container; `_env_file=None` keeps a developer's .env out of it.


def test_production_refuses_a_development_key_without_echoing_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("RAG_ENVIRONMENT", "production")
    monkeypatch.setenv("RAG_DEV_API_KEY", "rag-dev.s3cret-value")
    monkeypatch.delenv("RAG_TELEMETRY__CAPTURE_CONTENT", raising=False)
    with pytest.raises(
        ValueError, match=r"development key is configured \(RAG_DEV_API_KEY\)"
    ) as err:
        Settings(_env_file=None)
    assert "s3cret-value" not in str(err.value)


def test_production_refuses_content_capture_unless_explicitly_allowed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("RAG_ENVIRONMENT", "production")
    monkeypatch.delenv("RAG_DEV_API_KEY", raising=False)
    monkeypatch.setenv("RAG_TELEMETRY__CAPTURE_CONTENT", "true")
    monkeypatch.delenv("RAG_TELEMETRY__ALLOW_CONTENT_CAPTURE_IN_PRODUCTION", raising=False)
    with pytest.raises(ValueError, match="content capture is on"):
        Settings(_env_file=None)
    monkeypatch.setenv("RAG_TELEMETRY__ALLOW_CONTENT_CAPTURE_IN_PRODUCTION", "true")
    settings = Settings(_env_file=None)
    assert settings.telemetry.capture_content is True


def test_production_starts_when_nothing_unsafe_is_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RAG_ENVIRONMENT", "production")
    monkeypatch.setenv("RAG_DEV_API_KEY", "")  # an empty line in .env is no key
    monkeypatch.delenv("RAG_TELEMETRY__CAPTURE_CONTENT", raising=False)
    settings = Settings(_env_file=None)
    assert settings.environment == "production"
    assert settings.dev_api_key is None


def test_development_warns_about_what_production_would_refuse(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("RAG_ENVIRONMENT", "development")
    monkeypatch.setenv("RAG_DEV_API_KEY", "rag-dev.s3cret-value")
    monkeypatch.setenv("RAG_TELEMETRY__CAPTURE_CONTENT", "true")
    with caplog.at_level("WARNING", logger="app.settings"):
        settings = Settings(_env_file=None)
    assert settings.dev_api_key is not None
    assert settings.dev_api_key.get_secret_value() == "rag-dev.s3cret-value"
    warnings = [r.getMessage() for r in caplog.records if r.name == "app.settings"]
    assert len(warnings) == 2
    assert all("refused in production" in w for w in warnings)
    assert "s3cret-value" not in " ".join(warnings)
