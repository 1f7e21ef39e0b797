"""What the running usage on every streamed chunk costs the service to read.

The model client asks vLLM for ``continuous_usage_stats`` (``pipeline.model.spend``: a stream
cut short is charged what it spent), which adds a ``usage`` object to every chunk. This times
what the service does with one chunk, parsing it and turning it into events, with and without
that object, side by side in one process (medians of ``--rounds`` rounds).

    .venv/bin/python -m bench.chunk_usage [--rounds 5] [--number 200000]
"""

from __future__ import annotations

import argparse
import statistics
import timeit
from typing import Any

import orjson

from pipeline.answer.events import Usage, events_from_chunk

CHUNK: dict[str, Any] = {
    "id": "chatcmpl-1",
    "object": "chat.completion.chunk",
    "created": 1,
    "model": "smollm2",
    "choices": [
        {"index": 0, "delta": {"content": " dragon"}, "logprobs": None, "finish_reason": None}
    ],
}
USAGE = {"prompt_tokens": 57, "total_tokens": 69, "completion_tokens": 12}


def per_chunk_us(raw: bytes, rounds: int, number: int) -> float:
    def read() -> None:
        events = events_from_chunk(orjson.loads(raw))
        [event for event in events if not isinstance(event, Usage)]

    return statistics.median(
        timeit.timeit(read, number=number) / number * 1e6 for _ in range(rounds)
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--number", type=int, default=200_000)
    args = parser.parse_args()
    sides = {"without usage": CHUNK, "with usage": {**CHUNK, "usage": USAGE}}
    results = {}
    for name, chunk in sides.items():
        raw = orjson.dumps(chunk)
        results[name] = per_chunk_us(raw, args.rounds, args.number)
        print(f"{name}: {len(raw)} bytes, {results[name]:.2f} us per chunk (median)")
    plain, usage = results["without usage"], results["with usage"]
    print(f"the usage adds {usage - plain:.2f} us per chunk ({usage / plain:.2f}x)")


if __name__ == "__main__":
    main()
