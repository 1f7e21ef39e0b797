"""N-gram speculative decoding on the CPU vLLM: output tokens/s with and without, on answers
that copy from the sources.

    .venv/bin/python -m bench.spec_bench [--prompts 12] [--rounds 2] [--max-tokens 96]
        [--quick] [--llm-url http://127.0.0.1:8001] [--spec-url URL]

"Without" is the running vLLM (``--llm-url``, else ``RAG_TEST_VLLM_URL``, else port 8001); "with"
is a second vLLM this run starts on a free port (``scripts/start-vllm.sh`` with
``RAG_VLLM_ARGS=--speculative-config {"method":"ngram",...}``, its log in
``$TMPDIR/rag-bench-spec-vllm.log``) and stops at the end, or the one ``--spec-url`` names. It
needs about 2 GB of memory and 1 to 5 minutes to start: the run checks the memory first.

The prompts are what the service sends for a retrieved answer (``build_messages``: the fixed
instructions, then SciFact abstracts as sources) with a question that asks for a source's text
word for word, the kind of answer prompt lookup drafts well. Each prompt goes to both servers,
one request at a time, the order alternating; per request the decode rate is
``(completion_tokens - 1) / (total time - time to first token)``, and the figure is the median
of the per-prompt ratios with/without. vLLM's own counters give the share of draft tokens
accepted (``vllm:spec_decode_num_accepted_tokens_total`` over ``..._draft_tokens_total``).

Writes bench/results/spec.json.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import tempfile
from pathlib import Path
from typing import Any

import httpx

from bench.e2e import (
    StreamConnection,
    Streamed,
    chat_request,
    median,
    ratio,
    vllm_url,
    write_result,
)
from bench.retrieval_data import load_corpus
from pipeline.context import Passage
from pipeline.model.prompt import build_messages
from tests.support.servers import VLLMServer

SPECULATIVE = (
    '{"method":"ngram","num_speculative_tokens":4,"prompt_lookup_max":4,"prompt_lookup_min":2}'
)
NEEDS_GB = 3.0


def copy_prompts(count: int) -> list[list[dict[str, Any]]]:
    """Prompts whose answer copies a source: two abstracts as sources, and a request to quote
    the first one's opening sentences word for word."""
    corpus = [d for d in load_corpus() if len(d.text) > 600]
    prompts = []
    for number in range(count):
        first, second = corpus[number * 2], corpus[number * 2 + 1]
        passages = [
            Passage(d.id, f"{d.id}#0", d.title, d.text, 1.0 - n / 10)
            for n, d in enumerate((first, second))
        ]
        question = (
            f"Quote the first three sentences of source [{first.id}] word for word, "
            "with nothing before or after them."
        )
        prompts.append(build_messages([{"role": "user", "content": question}], passages))
    return prompts


def available_gb() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 1024 / 1024
    return 0.0


def spec_counters(base_url: str) -> dict[str, float]:
    text = httpx.get(f"{base_url}/metrics", timeout=10).text
    found = {}
    for name in ("accepted", "draft"):
        match = re.search(
            rf"^vllm:spec_decode_num_{name}_tokens_total(?:{{[^}}]*}})? (\S+)$", text, re.M
        )
        found[name] = float(match.group(1)) if match else float("nan")
    return found


def decode_rate(answer: Streamed) -> float:
    if answer.ttft_s is None or answer.completion_tokens < 2:
        return float("nan")
    return (answer.completion_tokens - 1) / max(1e-9, answer.total_s - answer.ttft_s)


