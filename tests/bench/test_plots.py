"""bench/plots.py draws each end-to-end benchmark's PNG from its JSON result, and skips the
results that are not there."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.e2e import write_result
from bench.plots import draw_all

PNG = b"\x89PNG\r\n\x1a\n"


def side(ttft: float, rate: float) -> dict[str, Any]:
    return {"ttft_p50_ms": ttft, "ttft_p99_ms": ttft * 3, "tokens_per_s": rate}


THROUGHPUT = {
    "levels": [
        {"concurrency": c, "service": side(50.0 * c, 10.0 * c), "vllm": side(45.0 * c, 11.0 * c)}
        for c in (1, 8, 32)
    ]
}
MISS = {
    "auth_to_upstream_ms": {"p50": 12.5},
    "segments_ms": {
        "cold": {"auth": 1.0, "retrieve": 9.0, "vLLM to first chunk": 400.0},
        "warm": {"auth": 0.9, "retrieve": 8.0, "vLLM to first chunk": 40.0, "first chunk": None},
    },
}
STACK = {
    "toggles": [
        {
            "name": "response cache",
            "measured": True,
            "metric": "latency_p50_ms",
            "on": {"latency_p50_ms": 2.0, "upstream_p50_ms": None},
            "off": {"latency_p50_ms": 800.0, "upstream_p50_ms": 12.0},
        },
        {"name": "request coalescing", "measured": False, "note": "no setting"},
    ]
}


def test_each_result_becomes_its_png(tmp_path: Path) -> None:
    write_result("throughput", THROUGHPUT, tmp_path)
    write_result("miss", MISS, tmp_path)
    write_result("stack", STACK, tmp_path)
    written = draw_all(tmp_path)
    assert sorted(p.name for p in written) == ["miss_stages.png", "stack.png", "throughput.png"]
    for path in written:
        assert path.read_bytes().startswith(PNG) and path.stat().st_size > 5000


def test_a_missing_result_is_skipped(tmp_path: Path) -> None:
    write_result("miss", MISS, tmp_path)
    assert [p.name for p in draw_all(tmp_path)] == ["miss_stages.png"]
