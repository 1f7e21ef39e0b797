"""Span attribute keys of our own, all under the ``rag.`` prefix, in one place.

GenAI and HTTP keys come from the OpenTelemetry semantic-conventions package instead.
"""

from typing import Final

STAGE: Final = "rag.stage"
TENANT: Final = "rag.tenant"
CACHE_STATUS: Final = "rag.cache.status"
CACHE_ERROR: Final = "rag.cache.error"
CACHE_STORED: Final = "rag.cache.stored"
TTFT_MS: Final = "rag.ttft_ms"
STREAM_ABANDONED: Final = "rag.stream.abandoned"
INGEST_DOCUMENTS: Final = "rag.ingest.documents"
RETRIEVAL_SKIPPED: Final = "rag.retrieval.skipped"
RETRIEVAL_CANDIDATES: Final = "rag.retrieval.candidates"
RETRIEVAL_ALLOWED: Final = "rag.retrieval.allowed"
RETRIEVAL_RESULTS: Final = "rag.retrieval.results"
RETRIEVAL_INDEX_VERSION: Final = "rag.retrieval.index_version"
RETRIEVAL_TIMING_PREFIX: Final = "rag.retrieval.ms."
ROUTE: Final = "rag.route"
ROUTE_REASON: Final = "rag.route.reason"
TOOL_ROUND: Final = "rag.tool.round"
TOOLS_PLANNED: Final = "rag.tools.planned"
TOOL_STATUS: Final = "rag.tool.status"
FEATURES_DEFAULTED: Final = "rag.features.defaulted"
FEATURES_USED: Final = "rag.features.used"
FEATURES_VERSION: Final = "rag.features.version"
FEATURES_LOOKUP: Final = "rag.features.lookup"  # hit, miss, stale, timeout, error
FEATURES_AGE_S: Final = "rag.features.age_s"
FEATURES_INVALID: Final = "rag.features.invalid"
FINISH_DETAIL: Final = "rag.finish.detail"
RETRIEVAL_FEATURE_FILTER: Final = "rag.retrieval.feature_filter"
JOB_ID: Final = "rag.job.id"
JOB_ATTEMPT: Final = "rag.job.attempt"
JOB_OUTCOME: Final = "rag.job.outcome"
WEBHOOK_ATTEMPT: Final = "rag.webhook.attempt"