async def measure(
    urls: dict[str, str], prompts: list[Any], rounds: int, max_tokens: int
) -> dict[str, Any]:
    connections = {side: StreamConnection(url) for side, url in urls.items()}
    rates: dict[str, list[float]] = {side: [] for side in urls}
    ends: dict[str, list[float]] = {side: [] for side in urls}
    tokens: dict[str, list[int]] = {side: [] for side in urls}
    pairs: list[float] = []
    try:
        for messages in prompts[:2]:  # warm-up: compile paths, prefix cache for both
            for connection in connections.values():
                await connection.send(chat_request(messages, 8))
        for repeat in range(rounds):
            for number, messages in enumerate(prompts):
                body = chat_request(messages, max_tokens)
                seen: dict[str, Streamed] = {}
                order = ("without", "with") if (number + repeat) % 2 == 0 else ("with", "without")
                for side in order:
                    answer = await connections[side].send(body)
                    if not answer.ok:
                        raise RuntimeError(f"{side}: {answer.status} {answer.body[:300]!r}")
                    seen[side] = answer
                    rates[side].append(decode_rate(answer))
                    ends[side].append(answer.completion_tokens / answer.total_s)
                    tokens[side].append(answer.completion_tokens)
                pairs.append(ratio(decode_rate(seen["with"]), decode_rate(seen["without"])))
    finally:
        for connection in connections.values():
            connection.close()
    return {
        "requests_per_side": len(pairs),
        "decode_tokens_per_s": {side: median(v) for side, v in rates.items()},
        "end_to_end_tokens_per_s": {side: median(v) for side, v in ends.items()},
        "completion_tokens_p50": {
            side: median([float(t) for t in v]) for side, v in tokens.items()
        },
        "decode_ratio_p50": median([p for p in pairs if p == p]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--llm-url", default=None)
    parser.add_argument("--spec-url", default=None, help="a running vLLM with the ngram config")
    parser.add_argument("--quick", action="store_true", help="4 prompts, one round, 48 tokens")
    args = parser.parse_args()
    if args.quick:
        args.prompts, args.rounds, args.max_tokens = 4, 1, 48
    without = vllm_url(args.llm_url)
    server: VLLMServer | None = None
    if args.spec_url:
        with_spec = args.spec_url.rstrip("/")
    else:
        if available_gb() < NEEDS_GB:
            raise SystemExit(f"{available_gb():.1f} GB available, a second vLLM needs {NEEDS_GB}")
        os.environ.pop("RAG_TEST_VLLM_URL", None)
        os.environ["RAG_VLLM_ARGS"] = f"--speculative-config {SPECULATIVE}"
        server = VLLMServer()
        server.log_path = Path(tempfile.gettempdir()) / "rag-bench-spec-vllm.log"
        print(f"starting a vLLM with {SPECULATIVE} (log: {server.log_path})", flush=True)
        server.start()
        with_spec = server.url
    try:
        before = spec_counters(with_spec)
        result = asyncio.run(
            measure(
                {"without": without, "with": with_spec},
                copy_prompts(args.prompts),
                args.rounds,
                args.max_tokens,
            )
        )
        after = spec_counters(with_spec)
    finally:
        if server is not None:
            server.stop()
    accepted = after["accepted"] - before["accepted"]
    drafted = after["draft"] - before["draft"]
    result.update(
        speculative_config=SPECULATIVE,
        draft_tokens=drafted,
        accepted_tokens=accepted,
        acceptance=ratio(accepted, drafted),
        max_tokens=args.max_tokens,
        quick=args.quick,
    )
    path = write_result("spec", result)
    rates, ends = result["decode_tokens_per_s"], result["end_to_end_tokens_per_s"]
    print("\n| | without | with ngram speculation | with/without (median of pairs) |")
    print("| --- | --- | --- | --- |")
    print(
        f"| decode tokens/s p50 | {rates['without']:.1f} | {rates['with']:.1f} "
        f"| **{result['decode_ratio_p50']:.2f}** |"
    )
    print(f"| end-to-end tokens/s p50 | {ends['without']:.1f} | {ends['with']:.1f} | |")
    print(
        f"\ndraft tokens accepted: {accepted:.0f} of {drafted:.0f} "
        f"({result['acceptance']:.0%}); {result['requests_per_side']} requests per side"
    )
    print(f"\nwritten: {path}")


if __name__ == "__main__":
    main()
