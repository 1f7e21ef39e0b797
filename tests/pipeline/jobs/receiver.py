"""Real webhook receivers for the tests, on loopback, in threads: an HTTP server that records
what it is sent and answers with the statuses it is told (then 200), and a raw TCP one that
drips its answer one byte a second."""

from __future__ import annotations

import itertools
import socket
import ssl
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from tests.support.servers import free_port


@dataclass
class Received:
    path: str
    headers: dict[str, str]
    body: bytes


@dataclass
class Receiver:
    """``with Receiver() as r``: serves on ``r.url``; ``r.statuses`` are answered in order."""

    port: int = field(default_factory=free_port)
    statuses: list[int] = field(default_factory=list)
    received: list[Received] = field(default_factory=list)
    tls: ssl.SSLContext | None = None

    def __post_init__(self) -> None:
        self._server: ThreadingHTTPServer | None = None
        self._lock = threading.Condition()

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self.port}/hook"

    def start(self) -> Receiver:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length", "0")))
                with receiver._lock:
                    receiver.received.append(
                        Received(self.path, {k.lower(): v for k, v in self.headers.items()}, body)
                    )
                    status = receiver.statuses.pop(0) if receiver.statuses else 200
                    receiver._lock.notify_all()
                self.send_response(status)
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        if self.tls is not None:
            self._server.socket = self.tls.wrap_socket(self._server.socket, server_side=True)
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def wait(self, count: int, within: float) -> bool:
        """Block until ``count`` requests have come in (or ``within`` seconds have passed)."""
        with self._lock:
            return self._lock.wait_for(lambda: len(self.received) >= count, within)

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def __enter__(self) -> Receiver:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@dataclass
class DripReceiver:
    """A raw TCP receiver that reads the request, then answers one byte a second (a status
    line that never ends) for up to ``drip_seconds``: a receiver that pins whoever waits on it.
    Counts connections and the most that were open at once."""

    port: int = field(default_factory=free_port)
    drip_seconds: float = 60.0
    connections: int = 0
    most_at_once: int = 0

    def __post_init__(self) -> None:
        self._open = 0
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._listener: socket.socket | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/hook"

    def __enter__(self) -> DripReceiver:
        self._listener = socket.create_server(("127.0.0.1", self.port))
        self._listener.settimeout(0.2)
        threading.Thread(target=self._accept, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stopped.set()
        if self._listener is not None:
            self._listener.close()

    def _accept(self) -> None:
        assert self._listener is not None
        while not self._stopped.is_set():
            try:
                conn, _ = self._listener.accept()
            except OSError:
                continue
            threading.Thread(target=self._drip, args=(conn,), daemon=True).start()

    def _drip(self, conn: socket.socket) -> None:
        with self._lock:
            self.connections += 1
            self._open += 1
            self.most_at_once = max(self.most_at_once, self._open)
        try:
            conn.settimeout(5)
            conn.recv(65536)  # the request (small enough to come in one read)
            deadline = time.monotonic() + self.drip_seconds
            for byte in itertools.cycle(b"HTTP/1.1 200 OK-and-then-some"):
                if self._stopped.is_set() or time.monotonic() > deadline:
                    break
                conn.sendall(bytes([byte]))
                if self._stopped.wait(1.0):
                    break
        except OSError:
            pass  # the client gave up: what the deadline is for
        finally:
            conn.close()
            with self._lock:
                self._open -= 1
