"""Conversion off the event loop, in worker processes that are killed at a file's time limit.

A converter parses untrusted bytes with third-party libraries; a thread running one cannot be
stopped, so a file that makes a parser spin would hold its thread for ever. Here files are
converted in `workers` long-lived worker processes (forked from a forkserver that has imported
the converters), one file at a time each; a worker past a file's `timeout_seconds` is killed and
replaced by a fresh one on the next file, as is one that failed or has converted
`files_per_worker` files (a parser that leaks cannot grow a worker for ever). A process per file
was measured too (bench/convert_bench.py): it pays the start of a process, and the import of
the program's main script that multiprocessing does in each child, on every file.

A worker refuses a text longer than `max_chars` (``too_large``) before sending it back: a small
DOCX can inflate to a hundred megabytes of text, which would otherwise cross the pipe and sit
in the API process only to be refused there.

One upload must not hold every worker for minutes, nor a queue of uploads pile up in memory:
`admit` lets at most `max_uploads` uploads in at once (each holds its files' bytes while it
waits), refusing the next with `PoolBusy`; `convert` takes a `deadline` (the upload's time
budget) past which a file still waiting, or still converting (its worker is killed), is refused
with ``upload_timeout``; and `per_tenant` bounds the files of one tenant converting at once,
so the others' files go ahead of its queue.
"""

from __future__ import annotations

import asyncio
import functools
import multiprocessing
import queue
import resource
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, contextmanager
from multiprocessing.connection import Connection
from multiprocessing.context import ForkServerContext
from typing import Any, TypeVar

from retrieval.files.convert import Converted, convert
from retrieval.files.kinds import FileRejected, ZipLimits

T = TypeVar("T")
_SMOOTHING = 0.2  # weight of the newest upload's duration in the running mean
# Imported once by the forkserver, so each worker starts with them loaded.
_PRELOAD = [
    "retrieval.files.convert",
    "markitdown.converters",
    "markdown_it",
    "pypdf",
    "trafilatura",
]


class PoolBusy(Exception):
    """`max_uploads` uploads are in already; `retry_after_s`: the mean time one takes."""

    def __init__(self, retry_after_s: float) -> None:
        super().__init__(f"{retry_after_s:.1f} s")
        self.retry_after_s = retry_after_s


def _outcome(
    filename: str, data: bytes, limits: ZipLimits, max_chars: int
) -> Converted | tuple[str, str, str]:
    try:
        converted = convert(filename, data, limits)
        if max_chars and len(converted.text) > max_chars:
            return (
                "rejected",
                "too_large",
                f"its text has {len(converted.text)} characters; the limit is {max_chars}",
            )
        return converted
    except FileRejected as exc:
        return ("rejected", exc.reason, str(exc))
    except MemoryError:
        return ("failed", "conversion_failed", "conversion ran out of memory")
    except Exception as exc:  # a library's own failure on a bad file
        return ("failed", "conversion_failed", f"{type(exc).__name__}: {exc}"[:500])


def _serve(conn: Connection, limits: ZipLimits, memory_bytes: int, max_chars: int) -> None:
    """A worker: convert each (filename, bytes) received, until the pipe closes."""
    if memory_bytes:
        resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    while True:
        try:
            filename, data = conn.recv()
        except EOFError:
            return
        conn.send(_outcome(filename, data, limits, max_chars))


class _Worker:
    def __init__(
        self, context: ForkServerContext, limits: ZipLimits, memory_bytes: int, max_chars: int
    ) -> None:
        self.conn, theirs = context.Pipe()
        self.process = context.Process(
            target=_serve, args=(theirs, limits, memory_bytes, max_chars), daemon=True
        )
        self.process.start()
        theirs.close()
        self.files = 0

    def stop(self) -> None:
        self.conn.close()
        if self.process.is_alive():
            self.process.kill()
        self.process.join()


