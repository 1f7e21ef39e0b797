"""The image's start command (the Dockerfile's CMD, run here as a real process) stops gracefully:
SIGTERM, as `docker stop` sends it, lets an in-flight stream finish, then the lifespan shuts the
service down and the process ends. While it drains, new requests get a 503 in OpenAI's shape with
Retry-After; what would outlast the grace period is ended cleanly (a stream with a final error
event, a plain request with the same 503), before uvicorn would cancel it."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from tests.app.test_errors import assert_openai_error
from tests.support.faultproxy import FaultProxy, hold_after_content
from tests.support.servers import UNENDING, RedisServer, VLLMServer, free_port, wait_for

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def image_command(port: int, grace: float | None = None) -> list[str]:
    """The Dockerfile's CMD, on the loopback and a free port instead of the container's 8000
    (and with another grace period, when given)."""
    dockerfile = re.sub(r"\\\n\s*", " ", (ROOT / "Dockerfile").read_text())
    found = re.search(r"^CMD\s+(\[.*\])\s*$", dockerfile, re.MULTILINE)
    assert found is not None, "the Dockerfile has no exec-form CMD"
    argv: list[str] = json.loads(found.group(1))
    argv[argv.index("--host") + 1] = "127.0.0.1"
    argv[argv.index("--port") + 1] = str(port)
    if grace is not None:
        argv[argv.index("--timeout-graceful-shutdown") + 1] = f"{grace:g}"
    return [str(BIN / argv[0]), *argv[1:]]


def _ready(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


@dataclass
class Served:
    port: int
    key: str
    process: subprocess.Popen[bytes]
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def logged(self) -> str:
        return self.log.read_text(errors="replace")

    def told(self, drained: Drained | None = None) -> str:
        """What a failed assertion should say: the timings and the server's last words."""
        timing = "" if drained is None else f"{drained.timing()}; "
        return f"{timing}server log tail:\n{self.logged()[-2000:]}"


