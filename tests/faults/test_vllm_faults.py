"""vLLM stopped, slowed past the deadline, cutting its stream, sending a malformed line or an
incomplete stream, or refusing this service (401/403/429), behind a fault proxy: the caller gets
an OpenAI-shaped 502/503/504 (a stream already started ends with an error event), nothing from
a broken stream is cached, and no task or connection is left behind. The real vLLM answers
behind the proxy; the proxy's rewriters make the faults it cannot be made to produce."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from app.settings import RedisSettings
from bench.load_bench import Census, census
from tests.conftest import chat_request, unique_question
from tests.faults.service import (
    ProxiedService,
    assert_openai_error,
    finish_reasons,
    proxied_service,
    sse_events,
    streamed_text,
)
from tests.support.faultproxy import (
    FaultProxy,
    RewriterFactory,
    close_after_events,
    http_response,
    malformed_line,
    misshapen_chunk,
    without_done,
    without_finish_reason,
)
from tests.support.process import ServiceProcess
from tests.support.servers import wait_for

# No job workers, and neither the similarity guard nor the router: what they embed at start-up
# costs seconds on these machines, and no fault here touches them.
SETTINGS: dict[str, dict[str, Any]] = {
    "llm": {"connect_timeout_seconds": 1.0},
    "jobs": {"workers": 0},
    "guard": {"similarity": False},
    "routing": {"enabled": False},
}
# The same for `rag serve`, with retrieval off too: the process would load its own model.
# Connections the Redis client may hold: its pool, and the key-change subscription.
REDIS_POOL = RedisSettings().max_connections + 1

PROCESS_SETTINGS = {
    "llm__connect_timeout_seconds": "1",
    "jobs__workers": "0",
    "guard__similarity": "false",
    "routing__enabled": "false",
    "retrieval__enabled": "false",
}


@pytest.fixture
def service(shared_embedder, redis_server, vllm) -> Iterator[ProxiedService]:
    with proxied_service(shared_embedder, redis_server.url, vllm.url, **SETTINGS) as served:
        yield served


def ask(question: str | None = None, **extra: Any) -> dict[str, Any]:
    return chat_request(question or unique_question(), **extra)


def warmed(service: ProxiedService) -> str:
    key = service.key()
    assert service.chat(key, ask()).status_code == 200
    return key


def answered_within_tries(service: ProxiedService, key: str, tries: int = 5) -> None:
    """A short answer comes back 200 within ``tries`` requests (each may meet a short
    deadline on a busy machine: a 504 there is the deadline working, not a fault)."""
    statuses = []
    for _ in range(tries):
        statuses.append(service.chat(key, ask(max_tokens=4)).status_code)
        if statuses[-1] == 200:
            return
        assert statuses[-1] == 504, f"not the deadline: {statuses}"
    raise AssertionError(f"no answer in {tries} tries: {statuses}")


def assert_error_event(response: httpx.Response, code: str) -> list[Any]:
    """A 200 stream that ended with an OpenAI-shaped error event, no finish, no ``[DONE]``."""
    assert response.status_code == 200, response.text
    events = sse_events(response.text)
    assert "[DONE]" not in events and finish_reasons(events) == [], events
    error = events[-1]
    assert set(error) == {"error"} and set(error["error"]) == {"message", "type", "param", "code"}
    assert (error["error"]["type"], error["error"]["code"]) == ("api_error", code), error
    return events


def assert_whole_then_cached(service: ProxiedService, key: str, request: dict[str, Any]) -> None:
    """The same request again, upstream healthy: a miss answered whole, then a hit."""
    again = service.chat(key, request)
    assert again.headers["x-cache"] == "miss", "a broken answer must not have been cached"
    events = sse_events(again.text)
    assert events[-1] == "[DONE]" and finish_reasons(events) in (["stop"], ["length"])
    assert service.chat(key, request).headers["x-cache"] == "hit"


def settled_census(census: Callable[[], Census], baseline: Census, within: float) -> Census:
    """The process's sockets once those to the model server, to clients and to anything but
    Redis are back to ``baseline``'s, or as they are after ``within`` seconds. Redis's are not
    waited for: its pool keeps what a burst opened, up to its bound (checked apart)."""
    latest = [census()]

    def back() -> bool:
        now = latest[0] = census()
        parts = ("upstream", "clients", "other")
        return all(getattr(now, part) <= getattr(baseline, part) for part in parts)

    with contextlib.suppress(TimeoutError):
        wait_for(back, within, "the sockets to settle")
    return latest[0]


def test_vllm_stopped_is_a_503_and_the_process_answers_again_when_it_is_back(
    redis_server, vllm, tmp_path
) -> None:
    # The service as its own process (`rag serve`): what it holds is read from /proc.
    with FaultProxy(vllm.url) as proxy:
        env = {f"RAG_{name.upper()}": value for name, value in PROCESS_SETTINGS.items()}
        with ServiceProcess(redis_server.url, proxy.url, tmp_path, **env) as server:
            assert server.process is not None
            headers = {"Authorization": f"Bearer {server.key()}"}
            with httpx.Client(base_url=server.url, headers=headers, timeout=60) as client:

                def chat(request: dict[str, Any]) -> httpx.Response:
                    return client.post("/v1/chat/completions", json=request)

                assert chat(ask()).status_code == 200
                pid, ports = server.process.pid, (server.port, redis_server.port, proxy.port)
                before, upstream = census(pid, *ports), proxy.open_connections

                proxy.refuse()  # a stopped vLLM: connections refused, open ones closed
                proxy.cut()
                for request in (ask(), ask(stream=True)):
                    started = time.monotonic()
                    down = chat(request)
                    error = assert_openai_error(down, 503, "service_unavailable")
                    assert error["code"] == "upstream_unavailable"
                    assert int(down.headers["retry-after"]) >= 1
                    assert time.monotonic() - started < 5.0, "refused at once, not timed out"
                assert client.get("/readyz").status_code == 503

                proxy.passing()
                assert chat(ask()).status_code == 200, "back without a restart"
                assert proxy.settled(upstream)
                # No socket leaked: to vLLM, to clients, or of any other kind (files, pipes);
                # the Redis pool may keep a connection a request opened, within its bound.
                after = settled_census(lambda: census(pid, *ports), before, within=10)
                told = f"before: {before.cell()}; after: {after.cell()}"
                assert after.upstream <= before.upstream, f"a model-server socket leaked; {told}"
                assert after.clients <= before.clients, f"a client socket leaked; {told}"
                assert after.other <= before.other, f"a descriptor leaked; {told}"
                assert after.redis <= REDIS_POOL, f"past the Redis pool's bound; {told}"


def test_vllm_slower_than_the_deadline_is_a_504_at_the_deadline(
    shared_embedder, redis_server, vllm
) -> None:
    deadline = 3.0
    settings = {**SETTINGS, "server": {"request_timeout_seconds": deadline}}
    with proxied_service(shared_embedder, redis_server.url, vllm.url, **settings) as service:
        key = service.key()
        # A real answer within the short deadline; a busy machine may take a try or two.
        answered_within_tries(service, key)
        before = service.counts()
        service.llm.slow(2 * deadline, responses=True)

        def timed(request: dict[str, Any]) -> tuple[float, httpx.Response]:
            started = time.monotonic()
            with httpx.Client(base_url=service.live.url, timeout=60) as client:
                answer = client.post(
                    "/v1/chat/completions", json=request, headers={"Authorization": f"Bearer {key}"}
                )
            return time.monotonic() - started, answer

        with ThreadPoolExecutor(2) as pool:
            results = list(pool.map(timed, [ask(), ask(stream=True)]))
        for elapsed, answer in results:
            assert assert_openai_error(answer, 504, "timeout")["code"] == "timeout"
            assert deadline - 0.2 <= elapsed < deadline + 2.0, elapsed

        service.llm.passing()
        answered_within_tries(service, key)
        service.assert_settled(before)


def test_vllm_closing_the_stream_mid_answer_ends_it_with_an_error_event_and_caches_nothing(
    service,
) -> None:
    key = warmed(service)
    before = service.counts()
    request = ask(max_tokens=16, stream=True)

    service.llm.rewrite(close_after_events(3))  # vLLM's role chunk and two tokens
    events = assert_error_event(service.chat(key, request), "upstream_failed")
    assert streamed_text(events), "what came before the cut reached the client"
    plain = service.chat(key, {**request, "stream": False})
    assert assert_openai_error(plain, 502, "api_error")["code"] == "upstream_failed"

    service.llm.passing()
    assert_whole_then_cached(service, key, request)
    service.assert_settled(before)


@pytest.mark.parametrize("edit", [malformed_line, misshapen_chunk], ids=["not-json", "not-a-chunk"])
def test_a_malformed_line_from_vllm_is_a_502_or_ends_the_stream_with_an_error_event(
    service, edit: Callable[[int], RewriterFactory]
) -> None:
    key = warmed(service)
    before = service.counts()
    request = ask(max_tokens=16, stream=True)

    service.llm.rewrite(edit(0))  # before any output: a status line can say it
    for broken in (request, {**request, "stream": False}):
        error = assert_openai_error(service.chat(key, broken), 502, "api_error")
        assert error["code"] == "upstream_malformed"
    service.llm.rewrite(edit(2))  # mid-answer: the stream says it
    assert_error_event(service.chat(key, request), "upstream_malformed")

    service.llm.passing()
    assert_whole_then_cached(service, key, request)
    service.assert_settled(before)


@pytest.mark.parametrize(
    "edit", [without_done, without_finish_reason], ids=["no-done", "no-finish-reason"]
)
def test_a_stream_ending_without_done_or_a_finish_reason_is_an_error_and_never_cached(
    service, edit: Callable[[], RewriterFactory]
) -> None:
    key = warmed(service)
    before = service.counts()
    request = ask(max_tokens=16, stream=True)

    service.llm.rewrite(edit())
    assert_error_event(service.chat(key, request), "upstream_failed")
    plain = service.chat(key, {**request, "stream": False})
    assert assert_openai_error(plain, 502, "api_error")["code"] == "upstream_failed"

    service.llm.passing()
    assert_whole_then_cached(service, key, request)
    service.assert_settled(before)


# vLLM started with --api-key answers a wrong key with a 401 and this body (its auth
# middleware). No second vLLM may be started on these machines, so the proxy answers in its
# place; 403 and 429 come from gateways in front of a model server, which the proxy stands for.
REFUSALS = [
    (http_response(401, b'{"error":"Unauthorized"}'), 502, "api_error", "upstream_unauthorized"),
    (
        http_response(403, b'{"error":{"message":"Forbidden","type":"permission_error"}}'),
        *(502, "api_error", "upstream_forbidden"),
    ),
    (
        http_response(
            429,
            b'{"error":{"message":"Too many requests","type":"rate_limit_error"}}',
            retry_after="7",
        ),
        *(429, "rate_limit_error", "upstream_rate_limited"),
    ),
]


def test_vllm_refusing_this_service_is_reported_as_what_it_is_not_as_the_callers_400(
    service,
) -> None:
    key = warmed(service)
    before = service.counts()
    for response, status, error_type, code in REFUSALS:
        service.llm.answer(response)
        for request in (ask(), ask(stream=True)):
            answer = service.chat(key, request)
            assert assert_openai_error(answer, status, error_type)["code"] == code
            if status == 429:
                assert answer.headers["retry-after"] == "7", "the upstream's wait is passed on"
        service.llm.passing()
    assert service.chat(key, ask()).status_code == 200
    service.assert_settled(before)