class ConverterPool:
    """Converts files in `workers` worker processes, each file within `timeout_seconds` and
    (where the platform allows) `memory_bytes` of address space per worker, its text within
    `max_chars` (0: any); `max_uploads` uploads in at once, `per_tenant` files of one tenant
    converting at once (None: any)."""

    def __init__(
        self,
        *,
        workers: int = 2,
        timeout_seconds: float = 30.0,
        zip_limits: ZipLimits | None = None,
        memory_bytes: int = 0,
        files_per_worker: int = 200,
        max_chars: int = 0,
        max_uploads: int = 8,
        per_tenant: int | None = None,
    ) -> None:
        self.workers = workers
        self.timeout_seconds = timeout_seconds
        self.zip_limits = zip_limits or ZipLimits()
        self.memory_bytes = memory_bytes
        self.files_per_worker = files_per_worker
        self.max_chars = max_chars
        self.max_uploads = max_uploads
        self.per_tenant = per_tenant
        self.uploads = 0
        self._mean_upload_s = 1.0
        # Per tenant: a bound on its files converting, and how many of its files hold or
        # wait for it (the entry goes when none does).
        self._tenants: dict[str, tuple[asyncio.Semaphore, int]] = {}
        self._context = multiprocessing.get_context("forkserver")
        self._context.set_forkserver_preload(_PRELOAD)
        # Idle workers; None stands for one not started yet (or killed): started when needed.
        self._idle: queue.SimpleQueue[_Worker | None] = queue.SimpleQueue()
        for _ in range(workers):
            self._idle.put(None)
        self._threads = ThreadPoolExecutor(workers, thread_name_prefix="convert")
        self._closed = False

    def admit(self) -> AbstractContextManager[None]:
        """One of the `max_uploads` places of an upload (reading, converting, ingesting its
        files), held until the context it returns exits; `PoolBusy` at once when none is free.
        Event-loop code only."""
        if self.uploads >= self.max_uploads:
            raise PoolBusy(self._mean_upload_s)
        self.uploads += 1
        return self._admitted(time.monotonic())

    @contextmanager
    def _admitted(self, started: float) -> Iterator[None]:
        try:
            yield
        finally:
            self.uploads -= 1
            self._mean_upload_s += _SMOOTHING * (time.monotonic() - started - self._mean_upload_s)

    def convert_now(self, filename: str, data: bytes, deadline: float | None = None) -> Converted:
        """Convert in a worker process and wait (blocking: the CLI's way, and the threads').
        Waits for a free worker when all `workers` are busy; past `deadline` (monotonic time),
        while waiting or converting, the file is refused with ``upload_timeout``."""
        if deadline is not None and _left(deadline) <= 0:
            raise _out_of_time()
        try:
            worker = self._idle.get(timeout=None if deadline is None else _left(deadline))
        except queue.Empty:
            raise _out_of_time() from None
        try:
            if worker is None:
                worker = _Worker(self._context, self.zip_limits, self.memory_bytes, self.max_chars)
            outcome, keep = self._run(worker, filename, data, deadline)
            worker.files += 1
            if not keep or worker.files >= self.files_per_worker:
                worker.stop()
                worker = None
        except BaseException:
            if worker is not None:
                worker.stop()
            worker = None
            raise
        finally:
            if self._closed and worker is not None:
                worker.stop()
                worker = None
            self._idle.put(worker)
        if isinstance(outcome, Converted):
            return outcome
        _, reason, message = outcome
        raise FileRejected(reason, message)  # type: ignore[arg-type]

    def _run(
        self, worker: _Worker, filename: str, data: bytes, deadline: float | None
    ) -> tuple[Converted | tuple[str, str, str], bool]:
        """The worker's outcome for the file, and whether the worker may be used again."""
        wait = self.timeout_seconds
        budget_first = deadline is not None and _left(deadline) < wait
        if deadline is not None:
            wait = min(wait, _left(deadline))
        try:
            worker.conn.send((filename, data))
            if not worker.conn.poll(wait):
                if budget_first:
                    raise _out_of_time()
                raise FileRejected(
                    "timeout", f"conversion took longer than {self.timeout_seconds:g} s"
                )
            outcome = worker.conn.recv()
        except (EOFError, OSError):
            raise FileRejected(
                "conversion_failed", "the converter died on this file (out of memory?)"
            ) from None
        return outcome, isinstance(outcome, Converted) or outcome[0] == "rejected"

    async def convert(
        self, filename: str, data: bytes, *, tenant: str = "", deadline: float | None = None
    ) -> Converted:
        """`convert_now` in one of the pool's threads, so the event loop never waits on it,
        once `tenant` has fewer than `per_tenant` files converting."""
        loop = asyncio.get_running_loop()
        if self.per_tenant is None:
            return await loop.run_in_executor(
                self._threads, self.convert_now, filename, data, deadline
            )
        turn, files = self._tenants.get(tenant) or (asyncio.Semaphore(self.per_tenant), 0)
        self._tenants[tenant] = (turn, files + 1)
        try:
            try:
                async with asyncio.timeout(None if deadline is None else _left(deadline)):
                    await turn.acquire()
            except TimeoutError:
                raise _out_of_time() from None
            try:
                return await loop.run_in_executor(
                    self._threads, self.convert_now, filename, data, deadline
                )
            finally:
                turn.release()
        finally:
            turn, files = self._tenants[tenant]
            if files == 1:
                del self._tenants[tenant]
            else:
                self._tenants[tenant] = (turn, files - 1)

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` in the pool's threads: the other CPU work on converted files (counting a
        large document's passages) stays off the event loop too."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._threads, functools.partial(fn, *args))

    def close(self) -> None:
        """Stop the idle workers (a busy one is stopped when its file is done)."""
        self._closed = True
        self._threads.shutdown(wait=False, cancel_futures=True)
        while True:
            try:
                worker = self._idle.get_nowait()
            except queue.Empty:
                return
            if worker is not None:
                worker.stop()


def _left(deadline: float) -> float:
    return max(0.0, deadline - time.monotonic())


def _out_of_time() -> FileRejected:
    return FileRejected(
        "upload_timeout", "the upload's time budget ran out before this file was converted"
    )
