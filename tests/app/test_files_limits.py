"""POST /v1/files under load and with files that inflate: a bounded number of uploads in at
once (the next one gets a 503 ``converter_busy`` with Retry-After, before its body is read), a
time budget per upload (files not converted by then are refused, the converted ones go in),
and a text over the document limit refused by the worker that converted it."""

from __future__ import annotations

import asyncio

import pytest

from tests.app.test_errors import assert_openai_error
from tests.conftest import make_settings
from tests.support.sample_files import coastal_sample, docx_bytes, long_pdf, text_bytes
from tests.support.servers import free_port

SAMPLE = coastal_sample()
MAX_CHARS = 500  # the sample's DOCX has 554 characters of text, its plain text 447
BUDGET_S = 4.0


@pytest.fixture(scope="module")
def slow_pdf() -> bytes:
    return long_pdf()


@pytest.fixture
async def harness(make_app, redis_server):
    settings = make_settings(
        redis_server.url,
        f"http://127.0.0.1:{free_port()}",
        files={
            "max_file_bytes": 5_000_000,
            "max_upload_bytes": 12_000_000,
            "convert_workers": 2,
            "max_pending_uploads": 1,
            "upload_timeout_seconds": BUDGET_S,
        },
        retrieval={"max_document_chars": MAX_CHARS},
    )
    async with make_app(settings) as h:
        yield h


async def upload(harness, files: list[tuple[str, bytes]], **fields: str):
    key = await harness.key(scopes="ingest")
    return await harness.client.post(
        "/v1/files",
        files=[("file", (name, data, "application/octet-stream")) for name, data in files],
        data={"purpose": "assistants", **fields},
        headers={"Authorization": f"Bearer {key}"},
    )


async def test_an_upload_past_the_bound_gets_a_503_with_retry_after(harness) -> None:
    converter = harness.services.converter
    with converter.admit():  # another upload in progress: the only place is taken
        busy = await upload(harness, [("notes.txt", text_bytes(SAMPLE))])
        error = assert_openai_error(busy, 503, "service_unavailable")
        assert error["code"] == "converter_busy"
        assert int(busy.headers["Retry-After"]) >= 1
        assert converter.uploads == 1
    refused = await upload(harness, [("notes.txt", text_bytes(SAMPLE))], metadata="[1]")
    assert_openai_error(refused, 400, "invalid_request_error")
    assert converter.uploads == 0  # a refused upload gives its place back
    accepted = await upload(harness, [("notes.txt", text_bytes(SAMPLE))])
    assert accepted.status_code == 200, accepted.text
    assert accepted.json()["document_id"] == "notes.txt"
    assert converter.uploads == 0


async def test_files_not_converted_within_the_budget_are_refused_and_the_others_go_in(
    harness, slow_pdf
) -> None:
    # The converter's forkserver started first, so the short file's worker starts at once.
    warm = await upload(harness, [("warm.txt", b"The tide rose over the levee at noon.\n")])
    assert warm.status_code == 200, warm.text
    response = await upload(
        harness, [("notes.txt", b"Dunes hold the sand.\n"), ("long.pdf", slow_pdf)]
    )
    assert response.status_code == 200, response.text
    body = response.json()
    assert [f["filename"] for f in body["data"]] == ["notes.txt"]
    (late,) = body["errors"]
    assert late["filename"] == "long.pdf" and late["status"] == 503
    assert late["error"]["code"] == "upload_timeout"
    # A slow upload in progress holds the only place: the next upload is turned away at once.
    alone = asyncio.create_task(upload(harness, [("long.pdf", slow_pdf)]))
    while harness.services.converter.uploads == 0 and not alone.done():
        await asyncio.wait({alone}, timeout=0.01)
    busy = await upload(harness, [("notes.txt", text_bytes(SAMPLE))])
    assert assert_openai_error(busy, 503, "service_unavailable")["code"] == "converter_busy"
    assert not alone.done()
    error = assert_openai_error(await alone, 503, "service_unavailable")
    assert error["code"] == "upload_timeout"


async def test_a_text_over_the_document_limit_is_refused_by_the_worker(harness) -> None:
    response = await upload(
        harness, [("report.docx", docx_bytes(SAMPLE)), ("short.txt", b"A short note.\n")]
    )
    assert response.status_code == 200, response.text
    body = response.json()
    assert [f["filename"] for f in body["data"]] == ["short.txt"]
    (big,) = body["errors"]
    assert big["filename"] == "report.docx" and big["status"] == 413
    # The worker's reason: the route's own check after conversion would say invalid_file.
    assert big["error"]["code"] == "too_large"
    assert str(MAX_CHARS) in big["error"]["message"]
