"""`rag jobs submit` run again after lines were refused: the refused lines are retried, the lines
that became jobs are not submitted twice. Against a live service and the real vLLM."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from app.main import create_app
from tests.conftest import make_settings, unique_question
from tests.support.cli import rag
from tests.support.servers import LiveService


@pytest.fixture
def live(redis_server, vllm) -> Iterator[tuple[LiveService, str]]:
    """A live service with a job worker, and a key of its tenant with the chat scope."""
    settings = make_settings(
        redis_server.url,
        vllm.url,
        jobs={"workers": 1, "concurrency": 2, "poll_seconds": 0.2},
        retrieval={"enabled": False},
    )
    app = create_app(settings)
    with LiveService(app) as service:
        yield service, service.run(app.state.services.keys.create("batch", "bob"))


def submit(live: LiveService, questions: Path, out: Path, key: str) -> int:
    done = rag(
        *("jobs", "submit", str(questions), "--out", str(out), "--url", live.url),
        *("--max-tokens", "8", "--poll", "0.2", "--quiet"),
        env={"RAG_API_KEY": key},
    )
    return done.returncode


def by_line(out: Path) -> dict[int, dict[str, Any]]:
    records = [json.loads(line) for line in out.read_text().splitlines()]
    lines = [r["line"] for r in records]
    assert len(lines) == len(set(lines)), f"one record per line: {lines}"
    return {r["line"]: r for r in records}


def jobs_of(live: LiveService, key: str) -> list[str]:
    response = httpx.get(
        f"{live.url}/v1/jobs?limit=100", headers={"Authorization": f"Bearer {key}"}
    )
    return [job["id"] for job in response.json()["data"]]


def test_a_rerun_with_a_good_key_submits_the_lines_a_bad_key_had_rejected(
    live: tuple[LiveService, str], tmp_path: Path
) -> None:
    service, key = live
    questions = tmp_path / "questions.jsonl"
    questions.write_text(f"{unique_question()}\n{unique_question()}\n")
    out = tmp_path / "answers.jsonl"

    assert submit(service, questions, out, "rag-not-a-key-of-anyone-0123456789abcdef") == 1
    assert [r["status"] for r in by_line(out).values()] == ["rejected", "rejected"]

    assert submit(service, questions, out, key) == 0
    answered = by_line(out)
    assert sorted(answered) == [1, 2]
    assert all(r["status"] == "succeeded" and r["answer"].strip() for r in answered.values())
    listed = jobs_of(service, key)
    assert sorted(listed) == sorted(r["id"] for r in answered.values())

    assert submit(service, questions, out, key) == 0  # nothing left to do
    assert jobs_of(service, key) == listed, "no line was submitted twice"


def test_a_rerun_submits_a_line_fixed_after_it_was_refused_as_invalid(
    live: tuple[LiveService, str], tmp_path: Path
) -> None:
    service, key = live
    questions = tmp_path / "questions.jsonl"
    first = unique_question()
    questions.write_text(f"{first}\n{json.dumps({'model': 'smollm2', 'messages': []})}\n")
    out = tmp_path / "answers.jsonl"

    assert submit(service, questions, out, key) == 1
    before = by_line(out)
    assert before[1]["status"] == "succeeded"
    assert before[2]["status"] == "rejected" and before[2]["error"]["param"] == "messages"

    questions.write_text(f"{first}\n{json.dumps({'question': unique_question()})}\n")
    assert submit(service, questions, out, key) == 0
    after = by_line(out)
    assert after[1] == before[1], "the answered line is kept as it was"
    assert after[2]["status"] == "succeeded" and after[2]["answer"].strip()
    assert sorted(jobs_of(service, key)) == sorted([after[1]["id"], after[2]["id"]])


def test_a_key_that_may_not_read_a_submitted_job_marks_it_rejected_instead_of_waiting(
    live: tuple[LiveService, str], tmp_path: Path
) -> None:
    service, key = live
    question = unique_question()
    questions = tmp_path / "questions.jsonl"
    questions.write_text(f"{question}\n")
    out = tmp_path / "answers.jsonl"
    # An earlier run submitted line 1 and was interrupted before its answer was written.
    job = httpx.post(
        f"{service.url}/v1/jobs",
        json={
            "model": "smollm2",
            "max_tokens": 8,
            "messages": [{"role": "user", "content": question}],
        },
        headers={"Authorization": f"Bearer {key}"},
    )
    assert job.status_code == 202, job.text
    (tmp_path / "answers.jsonl.state").write_text(
        json.dumps({"line": 1, "id": job.json()["id"]}) + "\n"
    )

    # Polling with a key the service refuses used to loop for ever (the helper's timeout).
    assert submit(service, questions, out, "rag-not-a-key-of-anyone-0123456789abcdef") == 1
    assert by_line(out)[1]["status"] == "rejected"

    assert submit(service, questions, out, key) == 0
    assert by_line(out)[1] == {**by_line(out)[1], "id": job.json()["id"], "status": "succeeded"}
    assert jobs_of(service, key) == [job.json()["id"]], "the job was polled, not submitted again"
