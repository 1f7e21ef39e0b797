"""The service's Prometheus metrics, in one place, and the runner observer that feeds most of them.

Every family is a process-wide object in prometheus-client's default registry, so ``/metrics``
(``app.routes.metrics``) serves them next to the process collectors. Labels are low-cardinality
only: route templates, stage names, statuses, model names from the configuration, error kinds;
never a tenant, a user or anything a caller chooses freely.

Where each is fed (none depends on trace sampling: a span processor sees only the spans that
are recorded, so with a ratio sampler metrics fed from spans would be sampled too):

- HTTP requests: the ASGI middleware (``app.http.middleware.RequestTracing``).
- Stage latency, cache outcomes, retrieval sizes: ``StageMetrics``, a runner observer.
- Model calls (time to first token, time per output token, tokens, errors): where the
  ``chat {model}`` span ends (``pipeline.model.chat``).
- Redis errors: ``pipeline.store.kv.KeyValueStore._call``, the one place Redis is called.
- Route slots (in use, queued, the wait, refusals): ``pipeline.model.slots.SlotPool``; streams
  ended by a client that stopped reading: ``app.http.streaming``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Final

from prometheus_client import Counter, Gauge, Histogram

from pipeline.telemetry import attributes as attr

if TYPE_CHECKING:  # the runner tells this observer of records; it reads no stage
    from pipeline.context import RequestContext, StageRecord

# Seconds. The hit path's stages take tens of microseconds to a millisecond, generation seconds.
LATENCY_BUCKETS: Final = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
    60.0,
)  # fmt: skip
TOKEN_BUCKETS: Final = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28)
COUNT_BUCKETS: Final = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)

HTTP_DURATION: Final = Histogram(
    "rag_http_request_duration_seconds",
    "HTTP requests by route template (none: answered before routing; unmatched: no route) and "
    "status: latency until the last byte (_count: requests).",
    ["method", "route", "status"],
    buckets=LATENCY_BUCKETS,
)
# The route label of a request answered before the router ran (a middleware's 401 or 413): no
# route ran, whether or not the path has one.
NOT_ROUTED: Final = "none"
HTTP_IN_FLIGHT: Final = Gauge("rag_http_requests_in_flight", "HTTP requests being served.")
EVENT_LOOP_LAG: Final = Histogram(  # fed by app.lag.LagProbe
    "rag_event_loop_lag_seconds",
    "How late the event loop's clock ticks ran (every 10 ms while the loop keeps time).",
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0),
)
EVENT_LOOP_LAG_MAX: Final = Gauge(  # fed by app.lag.LagProbe
    "rag_event_loop_lag_max_seconds",
    "The event loop's worst lag in the last 2 to 4 s (polled every 2 s, no peak is missed).",
)
STAGE_DURATION: Final = Histogram(
    "rag_stage_duration_seconds",
    "Pipeline stages by name and outcome (ok, degraded, error, cancelled).",
    ["stage", "status"],
    buckets=LATENCY_BUCKETS,
)
CACHE_LOOKUPS: Final = Counter(
    "rag_cache_lookups_total",
    "Response-cache lookups by outcome (hit, miss, bypass, error).",
    ["outcome"],
)
RETRIEVAL_CANDIDATES: Final = Histogram(
    "rag_retrieval_candidates",
    "BM25 candidates given a vector score, per retrieval.",
    buckets=COUNT_BUCKETS,
)
RETRIEVAL_RESULTS: Final = Histogram(
    "rag_retrieval_results", "Passages put into the prompt, per retrieval.", buckets=COUNT_BUCKETS
)
LLM_CALLS: Final = Counter(
    "rag_llm_calls_total",
    "Model calls by model and outcome (ok, error, abandoned, left_queue).",
    ["model", "outcome"],
)
LLM_TTFT: Final = Histogram(
    "rag_llm_time_to_first_token_seconds",
    "From sending a model call to its first streamed token.",
    ["model"],
    buckets=LATENCY_BUCKETS,
)
LLM_TPOT: Final = Histogram(
    "rag_llm_time_per_output_token_seconds",
    "Decode time per output token after the first, per model call.",
    ["model"],
    buckets=TOKEN_BUCKETS,
)
LLM_TOKENS: Final = Counter(
    "rag_llm_tokens_total", "Tokens by model and type (prompt, completion).", ["model", "type"]
)
LLM_ERRORS: Final = Counter(
    "rag_llm_errors_total",
    "Failed model calls by model and kind (the error code, else the exception type).",
    ["model", "kind"],
)
REDIS_ERRORS: Final = Counter(
    "rag_redis_errors_total",
    "Failed Redis calls by command and kind (exception type, or circuit_open when skipped).",
    ["command", "kind"],
)
RATELIMIT_REFUSED: Final = Counter(
    "rag_ratelimit_refused_total",
    "Requests refused with a 429 by the rate limiter, by scope (key, tenant) and kind "
    "(requests, tokens).",
    ["scope", "kind"],
)
RATELIMIT_DEGRADED: Final = Counter(
    "rag_ratelimit_degraded_total",
    "Rate-limit checks Redis could not answer, by what happened: open (admitted), closed "
    "(refused), settle_lost (an answer's tokens not charged), record_stale (a tenant record "
    "not read again: the last copy stays in use).",
    ["mode"],
)
KEY_REVOCATIONS: Final = Counter(
    "rag_key_invalidations_total",
    "In-process key cache invalidations by source: message (pub/sub), resubscribed (the whole "
    "cache, after the channel was lost).",
    ["source"],
)


def model_call_finished(
    model: str,
    *,
    first_token_s: float | None,
    total_s: float,
    prompt_tokens: int,
    completion_tokens: int,
) -> None:
    """One model call that streamed to its end."""
    LLM_CALLS.labels(model, "ok").inc()
    if first_token_s is not None:
        LLM_TTFT.labels(model).observe(first_token_s)
        if completion_tokens > 1:
            decode_s = max(0.0, total_s - first_token_s)
            LLM_TPOT.labels(model).observe(decode_s / (completion_tokens - 1))
    LLM_TOKENS.labels(model, "prompt").inc(prompt_tokens)
    LLM_TOKENS.labels(model, "completion").inc(completion_tokens)


def model_call_failed(model: str, kind: str) -> None:
    LLM_CALLS.labels(model, "error").inc()
    LLM_ERRORS.labels(model, kind).inc()


def model_call_abandoned(model: str, *, queued: bool = False) -> None:
    """A call its caller let go: cut short (``abandoned``), or before it reached the model
    server, its client gone while it queued for a slot (``left_queue``: no model time spent)."""
    LLM_CALLS.labels(model, "left_queue" if queued else "abandoned").inc()


def ratelimit_refused(scope: str, kind: str) -> None:
    RATELIMIT_REFUSED.labels(scope, kind).inc()


def ratelimit_degraded(mode: str) -> None:
    RATELIMIT_DEGRADED.labels(mode).inc()


def key_invalidated(source: str, count: int = 1) -> None:
    KEY_REVOCATIONS.labels(source).inc(count)


def redis_failed(command: str, kind: str) -> None:
    # Script and pipeline names ("EVALSHA job_claim") are ours: a bounded set.
    REDIS_ERRORS.labels(command, kind).inc()


UPSTREAM_SLOTS_IN_USE: Final = Gauge(
    "rag_upstream_slots_in_use",
    "Model calls holding one of their route's concurrency slots (this process).",
    ["route"],
)
UPSTREAM_QUEUED: Final = Gauge(
    "rag_upstream_queued",
    "Model calls waiting for a slot of their route (this process).",
    ["route"],
)
UPSTREAM_SLOT_WAIT: Final = Histogram(
    "rag_upstream_slot_wait_seconds",
    "Time a model call waited for a slot of its route (0: one was free).",
    ["route"],
    buckets=LATENCY_BUCKETS,
)
UPSTREAM_BUSY: Final = Counter(
    "rag_upstream_busy_total",
    "Model calls refused (503 upstream_busy): no slot of their route came free in time.",
    ["route"],
)
ADAPTED: Final = Counter(
    "rag_adapted_total",
    "Requests adapted to a loaded route before any refusal (pipeline.routing.load), by step: "
    "top_k (fewer sources), compress (a tighter source budget), small_route.",
    ["step"],
)
COALESCED: Final = Counter(
    "rag_coalesced_total",
    "Cacheable misses by their part in request coalescing (pipeline.store.singleflight): "
    "leader (generated), follower (answered with a leader's answer), off (generated alone).",
    ["role"],
)
INDEX_LOADED_BYTES: Final = Gauge(
    "rag_index_loaded_bytes",
    "What the tenants' index snapshots this process holds loaded hold in memory, what "
    "searches built on them included (RAG_RETRIEVAL__LOADED_INDEXES_MB bounds it).",
)
INDEX_LET_GO: Final = Counter(
    "rag_index_let_go_total",
    "Tenants' index snapshots let go for the loaded snapshots' budget (loaded again from disk "
    "on their next search): a steady rate means the budget is smaller than the tenants searched.",
)
STREAM_WRITE_STALLS: Final = Counter(
    "rag_stream_write_stalls_total",
    "Streamed answers ended because a send to the client did not complete within the limit.",
)
STREAMS_FINISHED_FOR_FOLLOWERS: Final = Counter(
    "rag_stream_finished_for_followers_total",
    "Streamed answers whose client left while other requests followed them (request "
    "coalescing): read on to their end for those, and answered (not one that failed).",
)


class RouteSlotMetrics:
    """The slot metrics of one route, children bound once (``pipeline.model.slots``)."""

    def __init__(self, route: str) -> None:
        self._in_use = UPSTREAM_SLOTS_IN_USE.labels(route)
        self._queued = UPSTREAM_QUEUED.labels(route)
        self._wait = UPSTREAM_SLOT_WAIT.labels(route)
        self._busy = UPSTREAM_BUSY.labels(route)

    def set(self, in_use: int, queued: int) -> None:
        self._in_use.set(in_use)
        self._queued.set(queued)

    def waited(self, seconds: float) -> None:
        self._wait.observe(seconds)

    def busy(self) -> None:
        self._busy.inc()


def adapted(step: str) -> None:
    ADAPTED.labels(step).inc()


def stream_write_stalled() -> None:
    STREAM_WRITE_STALLS.inc()


def index_let_go(tenant: str) -> None:
    # Not labelled by tenant: tenants are unbounded, a label each would grow the registry.
    INDEX_LET_GO.inc()


def stream_finished_for_followers() -> None:
    STREAMS_FINISHED_FOR_FOLLOWERS.inc()


CACHE_STATUS_KEY: Final = attr.info_key(attr.CACHE_STATUS)
CANDIDATES_KEY: Final = attr.info_key(attr.RETRIEVAL_CANDIDATES)
COALESCED_KEY: Final = attr.info_key(attr.COALESCED)
RESULTS_KEY: Final = attr.info_key(attr.RETRIEVAL_RESULTS)


class StageMetrics:
    """Runner observer: stage latency by name and outcome, the cache's outcome, the size of
    retrieval. Told about every stage of every run, sampled or not."""

    def __init__(self) -> None:
        # Children bound once: a label lookup takes a lock and a dict access per call.
        self._durations: dict[tuple[str, str], Histogram] = {}

    def stage_finished(self, record: StageRecord, ctx: RequestContext) -> None:
        key = (record.name, record.status)
        histogram = self._durations.get(key)
        if histogram is None:
            histogram = self._durations[key] = STAGE_DURATION.labels(*key)
        histogram.observe(record.duration_ms / 1000.0)
        if record.status != "ok":
            return
        # Keyed on what the stage reported (the span attributes), not on stage names.
        cache_status = record.info.get(CACHE_STATUS_KEY)
        if isinstance(cache_status, str):
            CACHE_LOOKUPS.labels(cache_status).inc()
        coalesced = record.info.get(COALESCED_KEY)
        if isinstance(coalesced, str):
            COALESCED.labels(coalesced).inc()
        candidates = record.info.get(CANDIDATES_KEY)
        results = record.info.get(RESULTS_KEY)
        if isinstance(candidates, int) and isinstance(results, int):
            RETRIEVAL_CANDIDATES.observe(candidates)
            RETRIEVAL_RESULTS.observe(results)
