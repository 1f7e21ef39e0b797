"""POST /v1/files end to end: real files made by real tools, uploaded as OpenAI's client uploads
them, converted in worker processes, embedded by the real model, found by /v1/retrieve with their
heading path and page; bad files refused one by one, by name, while the others go in."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.app.test_errors import assert_openai_error
from tests.conftest import make_settings
from tests.support.sample_files import (
    coastal_sample,
    docx_bytes,
    html_bytes,
    markdown_bytes,
    pdf_bytes,
    text_bytes,
    zip_bomb_docx,
)
from tests.support.servers import free_port

SAMPLE = coastal_sample()
TITLE = SAMPLE.title
MAX_FILE_BYTES = 400_000  # the zip bomb (~200 KB) fits: its ratio, not its size, refuses it
UPLOAD_LIMIT = 2_000_000


@pytest.fixture
async def harness(make_app, redis_server):
    settings = make_settings(
        redis_server.url,
        f"http://127.0.0.1:{free_port()}",
        files={"max_file_bytes": MAX_FILE_BYTES, "max_upload_bytes": UPLOAD_LIMIT, "max_files": 8},
    )
    async with make_app(settings) as h:
        yield h


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def upload(harness, key: str, files: list[tuple[str, bytes]], **fields: str):
    return await harness.client.post(
        "/v1/files",
        files=[("file", (name, data, "application/octet-stream")) for name, data in files],
        data={"purpose": "assistants", **fields},
        headers=auth(key),
    )


async def retrieve(harness, key: str, query: str, top_k: int = 3) -> list[dict]:
    response = await harness.client.post(
        "/v1/retrieve", json={"query": query, "top_k": top_k, "min_relevance": 0}, headers=auth(key)
    )
    assert response.status_code == 200, response.text
    return response.json()["data"]


async def test_upload_needs_the_ingest_scope(harness) -> None:
    key = await harness.key(scopes="chat,retrieve")
    response = await upload(harness, key, [("notes.txt", text_bytes(SAMPLE))])
    assert_openai_error(response, 403, "permission_error")


async def test_openais_client_uploads_a_pdf_whose_passages_carry_heading_and_page(harness) -> None:
    key = await harness.key(scopes="retrieve,ingest")
    client = openai.AsyncOpenAI(
        base_url="http://service/v1", api_key=key, http_client=harness.client
    )
    created = await client.files.create(
        file=("report.pdf", pdf_bytes(SAMPLE), "application/pdf"), purpose="assistants"
    )
    assert created.object == "file" and created.filename == "report.pdf"
    assert created.id == "report.pdf" and created.purpose == "assistants"
    extra = created.model_extra or {}
    assert extra["kind"] == "pdf" and extra["title"] == TITLE and extra["chunks"] >= 2
    hits = await retrieve(harness, key, "Which beach had the largest loss of dune front?")
    top = hits[0]
    assert top["document_id"] == "report.pdf" and "Saltmarsh Point" in top["text"]
    assert top["metadata"]["heading_path"] == [TITLE, "Results"]
    assert top["metadata"]["page"] == 2 and top["metadata"]["anchor"] == "results"
    assert top["metadata"]["filename"] == "report.pdf" and top["title"] == TITLE


async def test_one_upload_takes_the_good_files_and_names_each_bad_one(harness) -> None:
    key = await harness.key(scopes="retrieve,ingest")
    files = [
        ("report.docx", docx_bytes(SAMPLE)),
        ("page.html", html_bytes(SAMPLE)),
        ("locked.pdf", pdf_bytes(SAMPLE, password="secret")),
        ("scan.pdf", pdf_bytes(SAMPLE, image_only=True)),
        ("bomb.docx", zip_bomb_docx(docx_bytes(SAMPLE))),
        ("fake.pdf", html_bytes(SAMPLE)),
        ("big.txt", b"word " * (MAX_FILE_BYTES // 4)),
    ]
    response = await upload(harness, key, files)
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["object"] == "list"
    assert [f["id"] for f in body["data"]] == ["report.docx", "page.html"]
    refused = {e["filename"]: (e["status"], e["error"]["code"]) for e in body["errors"]}
    assert refused == {
        "locked.pdf": (400, "encrypted"),
        "scan.pdf": (400, "no_text"),
        "bomb.docx": (400, "zip_bomb"),
        "fake.pdf": (415, "type_mismatch"),
        "big.txt": (413, "too_large"),
    }
    for error in body["errors"]:
        assert set(error["error"]) == {"message", "type", "param", "code"}
        assert error["error"]["message"].startswith(error["filename"])
    hits = await retrieve(harness, key, "sea walls sand loss beaches", top_k=6)
    assert {h["document_id"] for h in hits} <= {"report.docx", "page.html"}
    table = [h for h in hits if "Gull Bay | 1.2" in h["text"]]
    assert table and table[0]["metadata"]["heading_path"] == [TITLE, "Results"]
    everything = " ".join(h["text"] for h in await retrieve(harness, key, "newsletter", 20))
    assert "newsletter" not in everything and "cookies" not in everything


async def test_an_upload_with_no_good_file_gets_the_files_status_and_reasons(harness) -> None:
    key = await harness.key(scopes="retrieve,ingest")
    locked = await upload(harness, key, [("locked.pdf", pdf_bytes(SAMPLE, password="pw"))])
    error = assert_openai_error(locked, 400, "invalid_request_error")
    assert error["code"] == "encrypted" and "locked.pdf" in error["message"]
    mismatched = await upload(harness, key, [("a.pdf", b"<html>x</html>"), ("b.docx", b"hi")])
    error = assert_openai_error(mismatched, 415, "invalid_request_error")
    assert "a.pdf" in error["message"] and "b.docx" in error["message"]
    mixed = await upload(harness, key, [("a.pdf", b"<html>x</html>"), ("c.exe", b"MZ")])
    assert mixed.status_code == 415
    mixed = await upload(
        harness,
        key,
        [("a.pdf", b"<html>x</html>"), ("scan.pdf", pdf_bytes(SAMPLE, image_only=True))],
    )
    assert_openai_error(mixed, 400, "invalid_request_error")


async def test_the_tenant_is_the_keys_and_document_id_metadata_and_access_are_kept(
    harness,
) -> None:
    key = await harness.key(tenant="acme", scopes="retrieve,ingest")
    other = await harness.key(tenant="globex", scopes="retrieve,ingest")
    response = await upload(
        harness,
        key,
        [("report.md", markdown_bytes(SAMPLE))],
        tenant="globex",
        document_id="erosion-2026",
        metadata='{"team": "coast", "year": 2026}',
    )
    assert response.status_code == 200, response.text
    assert response.json()["id"] == "erosion-2026"
    hits = await retrieve(harness, key, "laser rangefinder at low tide")
    assert hits[0]["document_id"] == "erosion-2026"
    assert hits[0]["metadata"]["team"] == "coast" and hits[0]["metadata"]["format"] == "markdown"
    assert await retrieve(harness, other, "laser rangefinder at low tide") == []


async def test_an_access_list_sent_with_the_file_hides_it_from_other_users(harness) -> None:
    key = await harness.key(user="ann", scopes="retrieve,ingest")
    member = await harness.services.keys.create(
        "acme", "bob", frozenset({"retrieve"}), groups=frozenset({"survey"})
    )
    outsider = await harness.key(user="cid", scopes="retrieve")
    response = await upload(
        harness, key, [("report.md", markdown_bytes(SAMPLE))], access='{"groups": ["survey"]}'
    )
    assert response.status_code == 200, response.text
    query = "laser rangefinder at low tide"
    assert (await retrieve(harness, member, query))[0]["document_id"] == "report.md"
    assert await retrieve(harness, outsider, query) == []
    bad = await upload(harness, key, [("a.md", b"# A\n\ntext")], access='{"groups": "x"}')
    assert_openai_error(bad, 400, "invalid_request_error")


async def test_two_files_of_one_name_and_bad_metadata_are_refused(harness) -> None:
    key = await harness.key(scopes="retrieve,ingest")
    twice = await upload(harness, key, [("a.md", b"# A\n\nOne."), ("a.md", b"# A\n\nTwo.")])
    assert twice.status_code == 200, twice.text
    assert [f["id"] for f in twice.json()["data"]] == ["a.md"]
    assert twice.json()["errors"][0]["error"]["code"] == "invalid_file"
    for metadata in ('{"bad key": 1}', "[1]", '{"k": {"nested": 1}}'):
        bad = await upload(harness, key, [("b.md", b"text")], metadata=metadata)
        assert assert_openai_error(bad, 400, "invalid_request_error")["param"] == "metadata"


async def test_upload_metadata_keeps_to_the_limits_of_v1_documents(harness) -> None:
    # These were stored (a hostile review, 2026-12-05): 100 keys, a 5,000-character value,
    # and 99999999999999999999999 as the float 1e+23, all refused by /v1/documents.
    key = await harness.key(scopes="retrieve,ingest")
    too_many = json.dumps({f"k{i}": i for i in range(100)})
    no_room = json.dumps({f"k{i}": i for i in range(63)})  # filename and format are added
    for metadata, code in (
        (too_many, None),
        (no_room, None),
        (json.dumps({"k": "x" * 5000}), None),
        ('{"n": 99999999999999999999999}', "integer_out_of_range"),
        ('{"n": 1e400}', "number_out_of_range"),
        ('{"k": "\\ud800"}', "invalid_string"),
    ):
        bad = await upload(harness, key, [("b.md", b"Plain text.")], metadata=metadata)
        error = assert_openai_error(bad, 400, "invalid_request_error")
        assert error["param"] == "metadata", (metadata[:40], error)
        if code is not None:
            assert error["code"] == code, error
    huge_access = json.dumps({"groups": [{"deep": [1e400]}]})
    bad = await upload(harness, key, [("b.md", b"Plain text.")], access=huge_access)
    assert assert_openai_error(bad, 400, "invalid_request_error")["param"] == "access"
    empty_id = await upload(harness, key, [("b.md", b"Plain text.")], document_id="")
    assert assert_openai_error(empty_id, 400, "invalid_request_error")["param"] == "document_id"
    fits = json.dumps({f"k{i}": i for i in range(61)} | {"n": 2**64 - 1})
    kept = await upload(harness, key, [("b.md", b"Plain text.")], metadata=fits)
    assert kept.status_code == 200, kept.text


async def test_a_file_name_with_a_path_or_control_characters_is_refused_by_name(harness) -> None:
    key = await harness.key(scopes="retrieve,ingest")
    # Paths, then names that read as others or break a line: a bidi override
    # ("\u202etxt.exe.md" shows as "dm.exe.txt"), an isolate, separators, a C1 control.
    spoofing = ("\u202etxt.exe.md", "a\u2067b.md", "a\u2028b.md", "a\u2029b.md", "c1\x85.md")
    hidden = ("a\u200bb.md", "a\ufeff.md", "tag\U000e0041\U000e0042.md")  # zero-width, tags
    for name in ("../../etc/passwd.txt", "a\\b.txt", "/abs.md", *spoofing, *hidden):
        response = await upload(harness, key, [(name, b"Plain text.")])
        error = assert_openai_error(response, 400, "invalid_request_error")
        assert error["code"] == "invalid_filename", name
    persian = "\u06af\u0632\u0627\u0631\u0634\u200c\u0647\u0627.md"  # a ZWNJ inside a word
    response = await upload(harness, key, [(persian, b"Plain text.")])
    assert response.status_code == 200, response.text
    assert response.json()["filename"] == persian
    for raw_name in (b"nul\x00.txt", b"tab\t.txt", b"bell\x07.txt"):  # as sent, not escaped
        body = (
            b'--B\r\nContent-Disposition: form-data; name="file"; filename="'
            + raw_name
            + b'"\r\n\r\nPlain text.\r\n--B--\r\n'
        )
        response = await harness.client.post(
            "/v1/files",
            content=body,
            headers={**auth(key), "Content-Type": "multipart/form-data; boundary=B"},
        )
        error = assert_openai_error(response, 400, "invalid_request_error")
        assert error["code"] == "invalid_filename", raw_name


async def test_hostile_multipart_bodies_get_a_4xx(harness) -> None:
    key = await harness.key(scopes="retrieve,ingest")
    post = harness.client.post

    async def raw(body: bytes, content_type: str) -> httpx.Response:
        return await post(
            "/v1/files", content=body, headers={**auth(key), "Content-Type": content_type}
        )

    part = b'--B\r\nContent-Disposition: form-data; name="file"; filename="a.txt"\r\n\r\nhi\r\n'
    cases = [
        (b"{}", "application/json", 415),
        (part + b"--B--\r\n", "multipart/form-data", 400),  # no boundary
        (part + b"--B--\r\n", "multipart/form-data; boundary=" + "x" * 300, 400),
        (
            b"--B\r\nX-Huge: " + b"h" * 100_000 + b"\r\n\r\nhi\r\n--B--\r\n",
            "multipart/form-data; boundary=B",
            400,
        ),
        (part * 500 + b"--B--\r\n", "multipart/form-data; boundary=B", 400),  # too many files
        (b"garbage without any boundary", "multipart/form-data; boundary=B", 400),
        (
            b'--B\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nx\r\n--B--\r\n',
            "multipart/form-data; boundary=B",
            400,
        ),
    ]
    for body, content_type, status in cases:
        response = await raw(body, content_type)
        assert_openai_error(response, status, "invalid_request_error")
    too_big = await raw(b"x" * (UPLOAD_LIMIT + 1), "multipart/form-data; boundary=B")
    assert too_big.status_code == 413
