"""Logs: one line per HTTP request, and the app's own log records, as JSON or as plain text.

``RAG_LOG__FORMAT=json`` (the default in production) writes one JSON object per line with the
trace and span ids of the span that was current, so a log line leads to its trace in Jaeger
and back; ``text`` (the default elsewhere) is for people at a terminal. The request line
(logger ``rag.request``) carries method, route template, status, duration, the cache's outcome
and each stage's duration, and never a header, a prompt or an answer: the API key and the text
a caller sent stay out of logs whatever the format.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import IO, Any, Final

import orjson
from opentelemetry import trace

from app.settings import LogSettings
from pipeline.context import RequestContext

REQUEST_LOGGER: Final = "rag.request"
# Probes and scrapes: logged at debug level, so a healthcheck does not fill the log.
QUIET_PATHS: Final = frozenset({"/healthz", "/readyz", "/metrics"})


@dataclass
class RequestFacts:
    """What the log line of one request says; the route hands it the context (``hand_to_log``)."""

    method: str
    path: str
    started: float = field(default_factory=time.perf_counter)
    status: int = 0
    route: str | None = None
    ctx: RequestContext | None = None

    def fields(self, duration_s: float, trace_id: int, span_id: int) -> dict[str, Any]:
        out: dict[str, Any] = {
            "method": self.method,
            "route": self.route or self.path,
            "status": self.status,
            "duration_ms": round(duration_s * 1000.0, 3),
        }
        if trace_id:
            out["trace_id"] = format(trace_id, "032x")
            out["span_id"] = format(span_id, "016x")
        ctx = self.ctx
        if ctx is not None:
            out["cache"] = ctx.cache_status
            out["stages"] = {r.name: r.duration_ms for r in ctx.records}
            failed = {r.name: r.status for r in ctx.records if r.status != "ok"}
            if failed:
                out["stage_status"] = failed
        return out


# Where a route leaves its request context for the log line: a key of the ASGI scope's state,
# which the HTTP middleware reads when the response is done.
REQUEST_CONTEXT: Final = "rag_request_context"


def hand_to_log(scope: MutableMapping[str, Any], ctx: RequestContext) -> None:
    """Give the request's context to its log line (stage durations, cache outcome). Called
    before the path runs, so a request the path refuses is logged with its stages too."""
    scope.setdefault("state", {})[REQUEST_CONTEXT] = ctx


def handed_context(scope: Mapping[str, Any]) -> RequestContext | None:
    ctx = scope.get("state", {}).get(REQUEST_CONTEXT)
    return ctx if isinstance(ctx, RequestContext) else None


class RequestLog:
    """Writes the one line of each request (``rag.request``)."""

    def __init__(self) -> None:
        self.logger = logging.getLogger(REQUEST_LOGGER)

    def write(self, facts: RequestFacts, duration_s: float, trace_id: int, span_id: int) -> None:
        level = logging.DEBUG if facts.path in QUIET_PATHS else logging.INFO
        if not self.logger.isEnabledFor(level):
            return
        fields = facts.fields(duration_s, trace_id, span_id)
        summary = f"{fields['method']} {fields['route']} {fields['status']}"
        logger = self.logger
        direct = _only_json_handler(logger, level)
        if direct is not None and direct.write_fields(level, logger.name, summary, fields):
            return
        # The record made directly: ``Logger.log`` would walk the stack for the caller's file
        # and line, which this line never shows (a fifth of a cache hit's logging cost).
        record = logger.makeRecord(
            logger.name, level, __file__, 0, summary, (), None, extra={"rag": fields}
        )
        logger.handle(record)


def _only_json_handler(logger: logging.Logger, level: int) -> _OurHandler | None:
    """This module's JSON handler when it is the one place a record of ``logger`` at ``level``
    would go, with no filter on the way (as ``configure_logging`` leaves things): the request
    line is then written to it without a ``LogRecord``, a third of its cost on a cache hit.
    None when anything else would see the record (a test's capture handler, say)."""
    current: logging.Logger | None = logger
    root = logging.getLogger()
    while current is not None:
        if current.filters or (current is not root and current.handlers):
            return None
        if not current.propagate:
            return None
        current = current.parent  # type: ignore[assignment]
    handlers = root.handlers
    if len(handlers) != 1:
        return None
    handler = handlers[0]
    if (
        not isinstance(handler, _OurHandler)
        or not isinstance(handler.formatter, JsonFormatter)
        or handler.filters
        or level < handler.level
    ):
        return None
    return handler


class JsonFormatter(logging.Formatter):
    """One JSON object per record: time, level, logger, message, trace and span ids, and the
    request fields of a request line."""

    def __init__(self) -> None:
        super().__init__()
        self._second = -1
        self._stamp = ""  # the time up to the second, made again when the second changes

    def format(self, record: logging.LogRecord) -> str:
        fields = getattr(record, "rag", None)
        exception = self.formatException(record.exc_info) if record.exc_info else None
        return self.line(
            record.created,
            record.msecs,
            record.levelname,
            record.name,
            record.getMessage(),
            fields if isinstance(fields, dict) else None,
            exception,
        )

    def line(
        self,
        created: float,
        msecs: float,
        level: str,
        logger: str,
        message: str,
        fields: dict[str, Any] | None,
        exception: str | None = None,
    ) -> str:
        """The JSON line of a record (``created`` in seconds, its ``msecs`` part)."""
        second = int(created)
        if second != self._second:
            self._stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second))
            self._second = second
        doc: dict[str, Any] = {
            "time": f"{self._stamp}.{int(msecs):03d}Z",
            "level": level.lower(),
            "logger": logger,
            "message": message,
        }
        if fields is None or "trace_id" not in fields:
            span = trace.get_current_span().get_span_context()
            if span.is_valid:
                doc["trace_id"] = format(span.trace_id, "032x")
                doc["span_id"] = format(span.span_id, "016x")
        if fields is not None:
            doc.update(fields)
        if exception is not None:
            doc["exception"] = exception
        return orjson.dumps(doc, default=str).decode()


