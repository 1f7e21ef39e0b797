"""A tool that hangs for ever, against the real vLLM: an HTTP tool aimed at a local server that
accepts the connection and never answers. The request ends within its deadline, with the tool's
timeout as its result or a 504 in OpenAI's shape; the tool's connection is closed and no task is
left behind."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.app.test_errors import assert_openai_error
from tests.conftest import AppHarness, chat_request, make_settings
from tests.pipeline.jobs.conftest import wait_until

SLACK_S = 2.0  # the deadline's own granularity plus a busy 2-core machine


class SilentServer:
    """Accepts connections, reads what is sent, never answers; counts the connections and
    those their client has closed."""

    def __init__(self) -> None:
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self.accepted = 0
        self.closed = 0
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return  # closed
            with self._lock:
                self.accepted += 1
            threading.Thread(target=self._hold, args=(conn,), daemon=True).start()

    def _hold(self, conn: socket.socket) -> None:
        with conn:
            try:
                while conn.recv(65536):
                    pass
            except OSError:
                pass
        with self._lock:
            self.closed += 1

    def close(self) -> None:
        self._listener.close()


@pytest.fixture
def silent() -> Iterator[SilentServer]:
    server = SilentServer()
    yield server
    server.close()


def hanging_tool_settings(
    redis_url: str, llm_url: str, port: int, *, deadline_s: float, tool_timeout_s: float
) -> Any:
    tool = {
        "name": "stock",
        "description": "How many of an item (by its SKU) are in stock.",
        "url": f"http://127.0.0.1:{port}/stock/{{sku}}",
        # Short arguments: the model's call (the first round) takes a second or so.
        "parameters": {
            "type": "object",
            "properties": {"sku": {"type": "string", "maxLength": 8}},
            "required": ["sku"],
            "additionalProperties": False,
        },
        "timeout_seconds": tool_timeout_s,
        "allow_private": True,
    }
    return make_settings(
        redis_url,
        llm_url,
        server={"request_timeout_seconds": deadline_s},
        tools={"http": [tool], "tenants": {"acme": {"private_network": True}}},
        jobs={"workers": 0},
        retrieval={"enabled": False},
    )


def forced_stock(**extra: Any) -> dict[str, Any]:
    return chat_request(
        "How many of item A-100 are in stock?",
        max_tokens=32,
        tool_choice={"type": "function", "function": {"name": "stock"}},
        rag={"enabled": False, "plan_tools": False},
        **extra,
    )


async def timed_chat(h: AppHarness, key: str, body: dict[str, Any]) -> tuple[Any, float]:
    started = time.monotonic()
    response = await h.chat(key, body, **{"Cache-Control": "no-store"})
    return response, time.monotonic() - started


async def no_new_tasks(before: set[asyncio.Task[Any]]) -> None:
    """Every task the request started has ended (within a short settling time)."""

    async def settled() -> bool:
        return not (asyncio.all_tasks() - before - {asyncio.current_task()})

    try:
        await wait_until(settled, within=10.0, what="the request's tasks to end")
    except AssertionError:
        left = asyncio.all_tasks() - before - {asyncio.current_task()}
        raise AssertionError(f"tasks left behind: {[t.get_coro() for t in left]}") from None


async def closed_by_the_service(silent: SilentServer) -> None:
    async def closed() -> bool:
        return silent.accepted >= 1 and silent.closed == silent.accepted

    await wait_until(closed, within=10.0, what="the tool's connection to be closed")


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
async def test_a_hanging_tool_ends_the_request_at_its_deadline(
    make_app, redis_server, vllm, silent: SilentServer, stream: bool
) -> None:
    """The tool's own timeout (60 s) is past the request's deadline (15 s: room for the model's
    forced first round on a busy machine): the deadline ends the request with a 504, streamed
    or not (nothing was sent before the tool ran)."""
    deadline = 15.0
    settings = hanging_tool_settings(
        redis_server.url, vllm.url, silent.port, deadline_s=deadline, tool_timeout_s=60.0
    )
    async with make_app(settings) as h:
        key = await h.key()
        before = asyncio.all_tasks()
        response, took = await timed_chat(h, key, forced_stock(stream=stream))
        assert silent.accepted == 1, (
            f"the tool was not called before the deadline ({response.status_code} after "
            f"{took:.1f} s): the model's first round took longer than {deadline} s"
        )
        error = assert_openai_error(response, 504, "timeout")
        assert error["code"] == "timeout"
        assert took <= deadline + SLACK_S, f"answered {took:.2f} s after the request"
        await closed_by_the_service(silent)
        await no_new_tasks(before)


async def test_a_hanging_tool_times_out_and_the_model_still_answers(
    make_app, redis_server, vllm, silent: SilentServer
) -> None:
    """The tool's timeout (1 s) is inside the deadline (60 s): the model is told the tool did
    not answer, and answers."""
    deadline = 60.0
    settings = hanging_tool_settings(
        redis_server.url, vllm.url, silent.port, deadline_s=deadline, tool_timeout_s=1.0
    )
    async with make_app(settings) as h:
        key = await h.key()
        before = asyncio.all_tasks()
        response, took = await timed_chat(h, key, forced_stock())
        assert response.status_code == 200, response.text
        answer = response.json()
        (run,) = answer["rag"]["tools"]
        assert (run["name"], run["status"]) == ("stock", "timeout")
        assert "did not answer within 1 s" in run["output"]
        assert answer["choices"][0]["finish_reason"] in ("stop", "length")
        assert took < deadline
        assert silent.accepted == 1
        await closed_by_the_service(silent)
        await no_new_tasks(before)
