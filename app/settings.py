"""Settings: one pydantic-settings class, environment variables prefixed ``RAG_``.

Nested groups use a double underscore: ``RAG_REDIS__URL``, ``RAG_LLM__BASE_URL``. Every field is
listed, with its default and meaning, in the README's configuration table.
"""

from __future__ import annotations

import json
import logging
from functools import lru_cache
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    SecretStr,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from app.production import unsafe_for_production
from pipeline.jobs.secret_box import parse_keys
from pipeline.store.limits import MAX_PER_MINUTE
from retrieval.backends.milvus_expr import (
    MAX_TYPED_FIELDS,
    TypedKind,
    check_collection,
    check_key,
)
from retrieval.embeddings import Backend
from retrieval.relevance import DEFAULT_THRESHOLD
from retrieval.tenants import check_tenant

logger = logging.getLogger(__name__)


def default_home() -> Path:
    return Path.home() / ".cache" / "rag"


class SettingsError(ValueError):
    """A setting that parses but cannot become what it configures (an HTTP tool off its own
    allow-list, a guard policy that is not one). Raised while the services are built, before
    anything is served, with the variable's name and never its value."""


def split_list(value: object) -> object:
    """A list setting from the environment: a JSON list, or comma-separated items."""
    if isinstance(value, str):
        text = value.strip()
        if text.startswith("["):
            return json.loads(text)
        return [item.strip() for item in text.split(",") if item.strip()]
    return value


# A list of strings read from one variable as `a, b` or `["a", "b"]` (NoDecode: pydantic-settings
# would otherwise insist on JSON).
CommaList = Annotated[list[str], NoDecode, BeforeValidator(split_list)]


class Durations(BaseModel):
    """Durations are named ``*_seconds``. A group whose fields were once ``*_ms`` lists them in
    ``renamed_ms``: the old variable still works (converted, with a warning) so a deployment's
    environment keeps its meaning across the rename."""

    renamed_ms: ClassVar[tuple[str, ...]] = ()

    @model_validator(mode="before")
    @classmethod
    def _milliseconds_to_seconds(cls, data: Any) -> Any:
        if not isinstance(data, dict) or not cls.renamed_ms:
            return data
        data = dict(data)
        for name in cls.renamed_ms:
            old = f"{name}_ms"
            if old not in data:
                continue
            value = data.pop(old)
            if f"{name}_seconds" in data:
                raise ValueError(f"set {name}_seconds or the old {old}, not both")
            try:
                data[f"{name}_seconds"] = float(value) / 1000.0
            except (TypeError, ValueError):
                raise ValueError(f"{old} must be a number of milliseconds") from None
            logger.warning("%s.%s is deprecated: set %s_seconds", cls.__name__, old, name)
        return data


class RedisSettings(BaseModel):
    url: str = "redis://127.0.0.1:6379/0"
    timeout_seconds: float = Field(
        0.5,
        gt=0,
        description=(
            "The bound on each command's round trip, a connect included, in time the event loop "
            "ran on time (the client's own connect timeout is a backstop of at least 5 s)."
        ),
    )
    retry_after_seconds: float = Field(
        1.0, ge=0, description="After a failure, skip Redis this long before trying again."
    )
    max_connections: int = Field(256, gt=0, description="Connections in the client's pool.")
    pool_wait_seconds: float = Field(
        0.25,
        gt=0,
        description="With every connection busy, a command waits this long for one, then "
        "fails alone (the circuit breaker stays closed: a full pool is not Redis down).",
    )
    key_prefix: str = "rag:"
    cluster: bool = Field(
        False,
        description="`url` names a node of a Redis Cluster (docs/scaling.md): the keys a script "
        "uses together carry one hash tag. A single Redis keeps its key names.",
    )

    @model_validator(mode="after")
    def _prefix_fits_cluster(self) -> RedisSettings:
        # A brace in the prefix would be the hash tag of every key: one slot for everything.
        if self.cluster and ("{" in self.key_prefix or "}" in self.key_prefix):
            raise ValueError("key_prefix must not contain { or } on a Redis Cluster")
        return self


