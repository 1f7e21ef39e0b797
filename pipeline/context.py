"""The request context: one mutable object handed from stage to stage."""

from __future__ import annotations

import contextvars
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from opentelemetry import trace

from pipeline.answer.completion import Completion
from pipeline.answer.stream import AnswerStream
from pipeline.telemetry import attributes as attr


@dataclass(frozen=True)
class Principal:
    """Who is calling, as resolved from the API key."""

    tenant: str
    user: str
    scopes: frozenset[str]
    key_id: str
    # The key record's own limits per minute (None: the tenant's default; 0: none).
    rpm: int | None = None
    tpm: int | None = None
    # The groups the key belongs to (its record's, ``rag keys groups``): which documents with
    # an access list it may retrieve (retrieval.access). Empty: only the tenant-wide ones.
    groups: frozenset[str] = frozenset()

    def can(self, scope: str) -> bool:
        return scope in self.scopes


# The version of a tenant's index and what of a principal decides which of its chunks the
# principal sees (``PassageSearch.access_scope``, read from one snapshot; None without access
# lists): what the response cache keys by and the model server's prefix cache is salted by.
AccessScope = Callable[["Principal"], tuple[str, Mapping[str, Any] | None]]


@dataclass(frozen=True)
class RagOptions:
    """The request's retrieval options (the ``rag`` extra field)."""

    enabled: bool = True
    top_k: int = 4
    filters: dict[str, Any] | None = None
    explain: bool = False
    route: str | None = None
    tools: tuple[str, ...] = ()
    plan_tools: bool = True
    compress: bool | None = None  # None: the server's setting
    budget_tokens: int | None = None
    min_relevance: float | None = None


@dataclass(frozen=True)
class ChatParams:
    """An OpenAI chat request, reduced to what decides the answer."""

    model: str
    messages: list[dict[str, Any]]
    stream: bool = False
    include_usage: bool = False
    sampling: dict[str, Any] = field(default_factory=dict)
    rag: RagOptions = field(default_factory=RagOptions)
    tools: list[dict[str, Any]] = field(default_factory=list)
    tool_choice: Any = None


@dataclass(frozen=True)
class Passage:
    """A retrieved passage as the prompt and the response's sources see it: ``score`` ranks
    it (the fused score), ``relevance`` is what the relevance gate compared with the request's
    ``min_relevance`` (None where the search could not compute it). ``source_text`` is the
    chunk's own text where ``text`` is an extract of it (compressed): citations index it."""

    document_id: str
    chunk_id: str
    title: str
    text: str
    score: float
    relevance: float | None = None
    source_text: str | None = None


@dataclass(frozen=True)
class Features:
    """A user's features for this request; ``defaulted`` names those that fell back."""

    values: dict[str, Any] = field(default_factory=dict)
    defaulted: frozenset[str] = frozenset()
    version: str | None = None

    def get(self, name: str, default: Any = None) -> Any:
        return self.values.get(name, default)


@dataclass(frozen=True)
class ToolRun:
    """One server-side tool call and its outcome; ``content`` is what the model is shown."""

    name: str
    call_id: str
    status: str  # ok, error, timeout, refused
    content: str
    duration_ms: float = 0.0
    cache_ttl: int | None = None  # None: cacheable for the cache's TTL; 0: never

    def report(self) -> dict[str, Any]:
        """What the response's ``rag.tools`` says of the run: its result too (cut to 500
        characters), so it reaches the caller even when the model garbles it."""
        output = self.content if len(self.content) <= 500 else self.content[:500] + " …"
        return {
            "name": self.name,
            "status": self.status,
            "duration_ms": round(self.duration_ms, 3),
            "output": output,
        }


@dataclass(frozen=True)
class RouteChoice:
    """The model route chosen for the request, and why."""

    name: str
    model: str
    reason: str

    def report(self) -> dict[str, Any]:
        return {"name": self.name, "model": self.model, "reason": self.reason}


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
    ended: bool = False  # the stage has returned (or failed); what it started may run on


_current_record: contextvars.ContextVar[StageRecord | None] = contextvars.ContextVar(
    "rag_stage_record", default=None
)


def current_record() -> StageRecord | None:
    """The explain record of the stage running now (for facts that arrive after it returned,
    such as those of a stream filter it added)."""
    return _current_record.get()


@dataclass
class RequestContext:
    """Everything a request accumulates on its way through the stages.

    Each stage declares the fields it reads and writes (``pipeline.runner.StageSpec``).
    Stages running concurrently write different fields; one that needs a sibling's field waits
    for it with ``await pipeline.runner.available(name)``.
    """

    params: ChatParams
    credential: str | None
    deadline: float
    cache_control: CacheControl = field(default_factory=CacheControl)
    request_id: str = field(default_factory=lambda: f"chatcmpl-{uuid.uuid4().hex}")
    created: int = field(default_factory=lambda: int(time.time()))
    started: float = field(default_factory=time.perf_counter)
    principal: Principal | None = None
    key_parts: dict[str, str] = field(default_factory=dict)
    cache_key: str | None = None
    cache_status: str = "miss"
    features: Features = field(default_factory=Features)
    query_vector: Any = None
    passages: list[Passage] = field(default_factory=list)
    tool_runs: list[ToolRun] = field(default_factory=list)
    route: RouteChoice | None = None
    answer: AnswerStream | None = None
    completion: Completion | None = None
    finished: bool = False
    records: list[StageRecord] = field(default_factory=list)
    # The tenant index versions this request's tool searches used (``search_documents``, in
    # the tools stage or the generation loop); the cache store compares them with its key's.
    index_versions: set[str] = field(default_factory=set)

    def respond(self, completion: Completion) -> None:
        """Hand back a final answer now; the runner skips the remaining stages."""
        self.completion = completion
        self.answer = AnswerStream.replay(completion)
        self.finished = True

    @property
    def caller(self) -> Principal:
        """The authenticated principal (stages that read it run after auth: checked when the
        path is built)."""
        if self.principal is None:
            raise RuntimeError("no principal: a stage that reads it runs before auth")
        return self.principal

    def annotate(self, **attributes: Any) -> None:
        """Record facts about the running stage on its span and in its explain record."""
        span = trace.get_current_span()
        recording = span.is_recording()  # not sampled: no attribute to build
        record = _current_record.get()
        for key, value in attributes.items():
            if value is None:
                continue
            if recording:
                span.set_attribute(key if "." in key else f"rag.{key}", value)
            if record is not None:
                record.info[attr.info_key(key)] = value

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
                "relevance": None if p.relevance is None else round(p.relevance, 6),
            }
            for p in self.passages
        ]
