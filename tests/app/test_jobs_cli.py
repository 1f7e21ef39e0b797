"""`rag worker` and `rag jobs submit`, run as processes as a user would, against the real vLLM."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx

from app.cli.batch import _records
from app.main import create_app
from tests.app.test_jobs import auth, chat_body, finished, submit
from tests.conftest import make_settings, unique_question
from tests.support.faultproxy import FaultProxy, SSEEdit
from tests.support.servers import ROOT, LiveService, wait_for


def rag_process(*args: str, env: dict[str, str], **options: Any) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "app.cli", *args],
        cwd=ROOT,
        env={**os.environ, **env},
        text=True,
        **options,
    )


async def test_rag_worker_runs_queued_jobs_and_stops_on_sigterm(
    make_app, redis_server, vllm
) -> None:
    settings = make_settings(
        redis_server.url, vllm.url, jobs={"workers": 0}, retrieval={"enabled": False}
    )
    env = {
        "RAG_ENVIRONMENT": "test",
        "RAG_REDIS__URL": redis_server.url,
        "RAG_REDIS__KEY_PREFIX": settings.redis.key_prefix,
        "RAG_LLM__BASE_URL": vllm.url,
        "RAG_RETRIEVAL__ENABLED": "false",
        "RAG_JOBS__POLL_SECONDS": "0.2",
    }
    async with make_app(settings) as h:
        key = await h.key()
        ids = [(await submit(h, key, chat_body(unique_question()))).json()["id"] for _ in range(2)]
        worker = rag_process("worker", "--concurrency", "2", env=env, stderr=subprocess.PIPE)
        try:
            jobs = [await finished(h, key, job_id, within=300) for job_id in ids]
        finally:
            worker.send_signal(signal.SIGTERM)
            _, stderr = await asyncio.to_thread(worker.communicate, timeout=60)
    assert [j["status"] for j in jobs] == ["succeeded", "succeeded"]
    assert all(j["result"]["choices"][0]["message"]["content"].strip() for j in jobs)
    assert worker.returncode == 0, stderr
    assert "rag worker: stopped" in stderr


def results(path: Path) -> list[dict[str, Any]]:
    """The records written (whole lines: a run may be writing the last one)."""
    whole = path.read_text().split("\n")[:-1] if path.exists() else []
    return [json.loads(line) for line in whole]


def test_jobs_submit_writes_results_and_resumes_after_an_interruption(
    redis_server, vllm, tmp_path: Path
) -> None:
    questions = tmp_path / "questions.jsonl"
    lines = [
        json.dumps({"question": unique_question()}),
        unique_question(),  # plain text
        json.dumps({"model": "smollm2", "messages": [{"role": "user", "content": "Hi?"}]}),
        json.dumps(unique_question()),
        json.dumps({"model": "smollm2", "messages": []}),  # refused: no messages
        json.dumps({"question": unique_question()}),
    ]
    questions.write_text("\n".join(lines) + "\n\n")
    out = tmp_path / "answers.jsonl"
    state = tmp_path / "answers.jsonl.state"
    answers = 0

    def succeeded() -> int:
        return sum(r["status"] == "succeeded" for r in results(out))

    def third_held(number: int, event: bytes) -> list[bytes]:
        nonlocal answers
        answers += number == 0  # the answers come one at a time (one worker, one at once)
        if number == 0 and answers == 3:
            llm.hold_here()
        return [event]

    with FaultProxy(vllm.url) as llm:
        # The third answer is held until the first run is interrupted: two lines are answered
        # before it, and not all, however fast or slow the model.
        llm.rewrite(lambda: SSEEdit(third_held))
        settings = make_settings(
            redis_server.url, llm.url, jobs={"workers": 1, "concurrency": 1, "poll_seconds": 0.2}
        )
        app = create_app(settings)
        with LiveService(app) as live:
            key = live.run(app.state.services.keys.create("batch", "bob"))
            args = ("jobs", "submit", str(questions), "--out", str(out), "--url", live.url)
            args += ("--max-tokens", "8", "--poll", "0.2", "--quiet")
            env = {"RAG_API_KEY": key}
            first = rag_process(*args, env=env, stderr=subprocess.DEVNULL)
            try:
                wait_for(lambda: len(results(state)) >= 5, 120, "the first run to submit")
                assert llm.holding_requests(b"/v1/chat/completions", 1, timeout=120)
                wait_for(lambda: succeeded() >= 2, 60, "the first run to write two answers")
            finally:
                first.send_signal(signal.SIGKILL)
                first.wait(30)
            answered_before = succeeded()
            # two, or more if a line was answered without the model (from the cache)
            assert 2 <= answered_before < 5, "the first run was cut off with answers written"
            llm.release()
            second = rag_process(*args, env=env, stderr=subprocess.PIPE)
            _, stderr = second.communicate(timeout=600)
            listed = live.run(_listed(live, key))
    assert second.returncode == 1, stderr  # one line was refused
    records = results(out)
    assert sorted(r["line"] for r in records) == [1, 2, 3, 4, 5, 6], "each line answered once"
    by_line = {r["line"]: r for r in records}
    assert by_line[5]["status"] == "rejected" and by_line[5]["error"]["param"] == "messages"
    for line in (1, 2, 3, 4, 6):
        assert by_line[line]["status"] == "succeeded", by_line[line]
        assert by_line[line]["answer"].strip()
        assert by_line[line]["result"]["object"] == "chat.completion"
    assert len(listed) == 5, "no line was submitted twice"
    assert {r["id"] for r in records if r["id"]} == set(listed)


async def _listed(live: LiveService, key: str) -> list[str]:
    async with httpx.AsyncClient(base_url=live.url) as client:
        response = await client.get("/v1/jobs?limit=100", headers=auth(key))
        return [job["id"] for job in response.json()["data"]]


def test_resumed_output_drops_a_torn_last_line(tmp_path: Path) -> None:
    out = tmp_path / "answers.jsonl"
    out.write_text('{"line": 1, "status": "succeeded"}\n{"line": 2, "sta')
    assert [r["line"] for r in _records(out)] == [1]
    assert out.read_text() == '{"line": 1, "status": "succeeded"}\n'