@contextmanager
def image_server(
    redis_server: RedisServer,
    vllm: VLLMServer,
    tmp_path: Path,
    grace: float | None = None,
    llm_url: str | None = None,
) -> Iterator[Served]:
    """The image's command as a process, ready, with a key for tenant acme (its model server:
    ``llm_url``, vLLM's by default). The tests time one answer against another: they start on
    an idle engine, not one still busy with what earlier tests left."""
    vllm.wait_idle()
    port = free_port()
    env = {
        **os.environ,
        "RAG_ENVIRONMENT": "test",
        "RAG_REDIS__URL": redis_server.url,
        "RAG_REDIS__KEY_PREFIX": f"t{uuid.uuid4().hex[:8]}:",
        "RAG_LLM__BASE_URL": llm_url or vllm.url,
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
    log_path = tmp_path / "server.log"
    log = log_path.open("wb")
    server = subprocess.Popen(
        image_command(port, grace), env=env, cwd=tmp_path, stdout=log, stderr=log
    )
    try:
        wait_for(lambda: _ready(port), 180, "the service started by the image's CMD", step=0.5)
        yield Served(port, key, server, log_path)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
        log.close()


def counting(max_tokens: int, stream: bool = True) -> dict[str, Any]:
    """A body whose answer takes exactly ``max_tokens`` tokens (the model counts and may not
    stop before)."""
    return {
        "model": "smollm2",
        "stream": stream,
        "max_tokens": max_tokens,
        "temperature": 0,
        "logit_bias": UNENDING,
        "rag": {"enabled": False},
        "messages": [{"role": "user", "content": "Count from 1 to 500, separated by commas."}],
    }


@dataclass
class Drained:
    """A stream SIGTERM came into: its SSE lines, with "SIGTERM" where the signal was sent."""

    lines: list[str]
    signal_s: float  # from the request to the signal
    took: float  # from the signal to the stream's end

    def timing(self) -> str:
        return (
            f"SIGTERM {self.signal_s:.2f} s after the request, end {self.took:.2f} s after SIGTERM"
        )


def stream_and_terminate(
    served: Served,
    body: dict[str, Any],
    *,
    while_draining: Any = None,
    hold: FaultProxy | None = None,
    before_answer: bool = False,
) -> Drained:
    """Stream an answer, SIGTERM the server (what `docker stop` sends PID 1) while it is in
    flight, and call ``while_draining()``. The signal goes at the answer's first chunk; with
    ``hold`` (the proxy in front of the model server, its rewriter ``hold_after_content``),
    once the proxy holds the rest of the answer, which it lets through once
    ``while_draining()`` has returned. With ``before_answer`` too, the signal goes before the
    answer has begun: the model call is held at the proxy before it reaches the model. Either
    way the stream is in flight all that time, however fast the engine or slow the test. (A
    signal at the first chunk, with the model call held only then, once came after the
    answer's end: the engine, on both cores, wrote 64 tokens before the test could hold them.)"""
    lines: list[str] = []
    began = time.monotonic()
    signalled = 0.0

    def terminate() -> None:
        nonlocal signalled
        served.process.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        lines.append("SIGTERM")
        try:
            if while_draining is not None:
                while_draining()
        finally:
            if hold is not None:
                hold.release()

    def stream() -> None:
        with httpx.stream(
            "POST",
            f"{served.url}/v1/chat/completions",
            json=body,
            headers={"Authorization": f"Bearer {served.key}", "Cache-Control": "no-store"},
            timeout=120,
        ) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if line:
                    lines.append(line)
                if before_answer or not line.startswith("data: {") or "SIGTERM" in lines:
                    continue
                if hold is not None:
                    assert hold.holding_requests(b"/v1/chat/completions", 1, timeout=60), (
                        f"the answer was not held within 60 s of its first chunk; {served.told()}"
                    )
                terminate()  # after the first chunk: what follows it came after the signal

    if not before_answer:
        stream()
        return Drained(lines, signalled - began, time.monotonic() - signalled)
    assert hold is not None, "before_answer holds the model call at the proxy"
    failed: list[BaseException] = []

    def streaming() -> None:
        try:
            stream()
        except BaseException as exc:  # re-raised in the test's thread below
            failed.append(exc)

    streamer = threading.Thread(target=streaming, daemon=True)
    hold.pause()  # every call waits at the proxy, until the stream's one is held by itself
    try:
        streamer.start()
        deadline = time.monotonic() + 60
        while not hold.holding_requests(b"/v1/chat/completions", 1, timeout=0.5):
            if failed:
                raise failed[0]
            assert time.monotonic() < deadline, (
                f"the stream's model call did not reach the proxy in 60 s; {served.told()}"
            )
        held = hold.hold_open(b"/v1/chat/completions")
        assert held == 1, f"{held} model calls held, not the stream's one"
    finally:
        hold.resume()  # the others (the readiness checks' health calls) pass again
    try:
        terminate()
    finally:
        streamer.join(timeout=150)
    assert not streamer.is_alive(), f"the stream did not end 150 s after SIGTERM; {served.told()}"
    if failed:
        raise failed[0]
    return Drained(lines, signalled - began, time.monotonic() - signalled)


def test_sigterm_lets_an_in_flight_stream_finish(
    redis_server: RedisServer, vllm: VLLMServer, tmp_path: Path
) -> None:
    """The answer is held by the proxy after its 12th word (prose: the output guard holds back
    only a word or so, so the first chunk has come by then), the signal goes, and the rest of
    the answer, more than 30 words, comes after it."""
    story = [{"role": "user", "content": "Write a long story about a lighthouse keeper."}]
    with (
        FaultProxy(vllm.url) as llm,
        image_server(redis_server, vllm, tmp_path, llm_url=llm.url) as served,
    ):
        llm.rewrite(hold_after_content(llm, 12))
        body = counting(48) | {"messages": story}
        lines = stream_and_terminate(served, body, hold=llm).lines
        after = lines[lines.index("SIGTERM") + 1 :]
        assert len([line for line in after if line.startswith("data: {")]) >= 2, lines[-3:]
        assert lines[-1] == "data: [DONE]"
        # uvicorn re-raises the signal once it has shut down, so the exit is SIGTERM's (143 in a
        # container), after the shutdown checked below, not instead of it.
        assert served.process.wait(timeout=30) in (0, -signal.SIGTERM)
        assert not _ready(served.port)
    logged = served.logged()
    assert "timeout graceful shutdown exceeded" not in logged
    assert "Application shutdown complete" in logged


def _refused_while_draining(response: httpx.Response) -> None:
    error = assert_openai_error(response, 503, "service_unavailable")
    assert error["code"] == "shutting_down"
    assert int(response.headers["retry-after"]) >= 1
    assert response.headers["connection"] == "close"


def test_new_requests_get_503_while_a_stream_drains(
    redis_server: RedisServer, vllm: VLLMServer, tmp_path: Path
) -> None:
    refused: list[httpx.Response] = []
    signalled = 0.0

    def new_requests() -> None:
        nonlocal signalled
        signalled = time.monotonic()
        ready = 0  # readyz answers 200 until the drain starts, at uvicorn's next tick (0.1 s)
        deadline = signalled + 10
        while time.monotonic() < deadline:
            try:
                readyz = httpx.get(f"{served.url}/readyz", timeout=10)
            except httpx.ConnectError as exc:
                raise AssertionError(
                    f"the socket closed {time.monotonic() - signalled:.2f} s after SIGTERM "
                    f"(after {ready} ready answers), while the stream was in flight; "
                    f"{served.told()}"
                ) from exc
            if readyz.status_code == 503:
                refused.append(readyz)
                break
            assert readyz.status_code == 200, readyz.text
            ready += 1
            time.sleep(0.02)
        else:
            raise AssertionError(f"readyz still 200 10 s after SIGTERM; {served.told()}")
        try:
            chat = httpx.post(
                f"{served.url}/v1/chat/completions",
                json=counting(8, stream=False),
                headers={"Authorization": f"Bearer {served.key}"},
                timeout=10,
            )
        except httpx.ConnectError as exc:
            raise AssertionError(
                f"a chat request {time.monotonic() - signalled:.2f} s after SIGTERM met a "
                f"closed socket, while the stream was in flight; {served.told()}"
            ) from exc
        refused.append(chat)

    # The stream's model call is held while the new requests are made (so it is still in flight
    # then, on any machine), and then finishes within a grace period far longer than it.
    with (
        FaultProxy(vllm.url) as llm,
        image_server(redis_server, vllm, tmp_path, grace=60, llm_url=llm.url) as served,
    ):
        drained = stream_and_terminate(
            served, counting(64), while_draining=new_requests, hold=llm, before_answer=True
        )
        assert drained.lines[-1] == "data: [DONE]", "the stream in flight finished"
        assert served.process.wait(timeout=30) in (0, -signal.SIGTERM)
    assert len(refused) == 2, f"readyz turned 503 within 10 s of SIGTERM; {served.told(drained)}"
    for response in refused:
        _refused_while_draining(response)
    logged = served.logged()
    assert "timeout graceful shutdown exceeded" not in logged
    assert "Application shutdown complete" in logged


def test_what_would_outlast_the_grace_period_ends_cleanly(
    redis_server: RedisServer, vllm: VLLMServer, tmp_path: Path
) -> None:
    """A 2 s grace period and answers of about a minute: the stream ends with an error event and
    the plain request with a 503, both within the grace period, before uvicorn would cancel
    them. (The answers are far longer than they need be, so that neither can end by itself
    before the cut, however the engine schedules them.)"""
    grace = 2.0
    plain: list[httpx.Response] = []

    def plain_request() -> None:
        plain.append(
            httpx.post(
                f"{served.url}/v1/chat/completions",
                json=counting(1500, stream=False),
                headers={"Authorization": f"Bearer {served.key}", "Cache-Control": "no-store"},
                timeout=120,
            )
        )

    with (
        FaultProxy(vllm.url) as llm,
        image_server(redis_server, vllm, tmp_path, grace=grace, llm_url=llm.url) as served,
    ):
        waiting = threading.Thread(target=plain_request)
        waiting.start()
        # The plain request is in flight before the signal: its model call has been sent (a
        # sleep of 0.5 s hoped so; a loaded machine can take longer to get it that far).
        wait_for(
            lambda: llm.requests_open(b"/v1/chat/completions") >= 1,
            60,
            "the plain request's model call",
            step=0.02,
        )
        drained = stream_and_terminate(served, counting(1500))
        waiting.join(30)
        assert served.process.wait(timeout=30) in (0, -signal.SIGTERM)
    lines = drained.lines
    told = served.told(drained)
    assert lines[-1].startswith("data: {"), f"{lines[-3:]}; {told}"
    last = json.loads(lines[-1].removeprefix("data: "))
    assert set(last) == {"error"}, last
    error = last["error"]
    assert (error["type"], error["code"]) == ("service_unavailable", "shutting_down")
    assert "data: [DONE]" not in lines
    deltas = [line for line in lines[lines.index("SIGTERM") + 1 : -1] if line.startswith("data:")]
    assert deltas, f"the stream went on after the signal until it was cut; {told}"
    assert drained.took < grace + 1.0, told
    assert len(plain) == 1, f"the plain request got an answer; {told}"
    assert plain[0].status_code == 503, f"{plain[0].text[:300]}; {told}"
    _refused_while_draining(plain[0])
    assert "stopped before its answer" in plain[0].json()["error"]["message"]
    logged = served.logged()
    assert "timeout graceful shutdown exceeded" not in logged
    assert "Application shutdown complete" in logged