class LLMSettings(BaseModel):
    base_url: str = "http://127.0.0.1:8001"
    api_key: str | None = None
    models: CommaList = Field(
        default_factory=lambda: ["smollm2"],
        description="Model names the service accepts; each is served under the same name.",
    )
    context_length: int = Field(2048, gt=0)
    default_max_tokens: int | None = Field(
        512, gt=0, description="max_tokens when a request sets none (None: up to the context)."
    )
    connect_timeout_seconds: float = Field(2.0, gt=0)
    read_timeout_seconds: float = Field(60.0, gt=0)
    max_connections: int = Field(
        256,
        gt=0,
        description="Connections to the model server, shared by the client's connection pools; "
        "a call over the limit waits up to the connect timeout for one.",
    )
    prefix_cache_salt: Literal["tenant", "off"] = Field(
        "tenant",
        description="Salt the model server's prefix cache per tenant and access scope (vLLM's "
        "cache_salt), and the grammars of JSON schemas with it (the schema's $comment), so no "
        "caller can time the prompts or schemas of a caller who may see what it may not; off: "
        "one cache for all (a single tenant, or a server that refuses the field).",
    )
    prefix_cache_secret: SecretStr | None = Field(
        None,
        description="Mixed into each salt, so a salt cannot be guessed from a tenant's name by "
        "anyone who can reach the model server itself.",
    )
    tokenizer_path: Path | None = Field(
        None,
        description="tokenizer.json of the served model, to count tokens as it does "
        "(unset: the one `make model` builds; none found: an approximate count).",
    )

    @field_validator("models", mode="after")
    @classmethod
    def _some_model(cls, models: list[str]) -> list[str]:
        if not models:
            raise ValueError("name at least one model")
        return models


class CacheSettings(BaseModel):
    enabled: bool = True
    ttl_seconds: int = Field(3600, gt=0)
    fast_path: bool = Field(
        True, description="Answer plain cache hits before routing (app.http.fastpath)."
    )
    coalesce: bool = Field(
        True,
        description="Identical concurrent misses share one generation, across replicas "
        "(pipeline.store.singleflight); off for benchmarks.",
    )


class AuthSettings(BaseModel):
    key_cache_seconds: float = Field(30.0, ge=0, description="In-process cache of resolved keys.")
    key_stale_seconds: float = Field(
        600.0, ge=0, description="How long a recently seen key is honoured while Redis is down."
    )


class TenantLimitSettings(BaseModel):
    """One tenant's limits per minute (0: none); unset ones fall back to ``limits``'s."""

    model_config = ConfigDict(extra="forbid")

    rpm: int | None = Field(
        None, ge=0, le=MAX_PER_MINUTE, description="Requests per minute of the whole tenant."
    )
    tpm: int | None = Field(
        None, ge=0, le=MAX_PER_MINUTE, description="Tokens per minute of the whole tenant."
    )
    key_rpm: int | None = Field(
        None, ge=0, le=MAX_PER_MINUTE, description="Requests per minute of each key."
    )
    key_tpm: int | None = Field(
        None, ge=0, le=MAX_PER_MINUTE, description="Tokens per minute of each key."
    )


class LimitSettings(BaseModel):
    """Rate limits shared by every replica (``pipeline.store.limits``): requests and tokens per
    minute, per key and per tenant. 0: no limit. A key record's own limits (``rag keys limits``)
    and a tenant record's (``rag keys tenant-limits``) come first; these are the defaults."""

    enabled: bool = Field(True, description="Check limits on every /v1 request (off: never).")
    key_rpm: int = Field(0, ge=0, le=MAX_PER_MINUTE, description="Requests per minute of each key.")
    key_tpm: int = Field(0, ge=0, le=MAX_PER_MINUTE, description="Tokens per minute of each key.")
    tenant_rpm: int = Field(
        0, ge=0, le=MAX_PER_MINUTE, description="Requests per minute of each tenant."
    )
    tenant_tpm: int = Field(
        0, ge=0, le=MAX_PER_MINUTE, description="Tokens per minute of each tenant."
    )
    tenants: dict[str, TenantLimitSettings] = Field(
        default_factory=dict, description="Per-tenant defaults (JSON: tenant -> limits)."
    )
    window_seconds: float = Field(
        60.0,
        gt=0,
        le=3600,
        description="The sliding window; a limit admits rpm * window / 60 requests per window.",
    )
    fail_open: bool = Field(
        True, description="While Redis is down: admit (true) or answer 429 (false)."
    )


