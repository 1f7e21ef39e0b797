"""What HTTP/1.1 pipelining costs the service's protocol (``app.http.server``), this checkout
against another (``--before``, a ``git worktree``), side by side.

    .venv/bin/python -m bench.pipelining_bench --before DIR [--rounds 5] [--connections 20]
        [--serial 8000]

Each measure runs in a fresh process started in the checkout measured, so each side runs its
own protocol on uvloop, the sides alternating, the order rotating by round:

- **memory under a pipelined flood**: ``--connections`` connections each send, in one write, a
  request the app holds and then 128 KiB of the smallest pipelined requests (18 bytes each);
  after a second, the server process's resident memory growth (MiB) and the requests waiting
  per connection;
- **the parser's CPU per request** (``data_received`` alone, on a protocol with a stand-in
  transport): a 1.6 KiB chat request in one read, and a 1 MiB body in 64 KiB reads;
- **the server's CPU per request, whole**: a trivial app answering ``--serial`` 1.6 KiB requests
  sent one after another on one connection by a client process of its own (raw sockets), so
  the figure is the server process's alone: reading, parsing, the ASGI cycle, writing.

Medians over the rounds. Writes bench/results/pipelining_bench.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

HERE = str(Path(__file__).resolve().parents[1])
SMALLEST = b"GET / HTTP/1.1\r\n\r\n"
FLOOD = SMALLEST * (131_072 // len(SMALLEST))
CHAT = (
    b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer k\r\n"
    b"content-type: application/json\r\ncontent-length: 1500\r\n\r\n" + b"x" * 1500
)
BIG = b"POST /v1/documents HTTP/1.1\r\nhost: x\r\ncontent-length: 1048576\r\n\r\n" + b"x" * 1048576


def rss_mib() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096 / 2**20


class Hold:
    """``/hold`` waits for ``release``; anything else is answered at once."""

    def __init__(self) -> None:
        self.release = asyncio.Event()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        if scope["path"] == "/hold":
            await self.release.wait()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"y"})


@asynccontextmanager
async def serving(app: Any) -> AsyncIterator[tuple[Any, int]]:
    """``app`` under uvicorn on the checkout's protocol, on a free port: the server and port."""
    import uvicorn

    from app.http.server import BoundedHttpToolsProtocol

    config = uvicorn.Config(
        app,
        port=0,
        http=BoundedHttpToolsProtocol,
        log_level="warning",
        lifespan="off",
        access_log=False,
    )
    server = uvicorn.Server(config)
    task = asyncio.ensure_future(server.serve())
    while not server.started:  # noqa: ASYNC110 (uvicorn has a flag, no event)
        await asyncio.sleep(0.01)
    try:
        yield server, server.servers[0].sockets[0].getsockname()[1]
    finally:
        server.should_exit = server.force_exit = True
        await task


async def flood(connections: int) -> dict[str, float]:
    app = Hold()
    async with serving(app) as (server, port):
        base = rss_mib()
        writers = []
        for _ in range(connections):
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET /hold HTTP/1.1\r\n\r\n" + FLOOD)
            writers.append(writer)
        await asyncio.sleep(1.0)
        waiting = [len(p.pipeline) for p in server.server_state.connections]
        grown = rss_mib() - base
        app.release.set()
        for writer in writers:
            writer.close()
    return {"rss_growth_mib": grown, "waiting_per_connection": statistics.median(waiting)}


class StandIn(asyncio.Transport):
    """A transport that takes writes and nothing else, for the parser alone."""

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"peername": ("127.0.0.1", 1), "sockname": ("127.0.0.1", 2)}.get(name, default)

    def write(self, data: Any) -> None:
        pass

    def is_closing(self) -> bool:
        return False

    def close(self) -> None:
        pass

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


async def parse_cost(reads: list[bytes], repeats: int = 200) -> float:
    """µs of ``data_received`` for one request arriving as ``reads`` (median of ``repeats``)."""
    import uvicorn
    from uvicorn.server import ServerState

    from app.http.server import BoundedHttpToolsProtocol

    async def app(scope: Any, receive: Any, send: Any) -> None:
        pass

    config = uvicorn.Config(app, http=BoundedHttpToolsProtocol, log_level="warning")
    config.load()
    loop = asyncio.get_running_loop()
    times = []
    for _ in range(repeats):
        protocol = BoundedHttpToolsProtocol(
            config=config, server_state=ServerState(), app_state={}, _loop=loop
        )
        protocol.connection_made(StandIn())
        started = time.perf_counter_ns()
        for read in reads:
            protocol.data_received(read)
        times.append((time.perf_counter_ns() - started) / 1000)
        for task in list(protocol.tasks):
            task.cancel()
        protocol.connection_lost(None)
        await asyncio.sleep(0)
    return statistics.median(times)


def own_checkout() -> None:
    """The protocol measured is the checkout's this process runs in, not an installed one."""
    from app.http import server

    if not Path(server.__file__).resolve().is_relative_to(Path.cwd().resolve()):
        raise RuntimeError(f"{Path.cwd()} has no app.http.server (found {server.__file__})")


