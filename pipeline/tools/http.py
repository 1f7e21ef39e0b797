"""HTTP tools: a GET to a configured URL template, and nowhere else.

A tool's URL is its template with the call's arguments filled in (percent-encoded, so an
argument cannot add a host, a query or a path separator). Before any request the URL is
normalised (scheme and host in lower case, default ports, percent-encoded unreserved
characters decoded, dot segments removed, repeated slashes collapsed) and must then match one
of the tool's allowed prefixes exactly: same scheme, host and port, and a path inside the
prefix's path. Userinfo, encoded slashes or backslashes and control characters are refused
outright. Redirects are followed only while they stay on the allow-list; the response body is
read up to a cap.

The address the host resolves to is checked by the webhooks' SSRF rules
(``pipeline.jobs.urls.UrlPolicy``: public addresses only, unless the tool is configured with
``allow_private`` for a service inside the network; cloud metadata addresses never) and the
connection goes to that checked address, so a name that resolves elsewhere a moment later
(DNS rebinding) is not followed.
"""

from __future__ import annotations

import posixpath
import re
import ssl
from dataclasses import dataclass
from typing import Any, Final
from urllib.parse import quote, urljoin, urlsplit

import httpx

from pipeline.jobs.urls import Resolver, UrlPolicy, WebhookUrlRefused, system_resolver
from pipeline.tools.base import Tool, ToolContext, ToolError
from pipeline.tools.registry import ToolRefused

MAX_URL_LENGTH: Final = 2048
DEFAULT_PORTS: Final = {"http": 80, "https": 443}
_PLACEHOLDER: Final = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")
_ESCAPE: Final = re.compile(r"%([0-9A-Fa-f]{2})")
_UNRESERVED: Final = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-._~")
_FORBIDDEN_ESCAPES: Final = frozenset({"2F", "5C", "00"})  # "/", "\", NUL


class UrlRefused(ToolRefused):
    """The URL may not be fetched by this tool (off its allow-list, or unsafe)."""


