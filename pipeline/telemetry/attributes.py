"""Span attribute keys of our own, all under the ``rag.`` prefix, in one place.

GenAI and HTTP keys come from the OpenTelemetry semantic-conventions package instead.
"""

from typing import Final

STAGE: Final = "rag.stage"
# The event loop's lag that a budgeted stage's budget did not count (pipeline.looptime).
STAGE_LOOP_LAG_MS: Final = "rag.stage.loop_lag_ms"
TENANT: Final = "rag.tenant"
CACHE_STATUS: Final = "rag.cache.status"
CACHE_ERROR: Final = "rag.cache.error"
CACHE_STORED: Final = "rag.cache.stored"
CACHE_INDEX_VERSION: Final = "rag.cache.index_version"  # the index version in the cache key
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
JOB_DEFERRED_MS: Final = "rag.job.deferred_ms"  # a job not run yet: its token window is full
WEBHOOK_ATTEMPT: Final = "rag.webhook.attempt"
ROUTE_WAIT_MS: Final = "rag.route.wait_ms"
GUARD_POLICY: Final = "rag.guard.policy"
GUARD_INPUT_TOKENS: Final = "rag.guard.input_tokens"
GUARD_PII_KINDS: Final = "rag.guard.pii.kinds"
GUARD_PII_ACTION: Final = "rag.guard.pii.action"
GUARD_INJECTION_RULE: Final = "rag.guard.injection.rule"
GUARD_INJECTION_SCORE: Final = "rag.guard.injection.score"
GUARD_SIMILARITY: Final = "rag.guard.injection.similarity"
GUARD_OUTPUT_VIOLATION: Final = "rag.guard.output.violation"
GUARD_OUTPUT_HELD_MAX: Final = "rag.guard.output.held_max"
# How long the answer's first text waited in the output redaction (from the model's first text
# to the first text let out), and for how many of the model's pieces of text: the part of the
# time to first token that exact redaction adds (the first word is shown once it has ended).
GUARD_OUTPUT_FIRST_HELD_MS: Final = "rag.guard.output.first_held_ms"
GUARD_OUTPUT_FIRST_HELD_PIECES: Final = "rag.guard.output.first_held_pieces"
GROUNDING_SUPPORT: Final = "rag.grounding.support"
GROUNDING_CITED: Final = "rag.grounding.cited"
GROUNDING_UNKNOWN: Final = "rag.grounding.unknown_citations"
GROUNDING_SENTENCES: Final = "rag.grounding.sentences"
RETRIEVAL_DROPPED: Final = "rag.retrieval.dropped"
RETRIEVAL_NO_SOURCES: Final = "rag.retrieval.no_sources"
# Chunks the request's metadata filter, and the user's feature-derived filter, excluded.
RETRIEVAL_EXCLUDED_BY_FILTERS: Final = "rag.retrieval.excluded.filters"
RETRIEVAL_EXCLUDED_BY_FEATURES: Final = "rag.retrieval.excluded.feature_filter"
# What a chat search looked for: "last_message", or "conversation" when the last user message
# depends on earlier turns (pipeline.sources.conversation); why (pronoun, opener, short,
# standalone, topic_shift, first_turn); how many earlier user turns it used, and their weights.
RETRIEVAL_QUERY_MODE: Final = "rag.retrieval.query.mode"
RETRIEVAL_QUERY_REASON: Final = "rag.retrieval.query.reason"
RETRIEVAL_QUERY_TURNS: Final = "rag.retrieval.query.earlier_turns"
RETRIEVAL_QUERY_TERM_WEIGHTS: Final = "rag.retrieval.query.term_weights"
COMPRESS_TOKENS_BEFORE: Final = "rag.compress.tokens_before"
COMPRESS_TOKENS_AFTER: Final = "rag.compress.tokens_after"
COMPRESS_BUDGET: Final = "rag.compress.budget"
COMPRESS_SENTENCES: Final = "rag.compress.sentences"
COMPRESS_SKIPPED: Final = "rag.compress.skipped"
# The sources cut to the route's context window (pipeline.model.budget): the room they had,
# what the kept ones take, the chunks dropped (weakest first), and the one cut (its characters
# shown, of those it had).
PROMPT_SOURCE_BUDGET: Final = "rag.prompt.source_budget"
PROMPT_SOURCE_TOKENS: Final = "rag.prompt.source_tokens"
PROMPT_SOURCES_DROPPED: Final = "rag.prompt.sources_dropped"
PROMPT_SOURCE_CUT: Final = "rag.prompt.source_cut"
PROMPT_SOURCE_CUT_CHARS: Final = "rag.prompt.source_cut_chars"
# Adaptation to a loaded route (pipeline.routing.load): how full its slots were (1: all
# taken), the steps taken, and the settings they gave the request.
ADAPT_PRESSURE: Final = "rag.adapt.pressure"
ADAPT_STEPS: Final = "rag.adapt.steps"
ADAPT_TOP_K: Final = "rag.adapt.top_k"
ADAPT_BUDGET: Final = "rag.adapt.budget_tokens"
ADAPT_ROUTE: Final = "rag.adapt.route"

# Request coalescing (pipeline.store.singleflight): leader, follower or off, and why (off) or
# how (a follower answered from the cache its flight had just filled: "cached").
COALESCED: Final = "rag.coalesced"
COALESCE_DETAIL: Final = "rag.coalesce.detail"
# On a coalesced flight's "flight publish" (its leader's) and "flight read" (a replica's reader
# of another's) spans: their round trips to Redis, the answer events they carried, and whether
# Redis failed one (coalescing then goes on without Redis, or stops).
FLIGHT_ROUND_TRIPS: Final = "rag.flight.round_trips"
FLIGHT_EVENTS: Final = "rag.flight.events"
FLIGHT_STORE_FAILED: Final = "rag.flight.store_failed"


def info_key(attribute: str) -> str:
    """The key under which ``annotate`` keeps a span attribute in the stage's explain record
    (``rag.retrieval.candidates`` -> ``retrieval.candidates``)."""
    return attribute.removeprefix("rag.")
