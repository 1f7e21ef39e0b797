"""The end-to-end benchmarks' shared parts (issue 18): a streamed chat request over a raw
keep-alive socket (time to first token, output tokens), the SciFact tenant built from cached
embeddings, a request's stage times read from its spans, percentiles and the JSON results.

The client is ``bench.loadclient``'s: hand-built HTTP/1.1 bytes, chunked SSE read by a minimal
parser, the first chunk carrying answer text noted as the time to first token. It costs the
same on both sides of a comparison (the service and bare vLLM speak the same SSE), and far less
than an httpx client would.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import statistics
import tempfile
import time
from collections.abc import Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from bench.loadclient import CHAT_PATH, NETWORK_ERRORS, ProtocolError, read_answer
from bench.rawclient import encode_request
from pipeline.answer.events import ContentDelta, events_from_chunk
from pipeline.guards.output import StreamingRedactor
from tests.support.process import ServiceProcess

RESULTS = Path(__file__).resolve().parent / "results"
COMPLETION_TOKENS = re.compile(rb'"completion_tokens":\s*(\d+)')
NO_CACHE = {"Cache-Control": "no-cache, no-store"}


@dataclass
class Streamed:
    """One streamed answer as the client saw it."""

    status: int
    ttft_s: float | None  # first chunk with answer text
    total_s: float
    completion_tokens: int
    trace_id: str = ""  # the service's x-trace-id
    cache: str = ""  # the service's x-cache
    body: bytes = b""
    second_s: float | None = None  # the second piece of answer text
    # Each chunk of the body with when it came (seconds after the request was sent).
    pieces: list[tuple[float, bytes]] = field(default_factory=list, repr=False)

    @property
    def ok(self) -> bool:
        """A 200 with a whole answer: a stream ending in ``[DONE]``, or a JSON completion."""
        whole = self.body.endswith(b"data: [DONE]\n\n") or self.body.startswith(b"{")
        return self.status == 200 and whole and b'data: {"error"' not in self.body


def first_released(
    pieces: Sequence[tuple[float, bytes]], redactor: StreamingRedactor
) -> float | None:
    """When a streamed answer's text first gets through ``redactor`` (``feed`` returns what it
    lets out), fed the answer's pieces of text as they came: for bare vLLM's stream under the
    service's output redaction, the earliest the service could show its first text. A text
    held to the end (a one-word answer) gets through with the stream's last piece; None when
    the answer has no text. Each ``data:`` line is one chunk (``events_from_chunk`` reads it,
    as the service's model client does); a line cut between pieces is read when it ends."""
    pending, at = b"", 0.0
    for at, piece in pieces:
        *lines, pending = (pending + piece).split(b"\n")
        for line in lines:
            if not line.startswith(b"data: {"):
                continue
            for event in events_from_chunk(orjson.loads(line[6:])):
                if isinstance(event, ContentDelta) and event.text and redactor.feed(event.text):
                    return at
    return at if redactor.end() else None


class StreamConnection:
    """One keep-alive connection that sends chat requests to ``base_url`` and reads each
    streamed answer whole; reconnects when the server closed it."""

    def __init__(
        self, base_url: str, headers: dict[str, str] | None = None, *, timed: bool = False
    ) -> None:
        self.url = base_url.rstrip("/") + CHAT_PATH
        self.headers = dict(headers or {})
        self.timed = timed  # keep each chunk with its time (``Streamed.pieces``)
        self._io: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None

    async def send(self, body: dict[str, Any], headers: dict[str, str] | None = None) -> Streamed:
        host, port, message = encode_request(
            self.url, orjson.dumps(body), {**self.headers, **(headers or {})}
        )
        for attempt in (0, 1):
            if self._io is None:
                self._io = await asyncio.open_connection(host, port)
            reader, writer = self._io
            started = time.perf_counter()
            try:
                writer.write(message)
                answer = await read_answer(reader, started, timed=self.timed)
            except (*NETWORK_ERRORS, ProtocolError):
                self.close()
                if attempt:
                    raise
                continue  # a kept-alive connection the server had closed: once more
            total = time.perf_counter() - started
            if answer.headers.get(b"connection", b"").lower() == b"close":
                self.close()
            tokens = COMPLETION_TOKENS.findall(answer.body)
            return Streamed(
                status=answer.status,
                ttft_s=answer.ttft,
                total_s=total,
                completion_tokens=int(tokens[-1]) if tokens else 0,
                trace_id=answer.headers.get(b"x-trace-id", b"").decode(),
                cache=answer.headers.get(b"x-cache", b"").decode(),
                body=answer.body,
                second_s=answer.second,
                pieces=answer.pieces,
            )
        raise AssertionError("unreachable")

    def close(self) -> None:
        if self._io is not None:
            self._io[1].close()
            self._io = None


def chat_request(messages: list[dict[str, Any]], max_tokens: int, **extra: Any) -> dict[str, Any]:
    """A streamed, greedy chat request that reports its usage."""
    return {
        "model": "smollm2",
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        **extra,
    }


# -- statistics --------------------------------------------------------------------------------


def percentile(values: Sequence[float], share: float) -> float:
    """The ``share`` quantile by linear interpolation between closest ranks (numpy's default);
    NaN when there are no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    position = (len(ordered) - 1) * share
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else math.nan


def ratio(numerator: float, denominator: float) -> float:
    return numerator / denominator if denominator else math.nan


# -- spans -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SpanView:
    """What the breakdown needs of a finished span (from the SDK's ReadableSpan or OTLP)."""

    name: str
    span_id: int
    parent_id: int | None
    start_ns: int
    end_ns: int
    attributes: dict[str, Any] = field(default_factory=dict)

    @property
    def ms(self) -> float:
        return (self.end_ns - self.start_ns) / 1e6


def span_views(spans: Sequence[Any], trace_id: str) -> list[SpanView]:
    """The SDK spans (``InMemorySpanExporter.get_finished_spans()``) of one trace."""
    wanted = int(trace_id, 16)
    views = []
    for span in spans:
        context = span.get_span_context()
        if context.trace_id != wanted:
            continue
        parent = span.parent.span_id if span.parent is not None else None
        views.append(
            SpanView(
                span.name,
                context.span_id,
                parent,
                span.start_time,
                span.end_time,
                dict(span.attributes or {}),
            )
        )
    return views


async def finished_spans(exporter: Any, trace_id: str, timeout_s: float = 5.0) -> list[SpanView]:
    """The trace's spans once its root has ended (the root and the ``chat`` span end as the
    response's last bytes go out, possibly after the client has read them)."""
    deadline = time.monotonic() + timeout_s
    while True:
        views = span_views(exporter.get_finished_spans(), trace_id)
        if any(v.parent_id is None for v in views) or time.monotonic() > deadline:
            return views
        await asyncio.sleep(0.005)


TTFT_ATTRIBUTE = "gen_ai.response.time_to_first_chunk"
INPUT_MESSAGES = "gen_ai.input.messages"
RETRIEVAL_TIMING = "rag.retrieval.ms."


@dataclass(frozen=True)
class Breakdown:
    """A miss's time, stage by stage, from its spans (ms from the root span's start).

    ``segments``: consecutive parts that add up to ``upstream_at_ms`` + ``vllm_first_chunk_ms``
    (+ what the client saw after, when ``client_ttft_s`` was given): the HTTP layer before the
    first stage, each top-level stage or group up to ``generate``, then ``generate``'s own part
    before the upstream call, vLLM's time to its first chunk, and the rest to the client.
    ``stages``: every stage span's duration, the members of a concurrent group included.
    """

    upstream_at_ms: float  # auth (the root span's start) to the upstream call (chat span start)
    vllm_first_chunk_ms: float
    segments: dict[str, float]
    stages: dict[str, float]
    prompt: list[dict[str, Any]] | None  # the messages sent upstream (content capture on)
    retrieval: dict[str, float] = field(default_factory=dict)  # embed, filter, bm25, vector...


def breakdown(views: Sequence[SpanView], client_ttft_s: float | None = None) -> Breakdown:
    roots = [v for v in views if v.parent_id is None]
    chats = sorted((v for v in views if v.name.startswith("chat ")), key=lambda v: v.start_ns)
    if len(roots) != 1 or not chats:
        raise ValueError(f"not a miss's trace: {sorted(v.name for v in views)}")
    root, chat = roots[0], chats[0]
    children = sorted(
        (
            v
            for v in views
            if v.parent_id == root.span_id and v.name.startswith(("stage ", "group "))
        ),
        key=lambda v: v.start_ns,
    )
    at = lambda ns: (ns - root.start_ns) / 1e6  # noqa: E731
    segments: dict[str, float] = {}
    cursor = root.start_ns
    if children:
        segments["http (before the first stage)"] = at(children[0].start_ns)
        cursor = children[0].start_ns
    for child in children:
        label = child.name.split(" ", 1)[1]
        if label == "generate":
            segments["generate (prompt, slot)"] = (chat.start_ns - cursor) / 1e6
            cursor = chat.start_ns
            break
        segments[label] = (child.end_ns - cursor) / 1e6  # gaps go to the stage after them
        cursor = child.end_ns
    first_chunk_ms = float(chat.attributes.get(TTFT_ATTRIBUTE, math.nan)) * 1000.0
    segments["vLLM to first chunk"] = first_chunk_ms
    if client_ttft_s is not None:
        seen = at(chat.start_ns) + first_chunk_ms
        segments["first chunk to client"] = client_ttft_s * 1000.0 - seen
    stages = {v.name.split(" ", 1)[1]: v.ms for v in views if v.name.startswith("stage ")}
    captured = chat.attributes.get(INPUT_MESSAGES)
    retrieval = {
        key.removeprefix(RETRIEVAL_TIMING): float(value)
        for v in views
        if v.name.startswith("retrieval ")
        for key, value in v.attributes.items()
        if key.startswith(RETRIEVAL_TIMING)
    }
    return Breakdown(
        upstream_at_ms=at(chat.start_ns),
        vllm_first_chunk_ms=first_chunk_ms,
        segments=segments,
        stages=stages,
        prompt=json.loads(captured) if isinstance(captured, str) else None,
        retrieval=retrieval,
    )


def median_segments(breakdowns: Sequence[Breakdown]) -> dict[str, float]:
    """Per segment, the median over requests (a segment missing from one counts as 0)."""
    names: list[str] = []
    for b in breakdowns:
        names.extend(n for n in b.segments if n not in names)
    return {n: median([b.segments.get(n, 0.0) for b in breakdowns]) for n in names}


def median_stages(breakdowns: Sequence[Breakdown]) -> dict[str, float]:
    names = sorted({n for b in breakdowns for n in b.stages})
    return {n: median([b.stages[n] for b in breakdowns if n in b.stages]) for n in names}


def median_retrieval(breakdowns: Sequence[Breakdown]) -> dict[str, float]:
    names = sorted({n for b in breakdowns for n in b.retrieval})
    return {n: median([b.retrieval[n] for b in breakdowns if n in b.retrieval]) for n in names}


# -- results -----------------------------------------------------------------------------------


def write_result(name: str, result: dict[str, Any], directory: Path = RESULTS) -> Path:
    """``result`` as ``directory/name.json`` (NaN written as null)."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{name}.json"
    path.write_text(json.dumps(_finite(result), indent=2) + "\n")
    return path


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def read_result(name: str, directory: Path = RESULTS) -> dict[str, Any] | None:
    path = directory / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def vllm_url(given: str | None) -> str:
    """``--llm-url``, else ``RAG_TEST_VLLM_URL``, else the local vLLM on 8001."""
    import os

    return (given or os.environ.get("RAG_TEST_VLLM_URL") or "http://127.0.0.1:8001").rstrip("/")


# -- the SciFact tenant ------------------------------------------------------------------------


def build_tenant(index_dir: Path, tenant: str, documents: Sequence[Any]) -> int:
    """Publish ``documents`` as ``tenant``'s index under ``index_dir``, one chunk per abstract
    as the retrieval benchmarks index SciFact, embedded through the on-disk embedding cache
    (``bench.retrieval_data``: the whole corpus is embedded once, about four minutes). The
    service started on ``index_dir`` serves it as it would an index it had ingested; its query
    embeddings are its own (the cache is never on the request path). Returns the chunk count."""
    from bench.retrieval_data import CachedEmbedder
    from retrieval.store import IndexStore

    store = IndexStore(index_dir, CachedEmbedder(), chunk_words=100_000, overlap_words=0)
    return store.upsert(tenant, list(documents)).total_chunks


def scifact_tenant(
    asked: list[tuple[str, list[str]]], extra_documents: int | None, tenant: str, name: str
) -> tuple[Path, int, int]:
    """A fresh index directory holding ``tenant``: the SciFact abstracts relevant to ``asked``
    and ``extra_documents`` others (None: all of them), as ``build_tenant`` publishes them.
    Returns the directory, the document count and the chunk count."""
    from bench.ttft_bench import corpus_for

    documents = corpus_for(asked, extra_documents if extra_documents is not None else 10**6)
    index_dir = Path(tempfile.mkdtemp(prefix=f"rag-bench-{name}-"))
    return index_dir, len(documents), build_tenant(index_dir, tenant, documents)


def serve_checkouts(
    stack: ExitStack,
    checkouts: Mapping[str, str | None],
    redis_url: str,
    llm_url: str,
    **env: str,
) -> dict[str, ServiceProcess]:
    """One ``rag serve`` process per checkout, by label (None: this one; a path: another, a
    ``git worktree``, first on its ``PYTHONPATH``), each in a work directory of its own and
    stopped with ``stack``: code before and after a change, served side by side."""
    return {
        label: stack.enter_context(
            ServiceProcess(
                redis_url,
                llm_url,
                Path(tempfile.mkdtemp(prefix="rag-bench-")),
                **env,
                **({"PYTHONPATH": path} if path else {}),
            )
        )
        for label, path in checkouts.items()
    }


def serve_sides(
    stack: ExitStack,
    before: str | None,
    redis_url: str,
    llm_url: str,
    tenants: int,
    tenant_prefix: str,
    **env: str,
) -> tuple[dict[str, ServiceProcess], dict[str, list[str]]]:
    """This checkout served as "service" and, with ``before`` (a checkout's directory), that
    code as "before" (``serve_checkouts``); with ``tenants`` keys for each side, one tenant each
    (``{tenant_prefix}{n}``): the services by side, and their keys by side."""
    checkouts: dict[str, str | None] = {"service": None}
    if before:
        checkouts["before"] = str(Path(before).resolve())
    services = serve_checkouts(stack, checkouts, redis_url, llm_url, **env)
    keys = {
        side: [service.key(f"{tenant_prefix}{n}", "bench", "chat") for n in range(tenants)]
        for side, service in services.items()
    }
    return services, keys
