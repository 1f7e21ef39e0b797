"""The cache-hit fast path: a plain ``POST /v1/chat/completions`` whose answer is cached is
answered here, without FastAPI's routing, the body's model validation or the stages.

``CacheFastPath`` is a pure ASGI middleware inside ``RequestTracing`` and ``DrainOnShutdown``
(so the request has its root span, metrics, log line and shutdown handling as any other) and
outside the body limit, the key check and the rate limits, which it does itself for what it
answers. It takes a request only when everything is plain: a bearer key this process resolved
recently (``ApiKeyStore.cached``: no Redis lookup, no re-check due) that carries the ``chat``
scope, a declared ``Content-Length`` of at most ``max_body_bytes``, no ``Cache-Control``. Then
it reads the body and looks up an *alias*: one Redis GET of a copy of the cached answer, under
the SHA-256 of

- a fingerprint of the settings (routes, defaults, tools, policies: what validation and the
  body's defaults depend on), the versions in the cache key (prompt layout, router, ...) and
  the service's own code and data files (``code_digest``): the full path runs the input guard
  and validation before its cache lookup, so a deploy that refuses more (a new guard rule, a
  stricter schema) must not find the aliases the code before it wrote;
- the tenant, the user where answers are personalised, the tenant's index version and the
  caller's access scope in it (``PassageSearch.access_scope``, as the cache key has them);
- the key parts earlier stages add (the tenant's guard policy token);
- the SHA-256 of the exact body bytes.

A request it takes pays the rate limits first, as the full path does before reading a body
(requests per minute; a 429 in OpenAI's shape with its headers, recorded as the full path
records one: no cache lookup, no stage); a request it then leaves to the full path is not
admitted twice (``ADMITTED``). A hit is answered with the bytes the full path gives
(``x-cache: hit``, the ``x-ratelimit-*`` headers, a new ``chatcmpl-`` id, ``rag`` with
``cache: "hit"``). Anything else, a miss or any error included, falls through to the full path
with the body replayed.

The alias is written here too, after the full path has answered a request with plain headers
(the body kept as the full path read it): when that request was a non-streamed, unexplained 200
whose cache lookup ran (a hit or a miss), the entry under the full path's key is copied to the
alias (``ResponseCache.copy``, with its TTL; nothing when the entry was not stored), and an answer
stored under that key later (a ``Cache-Control: no-cache`` refresh) deletes the entry's
copies. The alias is made from
the principal the full path resolved, and written only when the index version and key parts it
is made of are those the full path's key was made with, so an alias never holds an answer its
key would not find: two tenants, two users of a personalised path, two access scopes or two
index versions never share one. Its Redis key has the tenant in its name, as the entries' do.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Final

import orjson
from opentelemetry import trace
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.http.auth import bearer, refuse
from app.http.limits import ADMITTED, annotate_limits
from app.http.responses import chat_completion
from app.logs import hand_to_log, handed_context
from app.services import Services
from pipeline.answer.completion import Completion, UnreadableCompletion
from pipeline.context import ChatParams, Principal, RequestContext, StageRecord
from pipeline.errors import ServiceUnavailable, StoreUnavailable
from pipeline.guards.policy import GuardPolicy
from pipeline.model.prompt import PROMPT_VERSION
from pipeline.stages.auth import MAX_CREDENTIAL_CHARS
from pipeline.stages.cache import CacheLookup
from pipeline.stages.guard_in import GuardInput
from pipeline.store.limits import refusal
from pipeline.telemetry import attributes as attr

PATH: Final = "/v1/chat/completions"
MAX_BODY_BYTES: Final = 32_768
STAGE: Final = "fast_path"
# What RequestTracing reads of the route that ran (its template, for the span and the metrics).
ROUTE: Final = SimpleNamespace(path=PATH)
FAST_PATH_ATTRIBUTE: Final = "rag.cache.fast_path"
_STATUS_KEY: Final = attr.info_key(attr.CACHE_STATUS)
_VERSION_KEY: Final = attr.info_key(attr.CACHE_INDEX_VERSION)
# The packages whose files decide what the full path refuses or answers for a body.
_CODE: Final = ("app", "pipeline", "retrieval")


@functools.cache
def code_digest() -> str:
    """SHA-256 of the service's own files (sources and data: guard rules, schemas, exemplars):
    any deploy that changes them changes every alias."""
    return files_digest(Path(__file__).resolve().parents[2], _CODE)


def files_digest(root: Path, folders: tuple[str, ...]) -> str:
    """SHA-256 of the files under ``root``'s ``folders``, by path and content (bytecode caches
    left out: they follow the sources)."""
    digest = hashlib.sha256()
    for folder in folders:
        for path in sorted((root / folder).rglob("*")):
            if path.is_file() and "__pycache__" not in path.parts:
                digest.update(str(path.relative_to(root)).encode() + b"\0")
                digest.update(hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()


@dataclass(frozen=True)
class Alias:
    """Where one request's answer would be copied, and what of the path it was made from."""

    key: str
    version: str
    parts: dict[str, str]


