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
