#!/usr/bin/env bash
# Print the SmolLM2 model directory (where it is / would be); add --build to
# build it first if missing. Env: RAG_HOME, RAG_VLLM_VENV, RAG_MODEL_DIR,
# RAG_MODELS_DIR, RAG_GGUF_FILE (see build_model.py).
set -euo pipefail
if [[ -n "${RAG_MODEL_DIR:-}" && "${1:-}" != --build ]]; then echo "$RAG_MODEL_DIR"; exit 0; fi
RAG_HOME="${RAG_HOME:-$HOME/.cache/rag}"
VENV="${RAG_VLLM_VENV:-$RAG_HOME/venv-vllm}"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
if [[ "${1:-}" == --build ]]; then
    exec "$VENV/bin/python" "$HERE/build_model.py"
fi
exec "$VENV/bin/python" "$HERE/build_model.py" --print-path