class AliasBook:
    """Alias keys, made from what the app's cache lookup stage keys answers with."""

    def __init__(self, services: Services, lookup: CacheLookup, guard: GuardInput | None) -> None:
        self.services = services
        self.lookup = lookup
        self.guard = guard
        self.prefix = lookup.cache.alias_prefix
        settings = services.settings.model_dump_json().encode()
        versions = orjson.dumps(
            {"prompt": PROMPT_VERSION, **lookup.versions}, option=orjson.OPT_SORT_KEYS
        )
        code = code_digest().encode()
        self.fingerprint = hashlib.sha256(settings + b"\0" + versions + b"\0" + code).hexdigest()
        self._tokens: dict[str, tuple[GuardPolicy, str]] = {}

    def parts(self, tenant: str) -> dict[str, str]:
        """The key parts the full path's earlier stages add for ``tenant`` (guard_in's)."""
        if self.guard is None:
            return {}
        policy = self.guard.policies.for_tenant(tenant)
        known = self._tokens.get(tenant)
        if known is None or known[0] is not policy:
            # The token is a JSON dump and a hash of the policy: made once per policy object.
            known = self._tokens[tenant] = (policy, policy.cache_token)
        return {"guard": known[1]}

    def alias(self, principal: Principal, body: bytes) -> Alias:
        lookup = self.lookup
        if lookup.access_scope is not None:
            version, access = lookup.access_scope(principal)
        else:
            version, access = lookup.index_version(principal.tenant), None
        parts = self.parts(principal.tenant)
        material = orjson.dumps(
            [
                self.fingerprint,
                principal.tenant,
                principal.user if lookup.personalised else None,
                version,
                access,
                parts,
                hashlib.sha256(body).hexdigest(),
            ],
            option=orjson.OPT_SORT_KEYS,
        )
        tenant = self.lookup.cache.kv.tag(principal.tenant)  # its entry's slot on a cluster
        key = f"{self.prefix}{tenant}:{hashlib.sha256(material).hexdigest()}"
        return Alias(key, version, parts)

    async def remember(self, ctx: RequestContext, body: bytes) -> None:
        """Copy the entry the full path keyed this request (``body``, as the full path read
        it) under to the body's alias, when the full path keyed it exactly as the alias is
        made (see the module's docstring)."""
        if ctx.cache_key is None or ctx.cache_status not in ("hit", "miss"):
            return
        if ctx.params.stream or ctx.params.rag.explain or ctx.principal is None:
            return
        alias = self.alias(ctx.principal, body)
        info = next((r.info for r in ctx.records if r.name == "cache_lookup"), {})
        if info.get(_VERSION_KEY) != alias.version or ctx.key_parts != alias.parts:
            return
        # Redis down: no alias, and the next request takes the full path again.
        with contextlib.suppress(StoreUnavailable):
            await self.lookup.cache.copy(ctx.cache_key, alias.key)