class ServerSettings(BaseModel):
    host: str = "127.0.0.1"
    port: int = 8000
    request_timeout_seconds: float = Field(
        60.0, gt=0, description="Deadline of a request, a streamed answer's last chunk included."
    )
    stream_write_stall_seconds: float = Field(
        10.0,
        gt=0,
        description="A streamed answer whose client takes longer than this to accept one more "
        "chunk is ended (its upstream call closed, its route slot freed).",
    )
    max_body_bytes: int = Field(1_000_000, gt=0)


class TelemetrySettings(BaseModel):
    service_name: str = "rag-pipeline"
    capture_content: bool = Field(
        False, description="Put prompt and answer text on the chat span (off: never)."
    )
    allow_content_capture_in_production: bool = Field(
        False, description="Without it, production refuses to start with content capture on."
    )
    caller_trace: Literal["link", "follow"] = Field(
        "link",
        description=(
            "A caller's traceparent: link (each request a trace of its own, linked to the "
            "caller's span) or follow (continue the caller's trace and its sampling decision: "
            "only for callers you trust, as a caller could join another tenant's trace)."
        ),
    )
    metrics: bool = Field(True, description="Serve /metrics and record the service's metrics.")
    metrics_token: SecretStr | None = Field(
        None,
        description="Bearer token /metrics asks for (unset: none; production refuses that).",
    )

    @field_validator("metrics_token", mode="after")
    @classmethod
    def _empty_token_is_none(cls, value: SecretStr | None) -> SecretStr | None:
        return value if value is not None and value.get_secret_value() else None


class LogSettings(BaseModel):
    """Logs (``app.logs``): the format, the level, the one line per request."""

    format: Literal["json", "text"] | None = Field(
        None, description="json or text (None: json in production, text elsewhere)."
    )
    level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    requests: bool = Field(True, description="One line per HTTP request (logger rag.request).")


RetrievalBackendName = Literal["embedded", "milvus"]
# What README's filters range over, and the page numbers file ingestion adds.
DEFAULT_TYPED_FIELDS: dict[str, TypedKind] = {"year": "number", "date": "string", "page": "number"}


