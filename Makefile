# One command each: `make run` serves the whole stack locally, `make test` runs every check.
# Build outputs live outside git: the app venv in .venv, vLLM's venv and the model under $(RAG_HOME).

SHELL := /bin/bash
PYTHON ?= python3.11
RAG_HOME ?= $(HOME)/.cache/rag
export RAG_HOME
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | sha256sum | cut -c1-12)

.PHONY: help install vllm model redis run test lint typecheck pytest bench bench-cache bench-retrieval compose-check clean

help:
	@echo "make run        serve the API on :8000 with Redis and vLLM (installs everything first)"
	@echo "make test       lint, type-check and the whole test suite against real Redis and vLLM"
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

test: lint typecheck pytest

bench-cache: install model redis
	$(PY) -m bench.cache_hit

bench-retrieval: install
	$(PY) -m bench.retrieval_quality
	$(PY) -m bench.retrieval_latency
	$(PY) -m bench.ingest_bench

bench: bench-cache bench-retrieval

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache
