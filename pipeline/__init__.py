"""The request path, without FastAPI: stages run by a runner over one request context.

runner      Runner, Concurrent, check_path: spans, deadline, groups, failure policies
context     RequestContext and the values stages hand on (Principal, ChatParams, Passage, ...)
errors      PipelineError and its subclasses: each an HTTP status and an OpenAI error type
stages/     one module per stage of the path (auth, validate, guard_in, cache, features,
            retrieve, tools, guard_similarity, compress, route, generate, guard_out)
answer/     the answer as it is made: typed events, the stream and its filters, the completion
model/      calling a model: the vLLM client, the traced chat call, routes, prompt layout,
            reading message text, counting tokens
routing/    which route answers a request: the router and its word rules
sources/    what the prompt is grounded on: retrieval as the path uses it, compression
store/      Redis: the traced key-value store with its breaker, API keys, rate limits
telemetry/  span attribute keys, marking spans failed, the Prometheus metrics
guards/     input and output guardrails: PII, injection, policies, grounding
tools/      server-side tools, the planner and the function-calling loop
features/   the online feature store and the request log
jobs/       the asynchronous job queue, its workers and signed webhooks

Imports point down: ``stages`` uses the folders beside it; ``routing`` uses ``model``; ``model``,
``sources``, ``store`` and ``telemetry`` import no stage. Nothing here imports ``app``.
"""
