"""The service as its own process (`rag serve`), for what only a real process shows: the CPU time
a request costs the server, and how late its event loop runs while it works."""

from __future__ import annotations

import contextlib
import os
import re
import socket
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import httpx

from tests.support.servers import free_port, wait_for

BIN = Path(sys.executable).parent
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def process_cpu_seconds(pid: int) -> float:
    """User plus system CPU time process ``pid`` has used so far (Linux ``/proc``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


class ServiceProcess:
    """`rag serve` on a free port against the given Redis and vLLM; keys made with `rag keys`."""

    def __init__(self, redis_url: str, llm_url: str, workdir: Path, **env: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.workdir = workdir
        self.env = {
            **os.environ,
            "RAG_ENVIRONMENT": "test",
            "RAG_REDIS__URL": redis_url,
            "RAG_REDIS__KEY_PREFIX": f"t{uuid.uuid4().hex[:8]}:",
            "RAG_LLM__BASE_URL": llm_url,
            "RAG_RETRIEVAL__INDEX_DIR": str(workdir / "indexes"),
            "RAG_LOG__REQUESTS": "false",
            **env,
        }
        self.process: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> ServiceProcess:
        log = (self.workdir / "server.log").open("wb")
        self.process = subprocess.Popen(
            [str(BIN / "rag"), "serve", "--host", "127.0.0.1", "--port", str(self.port)],
            env=self.env,
            cwd=self.workdir,
            stdout=log,
            stderr=log,
        )
        log.close()
        wait_for(self._ready, 180, "the service process", step=0.25)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.process is not None:
            self.process.terminate()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def _ready(self) -> bool:
        if self.process is not None and self.process.poll() is not None:
            log = (self.workdir / "server.log").read_text(errors="replace")[-3000:]
            raise RuntimeError(f"the service process exited:\n{log}")
        try:
            return httpx.get(f"{self.url}/healthz", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def key(self, tenant: str = "acme", user: str = "alice", scopes: str = "chat,retrieve") -> str:
        done = subprocess.run(
            [
                *(str(BIN / "rag"), "keys", "create"),
                *("--tenant", tenant, "--user", user, "--scopes", scopes),
            ],
            env=self.env,
            capture_output=True,
            text=True,
            check=True,
        )
        return done.stdout.strip()

    def cpu_seconds(self) -> float:
        """User plus system CPU time the server process has used so far."""
        assert self.process is not None
        return process_cpu_seconds(self.process.pid)

    def lag_samples(self) -> tuple[int, int]:
        """(samples of the event loop's lag so far, those over 50 ms), from /metrics."""
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        count = _sample(text, r"rag_event_loop_lag_seconds_count")
        within = _sample(text, r'rag_event_loop_lag_seconds_bucket\{le="0\.05"\}')
        return int(count), int(count - within)


def _sample(text: str, name: str) -> float:
    found = re.search(rf"^{name} ([0-9.e+-]+)$", text, re.MULTILINE)
    assert found is not None, f"{name} not in /metrics"
    return float(found.group(1))


def raw_request(port: int, head: bytes, body: bytes = b"", timeout: float = 10.0) -> bytes:
    """Send ``head`` (request line and headers) and ``body`` on a fresh connection; return all
    the server answered before closing or ``timeout`` passed (whichever first)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        # The server may answer before it has read all of it: the answer is what matters.
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            sock.sendall(head + body)
        return _read_response(sock)


def _read_response(sock: socket.socket) -> bytes:
    data = b""
    while True:
        try:
            chunk = sock.recv(65536)
        except (TimeoutError, ConnectionResetError):
            return data
        if not chunk:
            return data
        data += chunk
        head, sep, rest = data.partition(b"\r\n\r\n")
        length = re.search(rb"(?im)^content-length: *(\d+)", head)
        if sep and length and len(rest) >= int(length.group(1)):
            return data


def status_of(response: bytes) -> int:
    return int(response.split(b" ", 2)[1])


def post_head(path: str, length: int, key: str | None = None, **headers: Any) -> bytes:
    lines = [
        f"POST {path} HTTP/1.1",
        "Host: service",
        "Content-Type: application/json",
        f"Content-Length: {length}",
    ]
    if key is not None:
        lines.append(f"Authorization: Bearer {key}")
    lines += [f"{k}: {v}" for k, v in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()
