"""``bench.pool_bench``: the model client's CPU per call, one pool against several, measured
against the stub model server."""

from __future__ import annotations

import argparse
import subprocess
import sys
from functools import partial

from bench.cache_hit import up
from bench.pool_bench import measure
from pipeline.model import client as client_module
from tests.support.servers import free_port, wait_for


def test_each_pool_count_is_measured_per_level_and_compared_with_the_first() -> None:
    port = free_port()
    stub = subprocess.Popen(
        [sys.executable, "-m", "bench.fake_upstream", "--port", str(port), "--interval-ms", "1"]
    )
    pools_before = client_module.POOLS
    try:
        url = f"http://127.0.0.1:{port}"
        wait_for(partial(up, f"{url}/health"), 30, "the fake model server", step=0.1)
        args = argparse.Namespace(streams=[1, 3], pools=[1, 2], rounds=2, calls=2, tokens=3)
        result = measure(url, args)
    finally:
        client_module.POOLS = pools_before
        stub.terminate()
        stub.wait(10)
    assert [row["streams"] for row in result["levels"]] == [1, 3]
    for row in result["levels"]:
        assert all(len(v) == 2 for v in row["us_per_call_rounds"].values())
        assert all(v > 0 for v in row["us_per_call"].values())
        assert row["ratios"]["1"] == 1.0
        assert row["ratios"]["2"] == row["us_per_call"]["2"] / row["us_per_call"]["1"]