class TextFormatter(logging.Formatter):
    """A line for a terminal; a request line lists its stages and its trace id."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def formatMessage(self, record: logging.LogRecord) -> str:
        line = super().formatMessage(record)
        fields = getattr(record, "rag", None)
        if not isinstance(fields, dict):
            return line
        extra = [f"{fields['duration_ms']:.1f}ms"]
        if "cache" in fields:
            extra.append(f"cache={fields['cache']}")
        if "stages" in fields:
            extra.append(" ".join(f"{k}={v:.1f}" for k, v in fields["stages"].items()))
        if "trace_id" in fields:
            extra.append(f"trace={fields['trace_id']}")
        return f"{line} {' '.join(extra)}"


class _OurHandler(logging.StreamHandler[IO[str]]):
    """The handler this module installs (configuring again replaces it). Without a stream of
    its own it writes to whatever ``sys.stderr`` is at the time (test runners swap it).

    Request lines written on an event loop are written together, once per turn of the loop:
    the first schedules the write (``call_soon``), the others of the same turn join it, so a
    loop that finishes 30 requests in a turn makes one ``write`` for them, not 30 (the one
    cost of the line that showed in a cache hit's profile). Nothing is reordered: any other
    record, ``flush()`` and ``close()`` (``logging.shutdown`` at exit) write the lines held
    first, and no more than ``MAX_HELD_LINES`` are ever held."""

    MAX_HELD_LINES: Final = 256

    def __init__(self, stream: IO[str] | None) -> None:
        super().__init__(stream or sys.stderr)
        self._follow_stderr = stream is None
        self._held: list[str] = []  # request lines not written yet, in order
        # The loop a write of the held lines is scheduled on (None: none is): a loop closed
        # with the write still queued drops it, and a line on the next loop schedules anew.
        self._scheduled: asyncio.AbstractEventLoop | None = None

    def emit(self, record: logging.LogRecord) -> None:
        # Under the handler's lock (``Handler.handle`` holds it).
        self._write_held()
        super().emit(record)

    def flush(self) -> None:
        with self.lock:  # type: ignore[union-attr]
            self._scheduled = None
            self._write_held()
            try:  # a text stream raises a broken pipe here, not in write()
                super().flush()
            except Exception:
                self.handleError(logging.makeLogRecord({"msg": "request lines"}))

    def close(self) -> None:
        self.flush()
        super().close()

    def _write_held(self) -> None:
        """Write the request lines held; a failure is reported as logging reports one (never
        raised to whoever logs), and those lines are dropped."""
        if self._follow_stderr:
            self.stream = sys.stderr
        if self._held:
            text = "".join(self._held)
            self._held.clear()
            try:
                self.stream.write(text)
            except Exception:
                self.handleError(logging.makeLogRecord({"msg": "request lines"}))

    def write_fields(self, level: int, logger: str, message: str, fields: dict[str, Any]) -> bool:
        """Write a request line as ``emit`` would write its record (the JSON formatter's
        line), held for the loop's turn (see the class); False, with nothing written or held,
        if making the line failed (the caller then goes through ``logging``, whose error
        handling reports it)."""
        formatter = self.formatter
        assert isinstance(formatter, JsonFormatter)
        created = time.time()
        try:
            line = formatter.line(
                created,
                (created - int(created)) * 1000,
                logging.getLevelName(level),
                logger,
                message,
                fields,
            )
        except Exception:
            return False
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        with self.lock:  # type: ignore[union-attr]
            self._held.append(line + self.terminator)
            schedule = loop is not None and self._scheduled is not loop
            if schedule:
                self._scheduled = loop
        if loop is None or len(self._held) >= self.MAX_HELD_LINES:
            self.flush()
        elif schedule:
            loop.call_soon(self.flush)
        return True


def log_format(config: LogSettings, environment: str) -> str:
    if config.format is not None:
        return config.format
    return "json" if environment == "production" else "text"


def configure_logging(
    config: LogSettings, environment: str, stream: IO[str] | None = None
) -> logging.Handler:
    """One handler on the root logger (replacing the one installed before), in the configured
    format; with JSON, uvicorn's own records go through it too. Uvicorn's access log is off
    while the request line, which replaces it, is on."""
    kind = log_format(config, environment)
    handler = _OurHandler(stream)
    handler.setFormatter(JsonFormatter() if kind == "json" else TextFormatter())
    root = logging.getLogger()
    for old in [h for h in root.handlers if isinstance(h, _OurHandler)]:
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(config.level)
    # Neither format shows the thread or the process: a record need not look them up.
    logging.logThreads = logging.logProcesses = logging.logMultiprocessing = False
    # httpx logs every upstream request at info: the request line and the trace say it better.
    logging.getLogger("httpx").setLevel(config.level if config.level == "DEBUG" else "WARNING")
    if kind == "json":
        uvicorn = logging.getLogger("uvicorn")
        uvicorn.handlers = []
        uvicorn.propagate = True
    # The request line says more than uvicorn's access line; one of them is enough.
    logging.getLogger("uvicorn.access").disabled = config.requests
    request_logger = logging.getLogger(REQUEST_LOGGER)
    request_logger.disabled = not config.requests
    return handler