class RetrievalSettings(Durations):
    renamed_ms = ("query_batch_window",)

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
    query_batch_window_seconds: float = Field(
        0.002, ge=0, description="Concurrent query embeddings wait this long to share a batch."
    )
    query_batch_max: int = Field(32, ge=1)
    search_threads: int = Field(
        4, ge=1, description="Threads that run searches; ingestion has its own (ingest_threads)."
    )
    ingest_threads: int = Field(
        1, ge=1, description="Threads that run ingests and deletes; more wait for one to free."
    )
    write_lock_wait_seconds: float = Field(
        30.0,
        gt=0,
        description="How long a write waits while another write of the tenant (this replica's, "
        "another's, `rag ingest`) holds its index without progress (a writer touches the lock "
        "while it works): then a 503 index_busy, nothing written.",
    )
    loaded_indexes_mb: int = Field(
        1024,
        ge=0,
        description="How much memory the tenants' loaded index snapshots may hold in one "
        "replica, counted from what each holds (its texts, metadata, arrays, and the filter "
        "columns and views searches build on it; not its size on disk): past it the least "
        "recently searched are let go, and loaded again from disk on their next search "
        "(rag_index_let_go_total counts them). 0: no bound.",
    )
    embeddings: Backend = Field(
        "onnx-int8",
        description="Embedding runtime: onnx-int8 (ONNX Runtime, int8 weights), onnx (ONNX "
        "Runtime, fp32), openvino (the fp32 model on OpenVINO, in bfloat16 on CPUs with AMX or "
        "AVX-512 BF16) or torch (sentence-transformers, fp32). All but torch never import "
        "torch; their model is built once under $RAG_HOME/embedder (make embedder). int8: "
        "SciFact nDCG@10 -0.003, queries 3.9x faster, replica RSS 0.44x; openvino on a bf16 "
        "CPU: ingestion 2x int8's (BENCHMARKS.md).",
    )
    ingest_embeddings: Backend | None = Field(
        None,
        description="Embedding runtime for ingestion, if not `embeddings`'s: the vectors of "
        "every runtime are the same model's (SciFact nDCG@10 0.7345 with passages by openvino "
        "and queries by onnx-int8). Unset, `rag ingest` (a bulk command, not a replica) takes "
        "openvino on CPUs with native bfloat16, where it ingests about 2x faster.",
    )
    query_torch_threads: int = Field(
        1,
        ge=0,
        description="Threads embedding one batch of queries, torch's or ONNX Runtime's "
        "(0: one per core).",
    )
    ingest_torch_threads: int = Field(
        1,
        ge=0,
        description="Threads embedding one batch of ingested passages, torch's or ONNX "
        "Runtime's (0: one per core).",
    )
    warm_up: bool = Field(True, description="Load the embedding model at start-up.")
    relevance_threshold: float = Field(
        DEFAULT_THRESHOLD,
        ge=0.0,
        le=1.0,
        description="Passages less relevant than this stay out of the prompt (0: no gate).",
    )
    backend: RetrievalBackendName = Field(
        "embedded",
        description="Where tenants' indexes live by default: embedded (snapshots loaded by each "
        "replica) or milvus (one Milvus collection, for tenants that outgrow a replica).",
    )
    tenant_backends: dict[str, RetrievalBackendName] = Field(
        default_factory=dict,
        description='Per-tenant backend, e.g. {"big": "milvus"}. `rag backend move` records '
        "its own override in Redis, which wins over this.",
    )
    milvus_uri: str | None = Field(
        None,
        description="Milvus: a file path runs Milvus Lite on it, http://host:19530 a server. "
        "Default, when a tenant uses Milvus: $RAG_HOME/milvus.db.",
    )
    milvus_collection: str = Field(
        "rag_chunks", pattern=r"^[A-Za-z_][A-Za-z0-9_]{0,254}$", description="One per deployment."
    )
    milvus_timeout_seconds: float = Field(
        10.0,
        gt=0,
        description="Each Milvus call, its retries included (rounded up to whole seconds): "
        "past it the request gets a 503 retrieval_unavailable.",
    )
    milvus_typed_fields: dict[str, TypedKind] = Field(
        default_factory=lambda: dict(DEFAULT_TYPED_FIELDS),
        description="Metadata keys a new Milvus collection gets typed, indexed columns for "
        "(ranges on them read the column, not the JSON). Fixed when a collection is created.",
    )
    milvus_tenant_collections: dict[str, str] = Field(
        default_factory=dict,
        description='A collection of its own for a very large tenant, e.g. {"big": "rag_big"}. '
        "Set it before the tenant's first write to Milvus (its chunks are not moved).",
    )

    @field_validator("milvus_typed_fields", mode="after")
    @classmethod
    def _typed_keys(cls, value: dict[str, TypedKind]) -> dict[str, TypedKind]:
        if len(value) > MAX_TYPED_FIELDS:
            raise ValueError(
                f"at most {MAX_TYPED_FIELDS} typed fields (a Milvus collection holds 64 fields)"
            )
        for key in value:
            check_key(key)  # a FilterError is a ValueError
        return value

    @field_validator("milvus_tenant_collections", mode="after")
    @classmethod
    def _collections(cls, value: dict[str, str]) -> dict[str, str]:
        for tenant, name in value.items():
            check_tenant(tenant)
            check_collection(name)
        return value

    @property
    def uses_milvus(self) -> bool:
        """Whether a Milvus backend is to be built (a default or an override names it, or a
        URI is set so that tenants can be moved to it)."""
        named = {self.backend, *self.tenant_backends.values()}
        return "milvus" in named or self.milvus_uri is not None

    def milvus_location(self) -> str:
        return self.milvus_uri or str(default_home() / "milvus.db")


