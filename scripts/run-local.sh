#!/usr/bin/env bash
# The local stack in one command (called by `make run`): Redis if none answers, vLLM, the API.
# Ctrl-C stops what this script started, and nothing else.
#   RAG_REDIS__URL     Redis to use (default redis://127.0.0.1:6379/0); started here if it does not answer
#   RAG_VLLM_PORT      vLLM's port (default 8001); RAG_LLM__BASE_URL is set to match
#   RAG_SERVER__PORT   the API's port (default 8000)
#   RAG_DEV_API_KEY    the development key of tenant `dev` (generated and printed when unset)
#   RAG_DEMO_SEED=0    do not give tenant `dev` its demo documents on first start
#   RAG_DEMO_DOCS      how many SciFact abstracts the demo tenant gets (default 300)
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=.venv
REDIS_URL="${RAG_REDIS__URL:-redis://127.0.0.1:6379/0}"
VLLM_PORT="${RAG_VLLM_PORT:-8001}"
API_PORT="${RAG_SERVER__PORT:-8000}"
export RAG_LLM__BASE_URL="${RAG_LLM__BASE_URL:-http://127.0.0.1:$VLLM_PORT}"
export RAG_REDIS__URL="$REDIS_URL"
LOGS="${RAG_HOME:-$HOME/.cache/rag}/logs"
mkdir -p "$LOGS"

pids=()
cleanup() {
    trap - INT TERM EXIT
    for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
    wait 2>/dev/null || true
    echo "stopped."
}
trap cleanup INT TERM EXIT

redis_answers() { "$VENV/bin/python" - "$REDIS_URL" <<'PY' 2>/dev/null
import sys, redis
sys.exit(0 if redis.Redis.from_url(sys.argv[1], socket_timeout=0.5).ping() else 1)
PY
}

if redis_answers; then
    echo "redis: using the server at $REDIS_URL"
else
    port=$("$VENV/bin/python" -c "import sys; from urllib.parse import urlparse; print(urlparse(sys.argv[1]).port or 6379)" "$REDIS_URL")
    echo "redis: starting redis-server on port $port"
    redis-server --port "$port" --bind 127.0.0.1 --save "" --appendonly no >"$LOGS/redis.log" 2>&1 &
    pids+=($!)
    for _ in $(seq 50); do redis_answers && break; sleep 0.1; done
    redis_answers || { echo "redis did not start; see $LOGS/redis.log" >&2; exit 1; }
fi

if curl -fsS "$RAG_LLM__BASE_URL/health" >/dev/null 2>&1; then
    echo "vllm: using the server at $RAG_LLM__BASE_URL"
else
    echo "vllm: starting on port $VLLM_PORT (warm-up takes 1-2 minutes; log: $LOGS/vllm.log)"
    bash scripts/start-vllm.sh "$VLLM_PORT" >"$LOGS/vllm.log" 2>&1 &
    pids+=($!)
    until curl -fsS "$RAG_LLM__BASE_URL/health" >/dev/null 2>&1; do
        kill -0 "${pids[-1]}" 2>/dev/null || { echo "vLLM exited; see $LOGS/vllm.log" >&2; exit 1; }
        sleep 2
    done
    echo "vllm: ready"
fi

if [[ -n "${RAG_DEV_API_KEY:-}" ]]; then
    key=$("$VENV/bin/rag" keys create --tenant dev --user dev --scopes chat,retrieve,ingest --key "$RAG_DEV_API_KEY")
else
    key=$("$VENV/bin/rag" keys create --tenant dev --user dev --scopes chat,retrieve,ingest)
fi

# The demo tenant: on first start, tenant `dev` gets a few hundred SciFact abstracts from
# data/scifact/, so the first answer comes with sources. Seeded once: a tenant that has an index
# (this demo's or documents of your own) is left as it is.
question="What is the capital of France?"
if [[ "${RAG_DEMO_SEED:-1}" != 0 ]]; then
    seeded=$("$VENV/bin/python" - 2>/dev/null <<'PY'
from app.settings import get_settings
from retrieval import Embedder, IndexStore
from retrieval.versions import NO_VERSION

store = IndexStore(get_settings().retrieval.index_dir, Embedder())
print("yes" if store.version("dev") != NO_VERSION else "no")
PY
)
    if [[ "$seeded" == yes ]]; then
        echo "demo: tenant 'dev' already has an index; not seeding it again"
    else
        docs="${RAG_DEMO_DOCS:-300}"
        echo "demo: indexing $docs SciFact abstracts for tenant 'dev' (about a minute on 2 cores)"
        "$VENV/bin/python" - "$LOGS/demo-seed.jsonl" "$docs" <<'PY'
import itertools
import sys

from tests.support.data import open_scifact

with open_scifact("corpus.jsonl") as src, open(sys.argv[1], "w", encoding="utf-8") as dst:
    dst.writelines(itertools.islice(src, int(sys.argv[2])))
PY
        "$VENV/bin/rag" ingest "$LOGS/demo-seed.jsonl" --tenant dev --quiet
    fi
    # Abstract 275294 ("Environmental factors that influence the cutaneous production of vitamin
    # D") is among the first 300.
    question="What environmental factors influence how much vitamin D the skin makes?"
fi

cat <<MSG

The API is starting on http://127.0.0.1:$API_PORT  (development key for tenant 'dev': $key)

  curl -s http://127.0.0.1:$API_PORT/v1/chat/completions \\
    -H "Authorization: Bearer $key" -H "Content-Type: application/json" \\
    -d '{"model": "smollm2", "max_tokens": 150, "messages": [{"role": "user", "content": "$question"}]}'

MSG
if [[ "${RAG_DEMO_SEED:-1}" != 0 ]]; then
    echo "The answer's \"rag\": {\"sources\": [...]} lists the abstracts it was given."
fi
# The server knows the development key, so RAG_ENVIRONMENT=production refuses to start with it.
RAG_DEV_API_KEY="$key" "$VENV/bin/rag" serve --host 127.0.0.1 --port "$API_PORT" &
pids+=($!)
wait "${pids[-1]}"
