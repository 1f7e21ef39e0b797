"""``bench.idle_cost``: the CPU a resting replica spends per second, side by side."""

from __future__ import annotations

import time

from bench.idle_cost import measure


class Spending:
    """A process that spends ``rate`` seconds of CPU per second of wall time."""

    def __init__(self, rate: float) -> None:
        self.rate = rate
        self.started = time.monotonic()

    def cpu_seconds(self) -> float:
        return (time.monotonic() - self.started) * self.rate


def test_each_side_is_read_over_the_same_windows_as_ms_per_second_and_compared() -> None:
    result = measure({"service": Spending(0.015), "before": Spending(0.030)}, 3, 0.05, settle_s=0.0)
    service, before = result["sides"]["service"], result["sides"]["before"]
    assert len(service["ms_per_s_windows"]) == len(before["ms_per_s_windows"]) == 3
    # Both read in the same windows: whatever the sleeps' jitter, the ratio is the rates'.
    assert abs(service["ms_per_s"] - 15.0) < 1.5
    assert abs(before["ms_per_s"] - 30.0) < 3.0
    assert abs(result["ratio"] - 0.5) < 0.05


def test_one_side_alone_has_no_ratio() -> None:
    result = measure({"service": Spending(0.01)}, 1, 0.02, settle_s=0.0)
    assert "ratio" not in result
    assert result["sides"]["service"]["ms_per_s"] > 0
