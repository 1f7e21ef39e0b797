"""The seed techniques stacked: each one toggled in the same run, time to first token (latency
for cache hits) with it on and off, and the part of a miss before the upstream call.

    .venv/bin/python -m bench.stack_bench [--pairs 8] [--concurrency 8] [--quick]
                                          [--llm-url http://127.0.0.1:8001]

Every variant is the service in this process (uvicorn in a thread) over one private
redis-server, the real vLLM and one SciFact tenant (the whole corpus; ``--quick``: the
questions' abstracts and 300 others) that all of them load from the same index directory. The
embedding model is loaded once and shared by the variants, except where a toggle changes it.
Each toggle measures its own fresh SciFact test questions, the two sides in alternating order.

``TOGGLES`` below is the list: where a technique has a setting, its ``setting`` names it
(``group.field`` of ``app.settings.Settings``) with the ``on`` and ``off`` values, and the run
builds a variant with each value that is not the default. A setting that ``Settings`` does not
have (yet) is reported as not measured, never imitated. Techniques switched per request
(compression, the relevance gate, the response cache) use the request's own switch, and the
parallel group (no setting) is the same stages run one after another by the real runner.

Workloads: ``miss`` (one streamed request at a time, nothing cached), ``hit`` (``--hits``
plain requests for one cached answer on a kept-alive connection), ``concurrent``
(``--concurrency`` distinct misses at once), ``identical`` (``--concurrency`` identical
requests at once, a new question each round, the cache as in production), ``repeat`` (a cached
question asked again, against the same with ``Cache-Control: no-cache``).

Writes bench/results/stack.json (``bench.plots`` draws TTFT with each technique on and off).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from app.main import create_app
from app.path import Paths
from app.settings import Settings
from bench.e2e import (
    NO_CACHE,
    StreamConnection,
    Streamed,
    breakdown,
    chat_request,
    finished_spans,
    median,
    ratio,
    scifact_tenant,
    vllm_url,
    write_result,
)
from bench.miss_bench import service_settings
from bench.ttft_bench import questions
from pipeline.runner import Concurrent, Runner
from retrieval import Embedder
from tests.support.servers import LiveService, RedisServer

TENANT = "scifact"


@dataclass(frozen=True)
class Toggle:
    """One technique: how it is switched, and the workload that shows what it does.

    ``setting``: ``group.field`` in ``Settings`` and its ``on``/``off`` values (extra fields
    that go with it in ``with_on``/``with_off``); ``request_off``: the request's ``rag`` options
    that switch it off instead; ``path``: ``serial`` for the group's stages in a row."""

    name: str
    workload: str  # miss | concurrent | identical | repeat
    setting: str | None = None
    on: Any = None
    off: Any = None
    with_on: dict[str, Any] = field(default_factory=dict)
    with_off: dict[str, Any] = field(default_factory=dict)
    request_off: dict[str, Any] | None = None
    path: str | None = None
    note: str = ""


# ---- The toggles. Other helpers' settings plug in here by name: when ``Settings`` has the field,
# ---- the toggle is measured; until then it is reported as not measured.
TOGGLES: list[Toggle] = [
    Toggle("response cache", "repeat", note="hit (on) vs Cache-Control: no-cache (off)"),
    # The cache-hit fast path (issue 18, helper A): plain hits answered before the full path.
    Toggle("cache-hit fast path", "hit", setting="cache.fast_path", on=True, off=False),
    # Request coalescing (issue 18, helper B): identical concurrent misses share one generation.
    Toggle("request coalescing", "identical", setting="cache.coalesce", on=True, off=False),
    # Prefix-stable prompt layout (helper D): no switch exists in Settings today; name it here.
    Toggle("prefix-stable prompt", "miss", setting="prompt.prefix_stable", on=True, off=False),
    Toggle(
        "relevance gate + compression",
        "miss",
        request_off={"compress": False, "min_relevance": 0.0},
        note="the request's rag.compress and rag.min_relevance",
    ),
    Toggle(
        "parallel stage group",
        "miss",
        path="serial",
        note="no setting: the same stages in a row, by the real runner",
    ),
    Toggle(
        "query-embedding batching",
        "concurrent",
        setting="retrieval.query_batch_max",
        on=32,
        off=1,
        with_off={"retrieval.query_batch_window_seconds": 0.0},
    ),
    Toggle(
        "retrieval cascade",
        "miss",
        setting="retrieval.candidates",
        on=None,
        off=10**7,
        note="off: every allowed chunk scored by vectors (the whole corpus), then fused",
    ),
    # Quantized embeddings (helper C): ONNX Runtime int8 against PyTorch fp32.
    Toggle(
        "quantized embeddings",
        "miss",
        setting="retrieval.embeddings",
        on="onnx-int8",
        off="torch",
    ),
]