class FileSettings(BaseModel):
    """Document files in (``POST /v1/files``, ``rag ingest``): limits and the converter pool."""

    model_config = {"extra": "forbid"}

    max_file_bytes: int = Field(10_000_000, gt=0, description="A larger file is refused (413).")
    max_upload_bytes: int = Field(
        25_000_000,
        gt=0,
        description="Body limit of POST /v1/files (server.max_body_bytes elsewhere).",
    )
    max_files: int = Field(20, ge=1, le=1000, description="Files in one upload.")
    convert_workers: int = Field(
        2, ge=1, description="Worker processes converting files, one file at a time each."
    )
    convert_timeout_seconds: float = Field(60.0, gt=0, description="A slower file is refused.")
    convert_memory_bytes: int = Field(
        2_000_000_000, ge=0, description="Address space of one worker process (0: no limit)."
    )
    max_unzipped_bytes: int = Field(
        100_000_000, gt=0, description="A DOCX/PPTX declaring more once inflated is refused."
    )
    max_zip_ratio: float = Field(100.0, gt=1, description="Inflation ratio of a zip member.")
    upload_timeout_seconds: float = Field(
        120.0,
        gt=0,
        description="Time budget of one upload's conversions; files not converted by then are "
        "refused (503 upload_timeout), the others go in.",
    )
    max_pending_uploads: int = Field(
        8,
        ge=1,
        description="Uploads in progress at once per process, each holding its files' bytes; "
        "one more gets 503 converter_busy with Retry-After.",
    )
    convert_tenant_workers: int | None = Field(
        None,
        ge=1,
        description="Files of one tenant converting at once; the tenant's others wait while "
        "other tenants' files go ahead (None: every worker).",
    )


