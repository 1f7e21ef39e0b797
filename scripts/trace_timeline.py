"""Draw real traces as a timeline: the picture in docs/tracing.md.

    RAG_TEST_VLLM_URL=http://127.0.0.1:8011 .venv/bin/python -m scripts.trace_timeline \\
        [--out docs/trace-timeline.png] [--spans trace-spans.json] [--docs 300]

Starts a private redis-server and an OTLP/gRPC receiver (tests/support/otlp.py), builds the app
with its real exporter pointed at the receiver (OTEL_EXPORTER_OTLP_PROTOCOL=grpc), gives a demo
tenant SciFact abstracts, and sends the same question three times through the app (a miss that
runs every stage and calls vLLM, then two cache hits); the miss and the second, warm, hit are
drawn. The spans the receiver got are drawn, one bar per
span in tree order; each bar is labelled with its duration. ``--from-json`` redraws saved spans.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any

import httpx

from app.cli.ingest_files import Skipped, read_jsonl
from app.main import create_app
from app.settings import Settings
from tests.support.data import scifact_file
from tests.support.otlp import GrpcTraceReceiver, ReceivedSpan, of_trace
from tests.support.servers import RedisServer

QUESTION = (
    "What environmental factors influence how much vitamin D the skin makes? And what is 24 * 365?"
)
COLOURS = {
    "POST": "#4c72b0",
    "group": "#8172b2",
    "stage": "#55a868",
    "redis": "#c44e52",
    "retrieval": "#dd8452",
    "chat": "#da8bc3",
    "execute_tool": "#937860",
}


async def record(vllm: str, documents: int) -> tuple[list[ReceivedSpan], list[ReceivedSpan]]:
    """The spans of a miss and of a warm hit after it, as the OTLP receiver got them."""
    redis = RedisServer()
    redis.start()
    try:
        with GrpcTraceReceiver() as receiver:
            os.environ.update(
                OTEL_EXPORTER_OTLP_ENDPOINT=receiver.endpoint,
                OTEL_EXPORTER_OTLP_PROTOCOL="grpc",
                OTEL_BSP_SCHEDULE_DELAY="100",
            )
            settings = Settings(
                environment="development",
                redis={"url": redis.url, "key_prefix": "timeline:"},
                llm={"base_url": vllm},
                retrieval={"index_dir": tempfile.mkdtemp(prefix="rag-timeline-")},
                log={"format": "json"},  # the request lines, as production writes them
            )
            ids = await _requests(settings, documents)
            spans = receiver.spans()  # the app's exit flushed the batch exporter
    finally:
        redis.stop()
    return of_trace(spans, ids[0]), of_trace(spans, ids[1])


async def _requests(settings: Settings, documents: int) -> list[str]:
    app = create_app(settings)
    async with app.router.lifespan_context(app):
        services = app.state.services
        corpus = read_jsonl(scifact_file("corpus.jsonl"), Skipped())
        docs = list(itertools.islice(corpus, documents))
        await services.retrieval.ingest("demo", docs)
        key = await services.keys.create("demo", "reader", frozenset({"chat"}))
        body = {
            "model": settings.llm.models[0],
            "messages": [{"role": "user", "content": QUESTION}],
            "max_tokens": 48,
            "temperature": 0,
        }
        headers = {"Authorization": f"Bearer {key}"}
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://app") as client:
            await client.get("/healthz")  # warm the app's code paths, not the cache
            ids = []
            for _ in range(3):  # a miss, a first hit (cold code paths), a warm hit
                response = await client.post("/v1/chat/completions", json=body, headers=headers)
                response.raise_for_status()
                ids.append(response.headers["x-trace-id"])
                print(response.headers["x-cache"], response.headers["x-trace-id"])
    return [ids[0], ids[-1]]


def tree_order(spans: list[ReceivedSpan]) -> list[tuple[int, ReceivedSpan]]:
    """(depth, span) depth-first from the root, children by start time."""
    kids: dict[str, list[ReceivedSpan]] = {}
    for span in spans:
        kids.setdefault(span.parent_id, []).append(span)
    ids = {s.span_id for s in spans}
    roots = [s for s in spans if s.parent_id not in ids]
    out: list[tuple[int, ReceivedSpan]] = []

    def walk(span: ReceivedSpan, depth: int) -> None:
        out.append((depth, span))
        for child in sorted(kids.get(span.span_id, []), key=lambda s: s.start_ns):
            walk(child, depth + 1)

    for root in sorted(roots, key=lambda s: s.start_ns):
        walk(root, 0)
    return out


def _draw(axis: Any, spans: list[ReceivedSpan], title: str, pad: float) -> None:
    rows = tree_order(spans)
    origin = min(s.start_ns for s in spans)
    total = max(s.end_ns for s in spans) - origin
    for row, (_, span) in enumerate(rows):
        start = (span.start_ns - origin) / 1e6
        width = max(span.duration_ms, total / 1e6 / 400)  # a sliver stays visible
        colour = COLOURS.get(span.name.split(" ")[0], "#999999")
        axis.barh(row, width, left=start, color=colour, height=0.7)
        label = (
            f"{span.duration_ms:.2f} ms" if span.duration_ms < 10 else f"{span.duration_ms:.0f} ms"
        )
        axis.text(start + width, row, f" {label}", va="center", fontsize=7)
    labels = ["  " * depth + span.name for depth, span in rows]
    axis.set_yticks(range(len(rows)))
    # Left-aligned, in monospace, so that the indentation shows the tree.
    axis.set_yticklabels(labels, fontsize=8, family="monospace", ha="left")
    axis.tick_params(axis="y", pad=pad)
    axis.invert_yaxis()
    axis.set_xlim(0, total / 1e6 * 1.15)
    axis.set_xlabel("ms since the request arrived")
    axis.set_title(title, fontsize=10, loc="left")
    axis.grid(axis="x", alpha=0.3)


def render(miss: list[ReceivedSpan], hit: list[ReceivedSpan], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (top, bottom) = plt.subplots(
        2, 1, figsize=(11, 0.22 * (len(miss) + len(hit)) + 2.2),
        gridspec_kw={"height_ratios": [len(miss), max(len(hit), 3)]},
    )  # fmt: skip
    widest = max(2 * depth + len(s.name) for depth, s in tree_order(miss) + tree_order(hit))
    pad = 4.9 * widest  # points: both panels' labels start at the same place
    _draw(top, miss, f"cache miss: trace {miss[0].trace_id} ({len(miss)} spans)", pad)
    _draw(bottom, hit, f"cache hit: the same question a third time, trace {hit[0].trace_id}", pad)
    resource = miss[0].resource
    figure.suptitle(
        f"{resource.get('service.name')} {resource.get('service.version')}: spans received "
        "over OTLP/gRPC by a test receiver (scripts/trace_timeline.py)",
        fontsize=10,
    )
    figure.tight_layout()
    figure.savefig(out, dpi=90)
    print(f"wrote {out} ({out.stat().st_size // 1024} KiB)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("docs/trace-timeline.png"))
    parser.add_argument("--spans", type=Path, help="also save the received spans as JSON here")
    parser.add_argument("--from-json", type=Path, help="draw spans saved with --spans instead")
    parser.add_argument("--docs", type=int, default=300, help="SciFact abstracts to index")
    args = parser.parse_args()
    if args.from_json:
        saved = json.loads(args.from_json.read_text())
        miss = [ReceivedSpan(**s) for s in saved["miss"]]
        hit = [ReceivedSpan(**s) for s in saved["hit"]]
    else:
        vllm = os.environ.get("RAG_TEST_VLLM_URL")
        if not vllm:
            raise SystemExit("set RAG_TEST_VLLM_URL to a running vLLM (make run starts one)")
        miss, hit = asyncio.run(record(vllm, args.docs))
    if args.spans:
        doc = {"miss": [asdict(s) for s in miss], "hit": [asdict(s) for s in hit]}
        args.spans.write_text(json.dumps(doc, indent=1))
    render(miss, hit, args.out)


if __name__ == "__main__":
    main()
