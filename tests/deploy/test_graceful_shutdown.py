"""The image's start command (the Dockerfile's CMD, run here as a real process) stops gracefully:
SIGTERM, as `docker stop` sends it, lets an in-flight stream finish, then the lifespan shuts the
service down and the process ends."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import httpx

from tests.support.servers import RedisServer, VLLMServer, free_port, wait_for

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def image_command(port: int) -> list[str]:
    """The Dockerfile's CMD, on the loopback and a free port instead of the container's 8000."""
    dockerfile = re.sub(r"\\\n\s*", " ", (ROOT / "Dockerfile").read_text())
    found = re.search(r"^CMD\s+(\[.*\])\s*$", dockerfile, re.MULTILINE)
    assert found is not None, "the Dockerfile has no exec-form CMD"
    argv: list[str] = json.loads(found.group(1))
    argv[argv.index("--host") + 1] = "127.0.0.1"
    argv[argv.index("--port") + 1] = str(port)
    return [str(BIN / argv[0]), *argv[1:]]


def _ready(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def stream_and_terminate(port: int, key: str, server: subprocess.Popen[bytes]) -> list[str]:
    """Stream an answer; at its first chunk, SIGTERM the server (what `docker stop` sends PID 1).
    Returns the SSE lines, with "SIGTERM" where the signal was sent."""
    body = {
        "model": "smollm2",
        "stream": True,
        "max_tokens": 24,
        "rag": {"enabled": False},
        "messages": [{"role": "user", "content": "Count from 1 to 30, separated by commas."}],
    }
    lines: list[str] = []
    with httpx.stream(
        "POST",
        f"http://127.0.0.1:{port}/v1/chat/completions",
        json=body,
        headers={"Authorization": f"Bearer {key}", "Cache-Control": "no-store"},
        timeout=120,
    ) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: {") and "SIGTERM" not in lines:
                server.send_signal(signal.SIGTERM)
                lines.append("SIGTERM")
            if line:
                lines.append(line)
    return lines


def test_sigterm_lets_an_in_flight_stream_finish(
    redis_server: RedisServer, vllm: VLLMServer, tmp_path: Path
) -> None:
    port = free_port()
    env = {
        **os.environ,
        "RAG_ENVIRONMENT": "test",
        "RAG_REDIS__URL": redis_server.url,
        "RAG_REDIS__KEY_PREFIX": f"t{uuid.uuid4().hex[:8]}:",
        "RAG_LLM__BASE_URL": vllm.url,
        "RAG_RETRIEVAL__ENABLED": "false",
        "RAG_RETRIEVAL__INDEX_DIR": str(tmp_path / "indexes"),
    }
    key = subprocess.run(
        [str(BIN / "rag"), "keys", "create", "--tenant", "acme", "--user", "alice"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    log = (tmp_path / "server.log").open("wb")
    server = subprocess.Popen(image_command(port), env=env, cwd=tmp_path, stdout=log, stderr=log)
    try:
        wait_for(lambda: _ready(port), 180, "the service started by the image's CMD", step=0.5)
        lines = stream_and_terminate(port, key, server)
        after = lines[lines.index("SIGTERM") + 1 :]
        assert len([line for line in after if line.startswith("data: {")]) >= 2, lines[-3:]
        assert lines[-1] == "data: [DONE]"
        # uvicorn re-raises the signal once it has shut down, so the exit is SIGTERM's (143 in a
        # container), after the shutdown checked below, not instead of it.
        assert server.wait(timeout=30) in (0, -signal.SIGTERM)
        assert not _ready(port)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
        log.close()
    logged = (tmp_path / "server.log").read_text()
    assert "timeout graceful shutdown exceeded" not in logged
    assert "Application shutdown complete" in logged
