"""What a hostile request costs the server, with and without a key, beside a tiny request.

    python -m bench.hostile_bench [--repeat 20]

The service runs as its own process (`rag serve`) against a private redis-server; the client
sends each body of `tests/support/hostile.py` (each crafted to cost as much as possible, just
under the 1 MB body limit) over raw sockets, ``--repeat`` times in a row, and reads the server's
CPU time from /proc before and after (its clock ticks are 10 ms, hence the repeats: the figure
is the total over the repeats divided by their number). The event loop's lag comes from the
service's own probe (``rag_event_loop_lag_seconds``): samples over 10 ms and over 50 ms while
the bodies were sent. The tiny request (a 100-byte chat body) is measured in the same run.

``--code DIR`` serves the service from another checkout (a `git worktree` of an earlier
commit: its modules come first on the server's PYTHONPATH), to measure before and after with
the same client and bodies.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import orjson

from tests.support.hostile import BODIES
from tests.support.process import ServiceProcess, post_head, raw_request, status_of
from tests.support.servers import RedisServer, free_port

PATH = "/v1/chat/completions"
TINY = orjson.dumps({"model": "smollm2", "messages": [{"role": "user", "content": "hi"}]})


def lag_counts(service: ServiceProcess) -> tuple[float, float, float]:
    """(samples, samples within 10 ms, within 50 ms) of the loop's lag; zeros where the code
    served has no probe."""
    import httpx

    text = httpx.get(f"{service.url}/metrics", timeout=10).text
    values = {}
    for line in text.splitlines():
        if line.startswith('rag_event_loop_lag_seconds_bucket{le="'):
            values[line.split('"')[1]] = float(line.rsplit(" ", 1)[1])
    return values.get("+Inf", 0.0), values.get("0.01", 0.0), values.get("0.05", 0.0)


def cost(service: ServiceProcess, body: bytes, key: str | None, repeat: int) -> tuple[float, int]:
    """(server CPU ms per request, the status of the last answer)."""
    time.sleep(0.2)
    before = service.cpu_seconds()
    status = 0
    for _ in range(repeat):
        status = status_of(raw_request(service.port, post_head(PATH, len(body), key), body, 120))
    return (service.cpu_seconds() - before) * 1000 / repeat, status


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--code", help="serve the service from this checkout instead")
    args = parser.parse_args()
    redis_server = RedisServer()
    redis_server.start()
    workdir = Path(tempfile.mkdtemp(prefix="rag-bench-hostile-"))
    # No model server: every body here is refused before generation (the tiny one with a key
    # gets the 503 of the absent upstream, after the whole path up to generation).
    llm = f"http://127.0.0.1:{free_port()}"
    try:
        code = {"PYTHONPATH": str(Path(args.code).resolve())} if args.code else {}
        with ServiceProcess(redis_server.url, llm, workdir, **code) as service:
            key = service.key()
            print(
                f"# hostile-input benchmark, {args.repeat} requests each, {os.cpu_count()} cores,"
                f" {time.strftime('%Y-%m-%d')}, code {args.code or 'this checkout'};"
                " server CPU per request (ms)"
            )
            print("| body | bytes | no key: CPU ms | status | with key: CPU ms | status |")
            print("|---|---|---|---|---|---|")
            lag_before = lag_counts(service)
            rows = [("tiny chat request", TINY)] + [(k, make()) for k, make in BODIES.items()]
            for name, body in rows:
                anon, anon_status = cost(service, body, None, args.repeat)
                authed, auth_status = cost(service, body, key, args.repeat)
                print(
                    f"| {name} | {len(body):,} | {anon:.2f} | {anon_status} | "
                    f"{authed:.2f} | {auth_status} |"
                )
            total, within_10, within_50 = (
                after - before
                for after, before in zip(lag_counts(service), lag_before, strict=True)
            )
            print(
                f"\nevent-loop lag over the whole run: {total:.0f} samples, "
                f"{total - within_10:.0f} over 10 ms, {total - within_50:.0f} over 50 ms"
            )
    finally:
        redis_server.stop()


if __name__ == "__main__":
    main()
