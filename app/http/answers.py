"""The bodies the routes answer with, as the OpenAPI document declares them.

Routes build these bodies themselves (``app.http.responses``, ``Job.public``, ...); the models
describe them for the document, and the schema fuzz test (``tests/app/test_schema_fuzz.py``)
checks every answer against them. Objects allow fields beyond the ones listed, as OpenAI's do.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class FunctionCall(BaseModel):
    name: str
    arguments: str


class ToolCall(BaseModel):
    id: str
    type: Literal["function"]
    function: FunctionCall


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None
    tool_calls: list[ToolCall] | None = None


class Choice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: dict[str, Any] | None
    finish_reason: str | None


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


Span = Annotated[
    list[int],
    Field(min_length=2, max_length=2, description="[start, end): string offsets (code points)."),
]


class CitedSource(BaseModel):
    index: int = Field(ge=1, description="The source's place in rag.sources, from 1.")
    document_id: str
    chunk_id: str
    span: Span
    score: float = Field(ge=0, le=1, description="Share of the sentence's words it holds.")


class Citation(BaseModel):
    """One sentence of the answer and the sources that support it (``pipeline.answer.citations``);
    ``span`` indexes the chunk's own text, as ``/v1/retrieve`` returns it."""

    sentence: int = Field(ge=0)
    text_span: Span
    supported: bool
    sources: list[CitedSource]


class RagInfo(BaseModel):
    """Our extension on an answer; with ``rag.explain`` also ``route``, ``features`` and
    ``explain``."""

    model_config = ConfigDict(extra="allow")

    sources: list[dict[str, Any]]
    citations: list[Citation]
    cache: str
    tools: list[dict[str, Any]]


class ChatCompletion(BaseModel):
    """OpenAI's chat completion, plus ``rag`` (sources, citations, cache, tools; with
    ``rag.explain`` the route, the features and each stage's record). A streamed answer is
    ``text/event-stream``: ``data:`` lines of ``chat.completion.chunk`` objects, then
    ``data: [DONE]``; each sentence's citation comes as soon as it is complete, on a chunk with
    an empty delta and ``rag: {"citations": [Citation]}``, and the last chunk's ``rag`` has them
    all."""

    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[Choice]
    usage: Usage
    service_tier: str | None
    system_fingerprint: str | None
    rag: RagInfo


class Model(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    rag: dict[str, Any]


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[Model]


class _IndexChange(BaseModel):
    """What an ingest or a delete did to the tenant's index (``retrieval.IngestResult``)."""

    version: str
    documents: int
    chunks: int
    seconds: float
    total_documents: int
    total_chunks: int


class IngestResult(_IndexChange):
    object: Literal["ingest.result"]


class DeleteResult(_IndexChange):
    object: Literal["delete.result"]
    deleted: Literal[True]
    # The tenant's cached answers removed with it; null when Redis could not be reached.
    cached_answers_removed: int | None


class DeleteBatchResult(_IndexChange):
    object: Literal["delete.result"]
    not_found: list[str]  # the ids the tenant does not have (nothing else changed for them)
    cached_answers_removed: int | None


class Passage(BaseModel):
    document_id: str
    chunk_id: str
    score: float
    relevance: float | None
    bm25_score: float | None
    vector_score: float | None
    title: str
    text: str
    metadata: dict[str, Any]


class RetrieveResult(BaseModel):
    object: Literal["list"]
    index_version: str
    candidates: int
    allowed: int
    dropped: int
    timings_ms: dict[str, float]
    data: list[Passage]


JobStatus = Literal["queued", "running", "succeeded", "failed", "cancelled"]


class JobCreated(BaseModel):
    id: str
    object: Literal["job"]
    status: JobStatus
    created_at: int


class Job(BaseModel):
    """A job as ``Job.public`` shows it: no prompt text; ``result`` is the chat completion."""

    id: str
    object: Literal["job"]
    status: JobStatus
    model: str | None
    created_at: int
    started_at: int | None
    finished_at: int | None
    attempts: int
    max_attempts: int
    expires_at: int | None
    metadata: dict[str, str] | None
    result: dict[str, Any] | None
    error: dict[str, Any] | None
    last_error: dict[str, Any] | None
    webhook: dict[str, Any] | None = None
    # True where the reader may not read the answer (another user's job, read by an admin, or
    # a key with fewer groups than the submitting key's): ``result`` is null.
    result_withheld: bool = False


class JobList(BaseModel):
    object: Literal["list"]
    data: list[Job]
    first_id: str | None
    last_id: str | None
    has_more: bool


class Health(BaseModel):
    status: Literal["ok"]


class Readiness(BaseModel):
    status: Literal["ready", "unready"]
    checks: dict[str, Literal["ok", "down"]]
