"""POST /v1/files under generated uploads: random bytes, names, content types, fields and raw
multipart bodies always get a 2xx or a 4xx in OpenAI's error shape, never a 5xx or a hang."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from app.main import create_app
from tests.conftest import AppHarness, make_settings
from tests.support.fuzzing import examples
from tests.support.sample_files import coastal_sample, docx_bytes, html_bytes, pdf_bytes
from tests.support.servers import free_port

SAMPLE = coastal_sample()
REAL = [pdf_bytes(SAMPLE), docx_bytes(SAMPLE), html_bytes(SAMPLE), b"# T\n\nSome text."]
SUFFIXES = [".pdf", ".docx", ".pptx", ".html", ".md", ".txt", ".exe", "", ".PDF", ".tar.gz"]
NAMES = st.builds(
    lambda stem, suffix: stem + suffix, st.text(max_size=40), st.sampled_from(SUFFIXES)
)
CONTENT = st.binary(max_size=3000) | st.sampled_from(REAL) | st.text(max_size=500).map(str.encode)
CONTENT_TYPES = st.sampled_from(
    ["application/pdf", "text/plain", "application/octet-stream", "", "x/\x00y", "text/html"]
) | st.text(max_size=30)
FIELDS = st.dictionaries(
    st.sampled_from(["purpose", "metadata", "access", "document_id", "tenant", "x"]),
    st.sampled_from(['{"a": 1}', "[]", "{", '{"groups": ["g"]}', "", "x" * 70])
    | st.text(max_size=40),
    max_size=3,
)


def _ok(response: httpx.Response) -> None:
    assert response.status_code < 500, response.text
    if response.status_code >= 400:
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"]
    else:
        body = response.json()
        assert body["object"] in {"file", "list"}


@pytest.fixture(scope="module")
async def fuzzed(redis_server, shared_embedder) -> AsyncIterator[tuple[AppHarness, str]]:
    config = make_settings(
        redis_server.url,
        f"http://127.0.0.1:{free_port()}",
        files={"max_file_bytes": 2000, "max_upload_bytes": 200_000, "max_files": 4},
    )
    app = create_app(config, embedder=shared_embedder)
    async with app.router.lifespan_context(app):
        harness = AppHarness(app, exporter=None)  # type: ignore[arg-type]
        key = await harness.key(scopes="retrieve,ingest")
        try:
            yield harness, key
        finally:
            await harness.client.aclose()


FUZZ = settings(
    max_examples=examples(60),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@FUZZ
@given(
    files=st.lists(st.tuples(NAMES, CONTENT, CONTENT_TYPES), min_size=1, max_size=5),
    fields=FIELDS,
)
@example(files=[("a.txt", b"plain", "text/plain")], fields={"metadata": '{"bad key": 1}'})
@example(files=[("a.txt", b"plain", "text/plain")], fields={"access": '{"groups": [1]}'})
async def test_generated_uploads_get_a_2xx_or_a_4xx(
    fuzzed: tuple[AppHarness, str], files: list[tuple[str, bytes, str]], fields: dict[str, Any]
) -> None:
    harness, key = fuzzed
    try:
        request = harness.client.build_request(
            "POST",
            "/v1/files",
            files=[("file", f) for f in files],
            data=fields,
            headers={"Authorization": f"Bearer {key}"},
        )
    except (ValueError, TypeError, UnicodeEncodeError):
        return  # httpx itself refuses to encode it: nothing reaches the service
    _ok(await harness.client.send(request))


@FUZZ
@given(
    body=st.binary(max_size=4000)
    | st.builds(
        lambda head, parts, tail: head + b"".join(parts) + tail,
        st.sampled_from([b"", b"--B\r\n", b"--B\r\nContent-Disposition: form-data; "]),
        st.lists(
            st.sampled_from(
                [
                    b'name="file"; filename="a.txt"\r\n\r\nhi\r\n--B\r\n',
                    b'name="purpose"\r\n\r\nx\r\n--B\r\n',
                    b"Content-Disposition: form-data\r\n\r\n",
                    b"\r\n",
                    b"--B--",
                ]
            )
            | st.binary(max_size=60),
            max_size=12,
        ),
        st.sampled_from([b"", b"--B--\r\n", b"\r\n--B--"]),
    ),
    content_type=st.sampled_from(
        [
            "multipart/form-data; boundary=B",
            "multipart/form-data",
            "multipart/form-data; boundary=",
            'multipart/form-data; boundary="B"; charset=nope',
            "application/x-www-form-urlencoded",
        ]
    ),
)
async def test_generated_raw_multipart_bodies_get_a_2xx_or_a_4xx(
    fuzzed: tuple[AppHarness, str], body: bytes, content_type: str
) -> None:
    harness, key = fuzzed
    response = await harness.client.post(
        "/v1/files",
        content=body,
        headers={"Authorization": f"Bearer {key}", "Content-Type": content_type},
    )
    _ok(response)
