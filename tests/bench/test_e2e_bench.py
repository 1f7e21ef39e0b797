"""The end-to-end benchmarks' parts (bench/e2e.py, the toggles of bench/stack_bench.py, the
prompts of bench/throughput_bench.py): the stream client against the real vLLM, a real miss's
spans broken down by stage, the percentiles, the toggles' settings."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest

from app.settings import Settings
from bench.e2e import (
    StreamConnection,
    breakdown,
    chat_request,
    first_released,
    percentile,
    read_result,
    span_views,
    write_result,
)
from bench.loadclient import read_answer
from bench.stack_bench import TOGGLES, has_setting, overrides
from bench.throughput_bench import prompts
from pipeline.guards.output import StreamingRedactor
from pipeline.model.prompt import INSTRUCTIONS
from retrieval.documents import Document
from tests.conftest import make_settings
from tests.support.servers import UNENDING, RedisServer, VLLMServer


def test_percentiles_interpolate_between_ranks_and_are_nan_without_values() -> None:
    values = [4.0, 1.0, 3.0, 2.0]
    assert percentile(values, 0.5) == 2.5
    assert percentile(values, 0.0) == 1.0 and percentile(values, 1.0) == 4.0
    assert percentile(values, 0.99) == pytest.approx(3.97)
    assert percentile([], 0.5) != percentile([], 0.5)  # NaN


def test_results_are_written_as_json_with_nan_as_null(tmp_path: Path) -> None:
    write_result("x", {"a": float("nan"), "b": [1.5, float("inf")]}, tmp_path)
    assert read_result("x", tmp_path) == {"a": None, "b": [1.5, None]}
    assert read_result("missing", tmp_path) is None


async def test_a_stream_from_vllm_is_read_whole_with_its_first_token_and_usage(
    vllm: VLLMServer,
) -> None:
    connection = StreamConnection(vllm.url)
    body = chat_request([{"role": "user", "content": "Count to ten."}], 6, logit_bias=UNENDING)
    try:
        first = await connection.send(body)
        second = await connection.send(body)  # the same connection, kept alive
    finally:
        connection.close()
    for answer in (first, second):
        assert answer.ok, answer.body[:200]
        assert answer.completion_tokens == 6
        assert answer.ttft_s is not None and 0 < answer.ttft_s <= answer.total_s
        assert answer.second_s is not None and answer.ttft_s <= answer.second_s <= answer.total_s


def sse_response(*chunks: bytes) -> bytes:
    head = (
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
    )
    body = b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in chunks)
    return head + body + b"0\r\n\r\n"


def text_event(text: str) -> bytes:
    return b'data: {"choices":[{"index":0,"delta":{"content":"%s"}}]}\n\n' % text.encode()


async def test_the_second_piece_of_text_is_timed_across_chunks_and_within_one() -> None:
    role = b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\n\n'
    done = b"data: [DONE]\n\n"
    whole = sse_response(role, text_event("The"), text_event(" answer"), done)
    cut = whole.index(b" answer") - 40  # inside the second text chunk's head
    apart = asyncio.StreamReader()
    apart.feed_data(whole[:cut])
    loop = asyncio.get_running_loop()
    loop.call_later(0.05, apart.feed_data, whole[cut:])
    loop.call_later(0.05, apart.feed_eof)
    answer = await read_answer(apart, time.perf_counter())
    assert answer.ttft is not None and answer.second is not None
    assert answer.second - answer.ttft >= 0.04  # timed when the second chunk came
    together = asyncio.StreamReader()
    together.feed_data(sse_response(role, text_event("The") + text_event(" answer"), done))
    together.feed_eof()
    answer = await read_answer(together, 0.0)
    assert answer.second is not None and answer.second == answer.ttft
    alone = asyncio.StreamReader()
    alone.feed_data(sse_response(role, text_event("Yes"), done))
    alone.feed_eof()
    answer = await read_answer(alone, 0.0)
    assert answer.ttft is not None and answer.second is None  # a one-token answer has none


async def test_text_gets_through_the_redaction_at_the_piece_that_ends_its_first_word() -> None:
    role = b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\n\n'
    words = ["R", "ip", "amy", "cin", " decreases", " it"]
    reader = asyncio.StreamReader()
    reader.feed_data(sse_response(role, *(text_event(w) for w in words), b"data: [DONE]\n\n"))
    reader.feed_eof()
    answer = await read_answer(reader, time.perf_counter(), timed=True)
    assert [chunk for _, chunk in answer.pieces][1] == text_event("R")
    times = [at for at, _ in answer.pieces]
    assert times == sorted(times) and len(times) == len(words) + 2
    # "Ripamycin" may still become an address until " decreases" shows where it ends.
    assert first_released(answer.pieces, StreamingRedactor()) == times[5]
    # Most answers: the second token ends the first word.
    pieces = [(0.1, role), (0.2, text_event("The")), (0.3, text_event(" answer"))]
    assert first_released(pieces, StreamingRedactor()) == 0.3
    # An event cut across two pieces is read when its end comes.
    event = text_event(" answer")
    cut = [(0.2, text_event("The") + event[:20]), (0.4, event[20:])]
    assert first_released(cut, StreamingRedactor()) == 0.4
    # A one-word answer gets through with the stream's end; one without text never does. A
    # redactor that holds nothing lets the first piece through.
    done = (0.3, b"data: [DONE]\n\n")
    assert first_released([(0.2, text_event("Yes")), done], StreamingRedactor()) == 0.3
    assert first_released([(0.2, role), done], StreamingRedactor()) is None
    open_ = StreamingRedactor(redact_kinds=())
    assert first_released([(0.2, text_event("Yes"))], open_) == 0.2
    # Without ``timed``, nothing is kept.
    plain = asyncio.StreamReader()
    plain.feed_data(sse_response(role, text_event("The"), b"data: [DONE]\n\n"))
    plain.feed_eof()
    assert (await read_answer(plain, 0.0)).pieces == []


async def test_a_misses_spans_break_down_into_the_stages_before_the_upstream_call(
    redis_server: RedisServer, vllm: VLLMServer, make_app: Any
) -> None:
    settings = make_settings(redis_server.url, vllm.url, telemetry={"capture_content": True})
    async with make_app(settings) as harness:
        services = harness.services
        documents = [
            Document("d1", "Vitamin D is made in the skin under sunlight.", "Vitamin D"),
            Document("d2", "Bone density depends on calcium and vitamin D.", "Bones"),
        ]
        await services.retrieval.ingest("acme", documents)
        key = await harness.key()
        question = "How does the skin make vitamin D?"
        body = chat_request([{"role": "user", "content": question}], 4)
        response = await harness.chat(key, body, **{"Cache-Control": "no-cache, no-store"})
        assert response.status_code == 200
        trace_id = response.headers["x-trace-id"]
        views = span_views(harness.exporter.get_finished_spans(), trace_id)

    miss = breakdown(views, client_ttft_s=None)
    assert {"auth", "retrieve", "generate"} <= set(miss.stages)
    assert miss.upstream_at_ms > 0 and miss.vllm_first_chunk_ms > 0
    # The segments are consecutive: they add up to the upstream call plus vLLM's first chunk.
    assert sum(miss.segments.values()) == pytest.approx(
        miss.upstream_at_ms + miss.vllm_first_chunk_ms, abs=0.01
    )
    assert any(name.startswith("group ") or "+" in name for name in miss.segments)
    # The prompt the service sent, as the direct request of bench/miss_bench.py resends it.
    assert miss.prompt is not None and miss.prompt[-1]["content"] == question
    assert "[d1]" in miss.prompt[0]["content"]


def test_a_trace_without_a_model_call_is_not_taken_for_a_miss() -> None:
    with pytest.raises(ValueError, match="not a miss"):
        breakdown([])


@pytest.mark.parametrize("toggle", [t for t in TOGGLES if t.setting], ids=lambda t: t.name)
def test_each_toggles_values_make_valid_settings_when_the_setting_exists(toggle: Any) -> None:
    assert toggle.setting is not None
    if not has_setting(toggle.setting):
        return  # reported as not measured by the bench, until its owner adds the setting
    for values in (
        {toggle.setting: toggle.on, **toggle.with_on},
        {toggle.setting: toggle.off, **toggle.with_off},
    ):
        Settings(environment="test", **overrides(values))


def test_settings_are_found_by_their_dotted_names() -> None:
    assert has_setting("retrieval.candidates") and has_setting("cache.enabled")
    assert not has_setting("retrieval.no_such_field") and not has_setting("nothing.here")
    assert overrides({"retrieval.candidates": 5, "cache.enabled": False}) == {
        "retrieval": {"candidates": 5},
        "cache": {"enabled": False},
    }


def test_the_throughput_prompts_are_laid_out_as_the_service_lays_out_a_retrieved_one() -> None:
    built = prompts(3)
    assert len(built) == 3 and len({p[-1]["content"] for p in built}) == 3
    for messages in built:
        system, user = messages
        assert system["role"] == "system" and system["content"].startswith(INSTRUCTIONS)
        assert system["content"].count("\n\n[") == 2  # two sources
        assert user["role"] == "user"
