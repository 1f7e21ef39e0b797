"""The end-to-end benchmarks' plots, drawn from their JSON results (bench/results/*.json).

    .venv/bin/python -m bench.plots [--results bench/results]

- ``throughput.png`` (bench/throughput_bench.py): time to first token p50 and p99, and output
  tokens/s, against concurrent streams, the service beside bare vLLM;
- ``miss_stages.png`` (bench/miss_bench.py): a miss's time stacked by stage, the question's
  first ask and a warm miss;
- ``stack.png`` (bench/stack_bench.py): each technique on and off: its metric (TTFT, or latency
  for hits), and auth to the upstream call.

A result that is missing is skipped; the PNGs are build outputs (bench/results is not in git).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # no display: files only

import matplotlib.pyplot as plt

from bench.e2e import RESULTS, read_result

SERVICE, BARE = "#4c72b0", "#dd8452"


def _nan(value: Any) -> float:
    return float("nan") if value is None else float(value)


def throughput(result: dict[str, Any], path: Path) -> Path:
    levels = result["levels"]
    streams = [row["concurrency"] for row in levels]
    figure, (latency, rate) = plt.subplots(1, 2, figsize=(11, 4.2))
    for side, colour, label in (("service", SERVICE, "service"), ("vllm", BARE, "bare vLLM")):
        p50 = [_nan(row[side]["ttft_p50_ms"]) for row in levels]
        p99 = [_nan(row[side]["ttft_p99_ms"]) for row in levels]
        latency.plot(streams, p50, "o-", color=colour, label=f"{label} p50")
        latency.plot(streams, p99, "o--", color=colour, alpha=0.6, label=f"{label} p99")
        rate.plot(
            streams,
            [_nan(row[side]["tokens_per_s"]) for row in levels],
            "o-",
            color=colour,
            label=label,
        )
    for axes in (latency, rate):
        axes.set_xscale("log", base=2)
        axes.set_xticks(streams, [str(s) for s in streams])
        axes.set_xlabel("concurrent streams")
        axes.grid(alpha=0.3)
        axes.legend()
    latency.set_yscale("log")
    latency.set_ylabel("time to first token (ms)")
    latency.set_title("TTFT against concurrency")
    rate.set_ylabel("output tokens/s")
    rate.set_title("Output tokens/s against concurrency")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def miss_stages(result: dict[str, Any], path: Path) -> Path:
    bars = [
        ("first ask", result["segments_ms"]["cold"]),
        ("warm miss", result["segments_ms"]["warm"]),
    ]
    names: list[str] = []
    for _, segments in bars:
        names.extend(n for n in segments if n not in names)
    colours = plt.get_cmap("tab20")(range(len(names)))
    figure, axes = plt.subplots(figsize=(11, 3.6))
    for row, (_label, segments) in enumerate(bars):
        left = 0.0
        for colour, name in zip(colours, names, strict=True):
            width = max(0.0, _nan(segments.get(name, 0.0)))
            axes.barh(row, width, left=left, color=colour, label=name if row == 0 else None)
            left += width
    axes.set_yticks(range(len(bars)), [label for label, _ in bars])
    axes.set_xlabel("ms from the request's arrival (medians per segment)")
    up = result["auth_to_upstream_ms"]["p50"]
    axes.set_title(f"A miss, stage by stage (auth to upstream call p50 {up:.1f} ms)")
    axes.legend(fontsize=7, ncol=4, loc="upper center", bbox_to_anchor=(0.5, -0.25))
    figure.tight_layout()
    figure.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(figure)
    return path


def stack(result: dict[str, Any], path: Path) -> Path:
    measured = [t for t in result["toggles"] if t["measured"]]
    figure, (main, upstream) = plt.subplots(1, 2, figsize=(12, 0.6 * len(measured) + 2.2))
    rows = range(len(measured))
    for offset, side, colour in ((-0.2, "on", SERVICE), (0.2, "off", BARE)):
        values = [_nan(t[side][t["metric"]]) for t in measured]
        main.barh([r + offset for r in rows], values, height=0.4, color=colour, label=side)
        ups = [_nan(t[side]["upstream_p50_ms"]) for t in measured]
        upstream.barh([r + offset for r in rows], ups, height=0.4, color=colour, label=side)
    labels = [
        f"{t['name']} ({'latency' if 'latency' in t['metric'] else 'TTFT'})" for t in measured
    ]
    main.set_yticks(list(rows), labels)
    upstream.set_yticks(list(rows), ["" for _ in measured])
    main.set_xscale("log")
    main.set_xlabel("p50 ms (log)")
    main.set_title("Each technique on and off")
    upstream.set_xlabel("auth to upstream call, p50 ms")
    upstream.set_title("The service's part of a miss")
    for axes in (main, upstream):
        axes.invert_yaxis()
        axes.grid(alpha=0.3, axis="x")
        axes.legend()
    skipped = [t["name"] for t in result["toggles"] if not t["measured"]]
    if skipped:
        figure.text(0.01, 0.01, "not measured: " + ", ".join(skipped), fontsize=7)
    figure.tight_layout(rect=(0, 0.04, 1, 1))
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


DRAWINGS = {"throughput": throughput, "miss": miss_stages, "stack": stack}
FILES = {"throughput": "throughput.png", "miss": "miss_stages.png", "stack": "stack.png"}


def draw_all(directory: Path = RESULTS) -> list[Path]:
    """Every plot whose result is there; the paths written."""
    written = []
    for name, draw in DRAWINGS.items():
        result = read_result(name, directory)
        if result is not None:
            written.append(draw(result, directory / FILES[name]))
    return written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args()
    for path in draw_all(args.results):
        print(f"written: {path}")


if __name__ == "__main__":
    main()
