"""The ONNX Runtime embedders against sentence-transformers, and an API process without torch."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from opentelemetry import trace

from retrieval.embeddings import Embedder, make_embedder
from retrieval.onnx_embeddings import OnnxEmbedder, OpenVinoEmbedder, ensure_built
from tests.support.servers import RedisServer, VLLMServer

ROOT = Path(__file__).resolve().parents[2]

TEXTS = [
    "a cat sat on the mat",
    "Daily low-dose aspirin lowers the risk of a first heart attack.",
    "Ünïcødé: naïve café, 漢字かな交じり文, Ελληνικά, emoji 🎉🧬, a right-to-left word שלום",
    "",
    "   ",
    "x",
    "Statins reduce LDL cholesterol. " * 12,
    "word " * 700,  # far past 256 tokens: truncated as sentence-transformers truncates
]


@pytest.fixture(scope="module")
def onnx_fp32() -> OnnxEmbedder:
    embedder = OnnxEmbedder(quantized=False, model_dir=ensure_built())
    embedder.warm_up()
    return embedder


@pytest.fixture(scope="module")
def onnx_int8() -> OnnxEmbedder:
    embedder = OnnxEmbedder(quantized=True, model_dir=ensure_built())
    embedder.warm_up()
    return embedder


@pytest.fixture(scope="module")
def openvino() -> OpenVinoEmbedder:
    embedder = OpenVinoEmbedder(model_dir=ensure_built())
    embedder.warm_up()
    return embedder


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.asarray((a * b).sum(axis=1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1)))


def test_fp32_vectors_match_sentence_transformers_per_text(
    embedder: Embedder, onnx_fp32: OnnxEmbedder
) -> None:
    reference = embedder.embed(TEXTS)
    vectors = onnx_fp32.embed(TEXTS)
    assert vectors.shape == (len(TEXTS), 384) and vectors.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, rtol=1e-5)
    assert cosines(vectors, reference).min() > 0.999


def test_fp32_vectors_do_not_depend_on_the_batch_they_are_in(onnx_fp32: OnnxEmbedder) -> None:
    together = onnx_fp32.embed(TEXTS)
    alone = np.vstack([onnx_fp32.embed([text]) for text in TEXTS])
    assert cosines(together, alone).min() > 0.9999


def test_int8_vectors_stay_close_to_sentence_transformers(
    embedder: Embedder, onnx_int8: OnnxEmbedder
) -> None:
    # Seen: 0.982 to 0.993 for these texts (0.987 to 0.999, mean 0.993, on 192 SciFact
    # passages), and 0.970 for "" and "   ", which are [CLS] [SEP] alone: no words to average
    # the rounding away over.
    reference = embedder.embed(TEXTS)
    vectors = onnx_int8.embed(TEXTS)
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, rtol=1e-5)
    similarity = cosines(vectors, reference)
    words = np.array([bool(text.strip()) for text in TEXTS])
    assert similarity[words].min() > 0.98
    assert similarity[~words].min() > 0.95


def test_int8_keeps_similar_texts_closer_than_unrelated_ones(onnx_int8: OnnxEmbedder) -> None:
    vectors = onnx_int8.embed(["a cat sat on the mat", "a kitten sat on a rug", "stock markets"])
    assert vectors[0] @ vectors[1] > vectors[0] @ vectors[2] + 0.2


def test_no_texts_give_an_empty_array(onnx_int8: OnnxEmbedder) -> None:
    empty = onnx_int8.embed([])
    assert empty.shape == (0, 384) and empty.dtype == np.float32


def test_text_past_256_tokens_is_truncated_like_sentence_transformers(
    embedder: Embedder, onnx_fp32: OnnxEmbedder
) -> None:
    head = "The heart pumps blood through the arteries and veins of the body. " * 30
    longer = head + "Volcanoes erupt molten rock, ash and gas from the earth's mantle. " * 30
    vectors = onnx_fp32.embed([head, longer])
    # Both are cut to the same first 256 tokens, so they embed the same; torch agrees.
    assert float(vectors[0] @ vectors[1]) > 0.9999
    assert cosines(vectors, embedder.embed([head, longer])).min() > 0.999


@pytest.mark.parametrize("runtime", ["onnx_int8", "openvino"])
def test_concurrent_calls_from_threads_give_the_same_vectors(
    runtime: str, request: pytest.FixtureRequest
) -> None:
    embedder: OnnxEmbedder = request.getfixturevalue(runtime)
    texts = [f"{text[:200]} #{i}" for i, text in enumerate(TEXTS * 2)]
    expected = embedder.embed(texts)
    with ThreadPoolExecutor(6) as pool:
        results = list(pool.map(embedder.embed, [texts] * 12))
    for vectors in results:
        np.testing.assert_allclose(vectors, expected, atol=1e-5)


def test_make_embedder_picks_the_backend_by_name() -> None:
    assert make_embedder("torch").backend == "torch"
    int8 = make_embedder("onnx-int8", threads=1)
    assert isinstance(int8, OnnxEmbedder) and int8.quantized and int8.threads == 1
    assert make_embedder("onnx").backend == "onnx"
    with pytest.raises(ValueError, match="unknown embedding backend"):
        make_embedder("tensorflow")  # type: ignore[arg-type]


def test_only_a_bulk_ingest_lets_onnx_runtime_threads_spin(onnx_int8: OnnxEmbedder) -> None:
    # A replica's embedders sleep between operators (an event loop shares the cores); the
    # embedder `rag ingest` makes spins, as torch's threads do, and gives the same vectors.
    def spins(embedder: OnnxEmbedder) -> str:
        options = embedder._session.get_session_options()
        return str(options.get_session_config_entry("session.intra_op.allow_spinning"))

    assert spins(onnx_int8) == "0"
    bulk = make_embedder("onnx-int8", spinning=True)
    assert isinstance(bulk, OnnxEmbedder)
    bulk.warm_up()
    assert spins(bulk) == "1"
    np.testing.assert_allclose(bulk.embed(TEXTS), onnx_int8.embed(TEXTS), atol=1e-6)
    from app.cli.backend import backend_router, bulk_backend
    from app.settings import get_settings

    embedder = backend_router().backends["embedded"].store.embedder  # type: ignore[attr-defined]
    assert embedder.backend == bulk_backend(get_settings().retrieval)
    if not isinstance(embedder, OpenVinoEmbedder):
        assert getattr(embedder, "spinning", None) is True


def test_rag_commands_ingest_with_openvino_where_the_cpu_has_bfloat16() -> None:
    from app.cli.backend import bulk_backend
    from app.settings import RetrievalSettings
    from retrieval.onnx_embeddings import native_bf16

    default = RetrievalSettings()
    assert bulk_backend(default) == ("openvino" if native_bf16() else default.embeddings)
    chosen = RetrievalSettings(embeddings="onnx-int8", ingest_embeddings="onnx")
    assert bulk_backend(chosen) == "onnx", "a set ingest runtime wins"
    # A replica ingests with `ingest_embeddings` when set, else with `embeddings`.
    from app.services import Services
    from app.settings import Settings

    settings = Settings(retrieval={"ingest_embeddings": "openvino"})
    services = Services.build(settings, trace.NoOpTracer())
    try:
        assert services.retrieval is not None
        assert services.retrieval.store.embedder.backend == "openvino"
        assert services.retrieval.queries.embedder.backend == settings.retrieval.embeddings
    finally:
        asyncio.run(services.aclose())


def test_openvino_gives_fp32s_vectors_in_bfloat16_where_the_cpu_has_it(
    openvino: OpenVinoEmbedder, onnx_fp32: OnnxEmbedder
) -> None:
    import openvino as ov

    native = "BF16" in ov.Core().get_property("CPU", "OPTIMIZATION_CAPABILITIES")
    assert openvino.precision == ("bf16" if native else "f32")
    assert make_embedder("openvino").backend == "openvino"
    vectors = openvino.embed(TEXTS)
    assert vectors.shape == (len(TEXTS), 384) and vectors.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, rtol=1e-4)
    # Closer to fp32 than int8 is (> 0.98 there): bfloat16 keeps 8 bits of mantissa per value.
    assert cosines(vectors, onnx_fp32.embed(TEXTS)).min() > (0.999 if native else 0.99999)
    alone = np.vstack([openvino.embed([text]) for text in TEXTS])
    assert cosines(vectors, alone).min() > 0.999, "a text's vector does not depend on its batch"
    assert openvino.embed([]).shape == (0, 384)


def test_the_build_is_idempotent_and_rebuilds_when_missing(tmp_path: Path) -> None:
    ensure_built()  # built here already: the child below only copies nothing
    env = {**os.environ, "RAG_HOME": str(tmp_path)}
    code = "from retrieval.onnx_embeddings import built_dir; print(built_dir())"
    target = Path(
        subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
        ).stdout.strip()
    )
    assert target.is_relative_to(tmp_path) and not target.exists()
    first = subprocess.run(
        [sys.executable, "-m", "retrieval.onnx_build"], env=env, capture_output=True, text=True
    )
    assert first.returncode == 0, first.stderr[-2000:]
    stamp = (target / "build.json").stat().st_mtime_ns
    again = subprocess.run(
        [sys.executable, "-m", "retrieval.onnx_build"], env=env, capture_output=True, text=True
    )
    assert again.returncode == 0 and (target / "build.json").stat().st_mtime_ns == stamp
    assert {p.name for p in target.iterdir()} == {
        "model.onnx",
        "model-int8.onnx",
        "tokenizer.json",
        "build.json",
    }


APP_WITHOUT_TORCH = textwrap.dedent(
    """
    import asyncio, json, sys, tempfile

    import httpx

    from app.main import create_app
    from app.settings import Settings

    async def main() -> None:
        settings = Settings(
            environment="test",
            redis={"url": sys.argv[1], "key_prefix": "onnx-no-torch:"},
            llm={"base_url": sys.argv[2]},
            retrieval={"index_dir": tempfile.mkdtemp(), "embeddings": "onnx-int8"},
            guard={"enabled": True, "similarity": True},
        )
        app = create_app(settings)
        async with app.router.lifespan_context(app):
            client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t")
            ready = await client.get("/readyz")
            services = app.state.services
            queries = services.retrieval.queries
            vector = await queries.embed("does aspirin prevent heart attacks?", scope="t")
            ingested = await asyncio.to_thread(
                services.retrieval.store.upsert,
                "acme",
                [__import__("retrieval").Document("d1", "Aspirin lowers heart attack risk.")],
            )
            await client.aclose()
        loaded = sorted(m for m in sys.modules if m.split(".")[0] in
                        ("torch", "sentence_transformers", "transformers"))
        print(json.dumps({
            "readyz": ready.status_code,
            "backend": queries.embedder.backend,
            "norm": float((vector ** 2).sum()),
            "chunks": ingested.chunks,
            "loaded": loaded,
        }))

    asyncio.run(main())
    """
)


def test_api_process_with_the_onnx_backend_never_imports_torch(
    redis_server: RedisServer, vllm: VLLMServer
) -> None:
    ensure_built()
    done = subprocess.run(
        [sys.executable, "-c", APP_WITHOUT_TORCH, redis_server.url, vllm.url],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["readyz"] == 200
    assert result["backend"] == "onnx-int8" and abs(result["norm"] - 1.0) < 1e-4
    assert result["chunks"] == 1
    assert result["loaded"] == []


def test_settings_refuse_an_unknown_embedding_backend() -> None:
    from pydantic import ValidationError

    from app.settings import Settings

    assert Settings(retrieval={"embeddings": "onnx-int8"}).retrieval.embeddings == "onnx-int8"
    with pytest.raises(ValidationError, match="embeddings"):
        Settings(retrieval={"embeddings": "tensorflow"})
