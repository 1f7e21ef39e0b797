#!/usr/bin/env bash
# The local stack in one command (called by `make run`): Redis if none answers, vLLM, the API.
# Ctrl-C stops what this script started, and nothing else.
#   RAG_REDIS__URL     Redis to use (default redis://127.0.0.1:6379/0); started here if it does not answer
#   RAG_VLLM_PORT      vLLM's port (default 8001); RAG_LLM__BASE_URL is set to match
#   RAG_SERVER__PORT   the API's port (default 8000)
#   RAG_DEV_API_KEY    the development key of tenant `dev` (generated and printed when unset)
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

cat <<MSG

The API is starting on http://127.0.0.1:$API_PORT  (development key for tenant 'dev': $key)

  curl -s http://127.0.0.1:$API_PORT/v1/chat/completions \\
    -H "Authorization: Bearer $key" -H "Content-Type: application/json" \\
    -d '{"model": "smollm2", "messages": [{"role": "user", "content": "What is the capital of France?"}]}'

MSG
"$VENV/bin/rag" serve --host 127.0.0.1 --port "$API_PORT" &
pids+=($!)
wait "${pids[-1]}"
