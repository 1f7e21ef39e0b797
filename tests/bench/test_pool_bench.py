"""``bench.pool_bench``: the model client's CPU per call, one pool against several, measured
against the stub model server."""

from __future__ import annotations

import argparse

from bench.fake_upstream import running
from bench.pool_bench import measure
from pipeline.model import client as client_module


def test_each_pool_count_is_measured_per_level_and_compared_with_the_first() -> None:
    pools_before = client_module.POOLS
    try:
        with running(interval_ms=1) as (url, _):
            args = argparse.Namespace(streams=[1, 3], pools=[1, 2], rounds=2, calls=2, tokens=3)
            result = measure(url, args)
    finally:
        client_module.POOLS = pools_before
    assert [row["streams"] for row in result["levels"]] == [1, 3]
    for row in result["levels"]:
        assert all(len(v) == 2 for v in row["us_per_call_rounds"].values())
        assert all(v > 0 for v in row["us_per_call"].values())
        assert row["ratios"]["1"] == 1.0
        assert row["ratios"]["2"] == row["us_per_call"]["2"] / row["us_per_call"]["1"]
