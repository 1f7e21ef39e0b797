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
