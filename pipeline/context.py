"""The request context: one mutable object handed from stage to stage."""

from __future__ import annotations

import contextvars
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from opentelemetry import trace


@dataclass(frozen=True)
class Principal:
    """Who is calling, as resolved from the API key."""

    tenant: str
    user: str
    scopes: frozenset[str]
    key_id: str

    def can(self, scope: str) -> bool:
        return scope in self.scopes


@dataclass(frozen=True)
class RagOptions:
    """The request's retrieval options (the ``rag`` extra field)."""

    enabled: bool = True
    top_k: int = 4
    filters: dict[str, Any] | None = None
    explain: bool = False


@dataclass(frozen=True)
class ChatParams:
    """An OpenAI chat request, reduced to what decides the answer."""

    model: str
    messages: list[dict[str, Any]]
    stream: bool = False
    include_usage: bool = False
    sampling: dict[str, Any] = field(default_factory=dict)
    rag: RagOptions = field(default_factory=RagOptions)


@dataclass(frozen=True)
class Passage:
    """A retrieved passage as the prompt and the response's sources see it."""

    document_id: str
    chunk_id: str
    title: str
    text: str
    score: float


@dataclass
class Completion:
    """A complete answer: what is returned, cached and replayed."""

    content: str
    finish_reason: str
    model: str
    prompt_tokens: int = 0
    completion_tokens: int = 0
    sources: list[dict[str, Any]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "content": self.content,
            "finish_reason": self.finish_reason,
            "model": self.model,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "sources": self.sources,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Completion:
        return cls(
            content=str(data["content"]),
            finish_reason=str(data["finish_reason"]),
            model=str(data["model"]),
            prompt_tokens=int(data.get("prompt_tokens", 0)),
            completion_tokens=int(data.get("completion_tokens", 0)),
            sources=list(data.get("sources", [])),
        )


@dataclass(frozen=True)
class CacheControl:
    no_cache: bool = False
    no_store: bool = False

    @classmethod
    def parse(cls, header: str | None) -> CacheControl:
        directives = {d.strip().lower() for d in (header or "").split(",")}
        return cls(no_cache="no-cache" in directives, no_store="no-store" in directives)


@dataclass
class StageRecord:
    """What one stage did and how long it took (for ``rag.explain``)."""

    name: str
    start_ms: float
    duration_ms: float = 0.0
    status: str = "ok"
    info: dict[str, Any] = field(default_factory=dict)


_current_record: contextvars.ContextVar[StageRecord | None] = contextvars.ContextVar(
    "rag_stage_record", default=None
)


@dataclass
class RequestContext:
    """Everything a request accumulates on its way through the stages.

    Stages running concurrently each fill their own fields; none reads what a sibling writes.
    """

    params: ChatParams
    credential: str | None
    deadline: float
    cache_control: CacheControl = field(default_factory=CacheControl)
    request_id: str = field(default_factory=lambda: f"chatcmpl-{uuid.uuid4().hex}")
    created: int = field(default_factory=lambda: int(time.time()))
    started: float = field(default_factory=time.perf_counter)
    principal: Principal | None = None
    cache_key: str | None = None
    cache_status: str = "miss"
    passages: list[Passage] = field(default_factory=list)
    completion: Completion | None = None
    stream: AsyncIterator[str] | None = None
    finished: bool = False
    records: list[StageRecord] = field(default_factory=list)

    def respond(self, completion: Completion) -> None:
        """Hand back a final answer now; the runner skips the remaining stages."""
        self.completion = completion
        self.finished = True

    def annotate(self, **attributes: Any) -> None:
        """Record facts about the running stage on its span and in its explain record."""
        span = trace.get_current_span()
        record = _current_record.get()
        for key, value in attributes.items():
            if value is None:
                continue
            span.set_attribute(key if "." in key else f"rag.{key}", value)
            if record is not None:
                record.info[key.removeprefix("rag.")] = value

    def elapsed_ms(self) -> float:
        return (time.perf_counter() - self.started) * 1000.0

    @property
    def sources(self) -> list[dict[str, Any]]:
        return [
            {
                "document_id": p.document_id,
                "chunk_id": p.chunk_id,
                "title": p.title,
                "score": round(p.score, 6),
            }
            for p in self.passages
        ]
