"""``rag jobs submit FILE.jsonl --out RESULTS.jsonl``: a file of questions, run as jobs.

Each non-empty line of the input is a job: a JSON chat-completions body (with ``messages``), a
JSON object ``{"question": ...}``, a JSON string, or plain text (the question itself). Results
are appended to the output, one JSON line each, as the jobs finish, in whatever order they do.

Resumable: beside the output, ``RESULTS.jsonl.state`` records line -> job id as each job is
submitted. A rerun skips the lines already in the output, polls the jobs already submitted,
and submits the rest; each submit carries ``Idempotency-Key`` = SHA-256 of the line, so a
submit whose answer was lost is not run twice.

A line the service refused (``"status": "rejected"``: a 4xx such as 401, 403 or 400, or no
answer after ``submit_attempts``) never became a job, so a rerun drops its record and submits
it again: with a good key, or after the line was fixed. Lines that became jobs are not.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import httpx
from tqdm import tqdm

from app.settings import get_settings

FINISHED = frozenset({"succeeded", "failed", "cancelled"})


@dataclass(frozen=True)
class BatchOptions:
    url: str
    key: str
    model: str = "smollm2"
    max_tokens: int | None = None
    in_flight: int = 32
    poll_seconds: float = 1.0
    progress: bool = True
    submit_attempts: int = 8


class LineRejected(Exception):
    """The service refused a line with a 4xx; the error goes to the output."""

    def __init__(self, error: dict[str, Any]) -> None:
        super().__init__(error.get("message", "rejected"))
        self.error = error


def job_body(text: str, options: BatchOptions) -> dict[str, Any]:
    try:
        parsed: Any = json.loads(text)
    except ValueError:
        parsed = text
    if isinstance(parsed, dict) and "messages" in parsed:
        body = dict(parsed)
        body.setdefault("model", options.model)
    else:
        question = parsed.get("question") if isinstance(parsed, dict) else parsed
        body = {"model": options.model, "messages": [{"role": "user", "content": str(question)}]}
    if options.max_tokens is not None:
        body.setdefault("max_tokens", options.max_tokens)
    return body


def _records(path: Path) -> list[dict[str, Any]]:
    """The complete JSON lines of ``path``; a torn last line (an interrupted write) is cut off."""
    if not path.exists():
        return []
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        data = data[: data.rfind(b"\n") + 1]
        path.write_bytes(data)
    records = []
    for line in data.decode().splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:
            continue
    return records


def _without_rejected(path: Path) -> list[dict[str, Any]]:
    """The records of ``path`` less the rejected ones, which are dropped from the file too
    (replaced at once, so an interrupted rerun leaves the old file or the new one)."""
    records = _records(path)
    kept = [r for r in records if r.get("status") != "rejected"]
    if len(kept) < len(records):
        fresh = path.with_name(path.name + ".tmp")
        fresh.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in kept))
        fresh.replace(path)
    return kept


def _append(stream: TextIO, record: dict[str, Any]) -> None:
    stream.write(json.dumps(record, ensure_ascii=False) + "\n")
    stream.flush()


class Batch:
    """One run over the input: submit, poll, write; see the module docstring."""

    def __init__(self, source: Path, out: Path, options: BatchOptions) -> None:
        self.options = options
        self.lines = [
            (number, text.strip())
            for number, text in enumerate(source.read_text().splitlines(), start=1)
            if text.strip()
        ]
        self.out = out
        self.state_path = out.with_name(out.name + ".state")
        done = {int(r["line"]) for r in _without_rejected(out) if "line" in r}
        self.submitted = {int(r["line"]): str(r["id"]) for r in _records(self.state_path)}
        self.todo = [(n, text) for n, text in self.lines if n not in done]

    async def run(self) -> int:
        """0 when every line has succeeded, 1 when some failed or were refused."""
        limit = asyncio.Semaphore(self.options.in_flight)
        headers = {"Authorization": f"Bearer {self.options.key}"}
        with (
            self.out.open("a") as out,
            self.state_path.open("a") as state,
            tqdm(
                total=len(self.lines),
                initial=len(self.lines) - len(self.todo),
                unit="job",
                disable=not self.options.progress,
            ) as bar,
        ):
            async with httpx.AsyncClient(
                base_url=self.options.url, headers=headers, timeout=30.0
            ) as client:

                async def one(number: int, text: str) -> None:
                    async with limit:
                        record = await self._line(client, state, number, text)
                    _append(out, record)
                    bar.update(1)

                await asyncio.gather(*(one(n, text) for n, text in self.todo))
        # Over the whole output, earlier runs included.
        return 0 if all(r.get("status") == "succeeded" for r in _records(self.out)) else 1

    async def _line(
        self, client: httpx.AsyncClient, state: TextIO, number: int, text: str
    ) -> dict[str, Any]:
        try:
            job_id = self.submitted.get(number)
            if job_id is None:
                job_id = await self._submit(client, text)
                _append(state, {"line": number, "id": job_id})
            job = await self._poll(client, job_id)
            if job is None:  # expired since the last run: submit it again
                job_id = await self._submit(client, text)
                _append(state, {"line": number, "id": job_id})
                job = await self._poll(client, job_id)
        except LineRejected as exc:
            return {"line": number, "id": None, "status": "rejected", "error": exc.error}
        record: dict[str, Any] = {"line": number, "id": job_id, "status": "failed"}
        if job is not None:
            record.update(status=job["status"], error=job.get("error"))
            result = job.get("result")
            if result:
                record["answer"] = result["choices"][0]["message"].get("content")
                record["result"] = result
        return record

    async def _submit(self, client: httpx.AsyncClient, text: str) -> str:
        idempotency = hashlib.sha256(text.encode()).hexdigest()
        delay = 0.5
        for _ in range(self.options.submit_attempts):
            try:
                response = await client.post(
                    "/v1/jobs",
                    json=job_body(text, self.options),
                    headers={"Idempotency-Key": idempotency},
                )
            except httpx.TransportError:
                response = None
            if response is not None and response.status_code == 202:
                return str(response.json()["id"])
            if response is not None and response.status_code < 500 and response.status_code != 429:
                raise LineRejected(_error_of(response))
            wait = response.headers.get("retry-after") if response is not None else None
            await asyncio.sleep(float(wait) if wait and wait.isdigit() else delay)
            delay = min(delay * 2, 30.0)
        raise LineRejected({"message": "the service did not accept the job", "type": "api_error"})

    async def _poll(self, client: httpx.AsyncClient, job_id: str) -> dict[str, Any] | None:
        while True:
            try:
                response = await client.get(f"/v1/jobs/{job_id}")
            except httpx.TransportError:
                response = None
            if response is not None and response.status_code == 404:
                return None
            if response is not None and response.status_code in (401, 403):
                # The key cannot read its jobs: waiting would never end. The job stays in the
                # state file, so a rerun with a good key polls it again.
                raise LineRejected(_error_of(response))
            if response is not None and response.status_code == 200:
                job: dict[str, Any] = response.json()
                if job["status"] in FINISHED:
                    return job
            await asyncio.sleep(self.options.poll_seconds)


def _error_of(response: httpx.Response) -> dict[str, Any]:
    """The service's error (OpenAI's shape), or the body's text when it is not one."""
    try:
        error = response.json().get("error")
    except (ValueError, AttributeError):
        error = None
    if isinstance(error, dict):
        return error
    return {"message": f"HTTP {response.status_code}: {response.text[:500]}", "type": "api_error"}


async def run_batch(source: Path, out: Path, options: BatchOptions) -> int:
    return await Batch(source, out, options).run()


def submit(args: argparse.Namespace) -> int:
    key = args.key or os.environ.get("RAG_API_KEY")
    if not key:
        raise ValueError("an API key is needed: --key or RAG_API_KEY")
    source = Path(args.file)
    if not source.is_file():
        raise ValueError(f"{source} is not a file")
    settings = get_settings()
    options = BatchOptions(
        url=args.url or f"http://{settings.server.host}:{settings.server.port}",
        key=key,
        model=args.model,
        max_tokens=args.max_tokens,
        in_flight=args.in_flight,
        poll_seconds=args.poll,
        progress=not args.quiet,
    )
    try:
        return asyncio.run(run_batch(source, Path(args.out), options))
    except KeyboardInterrupt:
        print("rag jobs submit: interrupted; run it again to resume", file=sys.stderr)
        return 130