def has_setting(path: str) -> bool:
    """Whether ``Settings`` has the field ``group.field`` (or a top-level ``field``)."""
    model: Any = Settings
    for part in path.split("."):
        fields = getattr(model, "model_fields", {})
        if part not in fields:
            return False
        model = fields[part].annotation
    return True


def default_of(path: str) -> Any:
    value: Any = Settings(environment="test")
    for part in path.split("."):
        value = getattr(value, part)
    return value


def overrides(values: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """``{"retrieval.candidates": 5}`` -> ``{"retrieval": {"candidates": 5}}``."""
    nested: dict[str, dict[str, Any]] = {}
    for path, value in values.items():
        group, name = path.split(".", 1)
        nested.setdefault(group, {})[name] = value
    return nested


@dataclass
class Variant:
    """One running service: its app, its server, its spans."""

    app: FastAPI
    live: LiveService
    exporter: InMemorySpanExporter

    @property
    def url(self) -> str:
        return self.live.url


class Fleet:
    """The variants of the service, built on demand and kept for the run."""

    def __init__(self, stack: contextlib.ExitStack, redis_url: str, llm: str, index: Path) -> None:
        self.stack = stack
        self.redis_url, self.llm, self.index = redis_url, llm, index
        self.embedder = Embedder()
        self.variants: dict[str, Variant] = {}

    def get(self, values: dict[str, Any]) -> Variant:
        name = repr(sorted(values.items()))
        if name not in self.variants:
            settings = service_settings(self.redis_url, self.llm, self.index, **overrides(values))
            exporter = InMemorySpanExporter()
            # A toggle of the embedding backend needs its own model; the others share one.
            shared = None if any(k == "retrieval.embeddings" for k in values) else self.embedder
            app = create_app(
                settings, span_processors=[SimpleSpanProcessor(exporter)], embedder=shared
            )
            live = self.stack.enter_context(LiveService(app))
            self.variants[name] = Variant(app, live, exporter)
        return self.variants[name]


@contextlib.contextmanager
def serial_path(variant: Variant) -> Iterator[None]:
    """The variant's chat path with its concurrent group's stages one after another."""
    paths: Paths = variant.app.state.paths
    services = variant.app.state.services
    steps = [
        s
        for step in paths.chat.steps
        for s in (step.stages if isinstance(step, Concurrent) else [step])
    ]
    variant.app.state.paths = replace(
        paths, chat=Runner(steps, services.tracer, observers=services.observers)
    )
    try:
        yield
    finally:
        variant.app.state.paths = paths


@dataclass
class Side:
    """What one side of a toggle measured."""

    ttft: list[float] = field(default_factory=list)
    latency: list[float] = field(default_factory=list)
    upstream: list[float] = field(default_factory=list)  # auth -> upstream call, ms
    generations: list[int] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        return {
            "requests": len(self.latency),
            "ttft_p50_ms": median(self.ttft) * 1000.0,
            "latency_p50_ms": median(self.latency) * 1000.0,
            "upstream_p50_ms": median(self.upstream),
            "generations": sum(self.generations) if self.generations else None,
        }


class Asker:
    """Sends one side's requests and reads their spans."""

    def __init__(self, variant: Variant, key: str, max_tokens: int) -> None:
        self.variant, self.key, self.max_tokens = variant, key, max_tokens

    async def ask(
        self,
        question: str,
        side: Side,
        *,
        cached: bool = False,
        rag: dict[str, Any] | None = None,
        stream: bool = True,
        connection: StreamConnection | None = None,
    ) -> Streamed:
        headers = {"Authorization": f"Bearer {self.key}", **({} if cached else NO_CACHE)}
        body = chat_request([{"role": "user", "content": question}], self.max_tokens)
        if rag:
            body["rag"] = rag
        if not stream:
            body["stream"] = False
            del body["stream_options"]
        own = connection is None
        connection = connection or StreamConnection(self.variant.url)
        try:
            answer = await connection.send(body, headers)
        finally:
            if own:
                connection.close()
        if not answer.ok:
            raise RuntimeError(f"{answer.status} {answer.body[:300]!r}")
        side.latency.append(answer.total_s)
        if answer.ttft_s is not None:
            side.ttft.append(answer.ttft_s)
        spans = await finished_spans(self.variant.exporter, answer.trace_id)
        if any(v.name.startswith("chat ") for v in spans):
            side.upstream.append(breakdown(spans).upstream_at_ms)
        return answer


async def run_toggle(
    toggle: Toggle, fleet: Fleet, key: str, asked: list[str], args: argparse.Namespace
) -> dict[str, Any]:
    base_values: dict[str, Any] = {}
    on_values, off_values = dict(base_values), dict(base_values)
    if toggle.setting is not None:
        default = default_of(toggle.setting)
        if toggle.on != default:
            on_values[toggle.setting] = toggle.on
        if toggle.off != default:
            off_values[toggle.setting] = toggle.off
        on_values.update(toggle.with_on)
        off_values.update(toggle.with_off)
    variants = {"on": fleet.get(on_values), "off": fleet.get(off_values)}
    sides = {"on": Side(), "off": Side()}
    askers = {name: Asker(v, key, args.max_tokens) for name, v in variants.items()}

    async def one(name: str, question: str) -> None:
        asker, side = askers[name], sides[name]
        rag = toggle.request_off if name == "off" else None
        if toggle.workload == "miss":
            if toggle.path == "serial" and name == "off":
                with serial_path(asker.variant):
                    await asker.ask(question, side)
            else:
                await asker.ask(question, side, rag=rag)
        elif toggle.workload == "repeat":
            await asker.ask(question, Side(), cached=True)  # answered and stored
            await asker.ask(question, side, cached=name == "on")
        elif toggle.workload == "hit":
            await asker.ask(question, Side(), cached=True, stream=False)  # answered and stored
            kept = StreamConnection(asker.variant.url)  # kept alive, as a load client's is
            try:
                for _ in range(args.hits):
                    await asker.ask(question, side, cached=True, stream=False, connection=kept)
            finally:
                kept.close()
        elif toggle.workload == "concurrent":
            batch = [f"{question} ({n})" for n in range(args.concurrency)]
            await asyncio.gather(*(asker.ask(q, side) for q in batch))
        elif toggle.workload == "identical":
            before = len(asker.variant.exporter.get_finished_spans())
            fresh = f"{question} (asked at {time.time_ns()})"
            await asyncio.gather(
                *(asker.ask(fresh, side, cached=True) for _ in range(args.concurrency))
            )
            spans = asker.variant.exporter.get_finished_spans()[before:]
            side.generations.append(sum(1 for s in spans if s.name.startswith("chat ")))
        asker.variant.exporter.clear()

    for number, question in enumerate(asked):
        for name in ("on", "off") if number % 2 == 0 else ("off", "on"):
            await one(name, question)
    on, off = sides["on"].summary(), sides["off"].summary()
    latency = ("repeat", "identical", "hit")
    metric = "latency_p50_ms" if toggle.workload in latency else "ttft_p50_ms"
    return {
        "name": toggle.name,
        "workload": toggle.workload,
        "measured": True,
        "switch": toggle.setting or ("request" if toggle.request_off else toggle.path or "request"),
        "note": toggle.note,
        "metric": metric,
        "on": on,
        "off": off,
        "ratio_on_off": ratio(on[metric], off[metric]),
        "upstream_ratio_on_off": ratio(on["upstream_p50_ms"], off["upstream_p50_ms"]),
    }


def absent(toggle: Toggle, why: str) -> dict[str, Any]:
    return {"name": toggle.name, "workload": toggle.workload, "measured": False, "note": why}


async def measure(
    fleet: Fleet, key: str, pool: list[str], args: argparse.Namespace
) -> list[dict[str, Any]]:
    results = []
    warm = fleet.get({})
    await Asker(warm, key, args.max_tokens).ask("Warm-up: what does vitamin D do?", Side())
    cursor = 0
    for toggle in TOGGLES:
        if toggle.setting is not None and not has_setting(toggle.setting):
            results.append(absent(toggle, f"Settings has no {toggle.setting}: not measured"))
            print(f"  {toggle.name}: no setting {toggle.setting}, not measured", flush=True)
            continue
        asked, cursor = pool[cursor : cursor + args.pairs], cursor + args.pairs
        try:
            result = await run_toggle(toggle, fleet, key, asked, args)
        except Exception as exc:  # a toggle that cannot run is reported, the others go on
            results.append(absent(toggle, f"failed: {type(exc).__name__}: {exc}"[:300]))
            print(f"  {toggle.name}: failed: {exc!r}"[:300], flush=True)
            continue
        results.append(result)
        metric = result["metric"]
        print(
            f"  {toggle.name}: {metric} on {result['on'][metric]:.1f} / off "
            f"{result['off'][metric]:.1f} ({result['ratio_on_off']:.2f}x); auth->upstream "
            f"{result['on']['upstream_p50_ms']:.1f} / {result['off']['upstream_p50_ms']:.1f} ms",
            flush=True,
        )
    return results


def report(toggles: list[dict[str, Any]]) -> None:
    print(
        "\n| technique | workload | metric | on | off | on/off | auth->upstream p50 ms on / off |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for t in toggles:
        if not t["measured"]:
            print(f"| {t['name']} | {t['workload']} | - | - | - | - | {t['note']} |")
            continue
        metric, on, off = t["metric"], t["on"], t["off"]
        extra = ""
        if on["generations"] is not None:
            extra = f" (generations {on['generations']} / {off['generations']})"
        print(
            f"| {t['name']} | {t['workload']} | {metric} | {on[metric]:.1f} | {off[metric]:.1f} "
            f"| **{t['ratio_on_off']:.2f}** | {on['upstream_p50_ms']:.1f} / "
            f"{off['upstream_p50_ms']:.1f}{extra} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pairs", type=int, default=8, help="questions per toggle")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--hits", type=int, default=20, help="hits per question (hit workload)")
    parser.add_argument("--extra-documents", type=int, default=None, help="default: all")
    parser.add_argument("--llm-url", default=None)
    parser.add_argument("--quick", action="store_true", help="2 questions per toggle, 4 at once")
    args = parser.parse_args()
    if args.quick:
        args.pairs, args.concurrency = 2, 4
        args.extra_documents = 300 if args.extra_documents is None else args.extra_documents
    llm = vllm_url(args.llm_url)
    asked = questions(args.pairs * len(TOGGLES))
    pool = [q for q, _ in asked]
    index_dir, documents, chunks = scifact_tenant(asked, args.extra_documents, TENANT, "stack")
    redis = RedisServer()
    redis.start()
    try:
        with contextlib.ExitStack() as stack:
            fleet = Fleet(stack, redis.url, llm, index_dir)
            base = fleet.get({})
            services = base.app.state.services
            key = base.live.run(services.keys.create(TENANT, "bench", frozenset({"chat"})))
            toggles = asyncio.run(measure(fleet, key, pool, args))
    finally:
        redis.stop()
    result = {
        "toggles": toggles,
        "documents": documents,
        "chunks": chunks,
        "pairs": args.pairs,
        "concurrency": args.concurrency,
        "llm_url": llm,
        "quick": args.quick,
    }
    path = write_result("stack", result)
    report(toggles)
    print(f"\nwritten: {path}")


if __name__ == "__main__":
    main()
