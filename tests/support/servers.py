"""Real servers for the tests: a private redis-server, the vLLM server, the service itself."""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import re
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

import httpx
import redis
import uvicorn
from fastapi import FastAPI

from app.http.server import BoundedHttpToolsProtocol

ROOT = Path(__file__).resolve().parents[2]
T = TypeVar("T")


async def over_its_memory(client: Any) -> None:
    """Put a test's own Redis (``client``: redis-py's asyncio client) over its maxmemory, with
    the default policy (noeviction): every write that needs memory is refused with an
    ``OutOfMemoryError``, reads go on. ``CONFIG SET maxmemory 0`` gives it room again."""
    from redis.exceptions import OutOfMemoryError

    for n in range(50):
        await client.set(f"junk:{n}", b"x" * 10_000)
    used = (await client.info("memory"))["used_memory"]
    await client.config_set("maxmemory", used - 100_000)
    try:
        await client.set("junk:more", b"x")
    except OutOfMemoryError:
        return
    raise AssertionError("Redis still takes writes over its maxmemory")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def port_outside_ephemeral_range() -> int:
    """A free port below the kernel's ephemeral range (where ``free_port`` and outgoing
    connections take theirs), for a server that binds it long after it is chosen."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    ports = list(range(20000, max(low, 20001)))
    random.shuffle(ports)
    for port in ports:
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    return free_port()


def cluster_node_port() -> int:
    """A free port whose cluster bus port (10,000 above) is free too, both below the
    ephemeral range (a bus port above 65,535, or taken, keeps a node from starting)."""
    ports = list(range(20000, 22000))
    random.shuffle(ports)
    for port in ports:
        with socket.socket() as one, socket.socket() as bus:
            try:
                one.bind(("127.0.0.1", port))
                bus.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port pair for a Redis Cluster node")


def wait_for(check: Callable[[], bool], timeout: float, what: str, step: float = 0.1) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(step)
    raise TimeoutError(f"{what} did not become ready within {timeout:.0f} s")


class RedisServer:
    """A redis-server of the tests' own, on a free port, that a test may stop and start again."""

    def __init__(self, password: str | None = None, port: int | None = None) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError(
                "redis-server is not installed: `apt-get install redis-server` (make test does it)"
            )
        self.binary = binary
        self.password = password  # `requirepass`, as compose's Redis has
        self.port = port or free_port()
        self.dir = tempfile.mkdtemp(prefix="rag-test-redis-")
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def _answers(self) -> bool:
        auth = f"AUTH {self.password}\r\n".encode() if self.password else b""
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as sock:
                sock.sendall(auth + b"PING\r\n")
                return b"+PONG" in sock.recv(32)
        except OSError:
            return False

    def start(self, *options: str) -> None:
        self.process = subprocess.Popen(
            [
                self.binary,
                *options,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                self.dir,
                *(["--requirepass", self.password] if self.password else []),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        wait_for(self._answers, 10, f"redis-server on port {self.port}")

    def stop(self) -> None:
        if self.process is not None:
            self.process.terminate()
            self.process.wait(10)
            self.process = None


class RedisClusterServers:
    """A Redis Cluster of the tests' own: ``nodes`` redis-servers on free ports, the slots split
    between the primaries by ``redis-cli --cluster create`` (``replicas`` of each primary among
    them); ``url`` names the first, which tells a cluster client the others. A node is taken
    for failed after ``node_timeout_ms`` without an answer (a replica then takes its place)."""

    def __init__(self, nodes: int = 3, replicas: int = 0, node_timeout_ms: int = 15000) -> None:
        self.replicas = replicas
        self.node_timeout_ms = node_timeout_ms
        self.nodes: list[RedisServer] = []
        for _ in range(nodes):
            port = cluster_node_port()
            while any(node.port in (port, port + 10000) for node in self.nodes):
                port = cluster_node_port()
            self.nodes.append(RedisServer(port=port))
        cli = shutil.which("redis-cli")
        if cli is None:
            raise RuntimeError("redis-cli is not installed: `apt-get install redis-tools`")
        self.cli = cli

    @property
    def url(self) -> str:
        """The first node that runs (all of them until a test stops one)."""
        return next((n for n in self.nodes if n.process is not None), self.nodes[0]).url

    def flags(self, node: RedisServer) -> set[str]:
        """``node``'s flags as a running node sees them (``master``, ``fail``, ``fail?``...)."""
        seen = next(n for n in self.nodes if n.process is not None)
        for line in self.ask(seen, "cluster", "nodes").splitlines():
            fields = line.split()
            if len(fields) > 2 and f":{node.port}@" in fields[1]:
                return set(fields[2].split(","))
        return set()

    def start_node(self, node: RedisServer) -> None:
        """Start one of the nodes (again: it rejoins with its own ``nodes.conf``)."""
        node.start(
            "--cluster-enabled",
            "yes",
            "--cluster-config-file",
            f"{node.dir}/nodes.conf",
            "--cluster-node-timeout",
            str(self.node_timeout_ms),
        )

    def start(self) -> None:
        try:
            self._start()
        except BaseException:
            self.stop()  # no node left running when the cluster could not be made
            raise

    def _start(self) -> None:
        for node in self.nodes:
            self.start_node(node)
        subprocess.run(
            [
                self.cli,
                "--cluster",
                "create",
                *(f"127.0.0.1:{node.port}" for node in self.nodes),
                "--cluster-replicas",
                str(self.replicas),
                "--cluster-yes",
            ],
            check=True,
            capture_output=True,
            timeout=30,
        )
        self.wait_ready()

    def wait_ready(self, timeout: float = 30) -> None:
        wait_for(self._ready, timeout, "the Redis Cluster's slots assigned")

    def ask(self, node: RedisServer, *command: str) -> str:
        return subprocess.run(
            [self.cli, "-p", str(node.port), *command], capture_output=True, text=True, timeout=5
        ).stdout

    def owner(self, slot: int) -> RedisServer:
        """The primary that holds ``slot``, as a running node sees it."""
        seen = next(n for n in self.nodes if n.process is not None)
        for line in self.ask(seen, "cluster", "nodes").splitlines():
            fields = line.split()
            for held in fields[8:]:
                first, _, last = held.partition("-")
                if first.isdigit() and int(first) <= slot <= int(last or first):
                    return next(n for n in self.nodes if f":{n.port}@" in fields[1])
        raise LookupError(f"no node holds slot {slot}")

    def move_slot(
        self, slot: int, to: RedisServer, *, keys_a_step: int = 1, pause_s: float = 0.0
    ) -> int:
        """Reshard ``slot`` to ``to`` as ``redis-cli --cluster reshard`` does, slowly enough to
        be caught in the middle: the slot marked importing and migrating, its keys moved
        ``keys_a_step`` at a time (MIGRATE) with ``pause_s`` between, then given to ``to`` on
        every node. Returns how many keys moved."""
        source = self.owner(slot)
        ids = {n.port: self.ask(n, "cluster", "myid").strip() for n in (source, to)}
        with redis.Redis(port=source.port) as old, redis.Redis(port=to.port) as new:
            new.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", ids[source.port])
            old.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", ids[to.port])
            moved = 0
            while keys := old.execute_command("CLUSTER", "GETKEYSINSLOT", slot, keys_a_step):
                old.execute_command("MIGRATE", "127.0.0.1", to.port, "", 0, 5000, "KEYS", *keys)
                moved += len(keys)
                time.sleep(pause_s)
        for node in self.nodes:
            if node.process is not None:
                with (
                    redis.Redis(port=node.port) as client,
                    contextlib.suppress(redis.ResponseError),
                ):
                    # (a replica refuses: it learns the slot's owner from its primary)
                    client.execute_command("CLUSTER", "SETSLOT", slot, "NODE", ids[to.port])
        return moved

    def _ready(self) -> bool:
        running = [node for node in self.nodes if node.process is not None]
        return all("cluster_state:ok" in self.ask(node, "cluster", "info") for node in running)

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()


# A logit_bias that keeps the test model (SmolLM2) from ending its answer: its end-of-turn
# (<|im_end|>, 2: the generation config's eos_token_id) and end-of-text (<|endoftext|>, 0)
# tokens may never be drawn, so it writes until max_tokens. Tests that need an answer of a
# known length (one still running when something happens to it) use it: with greedy decoding
# alone the model's length varies with the batch it shares (a "count to 500" stopped at 20).
UNENDING = {"0": -100, "2": -100}


class VLLMServer:
    """The real vLLM OpenAI-compatible server (CPU build), or one already running at a URL."""

    def __init__(self) -> None:
        self.process: subprocess.Popen[bytes] | None = None
        self.log_path = Path(tempfile.gettempdir()) / "rag-test-vllm.log"
        given = os.environ.get("RAG_TEST_VLLM_URL")
        self.url = given.rstrip("/") if given else ""
        self.launched = 0.0

    def _healthy(self) -> bool:
        try:
            return httpx.get(f"{self.url}/health", timeout=1.0).status_code == 200
        except httpx.HTTPError:
            return False

    def launch(self) -> None:
        """Start vLLM and return at once (it answers /health minutes later, after its warm-up);
        nothing when it was launched already or runs at RAG_TEST_VLLM_URL.

        It starts at nice 10, so the tests that run beside its warm-up keep their CPU; `ready`
        puts it back to normal priority where the user may (root, as CI). Its port is outside
        the ephemeral range: it is bound minutes after it is chosen, and in the meantime no
        outgoing connection or ``free_port`` can take it."""
        if self.url:
            return
        port = port_outside_ephemeral_range()
        self.url = f"http://127.0.0.1:{port}"
        script = ROOT / "scripts" / "start-vllm.sh"
        with self.log_path.open("wb") as log:
            self.process = subprocess.Popen(
                ["nice", "-n", "10", "bash", str(script), str(port)],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.launched = time.monotonic()

    def ready(self) -> None:
        """Wait until vLLM answers /health: at most 600 s from its launch."""
        if self.process is None:
            if not self.url:
                raise RuntimeError("vLLM was not launched")
            if not self._healthy():
                raise RuntimeError(f"RAG_TEST_VLLM_URL={self.url} does not answer /health")
            return
        deadline = self.launched + 600
        while not self._healthy():
            if self.process.poll() is not None:
                tail = self.log_path.read_text(errors="replace")[-3000:]
                raise RuntimeError(
                    "vLLM failed to start. Install it and build the model with "
                    f"`make vllm model`, or set RAG_TEST_VLLM_URL. Log tail:\n{tail}"
                )
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"vLLM did not answer /health within 600 s; see {self.log_path}")
            time.sleep(1)
        with contextlib.suppress(PermissionError):
            os.setpriority(os.PRIO_PGRP, self.process.pid, 0)

    def start(self) -> None:
        self.launch()
        self.ready()

    def busy(self) -> float:
        """Sequences vLLM is running or has queued now (its /metrics), -1 if it cannot tell."""
        try:
            text = httpx.get(f"{self.url}/metrics", timeout=5).text
        except httpx.HTTPError:
            return -1
        found = re.findall(
            r"^vllm:num_requests_(?:running|waiting)\{[^}]*\} ([0-9.e+]+)$", text, re.M
        )
        return sum(float(value) for value in found) if found else -1

    def wait_idle(self, timeout: float = 60) -> float:
        """Wait (at most ``timeout`` s) until vLLM runs nothing, so a test that times one
        answer against another does not share the engine with what earlier tests left; returns
        what was still running when the wait ended (0: idle)."""
        deadline = time.monotonic() + timeout
        while (left := self.busy()) > 0 and time.monotonic() < deadline:
            time.sleep(0.5)
        return left

    def stop(self) -> None:
        if self.process is not None:
            os.killpg(self.process.pid, 15)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, 9)
            self.process = None


class LiveService:
    """The FastAPI app served by uvicorn on a free port, in a thread, for real HTTP clients."""

    def __init__(self, app: FastAPI) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        # The HTTP protocol `rag serve` runs (``app.http.server``), not uvicorn's default.
        config = uvicorn.Config(
            app,
            host="127.0.0.1",
            port=self.port,
            log_level="warning",
            http=BoundedHttpToolsProtocol,
        )
        self.server = uvicorn.Server(config)
        self._loop: asyncio.AbstractEventLoop | None = None
        self.thread = threading.Thread(target=self._serve, daemon=True)

    def _serve(self) -> None:
        # A Runner, as asyncio.run: when the server has stopped, what is left on its loop (a
        # task, a transport's connection_lost callback) runs to its end before the loop is
        # closed, instead of leaving an open socket to the garbage collector.
        with asyncio.Runner() as runner:
            self._loop = runner.get_loop()
            runner.run(self.server.serve())

    def __enter__(self) -> LiveService:
        self.thread.start()
        wait_for(lambda: self.server.started, 180, "uvicorn")
        return self

    def run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        """Run a coroutine on the server's event loop (for its Redis-bound services)."""
        loop = self.server_loop
        return asyncio.run_coroutine_threadsafe(coroutine, loop).result(30)

    @property
    def server_loop(self) -> asyncio.AbstractEventLoop:
        assert self._loop is not None
        return self._loop

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(30)


def streamed_chat(url: str, key: str, body: dict[str, Any], timeout: float) -> Any:
    """A streamed chat request to the service at ``url`` (a context manager, as httpx's)."""
    return httpx.stream(
        "POST",
        f"{url}/v1/chat/completions",
        json=body,
        headers={"Authorization": f"Bearer {key}"},
        timeout=timeout,
    )