class RouteSettings(BaseModel):
    model_config = {"extra": "forbid"}

    base_url: str
    model: str
    api_key: str | None = None
    max_concurrency: int = Field(64, gt=0, description="Requests in flight on this route.")
    max_tenant_concurrency: int | None = Field(
        None,
        gt=0,
        description="Requests in flight on this route for one tenant; more wait their turn "
        "(None: a quarter of max_concurrency, at least 4 or the route's whole bound).",
    )

    @model_validator(mode="after")
    def _tenant_within_route(self) -> RouteSettings:
        if self.max_tenant_concurrency is not None and (
            self.max_tenant_concurrency > self.max_concurrency
        ):
            raise ValueError("max_tenant_concurrency cannot exceed max_concurrency")
        return self

    @property
    def tenant_concurrency(self) -> int:
        """One tenant's share. A quarter by default: one tenant's burst leaves three quarters
        of the route to the others, and a lone tenant still gets 16 of the default 64; a route
        of 4 slots or fewer is not split."""
        share = max(min(4, self.max_concurrency), self.max_concurrency // 4)
        return self.max_tenant_concurrency or share


class RoutingSettings(Durations):
    """Model routes (``RAG_ROUTING__ROUTES`` as JSON: name -> {base_url, model, ...}). Empty:
    two routes, ``small`` and ``large``, both on ``RAG_LLM__BASE_URL`` and its first model."""

    renamed_ms = ("timeout",)

    enabled: bool = Field(True, description="Choose a route per request (off: the default).")
    routes: dict[str, RouteSettings] = Field(default_factory=dict)
    default: str = Field("small", description="Route taken when nothing decides otherwise.")
    small_route: str = Field("small", description="Route of short, classification-like asks.")
    large_route: str = Field("large", description="Route of long, multi-step reasoning.")
    long_words: int = Field(60, gt=0, description="More words than this: a long prompt (large).")
    long_chars: int = Field(400, gt=0, description="More characters than this: long (large).")
    short_words: int = Field(
        20, gt=0, description="Up to this many words a factual question may go small."
    )
    capped_tiers: CommaList = Field(
        default_factory=lambda: ["free"],
        description="Values of the user's `tier` feature routed small unless pinned.",
    )
    timeout_seconds: float = Field(
        0.25, gt=0, description="Budget of the route stage; past it, the default route."
    )

    def resolved(self, llm: LLMSettings) -> dict[str, RouteSettings]:
        if self.routes:
            return self.routes

        def local(model: str) -> RouteSettings:
            return RouteSettings(base_url=llm.base_url, model=model, api_key=llm.api_key)

        first, *others = llm.models
        return {"small": local(first), "large": local(first), **{m: local(m) for m in others}}


class FeatureSettings(Durations):
    """The online feature store and the ``features`` stage."""

    renamed_ms = ("timeout",)

    enabled: bool = Field(True, description="Load the user's features (answers get personal).")
    timeout_seconds: float = Field(
        0.05, gt=0, description="Budget of the lookup; past it, defaults."
    )
    log_requests: bool = Field(
        True, description="Append each request to the request log `rag features compute` reads."
    )
    log_max_entries: int = Field(
        100_000, gt=0, description="Each tenant's request log keeps about this many newest records."
    )


class HttpToolSettings(BaseModel):
    """One HTTP tool: an entry of ``RAG_TOOLS__HTTP`` (a JSON list of these)."""

    model_config = {"extra": "forbid"}

    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str = Field(min_length=1, max_length=1000)
    url: str = Field(description="GET URL template; its {placeholders} are the tool's arguments.")
    allow: list[str] = Field(
        default_factory=list,
        description="URL prefixes the tool may fetch (empty: the template up to its first {}).",
    )
    parameters: dict[str, Any] | None = Field(
        None, description="JSON schema of the arguments (default: one string per placeholder)."
    )
    headers: dict[str, str] = Field(default_factory=dict)
    timeout_seconds: float = Field(5.0, gt=0)
    max_bytes: int = Field(64_000, gt=0, description="Longer responses are cut.")
    max_concurrency: int = Field(8, gt=0)
    rate_per_second: float | None = Field(None, gt=0)
    cache_ttl_seconds: int | None = Field(
        0, ge=0, description="How long an answer that used it may be cached (0: never)."
    )
    allow_private: bool = Field(
        False, description="Its allow-listed hosts may be private addresses (inside the network)."
    )

    def tool_options(self) -> dict[str, Any]:
        """Keyword arguments of ``pipeline.tools.http.HttpTool``."""
        return {
            "name": self.name,
            "description": self.description,
            "url": self.url,
            "allow": self.allow,
            "parameters": self.parameters,
            "headers": self.headers,
            "timeout_s": self.timeout_seconds,
            "max_bytes": self.max_bytes,
            "max_concurrency": self.max_concurrency,
            "rate_per_second": self.rate_per_second,
            "cache_ttl": self.cache_ttl_seconds,
            "allow_private": self.allow_private,
        }


class TenantToolSettings(BaseModel):
    """One tenant's tools: an entry of ``RAG_TOOLS__TENANTS`` (under "*": every other tenant)."""

    model_config = {"extra": "forbid"}

    allow: list[Annotated[str, Field(pattern=r"^(\*|[A-Za-z0-9_-]{1,64})$")]] = Field(
        default_factory=lambda: ["*"], description="Server tools it may use ('*': all of them)."
    )
    private_network: bool = Field(
        False, description="It may use HTTP tools configured with allow_private (opt-in)."
    )


class ToolSettings(BaseModel):
    """Server-side tools: planned ones and function calling."""

    enabled: bool = Field(True, description="Planned tools and server tools for the model.")
    max_rounds: int = Field(3, ge=1, le=10, description="Model calls with tool results, at most.")
    timeout_seconds: float = Field(2.0, gt=0, description="Timeout of each built-in tool call.")
    max_concurrency: int = Field(64, gt=0, description="Calls of one built-in tool at once.")
    http: list[HttpToolSettings] = Field(
        default_factory=list, description="HTTP tools (JSON list), each on its own allow-list."
    )
    tenants: dict[str, TenantToolSettings] = Field(
        default_factory=dict,
        description="Per tenant (JSON; '*': every other tenant): the server tools it may use and "
        "whether those reaching private networks. Default: every tool but those.",
    )

    @field_validator("http", mode="after")
    @classmethod
    def _distinct_names(cls, tools: list[HttpToolSettings]) -> list[HttpToolSettings]:
        names = [tool.name for tool in tools]
        if len(names) != len(set(names)):
            raise ValueError("two HTTP tools have the same name")
        return tools

    @model_validator(mode="after")
    def _tenants_name_known_tools(self) -> ToolSettings:
        from pipeline.tools.builtins import BUILTIN_TOOL_NAMES

        known = {*BUILTIN_TOOL_NAMES, *(tool.name for tool in self.http)}
        named = {name for entry in self.tenants.values() for name in entry.allow} - {"*"}
        unknown = ", ".join(sorted(named - known))
        if unknown:
            raise ValueError(
                f"RAG_TOOLS__TENANTS allows tools that do not exist: {unknown}"
                f" (tools: {', '.join(sorted(known))})"
            )
        return self


class JobSettings(BaseModel):
    """Asynchronous jobs (``/v1/jobs``): the queue, the workers, the webhooks."""

    workers: int = Field(1, ge=0, description="Job workers inside each API process (0: none).")
    concurrency: int = Field(
        2, ge=1, description="Jobs one worker runs at once (bounds what jobs take from chat)."
    )
    timeout_seconds: float = Field(300.0, gt=0, description="Deadline of one run of a job.")
    visibility_timeout_seconds: float = Field(
        30.0, gt=0, description="A job whose worker is silent this long is taken by another."
    )
    max_attempts: int = Field(3, ge=1, description="Runs of a job before it is failed.")
    retry_backoff_seconds: float = Field(
        1.0, ge=0, description="Wait before a job that failed transiently is queued again."
    )
    result_ttl_seconds: int = Field(86_400, gt=0, description="How long finished jobs are kept.")
    idempotency_ttl_seconds: int = Field(86_400, gt=0)
    max_body_bytes: int = Field(256_000, gt=0, description="Larger job bodies are a 413.")
    poll_seconds: float = Field(1.0, gt=0, description="Longest blocking read of the queue.")
    webhook_allow: CommaList = Field(
        default_factory=list,
        description="Hosts or CIDRs exempt from the webhook address rules (and allowed http).",
    )
    webhook_timeout_seconds: float = Field(
        10.0, gt=0, description="Overall deadline of one delivery attempt (connect to headers)."
    )
    webhook_connect_timeout_seconds: float = Field(3.0, gt=0)
    webhook_max_attempts: int = Field(6, ge=1)
    webhook_backoff_seconds: float = Field(1.0, ge=0, description="First retry delay; doubles.")
    webhook_secret_grace_seconds: int = Field(
        86_400, ge=0, description="After a rotation, the old secret also signs this long."
    )
    webhook_concurrency: int = Field(8, ge=1, description="Deliveries one worker makes at once.")
    webhook_tenant_concurrency: int = Field(
        2, ge=1, description="Deliveries of one tenant that one worker makes at once."
    )
    webhook_secret_key: SecretStr | None = Field(
        None,
        description="Base64 of 32 bytes (comma-separated for rotation: the first seals) that "
        "encrypts webhook secrets at rest; production refuses to start without it.",
    )
    queued_ttl_seconds: float = Field(
        86_400, gt=0, description="A queued job not started within this fails (job_expired)."
    )
    max_stream_length: int = Field(
        100_000, ge=1, description="Jobs queued or running, all tenants; more: 503 queue_full."
    )
    max_queued_per_tenant: int = Field(1_000, ge=1, description="More: 429 too_many_queued_jobs.")
    submit_rate_per_minute: float = Field(600.0, gt=0, description="Submits per tenant (429).")
    submit_burst: int = Field(60, ge=1, description="Submits a tenant may make at once.")
    sweep_seconds: float = Field(10.0, gt=0, description="How often workers fail expired jobs.")

    @field_validator("webhook_secret_key", mode="after")
    @classmethod
    def _valid_secret_key(cls, value: SecretStr | None) -> SecretStr | None:
        if value is None or not value.get_secret_value().strip():
            return None  # an empty line in .env: no key
        parse_keys(value.get_secret_value())  # base64 of 32 bytes each; never echoed
        return value

    def production_problems(self) -> list[str]:
        """What of the jobs' settings production refuses (app.production collects these)."""
        if self.webhook_secret_key is None:
            return [
                "webhook signing secrets would be stored in plaintext "
                "(RAG_JOBS__WEBHOOK_SECRET_KEY is not set)"
            ]
        return []


class CompressSettings(BaseModel):
    """Extractive compression of the sources: the sentences most relevant to the question,
    in their order, under a token budget (counted with the served model's tokenizer)."""

    enabled: bool = Field(True, description="Compress the sources before generating.")
    budget_tokens: int = Field(384, ge=16, le=8192, description="Tokens the sources may take.")


class AdaptSettings(BaseModel):
    """Graceful under load (``pipeline.routing.load``): as a route's slots fill, a request asks
    for fewer sources, then a tighter compression budget, then the small route, before any
    request is refused. Pressure is the calls holding or awaiting a slot over the slots."""

    enabled: bool = Field(True, description="Adapt requests to a loaded route (off: never).")
    top_k_at: float = Field(0.75, gt=0, description="Pressure from which top_k is reduced.")
    compress_at: float = Field(1.0, gt=0, description="Pressure from which sources compress.")
    small_route_at: float = Field(1.5, gt=0, description="Pressure from which: small route.")
    top_k: int = Field(2, ge=1, description="The top_k of a reduced request (at most).")
    budget_tokens: int = Field(
        192, ge=16, le=8192, description="The compression budget of a reduced request (at most)."
    )

    @model_validator(mode="after")
    def _in_order(self) -> AdaptSettings:
        if not self.top_k_at <= self.compress_at <= self.small_route_at:
            raise ValueError("top_k_at <= compress_at <= small_route_at")
        return self


class GuardSettings(BaseModel):
    """Input and output guardrails (``RAG_GUARD__POLICY``: JSON, tenant -> overrides, "*" for
    every tenant; keys: pii {kind: block|redact|allow}, injection block|allow,
    max_input_tokens, blocked_output_terms, version)."""

    enabled: bool = Field(True, description="guard_in, guard_similarity and guard_out.")
    policy: str | dict[str, Any] | None = Field(None, description="Per-tenant policy overrides.")
    similarity: bool = Field(
        True, description="Also compare the query's embedding to known injection attacks."
    )


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="RAG_",
        env_nested_delimiter="__",
        env_file=".env",
        extra="ignore",
        # Errors name the field, never echo its value (keys and tokens are settings too).
        hide_input_in_errors=True,
    )

    environment: Literal["development", "test", "production"] = "development"
    dev_api_key: SecretStr | None = Field(
        None, description="The key `make run` creates for tenant `dev`; production refuses it."
    )
    redis: RedisSettings = Field(default_factory=RedisSettings)
    llm: LLMSettings = Field(default_factory=LLMSettings)
    cache: CacheSettings = Field(default_factory=CacheSettings)
    auth: AuthSettings = Field(default_factory=AuthSettings)
    limits: LimitSettings = Field(default_factory=LimitSettings)
    server: ServerSettings = Field(default_factory=ServerSettings)
    telemetry: TelemetrySettings = Field(default_factory=TelemetrySettings)
    log: LogSettings = Field(default_factory=LogSettings)
    retrieval: RetrievalSettings = Field(default_factory=RetrievalSettings)
    files: FileSettings = Field(default_factory=FileSettings)
    jobs: JobSettings = Field(default_factory=JobSettings)
    routing: RoutingSettings = Field(default_factory=RoutingSettings)
    features: FeatureSettings = Field(default_factory=FeatureSettings)
    tools: ToolSettings = Field(default_factory=ToolSettings)
    guard: GuardSettings = Field(default_factory=GuardSettings)
    compress: CompressSettings = Field(default_factory=CompressSettings)
    adapt: AdaptSettings = Field(default_factory=AdaptSettings)

    @field_validator("dev_api_key", mode="after")
    @classmethod
    def _empty_key_is_none(cls, value: SecretStr | None) -> SecretStr | None:
        # `RAG_DEV_API_KEY=` (an empty line in .env) means "no development key".
        return value if value is not None and value.get_secret_value() else None

    @model_validator(mode="after")
    def _refuse_unsafe_production(self) -> Settings:
        # As the FastAPI template's _enforce_non_default_secrets: refused in production,
        # tolerated in development (loudly, by the server: ``warn_development``).
        problems = unsafe_for_production(self)
        if problems and self.environment == "production":
            raise ValueError("refusing to start in production: " + "; ".join(problems))
        return self

    def warn_development(self) -> None:
        """Log what production would refuse, in development (the app calls it once as it is
        made; a ``rag`` command, which serves nothing, does not: three warnings on every
        command buried its output). Tests set what they need and are not told."""
        if self.environment == "development":
            for problem in unsafe_for_production(self):
                logger.warning("%s: allowed in development, refused in production", problem)


@lru_cache
def get_settings() -> Settings:
    return Settings()