@dataclass(frozen=True)
class Url:
    """A normalised http(s) URL (no userinfo, no fragment)."""

    scheme: str
    host: str
    port: int
    path: str
    query: str = ""

    def origin(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        port = "" if DEFAULT_PORTS[self.scheme] == self.port else f":{self.port}"
        return f"{self.scheme}://{host}{port}"

    def __str__(self) -> str:
        return self.origin() + self.path + (f"?{self.query}" if self.query else "")

    def within(self, prefix: Url) -> bool:
        """Same scheme, host and port, and a path at or under the prefix's (by whole segments)."""
        if (self.scheme, self.host, self.port) != (prefix.scheme, prefix.host, prefix.port):
            return False
        base = prefix.path
        if base.endswith("/"):
            return self.path.startswith(base)
        return self.path == base or self.path.startswith(base + "/")


def _unescape(match: re.Match[str]) -> str:
    code = match.group(1).upper()
    if code in _FORBIDDEN_ESCAPES:
        raise UrlRefused("encoded slashes, backslashes and NUL are not allowed in a URL path")
    char = chr(int(code, 16))
    return char if char in _UNRESERVED else f"%{code}"


def normalise_path(path: str) -> str:
    """The path with unreserved escapes decoded, dot segments removed, slashes collapsed."""
    decoded = _ESCAPE.sub(_unescape, path or "/")
    clean = posixpath.normpath("/" + decoded)  # removes "." and ".." (never above "/")
    clean = re.sub(r"/{2,}", "/", clean)
    if decoded.endswith("/") and clean != "/":
        clean += "/"
    return clean


def parse_url(url: str) -> Url:
    """``url`` normalised, or ``UrlRefused`` saying what is wrong with it."""
    if not url or len(url) > MAX_URL_LENGTH:
        raise UrlRefused(f"a URL must be given, of at most {MAX_URL_LENGTH} characters")
    if any(ord(c) <= 32 or ord(c) == 127 or c == "\\" for c in url):
        raise UrlRefused("a URL must not contain spaces, control characters or backslashes")
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise UrlRefused(f"not a valid URL ({exc})") from None
    scheme = parts.scheme.lower()
    if scheme not in DEFAULT_PORTS:
        raise UrlRefused("only http and https URLs can be fetched")
    if "@" in parts.netloc:
        raise UrlRefused("a URL must not carry user names or passwords")
    host = (parts.hostname or "").rstrip(".")
    if not host:
        raise UrlRefused("the URL has no host")
    try:
        host = host.encode("idna").decode("ascii") if not host.isascii() else host.lower()
    except UnicodeError:
        raise UrlRefused("the URL's host name is not valid") from None
    return Url(scheme, host, port or DEFAULT_PORTS[scheme], normalise_path(parts.path), parts.query)


def default_prefix(template: str) -> str:
    """The template up to its first placeholder, cut back to a whole path segment."""
    head = template.split("{", 1)[0]
    if "?" in head:
        return head.split("?", 1)[0]
    parts = urlsplit(head)
    return f"{parts.scheme}://{parts.netloc}{parts.path.rsplit('/', 1)[0]}/"


def template_schema(template: str) -> dict[str, Any]:
    """An arguments schema with one required string per placeholder of ``template``."""
    names = list(dict.fromkeys(_PLACEHOLDER.findall(template)))
    return {
        "type": "object",
        "properties": {name: {"type": "string", "maxLength": 500} for name in names},
        "required": names,
        "additionalProperties": False,
    }


def _fill(template: str, arguments: dict[str, Any]) -> str:
    def value(match: re.Match[str]) -> str:
        return quote(str(arguments.get(match.group(1), "")), safe="")

    return _PLACEHOLDER.sub(value, template)


def _describe_refusal(exc: WebhookUrlRefused) -> str:
    # The shared SSRF rules speak of webhooks; the model is calling a tool.
    return str(exc).replace("webhook_url", "the URL").replace("webhook host", "the host")


class HttpTool:
    """A GET tool over ``url`` (a template with ``{name}`` placeholders for the arguments),
    allowed to fetch only under ``allow`` (URL prefixes; default: the template's own)."""

    def __init__(
        self,
        name: str,
        description: str,
        url: str,
        *,
        allow: list[str] | tuple[str, ...] = (),
        parameters: dict[str, Any] | None = None,
        headers: dict[str, str] | None = None,
        timeout_s: float = 5.0,
        max_bytes: int = 64_000,
        max_redirects: int = 3,
        max_concurrency: int = 8,
        rate_per_second: float | None = None,
        cache_ttl: int | None = 0,
        allow_private: bool = False,
        resolver: Resolver = system_resolver,
        verify: ssl.SSLContext | bool = True,
    ) -> None:
        self.name = name
        self.description = description
        self.template = url
        self.prefixes = [parse_url(prefix) for prefix in (allow or [default_prefix(url)])]
        own = parse_url(_fill(url, {p: "x" for p in _PLACEHOLDER.findall(url)}))
        if not self.allows(own):
            raise UrlRefused(f"HTTP tool {name!r}: its own URL {url} is off its allow-list")
        if not allow_private and any(p.scheme == "http" for p in self.prefixes):
            # Refused at start: the address rules take plain http only for a service inside
            # the network, so every call of such a tool would fail.
            raise UrlRefused(
                f"HTTP tool {name!r}: a public URL must use https (http is for a service "
                "inside the network, with allow_private)"
            )
        self.parameters = parameters or template_schema(url)
        self.headers = dict(headers or {})
        self.timeout_s = timeout_s
        self.max_bytes = max_bytes
        self.max_redirects = max_redirects
        self.max_concurrency = max_concurrency
        self.rate_per_second = rate_per_second
        self.cache_ttl = cache_ttl
        # Allow-listed hosts inside the network are exempt from the address rules only when the
        # operator says so; metadata addresses stay refused either way.
        self.policy = UrlPolicy([p.host for p in self.prefixes] if allow_private else [])
        self.resolver = resolver
        self.verify = httpx.create_ssl_context() if verify is True else verify

    def allows(self, url: Url) -> bool:
        return any(url.within(prefix) for prefix in self.prefixes)

    def check(self, url: str) -> Url:
        """The normalised URL when this tool may fetch it, else ``UrlRefused``."""
        parsed = parse_url(url)
        if not self.allows(parsed):
            raise UrlRefused(f"{self.name} may not fetch {parsed.origin()}{parsed.path[:100]}")
        return parsed

    def tool(self) -> Tool:
        async def run(arguments: dict[str, Any], context: ToolContext) -> str:
            return await self.fetch(_fill(self.template, arguments))

        return Tool(
            name=self.name,
            description=self.description,
            parameters=self.parameters,
            function=run,
            timeout_s=self.timeout_s,
            max_concurrency=self.max_concurrency,
            rate_per_second=self.rate_per_second,
            cache_ttl=self.cache_ttl,
        )

    async def fetch(self, url: str) -> str:
        """GET ``url`` (following redirects on the allow-list only); the body as text."""
        current = self.check(url)
        async with httpx.AsyncClient(
            timeout=self.timeout_s,
            follow_redirects=False,
            trust_env=False,  # never through a proxy: it would resolve the name itself
            verify=self.verify,
            limits=httpx.Limits(max_keepalive_connections=0),
        ) as client:
            for _ in range(self.max_redirects + 1):
                response, body = await self._get(client, current)
                location = response.headers.get("location")
                if not (response.is_redirect and location):
                    return self._text(response, body)
                try:
                    current = self.check(urljoin(str(current), location))
                except UrlRefused as exc:
                    raise UrlRefused(f"redirected off the allow-list: {exc}") from None
        raise ToolError(f"{self.name}: more than {self.max_redirects} redirects")

    async def _get(self, client: httpx.AsyncClient, url: Url) -> tuple[httpx.Response, bytes]:
        try:
            target = self.policy.parse(str(url))
            addresses = await self.policy.resolve(target, self.resolver)
        except WebhookUrlRefused as exc:
            raise UrlRefused(_describe_refusal(exc)) from None
        except OSError as exc:
            raise ToolError(f"{self.name}: cannot resolve {url.host} ({exc})") from None
        # Connect to the address just checked; the name goes in Host and in TLS (SNI).
        pinned = httpx.URL(str(url)).copy_with(host=str(addresses[0]))
        sni = {"sni_hostname": url.host} if url.scheme == "https" else {}
        request = client.build_request(
            "GET",
            pinned,
            # Identity: the cap counts the bytes read, which a compressed body would multiply.
            headers={
                **self.headers,
                "Host": urlsplit(str(url)).netloc,
                "Accept-Encoding": "identity",
            },
            extensions=sni,
        )
        try:
            response = await client.send(request, stream=True)
            try:
                body = await self._read(response)
            finally:
                await response.aclose()
        except httpx.TimeoutException:
            raise ToolError(f"{self.name}: {url.host} did not answer in time") from None
        except httpx.HTTPError as exc:
            raise ToolError(
                f"{self.name}: cannot reach {url.host} ({type(exc).__name__})"
            ) from None
        return response, body

    async def _read(self, response: httpx.Response) -> bytes:
        body = bytearray()
        async for chunk in response.aiter_raw():
            body.extend(chunk)
            if len(body) > self.max_bytes:
                break
        return bytes(body)

    def _text(self, response: httpx.Response, body: bytes) -> str:
        if response.status_code >= 400:
            raise ToolError(f"{self.name}: the server answered HTTP {response.status_code}")
        kind = response.headers.get("content-type", "text/plain").split(";")[0].strip().lower()
        if not (kind.startswith("text/") or kind.endswith(("json", "xml"))):
            return f"(a {kind} response of {len(body)} bytes, not shown)"
        try:
            text = body[: self.max_bytes].decode(response.charset_encoding or "utf-8", "replace")
        except LookupError:  # a charset Python does not know
            text = body[: self.max_bytes].decode("utf-8", "replace")
        if len(body) > self.max_bytes:
            text += f"\n… (cut at {self.max_bytes} bytes)"
        return text
