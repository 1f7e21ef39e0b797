"""Server CPU for one huge request head: uvicorn's httptools protocol against the bounded one
(`app.http.server`), side by side, on a bare ASGI app (the head is parsed before any app code runs).

    .venv/bin/python -m bench.head_bench [--mb 4 16 60]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
PROTOCOLS = {"httptools": "httptools", "bounded": "app.http.server:BoundedHttpToolsProtocol"}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def cpu(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def one(port: int, size: int) -> bytes:
    head = b"GET / HTTP/1.1\r\nHost: x\r\nX-Big: " + b"x" * size + b"\r\n\r\n"
    with socket.create_connection(("127.0.0.1", port), timeout=300) as sock:
        with contextlib.suppress(OSError):  # the bounded protocol answers before it all arrives
            sock.sendall(head)
        try:
            return sock.recv(200)
        except OSError:
            return b""


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mb", type=int, nargs="+", default=[4, 16, 60])
    args = parser.parse_args()
    print("| head | protocol | server CPU s | answer |")
    print("| --- | --- | --- | --- |")
    for mb in args.mb:
        for name, http in PROTOCOLS.items():
            port = free_port()
            server = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "uvicorn",
                    "bench.floor_app:app",
                    "--port",
                    str(port),
                    "--http",
                    http,
                    "--log-level",
                    "warning",
                ],
            )
            try:
                for _ in range(100):
                    try:
                        socket.create_connection(("127.0.0.1", port), timeout=1).close()
                        break
                    except OSError:
                        time.sleep(0.1)
                before = cpu(server.pid)
                answer = one(port, mb * 1_000_000)
                time.sleep(0.5)
                spent = cpu(server.pid) - before
                status = answer.split(b"\r\n", 1)[0].decode(errors="replace") or "(closed)"
                print(f"| {mb} MB | {name} | {spent:.2f} | {status} |", flush=True)
            finally:
                server.terminate()
                server.wait()


if __name__ == "__main__":
    main()
