#!/usr/bin/env bash
# Start vLLM's OpenAI-compatible server (CPU build) in the foreground.
#   scripts/start-vllm.sh [PORT]
# Env overrides:
#   RAG_HOME             cache root (default ~/.cache/rag)
#   RAG_VLLM_VENV        vLLM venv (default $RAG_HOME/venv-vllm)
#   RAG_VLLM_PORT        port (default 8001; the PORT argument wins)
#   RAG_VLLM_HOST        bind address (default 127.0.0.1)
#   RAG_VLLM_MODEL_NAME  served model name (default smollm2)
#   RAG_MODEL_DIR        model directory (default: built by build_model.py)
#   RAG_VLLM_MAX_LEN     --max-model-len (default 2048)
#   RAG_VLLM_KV_GIB      VLLM_CPU_KVCACHE_SPACE in GiB (default 1)
#   RAG_VLLM_DTYPE       --dtype (default: bfloat16 where the CPU has AVX-512,
#                        float32 elsewhere: on an AVX2-only AMD EPYC bfloat16 is
#                        emulated and prefill ran 5.5x slower, 1,227 tokens in
#                        28 s against 5.2 s; see BENCHMARKS.md)
#   RAG_VLLM_IOMP=0      do not LD_PRELOAD Intel OpenMP
#   RAG_VLLM_EAGER=1     add --enforce-eager: no torch.compile; /health after
#                        ~40 s every time, but decode ~15-20% slower. Default
#                        (compiled): ~110 s the first time, ~47 s once vLLM's
#                        compile cache (~/.cache/vllm, VLLM_CACHE_ROOT) is warm.
#   RAG_VLLM_DRY_RUN=1   print the command instead of running it
#   RAG_VLLM_ARGS        extra arguments, word-split (e.g. "--speculative-config ...")
set -euo pipefail

RAG_HOME="${RAG_HOME:-$HOME/.cache/rag}"
VENV="${RAG_VLLM_VENV:-$RAG_HOME/venv-vllm}"
PORT="${1:-${RAG_VLLM_PORT:-8001}}"
HOST="${RAG_VLLM_HOST:-127.0.0.1}"
NAME="${RAG_VLLM_MODEL_NAME:-smollm2}"
MAX_LEN="${RAG_VLLM_MAX_LEN:-2048}"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PY="$VENV/bin/python"

[[ -x "$PY" ]] || { echo "no vLLM venv at $VENV: run scripts/install-vllm.sh" >&2; exit 1; }

MODEL_DIR="${RAG_MODEL_DIR:-}"
if [[ -z "$MODEL_DIR" ]]; then
    MODEL_DIR="$("$PY" "$HERE/build_model.py")"   # builds once, then only prints
fi
[[ -f "$MODEL_DIR/config.json" ]] || { echo "no model at $MODEL_DIR" >&2; exit 1; }

export VLLM_CPU_KVCACHE_SPACE="${RAG_VLLM_KV_GIB:-${VLLM_CPU_KVCACHE_SPACE:-1}}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
# vLLM 0.32's AOT compile cache fails to reload on CPU ("'function' object has
# no attribute 'finalize_loading'") and recompiles (~75 s) on every start; the
# non-AOT inductor cache reloads fine (init 77 s -> 18 s on the second start).
export VLLM_USE_AOT_COMPILE="${VLLM_USE_AOT_COMPILE:-0}"

# vLLM warns that it is slower without Intel OpenMP preloaded.
if [[ "${RAG_VLLM_IOMP:-1}" != 0 && -f "$VENV/lib/libiomp5.so" ]]; then
    case ":${LD_PRELOAD:-}:" in
        *libiomp5.so*) ;;
        *) export LD_PRELOAD="$VENV/lib/libiomp5.so${LD_PRELOAD:+:$LD_PRELOAD}" ;;
    esac
fi

DTYPE="${RAG_VLLM_DTYPE:-}"
if [[ -z "$DTYPE" ]]; then
    if grep -qw avx512f /proc/cpuinfo 2>/dev/null; then DTYPE=bfloat16; else DTYPE=float32; fi
fi

ARGS=(--model "$MODEL_DIR" --served-model-name "$NAME"
      --host "$HOST" --port "$PORT"
      --max-model-len "$MAX_LEN" --dtype "$DTYPE"
      --enable-auto-tool-choice --tool-call-parser hermes)
if [[ "${RAG_VLLM_EAGER:-0}" == 1 ]]; then ARGS+=(--enforce-eager); fi
# shellcheck disable=SC2206  # word-splitting RAG_VLLM_ARGS is intended
EXTRA=(${RAG_VLLM_ARGS:-})

if [[ "${RAG_VLLM_DRY_RUN:-0}" == 1 ]]; then
    echo "LD_PRELOAD=${LD_PRELOAD:-} VLLM_CPU_KVCACHE_SPACE=$VLLM_CPU_KVCACHE_SPACE" \
         "VLLM_USE_AOT_COMPILE=$VLLM_USE_AOT_COMPILE HF_HUB_OFFLINE=1" \
         "$PY -m vllm.entrypoints.openai.api_server ${ARGS[*]} ${EXTRA[*]+${EXTRA[*]}}"
    exit 0
fi
exec "$PY" -m vllm.entrypoints.openai.api_server "${ARGS[@]}" ${EXTRA[@]+"${EXTRA[@]}"}
