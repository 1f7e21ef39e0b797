"""The load benchmark's client: many keep-alive connections per process, lighter than the server.

Each connection sends hand-built HTTP/1.1 requests (the bytes of a cache hit are built once) and
reads the answer with a minimal parser: the status line, the headers, then the body by its
Content-Length or, for a stream, by its chunks, noting when the first chunk that carries answer
text arrives (time to first token). One uvloop process drives hundreds of connections; the
benchmark runs several such processes and reports their CPU time beside the server's, so it is
seen that the client costs less than what it measures.

Every answer is judged:
- ``ok``: a 200 with a whole body (a JSON completion, or a stream that ends with ``[DONE]`` and
  carries no ``error`` event);
- ``shed``: a 429 or 503 with ``Retry-After`` and an OpenAI error body, the service refusing load
  by design (rate limits, the upstream bound): expected, counted apart;
- anything else is unexpected: another status, a stream cut or ended by an error event, a reset
  connection, a response this parser cannot read, a request still unanswered when the run ends.

    result = run_load(LoadSpec(base_url, chat_workload(key, hits, mix), connections=32,
                               start_at=time.monotonic() + 1, duration_s=5))
"""

from __future__ import annotations

import asyncio
import random
import re
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import orjson

from bench.rawclient import encode_request

CHAT_PATH = "/v1/chat/completions"
# The first SSE chunk with answer text (the role chunk before it has an empty content).
FIRST_TEXT = re.compile(rb'"delta":\{"content":"[^"]')
DONE = b"data: [DONE]\n\n"
ERROR_EVENT = b'data: {"error"'
NETWORK_ERRORS = (
    ConnectionError,
    asyncio.IncompleteReadError,
    asyncio.LimitOverrunError,
    OSError,
)


class ProtocolError(Exception):
    """An answer this client cannot read as HTTP/1.1."""


@dataclass(frozen=True)
class Mix:
    """What a chat connection sends: a miss with probability ``miss_share`` while fewer than
    ``miss_slots`` misses of this process are in flight (the CPU vLLM serves a few tokens a second
    per stream), else a hit; either streamed with probability ``stream_share``."""

    miss_share: float = 0.05
    stream_share: float = 0.5
    miss_slots: int = 4
    miss_max_tokens: int = 8

    def describe(self) -> str:
        return (
            f"misses {self.miss_share:.0%} of draws (at most {self.miss_slots} in flight per "
            f"client process, max_tokens {self.miss_max_tokens}), streamed {self.stream_share:.0%}"
        )


@dataclass(frozen=True)
class Workload:
    """What the connections send. ``bodies``: the bodies sent in turn, each as kind ``kind``
    (a path that answers JSON). ``hits``: the cached questions of a chat workload (``mix`` then
    says how hits, misses, streams and plain answers are drawn)."""

    path: str
    key: str
    kind: str = "chat"
    bodies: tuple[bytes, ...] = ()
    hits: tuple[str, ...] = ()
    mix: Mix = field(default_factory=Mix)


