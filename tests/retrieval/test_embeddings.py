"""The embedder's output, and the batcher's batching of concurrent queries."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from retrieval.embeddings import Embedder, QueryBatcher

from .conftest import CountingEmbedder

QUERIES = [f"question number {i} about {topic}" for i, topic in enumerate(
    ["heart disease", "python code", "volcanoes", "bread", "tides", "jazz", "insulin", "rust"] * 3
)]  # fmt: skip


def test_embeddings_are_unit_float32_rows_and_similar_texts_are_close(embedder: Embedder) -> None:
    vectors = embedder.embed(["a cat sat on the mat", "a kitten sat on a rug", "stock markets"])
    assert vectors.shape == (3, 384) and vectors.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, rtol=1e-5)
    assert vectors[0] @ vectors[1] > vectors[0] @ vectors[2] + 0.2
    assert embedder.embed([]).shape == (0, 384)


async def test_query_batcher_batches_concurrent_callers_with_unbatched_results(
    counting_embedder: CountingEmbedder,
) -> None:
    batcher = QueryBatcher(counting_embedder, max_batch=32, window_s=0.02)
    try:
        results = await asyncio.gather(*(batcher.embed(q, scope="t") for q in QUERIES))
    finally:
        await batcher.aclose()
    assert sum(counting_embedder.calls) == len(QUERIES)
    assert len(counting_embedder.calls) <= 2, counting_embedder.calls
    for query, vector in zip(QUERIES, results, strict=True):
        alone = counting_embedder.embed([query])[0]
        np.testing.assert_allclose(vector, alone, atol=1e-5)


async def test_callers_of_one_scope_waiting_for_one_text_share_one_embedding(
    counting_embedder: CountingEmbedder,
) -> None:
    """A burst of identical requests embeds its text once; another scope (tenant) gets its
    own, and nothing is kept once handed out."""
    batcher = QueryBatcher(counting_embedder, max_batch=32, window_s=0.02)
    try:
        same = await asyncio.gather(*(batcher.embed(QUERIES[0], scope="acme") for _ in range(10)))
        assert counting_embedder.calls == [1]
        other, later = await asyncio.gather(
            batcher.embed(QUERIES[0], scope="globex"), batcher.embed(QUERIES[0], scope="acme")
        )
    finally:
        await batcher.aclose()
    assert counting_embedder.calls == [1, 2]
    for vector in (*same, other, later):
        np.testing.assert_allclose(vector, same[0], atol=1e-6)


async def test_a_caller_that_leaves_does_not_take_the_shared_embedding_from_the_others(
    counting_embedder: CountingEmbedder,
) -> None:
    """... but when its last caller leaves, a text is taken out of its batch."""
    batcher = QueryBatcher(counting_embedder, max_batch=32, window_s=0.05)
    try:
        leaving = asyncio.create_task(batcher.embed(QUERIES[1], scope="acme"))
        staying = asyncio.create_task(batcher.embed(QUERIES[1], scope="acme"))
        alone = asyncio.create_task(batcher.embed(QUERIES[2], scope="acme"))
        await asyncio.sleep(0.01)  # all wait on their embeddings, their batch still open
        leaving.cancel()
        alone.cancel()
        vector = await staying
    finally:
        await batcher.aclose()
    assert leaving.cancelled() and alone.cancelled()
    assert counting_embedder.texts == [[QUERIES[1]]]
    np.testing.assert_allclose(vector, counting_embedder.embed([QUERIES[1]])[0], atol=1e-5)


async def test_a_text_asked_for_again_as_its_last_caller_leaves_is_embedded_anew(
    counting_embedder: CountingEmbedder,
) -> None:
    """The left embedding is cancelled; the next caller, in the same turn of the loop, does
    not get that cancellation but an embedding of its own."""
    batcher = QueryBatcher(counting_embedder, max_batch=32, window_s=0.05)
    try:
        leaving = asyncio.create_task(batcher.embed(QUERIES[3], scope="acme"))
        await asyncio.sleep(0.01)
        leaving.cancel()
        # Runs right after the leaving caller's last step, before the callbacks it scheduled.
        coming = asyncio.create_task(batcher.embed(QUERIES[3], scope="acme"))
        with pytest.raises(asyncio.CancelledError):
            await leaving
        vector = await coming
    finally:
        await batcher.aclose()
    assert counting_embedder.texts == [[QUERIES[3]]]
    np.testing.assert_allclose(vector, counting_embedder.embed([QUERIES[3]])[0], atol=1e-5)


async def test_query_batcher_respects_max_batch(counting_embedder: CountingEmbedder) -> None:
    batcher = QueryBatcher(counting_embedder, max_batch=5, window_s=0.05)
    try:
        await asyncio.gather(*(batcher.embed(q, scope="t") for q in QUERIES[:12]))
    finally:
        await batcher.aclose()
    assert max(counting_embedder.calls) <= 5 and sum(counting_embedder.calls) == 12


async def test_query_batcher_keeps_the_event_loop_free(counting_embedder: CountingEmbedder) -> None:
    batcher = QueryBatcher(counting_embedder, window_s=0.001)
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0.001)
            ticks += 1

    task = asyncio.create_task(ticker())
    try:
        await asyncio.gather(*(batcher.embed(q * 20, scope="t") for q in QUERIES))
    finally:
        task.cancel()
        await batcher.aclose()
    assert ticks > 3


async def test_closed_batcher_refuses_new_queries(counting_embedder: CountingEmbedder) -> None:
    batcher = QueryBatcher(counting_embedder)
    await batcher.embed("hello", scope="t")
    await batcher.aclose()
    with pytest.raises(RuntimeError, match="closed"):
        await batcher.embed("again", scope="t")


async def test_embed_errors_reach_every_caller_of_the_batch(embedder: Embedder) -> None:
    class Broken(Embedder):
        def embed(self, texts: list[str]) -> np.ndarray:
            raise OSError("model gone")

    batcher = QueryBatcher(Broken(), window_s=0.01)
    try:
        results = await asyncio.gather(
            *(batcher.embed(q, scope="t") for q in QUERIES[:3]), return_exceptions=True
        )
    finally:
        await batcher.aclose()
    assert all(isinstance(r, OSError) for r in results)
