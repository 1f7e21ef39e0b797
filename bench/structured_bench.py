"""What structured outputs and logprobs cost, side by side in one run.

1. The output guard on one answer (about 1.2 KB, 4 characters a chunk, some PII in it), as
   text, as text with logprobs, as JSON (read string by string) and as JSON with logprobs:
   microseconds per chunk, medians of rounds, and the ratio to plain text.
2. Reading a request body: a typical chat body, and the same with a JSON schema and logprobs
   (``ChatCompletionRequest`` validation, microseconds).
3. Through the service against the real CPU vLLM (``--llm-url``, default the dev server on
   8001): the same questions answered as free text, ``json_object`` and ``json_schema``
   (response cache bypassed), alternating: median seconds per request and per completion token.

    .venv/bin/python -m bench.structured_bench [--rounds 30] [--requests 8] [--llm-url URL]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

import httpx

from app.http.schemas import ChatCompletionRequest
from app.main import create_app
from app.settings import Settings
from pipeline.answer.completion import Completion
from pipeline.answer.events import ContentDelta, Finish, StreamEvent
from pipeline.answer.stream import AnswerStream
from pipeline.context import ChatParams, Principal, RequestContext
from pipeline.guards.policy import PolicyBook
from pipeline.stages.guard_out import GuardOutput
from tests.support.servers import LiveService, RedisServer
from tests.support.tracing import memory_tracing

RECORD = {
    "name": "Jane Doe",
    "contact": "write to jane.doe@example.com or call +44 20 7946 0958",
    "notes": "The kea is a large parrot of the alpine regions of New Zealand. " * 6,
    "visits": [3, 5, 8],
    "active": True,
}
ANSWER_JSON = json.dumps(RECORD, indent=2)
ANSWER_TEXT = (
    f"{RECORD['name']} can be reached: {RECORD['contact']}. {RECORD['notes']} "
    "Visits were on days 3, 5 and 8."
)


def events(answer: str, logprobs: bool) -> list[StreamEvent]:
    out: list[StreamEvent] = []
    for i in range(0, len(answer), 4):
        piece = answer[i : i + 4]
        entries = ({"token": piece, "logprob": -0.1, "bytes": [], "top_logprobs": []},)
        out.append(ContentDelta(piece, entries if logprobs else ()))
    return [*out, Finish("stop")]


async def play(items: Sequence[StreamEvent]) -> AsyncIterator[StreamEvent]:
    for item in items:
        yield item


async def guard_once(answer: str, sampling: dict[str, Any], provider: Any) -> float:
    items = events(answer, bool(sampling.get("logprobs")))
    ctx = RequestContext(
        params=ChatParams(model="m", messages=[], sampling=sampling),
        credential=None,
        deadline=asyncio.get_running_loop().time() + 60,
        principal=Principal("bench", "u", frozenset({"chat"}), "k"),
    )
    base = Completion("", "stop", "m", logprobs=[] if sampling.get("logprobs") else None)
    ctx.answer = AnswerStream(play(items), lambda: base)
    await GuardOutput(PolicyBook.from_json(None), provider.get_tracer("b"))(ctx)
    started = time.perf_counter()
    await ctx.answer.drain()
    return (time.perf_counter() - started) / len(items) * 1e6


async def guard_costs(rounds: int) -> None:
    provider, _ = memory_tracing()
    modes = {
        "text": (ANSWER_TEXT, {}),
        "text + logprobs": (ANSWER_TEXT, {"logprobs": True}),
        "json": (ANSWER_JSON, {"response_format": {"type": "json_object"}}),
        "json + logprobs": (
            ANSWER_JSON,
            {"response_format": {"type": "json_object"}, "logprobs": True},
        ),
    }
    samples: dict[str, list[float]] = {name: [] for name in modes}
    for _ in range(rounds):
        for name, (answer, sampling) in modes.items():
            samples[name].append(await guard_once(answer, sampling, provider))
    base = statistics.median(samples["text"])
    print("output guard, µs per 4-character chunk (median of rounds):")
    for name, values in samples.items():
        median = statistics.median(values)
        print(f"  {name:<16} {median:7.1f} µs   {median / base:4.2f}x text")


def validation_costs(rounds: int) -> None:
    typical = {
        "model": "smollm2",
        "messages": [{"role": "user", "content": "What does a fjord look like?"}],
        "max_tokens": 64,
        "temperature": 0,
    }
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "country": {"type": "string"}},
        "required": ["name", "country"],
        "additionalProperties": False,
    }
    structured = {
        **typical,
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "place", "schema": schema, "strict": True},
        },
        "logprobs": True,
        "top_logprobs": 2,
    }
    print("request body validation, µs (median):")
    for name, body in (("typical", typical), ("schema + logprobs", structured)):
        times = []
        for _ in range(rounds * 100):
            started = time.perf_counter()
            ChatCompletionRequest.model_validate(body).to_params(4, 512)
            times.append((time.perf_counter() - started) * 1e6)
        print(f"  {name:<18} {statistics.median(times):6.1f} µs")


QUESTIONS = [
    "Where is Lyon?",
    "Name a city and its country.",
    "Which city is the capital of Japan?",
    "Where is the kea found?",
]
PLACE = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 30},
        "country": {"type": "string", "maxLength": 30},
    },
    "required": ["name", "country"],
    "additionalProperties": False,
}
FORMATS: dict[str, dict[str, Any] | None] = {
    "text": None,
    "json_object": {"type": "json_object"},
    "json_schema": {"type": "json_schema", "json_schema": {"name": "place", "schema": PLACE}},
}


def service_costs(llm_url: str, requests: int) -> None:
    redis = RedisServer()
    redis.start()
    try:
        _service_costs(redis, llm_url, requests)
    finally:
        redis.stop()


def _service_costs(redis: RedisServer, llm_url: str, requests: int) -> None:
    settings = Settings(
        environment="test",
        redis={"url": redis.url, "key_prefix": "bench:"},
        llm={"base_url": llm_url},
        retrieval={"index_dir": tempfile.mkdtemp(prefix="rag-bench-")},
        jobs={"workers": 0},
    )
    app = create_app(settings)
    with LiveService(app) as live:
        key = live.run(app.state.services.keys.create("bench", "u"))
        headers = {"Authorization": f"Bearer {key}", "Cache-Control": "no-cache, no-store"}
        seconds: dict[str, list[float]] = {name: [] for name in FORMATS}
        per_token: dict[str, list[float]] = {name: [] for name in FORMATS}
        with httpx.Client(base_url=live.url, headers=headers, timeout=300) as client:
            for n in range(requests):
                question = QUESTIONS[n % len(QUESTIONS)]
                order = list(FORMATS) if n % 2 == 0 else list(reversed(FORMATS))
                for name in order:
                    body: dict[str, Any] = {
                        "model": "smollm2",
                        "messages": [{"role": "user", "content": question}],
                        "max_tokens": 64,
                        "temperature": 0,
                        "rag": {"enabled": False},
                    }
                    if FORMATS[name] is not None:
                        body["response_format"] = FORMATS[name]
                    started = time.perf_counter()
                    response = client.post("/v1/chat/completions", json=body)
                    elapsed = time.perf_counter() - started
                    assert response.status_code == 200, response.text
                    tokens = response.json()["usage"]["completion_tokens"] or 1
                    seconds[name].append(elapsed)
                    per_token[name].append(elapsed / tokens * 1000)
    base = statistics.median(per_token["text"])
    print(f"through the service and vLLM ({requests} requests each, max_tokens 64):")
    for name in FORMATS:
        s, t = statistics.median(seconds[name]), statistics.median(per_token[name])
        print(f"  {name:<12} {s:6.2f} s/request   {t:6.1f} ms/token   {t / base:4.2f}x text")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--llm-url", default="http://127.0.0.1:8001")
    parser.add_argument("--no-service", action="store_true", help="skip part 3 (no vLLM)")
    args = parser.parse_args()
    asyncio.run(guard_costs(args.rounds))
    validation_costs(args.rounds)
    if not args.no_service:
        service_costs(args.llm_url, args.requests)


if __name__ == "__main__":
    main()