def chat_body(question: str, *, stream: bool, max_tokens: int = 8) -> dict[str, Any]:
    return {
        "model": "smollm2",
        "messages": [{"role": "user", "content": question}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": stream,
    }


def chat_workload(key: str, hits: list[str], mix: Mix) -> Workload:
    return Workload(CHAT_PATH, key, hits=tuple(hits), mix=mix)


@dataclass(frozen=True)
class LoadSpec:
    """One client process's share: ``connections`` connections to ``base_url`` sending
    ``workload`` from ``start_at`` (``time.monotonic()``, shared by the processes of a machine)
    for ``duration_s``; requests still running then get ``drain_s`` more to be answered."""

    base_url: str
    workload: Workload
    connections: int
    start_at: float
    duration_s: float
    drain_s: float = 60.0
    seed: int = 0


@dataclass
class Tally:
    """What one kind of request saw."""

    latencies: list[float] = field(default_factory=list)  # ok answers, seconds
    ttfts: list[float] = field(default_factory=list)  # ok streams, seconds
    shed: Counter[int] = field(default_factory=Counter)  # status -> count
    unexpected: Counter[str] = field(default_factory=Counter)  # what went wrong -> count
    cache: Counter[str] = field(default_factory=Counter)  # x-cache of ok answers
    examples: list[str] = field(default_factory=list)  # the first few unexpected answers

    def note(self, example: str) -> None:
        if len(self.examples) < 5:
            self.examples.append(example[:300])

    def merge(self, other: Tally) -> None:
        self.latencies += other.latencies
        self.ttfts += other.ttfts
        self.shed.update(other.shed)
        self.unexpected.update(other.unexpected)
        self.cache.update(other.cache)
        self.examples += other.examples[: max(0, 5 - len(self.examples))]

    @property
    def answered(self) -> int:
        return len(self.latencies) + sum(self.shed.values()) + sum(self.unexpected.values())


@dataclass
class LoadResult:
    """Per kind of request, what was seen; per connection, whether it was answered."""

    kinds: dict[str, Tally] = field(default_factory=dict)
    connections: int = 0
    connections_answered: int = 0  # connections that got at least one whole answer
    sent: int = 0
    reconnects: int = 0
    wall_s: float = 0.0
    client_cpu_s: float = 0.0

    def tally(self, kind: str) -> Tally:
        return self.kinds.setdefault(kind, Tally())

    def merge(self, other: LoadResult) -> None:
        for kind, tally in other.kinds.items():
            self.tally(kind).merge(tally)
        self.connections += other.connections
        self.connections_answered += other.connections_answered
        self.sent += other.sent
        self.reconnects += other.reconnects
        self.wall_s = max(self.wall_s, other.wall_s)
        self.client_cpu_s += other.client_cpu_s

    @property
    def unexpected(self) -> int:
        return sum(sum(t.unexpected.values()) for t in self.kinds.values())

    @property
    def shed(self) -> int:
        return sum(sum(t.shed.values()) for t in self.kinds.values())

    @property
    def answered(self) -> int:
        return sum(t.answered for t in self.kinds.values())


@dataclass
class Answer:
    status: int
    headers: dict[bytes, bytes]
    body: bytes
    ttft: float | None
    # When the second piece of answer text came: what a client sees first through a filter
    # that needs the next token to decide the first (the service's exact output redaction).
    second: float | None = None
    # With ``timed``: each chunk of the body with when it came (seconds after ``started``).
    pieces: list[tuple[float, bytes]] = field(default_factory=list)


async def read_answer(
    reader: asyncio.StreamReader, started: float, *, timed: bool = False
) -> Answer:
    """One HTTP/1.1 response, its body read by Content-Length or by chunks; ``ttft`` is when
    the first chunk with answer text arrived (seconds after ``started``), ``second`` when the
    second piece of answer text did (a chunk may hold several SSE events); ``timed`` keeps
    every chunk with its time (``Answer.pieces``), to be read after the measurement."""
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head[:-4].split(b"\r\n")
    if not lines[0].startswith(b"HTTP/1.1 ") or len(lines[0]) < 12:
        raise ProtocolError(f"not an HTTP/1.1 status line: {lines[0][:80]!r}")
    status = int(lines[0][9:12])
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        headers[name.strip().lower()] = value.strip()
    if b"content-length" in headers:
        body = await reader.readexactly(int(headers[b"content-length"]))
        return Answer(status, headers, body, None)
    if headers.get(b"transfer-encoding", b"").lower() != b"chunked":
        raise ProtocolError("neither Content-Length nor chunked")
    parts, ttft, second, texts = [], None, None, 0
    pieces: list[tuple[float, bytes]] = []
    while True:
        size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
        if size == 0:
            if await reader.readuntil(b"\r\n") != b"\r\n":
                raise ProtocolError("trailers after the last chunk")
            break
        chunk = await reader.readexactly(size + 2)
        if chunk[-2:] != b"\r\n":
            raise ProtocolError("a chunk longer than its size")
        now = time.perf_counter() - started if timed or second is None else 0.0
        if second is None and (found := len(FIRST_TEXT.findall(chunk))):
            ttft = now if ttft is None else ttft
            texts += found
            second = now if texts >= 2 else None
        parts.append(chunk[:-2])
        if timed:
            pieces.append((now, parts[-1]))
    return Answer(status, headers, b"".join(parts), ttft, second, pieces)


def judge(stream: bool, answer: Answer) -> str:
    """``ok``, ``shed`` or what was wrong (see the module's docstring)."""
    if answer.status == 200:
        if not stream:
            return "ok" if answer.body.startswith(b"{") else "200 without a JSON body"
        if ERROR_EVENT in answer.body:
            return "stream with an error event"
        return "ok" if answer.body.endswith(DONE) else "stream without [DONE]"
    shed = answer.status in (429, 503) and b"retry-after" in answer.headers
    if shed and answer.body.startswith(b'{"error"'):
        return "shed"
    return f"status {answer.status}"


class Requests:
    """Draws each connection's next request: its kind, whether it streams, its bytes."""

    def __init__(self, base_url: str, workload: Workload, seed: int) -> None:
        self.workload = workload
        self.base_url = base_url
        self.headers = {"Authorization": f"Bearer {workload.key}"}
        self.url = base_url + workload.path
        self.rng = random.Random(seed)
        self.misses_in_flight = 0
        self.misses = 0
        self.count = 0
        self.seed = seed
        self.fixed = [encode_request(self.url, b, self.headers)[2] for b in workload.bodies]
        self.hits = {
            stream: [self._chat(q, stream) for q in workload.hits] for stream in (False, True)
        }

    def address(self) -> tuple[str, int]:
        host, port, _ = encode_request(self.url, b"", {})
        return host, port

    def _chat(self, question: str, stream: bool, max_tokens: int = 8) -> bytes:
        body = orjson.dumps(chat_body(question, stream=stream, max_tokens=max_tokens))
        return encode_request(self.url, body, self.headers)[2]

    def draw(self) -> tuple[str, bool, bytes]:
        self.count += 1
        if self.fixed:
            return self.workload.kind, False, self.fixed[self.count % len(self.fixed)]
        mix = self.workload.mix
        stream = self.rng.random() < mix.stream_share
        if self.rng.random() < mix.miss_share and self.misses_in_flight < mix.miss_slots:
            # Few misses fit in a run: their shapes alternate, so both are always measured.
            self.misses += 1
            stream = self.misses % 2 == 0
            shape = "stream" if stream else "plain"
            self.misses_in_flight += 1
            question = f"In one sentence, what is a cache miss? (load {self.seed}-{self.count})"
            return f"miss/{shape}", stream, self._chat(question, stream, mix.miss_max_tokens)
        hits = self.hits[stream]
        return f"hit/{'stream' if stream else 'plain'}", stream, hits[self.count % len(hits)]

    def done(self, kind: str) -> None:
        if kind.startswith("miss/"):
            self.misses_in_flight -= 1


async def _connection(
    requests: Requests, result: LoadResult, until: float, drain_by: float
) -> None:
    """One connection's closed loop: send, read the whole answer, judge it, again, until
    ``until``; a connection the server closed or broke is opened again."""
    host, port = requests.address()
    loop = asyncio.get_running_loop()
    answered = False
    writer: asyncio.StreamWriter | None = None
    try:
        while loop.time() < until:
            if writer is None:
                reader, writer = await asyncio.open_connection(host, port)
            kind, stream, message = requests.draw()
            tally = result.tally(kind)
            result.sent += 1
            started = time.perf_counter()
            try:
                writer.write(message)
                answer = await asyncio.wait_for(
                    read_answer(reader, started), max(1.0, drain_by - loop.time())
                )
            except TimeoutError:
                tally.unexpected["unanswered at the end of the run"] += 1
                break
            except (*NETWORK_ERRORS, ProtocolError, ValueError) as exc:
                tally.unexpected[type(exc).__name__] += 1
                tally.note(f"{kind}: {type(exc).__name__}: {exc}")
                writer.close()
                writer = None
                result.reconnects += 1
                continue
            finally:
                requests.done(kind)
            verdict = judge(stream, answer)
            if verdict == "ok":
                answered = True
                tally.latencies.append(time.perf_counter() - started)
                if answer.ttft is not None:
                    tally.ttfts.append(answer.ttft)
                tally.cache[answer.headers.get(b"x-cache", b"-").decode()] += 1
            elif verdict == "shed":
                answered = True
                tally.shed[answer.status] += 1
            else:
                tally.unexpected[verdict] += 1
                tally.note(f"{kind}: {verdict}: {answer.body[:200]!r}")
            if answer.headers.get(b"connection", b"").lower() == b"close":
                writer.close()
                writer = None
                result.reconnects += 1
    finally:
        if writer is not None:
            writer.close()
        result.connections_answered += answered


async def drive(spec: LoadSpec) -> LoadResult:
    """Run ``spec``'s connections in this process's event loop."""
    result = LoadResult(connections=spec.connections)
    requests = Requests(spec.base_url, spec.workload, spec.seed)
    loop = asyncio.get_running_loop()
    # Both clocks are CLOCK_MONOTONIC on Linux: loop.time() is time.monotonic().
    await asyncio.sleep(max(0.0, spec.start_at - time.monotonic()))
    started = loop.time()
    until = started + spec.duration_s
    cpu = time.process_time()
    await asyncio.gather(
        *(
            _connection(requests, result, until, until + spec.drain_s)
            for _ in range(spec.connections)
        )
    )
    result.wall_s = loop.time() - started
    result.client_cpu_s = time.process_time() - cpu
    return result


def run_load(spec: LoadSpec) -> LoadResult:
    """``drive(spec)`` on a uvloop event loop (the entry point of a client process)."""
    import uvloop

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(drive(spec))


def ready(seconds: float) -> int:
    """A client process's warm-up: its modules imported, held ``seconds`` (so that every
    process of a pool gets one); its pid."""
    import os

    import uvloop  # noqa: F401

    time.sleep(seconds)
    return os.getpid()


def percentile(values: list[float], share: float) -> float:
    """The ``share`` quantile (nearest rank) of ``values``; NaN when there are none."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, int(len(ordered) * share + 0.5) - 1))]