SERIAL_CLIENT = (
    "import socket, sys\n"
    "request = bytes.fromhex(sys.argv[3])\n"
    "sock = socket.create_connection(('127.0.0.1', int(sys.argv[1])))\n"
    "sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)\n"
    "for _ in range(int(sys.argv[2])):\n"
    "    sock.sendall(request)\n"
    "    got = b''\n"
    "    while not got.endswith(b'}'):\n"
    "        got += sock.recv(65536)\n"
)


async def serial(requests: int) -> dict[str, float]:
    """µs of this process's CPU per request, serving ``requests`` sent one after another."""
    answer = b'{"answer": "' + b"x" * 600 + b'"}'

    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        while (await receive()).get("more_body"):
            pass
        length = str(len(answer)).encode()
        await send(
            {"type": "http.response.start", "status": 200, "headers": [(b"content-length", length)]}
        )
        await send({"type": "http.response.body", "body": answer})

    async with serving(app) as (_, port):
        started = time.process_time()
        client = await asyncio.create_subprocess_exec(
            sys.executable, "-c", SERIAL_CLIENT, str(port), str(requests), CHAT.hex()
        )
        await client.wait()
        spent = time.process_time() - started
    return {"serial_us": spent / requests * 1e6}


async def child(mode: str, connections: int) -> dict[str, float]:
    """One side's measures of one kind, each kind in a fresh process of its own: the flood's
    memory, once freed, would make the parser's allocations cheaper after it."""
    own_checkout()
    if mode == "flood":
        return await flood(connections)
    if mode == "serial":
        return await serial(connections)
    return {
        "chat_us": await parse_cost([CHAT]),
        "body_1mib_us": await parse_cost(
            [BIG[i : i + 65536] for i in range(0, len(BIG), 65536)], repeats=50
        ),
    }


# The measure is this file's, run against the other checkout's ``app`` (its ``bench`` may not
# have this file): loaded by its path, in a process whose first import path is that checkout.
CHILD = (
    "import importlib.util, json, sys, uvloop\n"
    "spec = importlib.util.spec_from_file_location('pipelining_bench', sys.argv[3])\n"
    "module = importlib.util.module_from_spec(spec)\n"
    "spec.loader.exec_module(module)\n"
    "print(json.dumps(uvloop.run(module.child(sys.argv[1], int(sys.argv[2])))))\n"
)
MEASURES = ("rss_growth_mib", "waiting_per_connection", "chat_us", "body_1mib_us", "serial_us")


def run_side(root: str, connections: int, serial: int) -> dict[str, float]:
    values: dict[str, float] = {}
    for mode, count in (("flood", connections), ("parse", 0), ("serial", serial)):
        done = subprocess.run(
            [sys.executable, "-c", CHILD, mode, str(count), __file__],
            cwd=root,
            capture_output=True,
            text=True,
            check=False,
        )
        if done.returncode != 0:
            raise RuntimeError(f"the measure in {root} failed:\n{done.stderr[-2000:]}")
        values.update(json.loads(done.stdout.strip().splitlines()[-1]))
    return values


def measure(
    roots: dict[str, str], rounds: int, connections: int, serial: int = 8000
) -> dict[str, Any]:
    from bench.e2e import median, ratio

    sides = list(roots)
    series: dict[str, list[dict[str, float]]] = {side: [] for side in sides}
    for number in range(rounds):
        turn = number % len(sides)
        for side in sides[turn:] + sides[:turn]:
            series[side].append(run_side(roots[side], connections, serial))
        print(f"  round {number + 1}/{rounds} done", flush=True)
    result: dict[str, Any] = {"sides": {}}
    for side in sides:
        result["sides"][side] = {m: median([r[m] for r in series[side]]) for m in MEASURES}
        result["sides"][side]["rounds"] = series[side]
    after, before = (result["sides"][s] for s in sides)
    result["ratios"] = {m: ratio(after[m], before[m]) for m in MEASURES}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--before", required=True, help="the other checkout")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--connections", type=int, default=20)
    parser.add_argument("--serial", type=int, default=8000, help="requests, one after another")
    args = parser.parse_args()
    if min(args.rounds, args.connections, args.serial) < 1:
        parser.error("--rounds, --connections and --serial at least 1")
    roots = {"this checkout": HERE, "before": str(Path(args.before).resolve())}
    result = measure(roots, args.rounds, args.connections, args.serial)
    result.update(vars(args))
    from bench.e2e import write_result

    path = write_result("pipelining_bench", result)
    print(
        "\n| side | RSS growth MiB | waiting / connection | parser µs, chat | parser µs, 1 MiB "
        "| server µs / request |\n| --- | --- | --- | --- | --- | --- |"
    )
    for side, row in result["sides"].items():
        print(
            f"| {side} | {row['rss_growth_mib']:.1f} | {row['waiting_per_connection']:.0f} "
            f"| {row['chat_us']:.1f} | {row['body_1mib_us']:.0f} | {row['serial_us']:.1f} |"
        )
    print("\nratios: " + ", ".join(f"{m} {v:.2f}x" for m, v in result["ratios"].items()))
    print(f"written: {path}")


if __name__ == "__main__":
    main()