class CacheFastPath:
    """Answers plain cache hits of ``POST /v1/chat/completions`` (see the module's docstring)."""

    def __init__(self, app: ASGIApp, *, max_body_bytes: int = MAX_BODY_BYTES) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self._book: AliasBook | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] != PATH or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        token, length = _plain_headers(scope["headers"], self.max_body_bytes)
        book = self._aliases(scope) if token is not None else None
        if book is None or token is None:
            await self.app(scope, receive, send)
            return
        principal = book.services.keys.cached(token)
        if principal is not None and principal.can("chat"):
            started = time.perf_counter()
            headers = await self._admit(scope, send, book, principal)
            if headers is None:
                return  # refused (429), before the body was read, as on the full path
            body, messages = await _read(receive, length)
            if body is not None and await self._hit(
                scope, send, book, principal, body, started, headers
            ):
                return
        else:
            # Not ours to answer (the full path checks the key), but its body is kept as the
            # full path reads it, so that its answer can be given an alias.
            messages = []
        chunks: list[bytes] = []
        status = 0

        async def replay() -> Message:
            message = messages.pop(0) if messages else await receive()
            if message["type"] == "http.request":
                chunks.append(message.get("body", b""))
            return message

        async def watched(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        await self.app(scope, replay, watched)
        ctx = handed_context(scope)
        if status == 200 and ctx is not None and sum(map(len, chunks)) == length:
            await book.remember(ctx, b"".join(chunks))

    async def _hit(
        self,
        scope: Scope,
        send: Send,
        book: AliasBook,
        principal: Principal,
        body: bytes,
        started: float,
        headers: list[tuple[bytes, bytes]],
    ) -> bool:
        """Look the body's alias up and answer it (True), or leave it to the full path."""
        search = book.services.retrieval
        try:
            if search is not None and not search.loaded(principal.tenant):
                return False  # the full path loads the snapshot, off the event loop
            raw = await book.services.kv.get(book.alias(principal, body).key)
        except (ServiceUnavailable, OSError):  # Redis, or the caller's index unread:
            return False  # the full path says so (a damaged index was a 500 here: a review)
        if raw is None:
            return False
        return await self._answer(scope, send, book, principal, raw, started, headers)

    async def _admit(
        self, scope: Scope, send: Send, book: AliasBook, principal: Principal
    ) -> list[tuple[bytes, bytes]] | None:
        """The rate limits' headers for a request admitted, its decision kept in the scope
        for the full path (``RateLimits``) in case it is not answered here; None when it was
        refused, with the 429 sent."""
        limiter = book.services.limits
        if limiter is None:
            return []
        decision = await limiter.admit(principal)  # never raises for Redis
        annotate_limits(decision)
        if not decision.admitted:
            await refuse(send, refusal(decision, limiter.config.window_seconds))
            span = trace.get_current_span()
            if span.is_recording():
                span.set_attribute(FAST_PATH_ATTRIBUTE, True)
            return None
        scope.setdefault("state", {})[ADMITTED] = (principal.key_id, decision)
        return [(k.encode(), v.encode()) for k, v in decision.headers().items()]

    def _aliases(self, scope: Scope) -> AliasBook | None:
        """The alias book of the app's services, made when they are (by the lifespan); None
        before that, or when the path has no cache lookup."""
        state = scope["app"].state
        services: Services | None = getattr(state, "services", None)
        book = self._book
        if book is not None and book.services is services:
            return book
        paths = getattr(state, "paths", None)
        if services is None or paths is None:
            return None
        steps = paths.chat.steps
        lookup = next((s for s in steps if isinstance(s, CacheLookup)), None)
        if lookup is None:
            return None
        guard = next((s for s in steps if isinstance(s, GuardInput)), None)
        self._book = AliasBook(services, lookup, guard)
        return self._book

    async def _answer(
        self,
        scope: Scope,
        send: Send,
        book: AliasBook,
        principal: Principal,
        raw: bytes,
        started: float,
        headers: list[tuple[bytes, bytes]],
    ) -> bool:
        """Answer a hit (True), or say it cannot be answered here (False: nothing was sent)."""
        try:
            completion = Completion.from_stored(raw)
        except UnreadableCompletion:
            return False  # a damaged entry: the full path takes it as a miss
        ctx = self._account(scope, book, principal, completion, started)
        body = orjson.dumps(chat_completion(ctx, completion))
        # The headers in the order the full path's response has them (the route's, then the
        # rate limits'); RequestTracing adds x-trace-id after them.
        start: dict[str, Any] = {
            "type": "http.response.start",
            "status": 200,
            "headers": [
                (b"x-request-id", ctx.request_id.encode()),
                (b"x-cache", b"hit"),
                (b"content-length", str(len(body)).encode()),
                (b"content-type", b"application/json"),
                *headers,
            ],
        }
        await send(start)
        await send({"type": "http.response.body", "body": body})
        return True

    def _account(
        self,
        scope: Scope,
        book: AliasBook,
        principal: Principal,
        completion: Completion,
        started: float,
    ) -> RequestContext:
        """The request's context for its log line and metrics (as the route hands the full
        path's), its route for the HTTP metrics, and its facts on the root span."""
        ctx = RequestContext(
            params=ChatParams(model=completion.model, messages=[]),
            credential=None,
            deadline=0.0,
            principal=principal,
            cache_status="hit",
            completion=completion,
        )
        record = StageRecord(STAGE, 0.0, round((time.perf_counter() - started) * 1000.0, 3))
        record.info[_STATUS_KEY] = "hit"
        record.ended = True
        ctx.records.append(record)
        for observer in book.services.observers:
            observer.stage_finished(record, ctx)
        hand_to_log(scope, ctx)
        scope["route"] = ROUTE
        span = trace.get_current_span()
        if span.is_recording():
            span.set_attribute(attr.TENANT, principal.tenant)
            span.set_attribute(attr.CACHE_STATUS, "hit")
            span.set_attribute(FAST_PATH_ATTRIBUTE, True)
        return ctx


def _plain_headers(headers: list[tuple[bytes, bytes]], limit: int) -> tuple[str | None, int]:
    """(bearer token, declared length) of a request plain enough for the fast path, else
    (None, 0): a key, a Content-Length of at most ``limit`` and no Cache-Control."""
    token: str | None = None
    seen_key = False
    length = -1
    for name, value in headers:
        if name == b"authorization" and not seen_key:
            seen_key = True  # the first one counts, as for the key check (token_from_headers)
            token = bearer(value.decode("latin-1"))
        elif name == b"content-length":
            length = int(value) if value.isdigit() and len(value) < 10 else -1
        elif name in (b"cache-control", b"transfer-encoding"):
            return None, 0
    if not token or len(token) > MAX_CREDENTIAL_CHARS or not 0 < length <= limit:
        return None, 0
    return token, length


async def _read(receive: Receive, length: int) -> tuple[bytes | None, list[Message]]:
    """The whole body when it is exactly ``length`` bytes (else None), and the messages read,
    to be replayed to the full path if it is not answered here."""
    messages: list[Message] = []
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        messages.append(message)
        if message["type"] != "http.request":
            return None, messages  # the client went away: the full path sees it too
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > length:
            return None, messages
        chunks.append(chunk)
        if not message.get("more_body", False):
            break
    return (b"".join(chunks) if size == length else None), messages
