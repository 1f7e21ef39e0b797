"""``bench.client_cost``: the model client's CPU per call and per token, measured in a process
per side, each running its own checkout's code."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from bench.client_cost import HERE, measure
from bench.fake_upstream import running


def test_each_side_runs_its_own_checkout_and_is_compared_per_call_and_per_token() -> None:
    args = argparse.Namespace(streams=2, rounds=2, calls=2, lengths=[1, 9])
    with running(interval_ms=1) as (url, _):
        result = measure(url, {"this": HERE, "same": HERE}, args)
    for row in result["sides"].values():
        assert all(len(v) == 2 for v in row["us_per_call_rounds"].values())
        assert all(v > 0 for v in row["us_per_call"].values())
        assert row["us_per_call"]["9"] > row["us_per_call"]["1"], "a longer answer costs more"
    this, same = result["sides"]["this"], result["sides"]["same"]
    assert result["ratios"]["per_token"] == this["us_per_token"] / same["us_per_token"]


def test_a_side_that_cannot_run_the_measure_fails_the_bench_with_its_error(tmp_path: Path) -> None:
    args = argparse.Namespace(streams=1, rounds=1, calls=1, lengths=[1, 2])
    with running(interval_ms=1) as (url, _), pytest.raises(RuntimeError, match="failed"):
        measure(url, {"empty": str(tmp_path), "this": HERE}, args)
