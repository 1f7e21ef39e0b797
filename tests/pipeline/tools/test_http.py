"""HTTP tools: URLs normalised and held to an allow-list; a real local server for the rest."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, ClassVar
from urllib.parse import parse_qs, urlsplit

import pytest

from pipeline.answer.events import ToolCall
from pipeline.tools.http import HttpTool, UrlRefused, parse_url
from pipeline.tools.invoker import ToolInvoker
from pipeline.tools.registry import ToolRegistry
from tests.pipeline.tools.support import Tracing, caller


@pytest.mark.parametrize(
    ("url", "normal"),
    [
        ("HTTP://Example.COM:80/a/./b/../c", "http://example.com/a/c"),
        ("https://example.com", "https://example.com/"),
        ("https://example.com:8443/x/", "https://example.com:8443/x/"),
        ("https://example.com./%7Euser/%41", "https://example.com/~user/A"),
        ("https://example.com/a/%2e%2e/b", "https://example.com/b"),
        ("https://example.com//a///b", "https://example.com/a/b"),
        ("https://example.com/a/../../../b", "https://example.com/b"),
        ("https://example.com/q?x=1&y=../z#frag", "https://example.com/q?x=1&y=../z"),
        ("https://bücher.example/", "https://xn--bcher-kva.example/"),
        ("http://[::1]:8080/a", "http://[::1]:8080/a"),
    ],
)
def test_urls_are_normalised(url: str, normal: str) -> None:
    assert str(parse_url(url)) == normal


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("ftp://example.com/", "only http and https"),
        ("file:///etc/passwd", "only http and https"),
        ("https://user:pw@example.com/", "user names or passwords"),
        ("https://example.com@evil.com/", "user names or passwords"),
        ("https://example.com/a%2Fb", "encoded slashes"),
        ("https://example.com/a%5cb", "encoded slashes"),
        ("https://example.com/a\\b", "backslashes"),
        ("https://example.com/a b", "spaces"),
        ("https://example.com:99999/", "not a valid URL"),
        ("https:///path", "no host"),
        ("", "must be given"),
    ],
)
def test_unsafe_urls_are_refused(url: str, says: str) -> None:
    with pytest.raises(UrlRefused, match=says):
        parse_url(url)


API = HttpTool(
    "api", "test", "https://api.example.com/v1/items/{id}", allow=["https://api.example.com/v1/"]
)


@pytest.mark.parametrize(
    "url",
    [
        "https://evil.com/v1/items/1",
        "http://api.example.com/v1/items/1",
        "https://api.example.com:8443/v1/items/1",
        "https://api.example.com@evil.com/v1/items/1",
        "https://api.example.com.evil.com/v1/items/1",
        "https://evil.com/https://api.example.com/v1/",
        "https://api.example.com/v1/../admin",
        "https://api.example.com/v1/%2e%2e/admin",
        "https://api.example.com/v1/..%2fadmin",
        "https://api.example.com/v10/items",
        "https://api.example.com/v1",
        "https://api.example.com/",
    ],
)
def test_urls_off_the_allow_list_are_refused(url: str) -> None:
    with pytest.raises(UrlRefused):
        API.check(url)


def test_urls_on_the_allow_list_pass_normalised() -> None:
    checked = API.check("https://API.example.com:443/v1/./items/7?full=1")
    assert str(checked) == "https://api.example.com/v1/items/7?full=1"
    exact = HttpTool("x", "x", "https://h.example/api/{q}", allow=["https://h.example/api"])
    assert str(exact.check("https://h.example/api")) == "https://h.example/api"
    with pytest.raises(UrlRefused):
        exact.check("https://h.example/apix")


def test_a_tool_whose_own_url_is_off_its_allow_list_is_refused_at_start() -> None:
    with pytest.raises(UrlRefused, match="off its allow-list"):
        HttpTool("x", "x", "https://a.example/{q}", allow=["https://b.example/"])
    default = HttpTool("x", "x", "https://a.example/api/search?q={q}")
    assert [str(p) for p in default.prefixes] == ["https://a.example/api/search"]
    assert default.parameters["required"] == ["q"]


def test_a_public_tool_on_plain_http_is_refused_at_start_not_at_every_call() -> None:
    with pytest.raises(UrlRefused, match="https"):
        HttpTool("x", "x", "http://api.example.com/v1/items/{id}")
    with pytest.raises(UrlRefused, match="https"):
        HttpTool(
            "x", "x", "https://a.example/{q}", allow=["https://a.example/", "http://b.example/"]
        )
    inside = HttpTool("x", "x", "http://inventory.internal/items/{id}", allow_private=True)
    assert str(inside.check("http://inventory.internal/items/7")).startswith("http://")


class Handler(BaseHTTPRequestHandler):
    seen: ClassVar[list[tuple[str, str]]] = []

    def do_GET(self) -> None:
        url = urlsplit(self.path)
        self.seen.append((url.path, self.headers.get("Host", "")))
        port = self.server.server_address[1]
        routes: dict[str, tuple[int, str, bytes, dict[str, str]]] = {
            "/api/echo": (200, "text/plain", f"echo: {parse_qs(url.query).get('q')}".encode(), {}),
            "/api/json": (200, "application/json", b'{"ok": true}', {}),
            "/api/odd": (200, "text/plain; charset=klingon", "olá".encode(), {}),
            "/api/big": (200, "text/plain", b"x" * 200_000, {}),
            "/api/image": (200, "image/png", b"\x89PNG" + b"\0" * 100, {}),
            "/api/in": (302, "text/plain", b"", {"Location": "/api/echo?q=moved"}),
            "/api/out": (302, "text/plain", b"", {"Location": "/secret"}),
            "/api/host": (
                302,
                "text/plain",
                b"",
                {"Location": f"http://localhost:{port}/api/echo"},
            ),
            "/api/loop": (302, "text/plain", b"", {"Location": "/api/loop"}),
            "/secret": (200, "text/plain", b"the secret", {}),
        }
        if url.path == "/api/slow":
            time.sleep(3.0)  # six times the 0.5 s timeout of the tool that asks for it
        status, kind, body, headers = routes.get(url.path, (404, "text/plain", b"no", {}))
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        for name, value in headers.items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


async def fetch(tracing: Tracing, tool: HttpTool, arguments: str) -> Any:
    invoker = ToolInvoker(ToolRegistry([tool.tool()]), tracing.tracer)
    (run,) = await invoker.run([ToolCall("1", tool.name, arguments)], caller())
    return run


def local(server: str, **options: Any) -> HttpTool:
    # 5 s: the real fetches (a redirect, a body cut at its cap) are not what is timed, and the
    # server shares this process's GIL. The test of a timeout sets a short one.
    options.setdefault("timeout_s", 5.0)
    return HttpTool("local", "test", server + "/api/{path}", allow_private=True, **options)


async def test_an_allowed_url_is_fetched_from_the_real_server(
    tracing: Tracing, server: str
) -> None:
    echo = HttpTool("echo", "echo", server + "/api/echo?q={q}", allow_private=True)
    run = await fetch(tracing, echo, '{"q": "../../secret?x=1#y"}')
    # The argument was encoded into the query: it could not leave /api/echo.
    assert (run.status, run.content) == ("ok", "echo: ['../../secret?x=1#y']")
    assert Handler.seen[-1] == ("/api/echo", server.removeprefix("http://"))
    assert run.cache_ttl == 0
    json_run = await fetch(tracing, local(server), '{"path": "json"}')
    assert json_run.content == '{"ok": true}'


async def test_path_arguments_cannot_leave_the_prefix(tracing: Tracing, server: str) -> None:
    before = len(Handler.seen)
    for path, says in ((".", "may not fetch"), ("..", "may not fetch"), ("../secret", "slashes")):
        run = await fetch(tracing, local(server), f'{{"path": "{path}"}}')
        assert run.status == "refused" and says in run.content, path
    # An escape in an argument is encoded again: a file name under /api/, not "..".
    escaped = await fetch(tracing, local(server), '{"path": "%2e%2e"}')
    assert escaped.content == "local: the server answered HTTP 404"
    assert [path for path, _ in Handler.seen[before:]] == ["/api/%252e%252e"]


async def test_redirects_are_followed_only_on_the_allow_list(tracing: Tracing, server: str) -> None:
    moved = await fetch(tracing, local(server), '{"path": "in"}')
    assert moved.content == "echo: ['moved']"
    out = await fetch(tracing, local(server), '{"path": "out"}')
    assert out.status == "refused" and "redirected off the allow-list" in out.content
    other_host = await fetch(tracing, local(server), '{"path": "host"}')
    assert other_host.status == "refused"
    looping = await fetch(tracing, local(server), '{"path": "loop"}')
    assert looping.status == "error" and "more than 3 redirects" in looping.content
    assert not any(path == "/secret" for path, _ in Handler.seen)


async def test_responses_are_capped_and_failures_described(tracing: Tracing, server: str) -> None:
    big = await fetch(tracing, local(server, max_bytes=1000), '{"path": "big"}')
    assert big.status == "ok" and big.content == "x" * 1000 + "\n… (cut at 1000 bytes)"
    missing = await fetch(tracing, local(server), '{"path": "nothing-here"}')
    assert (missing.status, missing.content) == ("error", "local: the server answered HTTP 404")
    odd = await fetch(tracing, local(server), '{"path": "odd"}')
    assert (odd.status, odd.content) == ("ok", "olá")  # an unknown charset: read as UTF-8
    image = await fetch(tracing, local(server), '{"path": "image"}')
    assert image.content == "(a image/png response of 104 bytes, not shown)"
    slow = await fetch(tracing, local(server, timeout_s=0.5), '{"path": "slow"}')
    # The client's own timeout or the invoker's, whichever comes first: never a hang.
    assert (slow.status, slow.content) in (
        ("timeout", "local did not answer within 0.5 s; try again later."),
        ("error", "local: 127.0.0.1 did not answer in time"),
    )


async def test_private_addresses_need_allow_private(tracing: Tracing, server: str) -> None:
    port = server.rsplit(":", 1)[1]
    tool = HttpTool("inner", "x", f"https://127.0.0.1:{port}/api/{{path}}")
    run = await fetch(tracing, tool, '{"path": "echo"}')
    assert run.status == "refused" and "loopback" in run.content
    metadata = HttpTool("meta", "x", "http://169.254.169.254/latest/{path}", allow_private=True)
    run = await fetch(tracing, metadata, '{"path": "meta-data"}')
    assert run.status == "refused" and "metadata" in run.content
    mapped = HttpTool(
        "meta6", "x", "http://[::ffff:169.254.169.254]/latest/{path}", allow_private=True
    )
    run = await fetch(tracing, mapped, '{"path": "meta-data"}')
    assert run.status == "refused" and "metadata" in run.content
