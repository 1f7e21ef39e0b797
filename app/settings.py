"""Settings: one pydantic-settings class, environment variables prefixed ``RAG_``.

Nested groups use a double underscore: ``RAG_REDIS__URL``, ``RAG_LLM__BASE_URL``. Every field is
listed, with its default and meaning, in the README's configuration table.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, Field, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict


def default_home() -> Path:
    return Path.home() / ".cache" / "rag"


class RedisSettings(BaseModel):
    url: str = "redis://127.0.0.1:6379/0"
    timeout_seconds: float = Field(0.5, gt=0, description="Socket connect/read timeout.")
    retry_after_seconds: float = Field(
        1.0, ge=0, description="After a failure, skip Redis this long before trying again."
    )
    key_prefix: str = "rag:"


class LLMSettings(BaseModel):
    base_url: str = "http://127.0.0.1:8001"
    api_key: str | None = None
    models: Annotated[list[str], NoDecode] = Field(
        default_factory=lambda: ["smollm2"],
        description="Model names the service accepts; each is served under the same name.",
    )
    context_length: int = Field(2048, gt=0)
    default_max_tokens: int | None = Field(
        512, gt=0, description="max_tokens when a request sets none (None: up to the context)."
    )
    connect_timeout_seconds: float = Field(2.0, gt=0)
    read_timeout_seconds: float = Field(60.0, gt=0)
    max_connections: int = Field(256, gt=0)

    @field_validator("models", mode="before")
    @classmethod
    def _split_models(cls, value: object) -> object:
        if isinstance(value, str):
            text = value.strip()
            if text.startswith("["):
                return json.loads(text)
            return [m.strip() for m in text.split(",") if m.strip()]
        return value


class CacheSettings(BaseModel):
    enabled: bool = True
    ttl_seconds: int = Field(3600, gt=0)


class AuthSettings(BaseModel):
    key_cache_seconds: float = Field(30.0, ge=0, description="In-process cache of resolved keys.")
    key_stale_seconds: float = Field(
        600.0, ge=0, description="How long a recently seen key is honoured while Redis is down."
    )


class ServerSettings(BaseModel):
    host: str = "127.0.0.1"
    port: int = 8000
    request_timeout_seconds: float = Field(
        60.0, gt=0, description="Deadline of a request (for a stream: until its first token)."
    )
    max_body_bytes: int = Field(1_000_000, gt=0)


class TelemetrySettings(BaseModel):
    service_name: str = "rag-pipeline"
    capture_content: bool = Field(
        False, description="Put prompt and answer text on the chat span (off: never)."
    )


class RetrievalSettings(BaseModel):
    enabled: bool = True
    index_dir: Path = Field(default_factory=lambda: default_home() / "indexes")
    top_k: int = Field(4, ge=1, le=50, description="Passages put into the prompt by default.")
    candidates: int | None = Field(
        None, ge=1, description="BM25 candidates scored by vectors (None: the tuned default)."
    )
    chunk_words: int = Field(180, ge=16)
    overlap_words: int = Field(30, ge=0)
    max_document_chars: int = Field(1_000_000, gt=0)
    max_batch_documents: int = Field(1000, gt=0)
    approximate_above: int = Field(200_000, gt=0)
    query_batch_window_ms: float = Field(2.0, ge=0)
    query_batch_max: int = Field(32, ge=1)
    warm_up: bool = Field(True, description="Load the embedding model at start-up.")


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="RAG_", env_nested_delimiter="__", env_file=".env", extra="ignore"
    )

    environment: Literal["development", "test", "production"] = "development"
    redis: RedisSettings = Field(default_factory=RedisSettings)
    llm: LLMSettings = Field(default_factory=LLMSettings)
    cache: CacheSettings = Field(default_factory=CacheSettings)
    auth: AuthSettings = Field(default_factory=AuthSettings)
    server: ServerSettings = Field(default_factory=ServerSettings)
    telemetry: TelemetrySettings = Field(default_factory=TelemetrySettings)
    retrieval: RetrievalSettings = Field(default_factory=RetrievalSettings)


@lru_cache
def get_settings() -> Settings:
    return Settings()
